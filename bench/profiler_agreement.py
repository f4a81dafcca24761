"""Collective time per op, telemetry vs torch.profiler, on real 2-rank torchrun jobs of the trainer.

Method: the trainer profiles steps A:B (``--profile-dir``/``--profile-steps``, a Chrome trace per rank)
with telemetry on; the agent's ``ingest`` writes the store. Per rank, step and gloo op, the telemetry's
Σ(t_end − t_start) is compared with the profiler's Σ(c10d issue event start → ``gloo:*`` range end), the
mapping of ``tests/workers/hooks_common.py`` (the same one ``tests/test_telemetry_e2e.py`` asserts on).

Printed per strategy, rank and op: the per-step ratios, their median, the profiler's mean op time and the
mean bias per op in µs ((Σ ours − Σ profiler) / count). A ratio hides whether a gap is a fixed cost per op
(Python timestamps, a thread's wake-up) or proportional; the bias per op across model widths tells which.
For TP the profiler's own ``_c10d_functional::<op>`` start → ``wait_tensor`` end (what a Python-level
observer of a functional collective can see at best) is printed as well.

    python bench/profiler_agreement.py [--strategies ddp,fsdp,tp,pp-1f1b,pp-gpipe] [--models tiny,tiny-wide]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.collector.store import read_table  # noqa: E402
from bench.telemetry_overhead import STRATEGIES  # noqa: E402  (the same jobs as the overhead A/B)
from trainer.model import FLAVORS  # noqa: E402
from tests.workers.hooks_common import (  # noqa: E402  (the profiler mapping lives with the tests)
    OP_TO_GLOO, chrome_trace_events, profiler_step_totals, tracer_step_totals,
)


def run(strategy: str, *, model: str, steps: int, first: int, last: int) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "trainer.train", "--store", str(store), "--run-name", "r", "--model", model,
               "--steps", str(steps), "--profile-dir", str(store / "prof"),
               "--profile-steps", f"{first}:{last}", *STRATEGIES[strategy]]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
        subprocess.run([sys.executable, "-m", "meshscope_cli", "ingest", "--store", str(store)], cwd=ROOT,
                       env=env, check=True, capture_output=True, timeout=300)
        coll = read_table(store, "collective", run="r")
        for rank in (0, 1):
            events = chrome_trace_events(store / "prof" / f"rank-{rank}.json")
            prof = profiler_step_totals(None, last - first, window_prefix="train_step_", events=events,
                                        first_step=first)
            mine = coll[coll["rank"] == rank]
            per_op: dict[str, dict[str, list[float]]] = {}
            for i, step in enumerate(range(first, last)):
                recs = mine[mine["step"] == step][["op", "t_start", "t_end", "wait_s"]].to_dict("records")
                for name, t in tracer_step_totals(recs).items():
                    p = prof[i].get(name)
                    if p is None or p["count"] != t["count"] or p["issue_to_done_s"] != p["issue_to_done_s"]:
                        continue  # not pairable in this step (see the e2e test)
                    d = per_op.setdefault(name, {"ratio": [], "bias_us": [], "op_us": [], "funcol": []})
                    d["ratio"].append(t["duration_s"] / p["issue_to_done_s"])
                    d["bias_us"].append((t["duration_s"] - p["issue_to_done_s"]) / t["count"] * 1e6)
                    d["op_us"].append(p["issue_to_done_s"] / t["count"] * 1e6)
                    if p.get("funcol_issue_to_wait_s", float("nan")) == p.get("funcol_issue_to_wait_s"):
                        d["funcol"].append(t["duration_s"] / p["funcol_issue_to_wait_s"])
            for name, d in sorted(per_op.items()):
                line = (f"{strategy:9s} {model:9s} rank {rank} {name:16s} ratios "
                        f"{[round(v, 3) for v in d['ratio']]} median {statistics.median(d['ratio']):.3f}; "
                        f"op {statistics.fmean(d['op_us']):8.1f} us, bias {statistics.fmean(d['bias_us']):+7.1f} us/op")
                if d["funcol"]:
                    line += f"; vs funcol issue->wait_tensor end: median {statistics.median(d['funcol']):.3f}"
                lines.append(line)
        ops = {OP_TO_GLOO[op] for op in set(coll["op"])}
        lines.append(f"{strategy:9s} {model:9s} ops traced: {sorted(ops)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--models", default="tiny,tiny-wide")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile-steps", default="2:10", help="A:B, the profiled steps (default 2:10)")
    args = ap.parse_args()
    try:
        first, last = (int(x) for x in args.profile_steps.split(":"))
    except ValueError:
        ap.error(f"--profile-steps {args.profile_steps!r} must look like A:B")
    if not 0 <= first < last - 1 or last > args.steps:
        ap.error(f"--profile-steps {args.profile_steps!r} needs 0 <= A < B - 1 and B <= --steps ({args.steps})")
    strategies, models = args.strategies.split(","), args.models.split(",")
    for bad, known, what in ((set(strategies) - set(STRATEGIES), STRATEGIES, "strategy"),
                             (set(models) - set(FLAVORS), FLAVORS, "model")):
        if bad:
            ap.error(f"unknown {what} {', '.join(sorted(bad))}; choose from {', '.join(known)}")
    for strategy in strategies:
        for model in models:
            for line in run(strategy, model=model, steps=args.steps, first=first, last=last):
                print(line, flush=True)


if __name__ == "__main__":
    main()
