"""Zero-code vs the explicit API on the same job: training-thread CPU time per step.

    python bench/zerocode_overhead.py [--rounds 4] [--steps 300]

Three arms of bench/zerocode_job.py (a 2-rank gloo DDP loop over token ids), each a torchrun job:
``off`` (the loop as it is), ``explicit`` (written around ``Telemetry.step`` / ``phase``) and ``zero``
(the ``off`` loop under ``meshscope run``). The arms alternate for ``--rounds`` rounds so that the
machine's drift is shared; per arm, the median over rounds of rank 0's median CPU time per step (warm-up
steps left out). Telemetry time = arm − off. Prints one JSON object; the goal (issue "zero code"): the
zero-code path costs at most 20 % more telemetry time than the explicit one."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = Path(__file__).resolve().parent / "zerocode_job.py"


def arm(name: str, *, tmp: Path, steps: int, i: int) -> float:
    out = tmp / f"{name}-{i}.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(JOB),
                "--steps", str(steps), "--out", str(out)]
    if name == "explicit":
        cmd = torchrun + ["--mode", "explicit", "--store", str(tmp / "store-explicit")]
    elif name == "zero":
        cmd = [sys.executable, "-m", "meshscope", "run", "--store", str(tmp / "store-zero"), "--run", f"zero-{i}", "--",
               *torchrun]
    else:
        cmd = torchrun
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(2):  # a torchrun start can fail on a busy 2-core machine: once more, then say why
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode == 0:
            return statistics.median(json.loads(out.read_text())["cpu_s"])
        print(f"arm {name} round {i} attempt {attempt} exited {proc.returncode}: {proc.stderr[-1500:]}",
              file=sys.stderr)
    raise SystemExit(f"arm {name} failed twice (its output is above)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    per_arm: dict[str, list[float]] = {"off": [], "explicit": [], "zero": []}
    with tempfile.TemporaryDirectory(prefix="meshscope-zerocode-bench-") as d:
        for i in range(args.rounds):
            order = list(per_arm) if i % 2 == 0 else list(reversed(per_arm))
            for name in order:
                per_arm[name].append(arm(name, tmp=Path(d), steps=args.steps, i=i))
    med = {k: statistics.median(v) for k, v in per_arm.items()}
    explicit, zero = med["explicit"] - med["off"], med["zero"] - med["off"]
    print(json.dumps({
        "cpu_us_per_step": {k: round(v * 1e6, 1) for k, v in med.items()},
        "rounds_us": {k: [round(x * 1e6, 1) for x in v] for k, v in per_arm.items()},
        "telemetry_us_per_step": {"explicit": round(explicit * 1e6, 1), "zero_code": round(zero * 1e6, 1)},
        "zero_over_explicit": round(zero / explicit, 3) if explicit > 0 else None,
        "goal": "zero_over_explicit <= 1.2",
        "load_avg": os.getloadavg(),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
