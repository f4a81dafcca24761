"""``meshscope diff`` against what was done to the runs, on this machine: N runs of one layout and seed (every
pair's interval and whether ``--fail-above`` would fail), and one run with an injected straggler against
the first (the slowdown, its parts, the gate); and how long the command takes. With ``--pipeline-pairs K``,
K pairs of 1F1B on 2 stages with 8 microbatches against 4 (``tiny-wide``, global batch 32): the bubble's
change against the schedule's (p − 1) · compute / m from each run's own compute, and what the verdict names.
``--runs 0`` runs the pipeline pairs alone.

    python bench/diff_runs.py [--runs 5] [--model tiny] [--steps 40] [--fail-above 5] [--pipeline-pairs 0]
                              [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshscope.agent.store.reader import Store  # noqa: E402
from meshscope.dashboard import diff, diffcli, views  # noqa: E402
from tests.support.jobs import run_job  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fail-above", type=float, default=5.0)
    ap.add_argument("--pipeline-pairs", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    args = ("--model", a.model, "--steps", str(a.steps), "--seed", "5", "--batch-size", "8")
    result: dict = {"model": a.model, "steps": a.steps}
    with tempfile.TemporaryDirectory(prefix="meshscope-diff-") as tmp:
        store = Path(tmp)
        if a.pipeline_pairs:
            result["pipeline"] = pipeline_pairs(store, pairs=a.pipeline_pairs)
        if a.runs == 0:
            _write(a.out, result)
            return 0
        for k in range(a.runs):
            run_job(store, f"same-{k}", 2, *args)
        run_job(store, "straggler", 2, *args, "--straggler-ranks", "1", "--straggler-seconds", "0.05")
        load = views.direct_loader(Store.open(store))
        rows = []
        for x, y in itertools.combinations(range(a.runs), 2):
            c = diffcli.build(load, load, run_a=f"same-{x}", run_b=f"same-{y}")
            w = diff.whole(c)
            rows.append({"a": f"same-{x}", "b": f"same-{y}", "diff_pct": w["diff_pct"], "lo_pct": w["lo_pct"],
                         "hi_pct": w["hi_pct"], "covers_0": w["lo_pct"] <= 0 <= w["hi_pct"],
                         "gate_fails": diff.gate(c, fail_above_pct=a.fail_above), "run_noise": c["run_noise"]})
        c = diffcli.build(load, load, run_a="same-0", run_b="straggler")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "meshscope.cli", "diff", "--store", str(store), "same-0",
                               "straggler", "--fail-above", str(a.fail_above)], capture_output=True, text=True)
        took = time.perf_counter() - t0
    result.update({"pairs": rows, "straggler": {
        "verdict": c["verdict"], "parts": c["parts"], "cli_exit": proc.returncode, "cli_seconds": took}})
    print(f"{len(rows)} pairs of identical runs ({a.model}, {a.steps} steps, 2 gloo ranks):")
    for r in rows:
        print(f"  {r['a']} → {r['b']}: {r['diff_pct']:+6.1f} % ({r['lo_pct']:+6.1f} … {r['hi_pct']:+6.1f}), "
              f"covers 0: {r['covers_0']}, --fail-above {a.fail_above:g} fails: {r['gate_fails']}")
    print(f"  run-to-run noise used: {rows[-1]['run_noise']['rel_sd']:.1%} ({rows[-1]['run_noise']['source']})")
    print(f"  no significant difference in {sum(r['covers_0'] for r in rows)} of {len(rows)}; gate failed "
          f"{sum(r['gate_fails'] for r in rows)} times")
    print(f"straggler (rank 1 +0.05 s per step): {c['verdict']}")
    print(f"  meshscope diff --fail-above {a.fail_above:g}: exit {proc.returncode} in {took:.2f} s")
    _write(a.out, result)
    return 0


def _write(out: Path | None, result: dict) -> None:
    if out:
        out.write_text(json.dumps(result, indent=2, default=str))


PP = ("--model", "tiny-wide", "--steps", "12", "--seed", "5", "--batch-size", "32", "--pp", "2", "--schedule", "1f1b")


def pipeline_pairs(store: Path, *, pairs: int) -> list[dict]:
    """K pairs of 1F1B, 8 microbatches (A) against 4 (B): the parts' changes in points of A's step time and
    the bubble's change the schedule predicts from each run's measured compute, (p − 1) · compute / m."""
    rows = []
    for k in range(pairs):
        run_job(store, f"pp-m8-{k}", 2, *PP, "--microbatches", "8")
        run_job(store, f"pp-m4-{k}", 2, *PP, "--microbatches", "4")
        load = views.direct_loader(Store.open(store))
        c = diffcli.build(load, load, run_a=f"pp-m8-{k}", run_b=f"pp-m4-{k}")
        by = {p["part"]: p for p in c["parts"]}
        w = by["step"]
        predicted = by["compute"]["b_s"] / 4 - by["compute"]["a_s"] / 8
        row = {"pair": k, "diff_pct": w["diff_pct"], "lo_pct": w["lo_pct"], "hi_pct": w["hi_pct"],
               "bubble_points": by["bubble"]["diff_pct"], "bubble_s": by["bubble"]["diff_s"],
               "predicted_bubble_s": predicted, "compute_points": by["compute"]["diff_pct"],
               "bubble_a_s": by["bubble"]["a_s"], "bubble_b_s": by["bubble"]["b_s"], "verdict": c["verdict"]}
        rows.append(row)
        print(f"1F1B m8 → m4, pair {k}: step {w['diff_pct']:+.1f} % ({w['lo_pct']:+.1f} … {w['hi_pct']:+.1f}); "
              f"bubble {row['bubble_points']:+.1f} points ({row['bubble_s'] * 1e3:+.1f} ms, schedule "
              f"{predicted * 1e3:+.1f} ms); compute {row['compute_points']:+.1f} points\n  {c['verdict']}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
