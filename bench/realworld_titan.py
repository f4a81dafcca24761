"""torchtitan 0.3.0's llama3 debug model (tests/realworld/titan.py: 2 CPU ranks, gloo), run alone and under
``meshscope run`` in alternating pairs: the job's own median step time (from its log) in each arm, the
overhead, and meshscope's median step time against the job's own on the observed runs. One JSON object on
stdout, with the machine's load average at start and end.

    python bench/realworld_titan.py [--layout fsdp] [--steps 12] [--pairs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/realworld: the harness the tier uses

from tests.realworld import titan  # noqa: E402


def _median_step(result: titan.TitanResult) -> float:
    times = [s.step_time_s for s in result.steps[2:] if s.step_time_s]  # the job's steady steps
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="fsdp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--pairs", type=int, default=3)
    args = p.parse_args()
    load0 = os.getloadavg()
    alone, observed, agreement = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = ("alone", "observed") if i % 2 == 0 else ("observed", "alone")  # alternate who goes first
            for arm in order:
                work = Path(tmp) / f"{arm}{i}"
                store = work / "store" if arm == "observed" else None
                r = titan.run(layout=args.layout, steps=args.steps, workdir=work, meshscope_store=store,
                              run_name=f"b{i}" if store else None, timeout_s=900)
                if r.returncode != 0:
                    raise SystemExit(f"{arm} run {i} exited {r.returncode}: {r.stderr[-2000:]}")
                job = _median_step(r)
                (alone if arm == "alone" else observed).append(job)
                if store is not None:
                    rep = titan.report_json(store, f"b{i}")
                    agreement.append(rep["step_time_s_median"] / job - 1)
    print(json.dumps({
        "layout": args.layout, "steps": args.steps, "pairs": args.pairs, "time": time.strftime("%Y-%m-%d %H:%M"),
        "job_median_step_s_alone": alone, "job_median_step_s_observed": observed,
        "overhead_pct": 100 * (statistics.median(observed) / statistics.median(alone) - 1),
        "meshscope_vs_job_step_time_pct": [100 * a for a in agreement],
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
    }, indent=1))


if __name__ == "__main__":
    main()
