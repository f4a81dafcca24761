"""The CPU peak MFU is measured against, per rank, over identical runs: each start's own calibration (a fresh
cache per run, as before ``flops.cpu_peak`` kept the best) against the host's best kept across starts (one
cache for all runs), and a quiet calibration in this process for reference. What the spread does to MFU:
the same step time over a peak that moves.

    python bench/cpu_peak.py [--runs 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from meshscope.agent.instrument import flops  # noqa: E402
from meshscope.agent.store.reader import Store  # noqa: E402
from tests.support.jobs import run_job  # noqa: E402

ARGS = ("--model", "tiny", "--steps", "6", "--seed", "1", "--batch-size", "8")


def _peaks(store: Path, runs: list[str]) -> list[dict]:
    t = Store.open(store).query("SELECT run, rank, peak_flops FROM run ORDER BY run, rank", kinds=("run",), runs=runs)
    m = Store.open(store).query("SELECT run, rank, median(mfu) AS mfu, median(wall_s) AS wall_s FROM step "
                                "WHERE step >= 2 GROUP BY ALL", kinds=("step",), runs=runs)
    return t.merge(m, on=["run", "rank"]).to_dict("records")


def _spread(rows: list[dict], key: str) -> dict:
    v = [r[key] for r in rows]
    return {"min": min(v), "max": max(v), "max_over_min": max(v) / min(v)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)  # as the ranks run (OMP_NUM_THREADS=1)
    quiet = max(flops.calibrate_cpu_peak() for _ in range(3))
    result: dict = {"quiet_gflops": quiet / 1e9, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="meshscope-peak-") as tmp:
        base = Path(tmp)
        for mode in ("each start", "kept"):
            store = base / mode.replace(" ", "-")
            shared = base / "cache-kept"
            for k in range(a.runs):
                cache = shared if mode == "kept" else base / f"cache-{k}"
                os.environ["MESHSCOPE_CACHE_DIR"] = str(cache)
                run_job(store, f"r{k}", 2, *ARGS)
            rows = _peaks(store, [f"r{k}" for k in range(a.runs)])
            result[mode] = {"ranks": rows, "peak": _spread(rows, "peak_flops"), "mfu": _spread(rows, "mfu"),
                            "wall_s": _spread(rows, "wall_s")}
            p, mfu, w = result[mode]["peak"], result[mode]["mfu"], result[mode]["wall_s"]
            print(f"{mode:>10}: peak {p['min'] / 1e9:.1f}-{p['max'] / 1e9:.1f} GF/s (×{p['max_over_min']:.2f}), "
                  f"MFU {mfu['min']:.1%}-{mfu['max']:.1%} (×{mfu['max_over_min']:.2f}), step "
                  f"{w['min'] * 1e3:.1f}-{w['max'] * 1e3:.1f} ms (×{w['max_over_min']:.2f}) over {len(rows)} ranks")
    print(f"quiet calibration in one process: {quiet / 1e9:.1f} GF/s")
    if a.out:
        a.out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
