"""Telemetry on vs off as a user runs it: the trainer's own command, alternately with a run store (telemetry
on: hooks, flusher thread, samplers, spool) and without one (no telemetry object at all), each arm a fresh
process. Unlike an in-process A/B (bench/overhead_worker.py, the GPU kit's section 5), this also counts
what telemetry's background threads take from the training thread (the GIL) and anything set up only
when a store is given. Step times are the trainer's printed ``step_time`` (its loop's wall time per step).

    python3 bench/trainer_ab.py [--rounds 2] [--steps 25] [--skip 5] -- TRAINER ARGS...
    e.g. python3 bench/trainer_ab.py -- --model 1b --device cuda --compile
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP = re.compile(r"step=(\d+) .*?step_time=([0-9.]+)ms")


def run_arm(arm: str, *, i: int, steps: int, store: Path, trainer_args: list[str]) -> dict:
    argv = [sys.executable, "-m", "meshscope.trainer.train", "--steps", str(steps), "--log-every", "1",
            *trainer_args]
    if arm == "on":
        argv += ["--store", str(store), "--run-name", f"ab-{i}"]
    t = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} arm exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    times = {int(m.group(1)): float(m.group(2)) for m in STEP.finditer(proc.stdout + proc.stderr)}
    return {"arm": arm, "round": i, "seconds": time.monotonic() - t, "step_ms": times}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, trainer_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="on/off pairs, the order alternating")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--skip", type=int, default=5, help="first steps of each process left out (compile, warm-up)")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(ours)
    runs = []
    with tempfile.TemporaryDirectory(prefix="meshscope-ab-") as tmp:
        for i in range(ns.rounds):
            for arm in (("on", "off") if i % 2 == 0 else ("off", "on")):
                r = run_arm(arm, i=i, steps=ns.steps, store=Path(tmp) / "store", trainer_args=trainer_args)
                kept = [ms for step, ms in sorted(r["step_ms"].items()) if step >= ns.skip]
                r["median_ms"] = statistics.median(kept) if kept else float("nan")
                runs.append(r)
                print(f"round {i} {arm:3s}: median step {r['median_ms']:.2f} ms over {len(kept)} steps "
                      f"({r['seconds']:.0f} s process)", flush=True)
    on = statistics.median(r["median_ms"] for r in runs if r["arm"] == "on")
    off = statistics.median(r["median_ms"] for r in runs if r["arm"] == "off")
    summary = {"on_ms": on, "off_ms": off, "overhead": on / off - 1.0, "trainer_args": trainer_args,
               "rounds": ns.rounds, "steps": ns.steps, "skip": ns.skip}
    print(json.dumps(summary))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
