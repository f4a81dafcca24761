"""Does a stopped (SIGSTOP) node agent slow training? Paired, interleaved stop/run blocks on one real job.

Method: one 2-rank gloo torchrun job of the reference trainer and one agent (production poll interval,
1 s). After a warm-up, ``--pairs`` cycles of ``--block`` seconds with the agent stopped followed by
``--block`` seconds with it running (the running block includes its catch-up, which is the agent's
busiest time). The pace of a step is its maximum wall time over the ranks; per cycle, the stopped block's
median step time over the running block's median is one paired ratio. Adjacent blocks share the
machine's background load, so slow drifts cancel; reported: the median and mean ratio with a 95 %
bootstrap interval over cycles, the pooled medians, and the agent's CPU per second of training.
``ratio < 1`` means training was faster while the agent was stopped (it frees CPU).

``tests/test_faults_agent_stall.py`` checks a single continuous 30 s stop (catch-up, bounds, no loss);
this script estimates the throughput effect with the precision that a single window cannot have on a
shared machine.

    python bench/faults_stall.py [--pairs 12] [--block 2.5] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshscope.agent.store.reader import read_table  # noqa: E402
from bench.telemetry_overhead import bootstrap_ci  # noqa: E402
from tests.support.harness import AgentProcess, Job, poll_until  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--block", type=float, default=2.5, help="seconds per block")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=5.0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshscope-stall-") as tmp:
        store = Path(tmp)
        agent = AgentProcess(store, poll_interval=1.0)
        job = Job(args.world, "--steps", 1_000_000, "--log-every", 100_000, "--store", store, "--run-name", "b",
                  log=store / "job.log")
        cycles = []
        try:
            poll_until(lambda: agent.scrape().value("meshscope_rank_last_step", run="b", rank="0") is not None,
                       timeout_s=180, what="first steps")
            time.sleep(args.warmup)
            cpu0, t0 = agent.cpu_seconds(), time.time()
            for _ in range(args.pairs):
                a = time.time()
                agent.signal(signal.SIGSTOP)
                time.sleep(args.block)
                b = time.time()
                agent.signal(signal.SIGCONT)
                time.sleep(args.block)
                cycles.append((a, b, time.time()))
            cpu = (agent.cpu_seconds() - cpu0) / (time.time() - t0)
            assert job.running(), job.tail()
        finally:
            job.kill()
            agent.stop()
            agent.kill()
        step = read_table(store, "step", run="b")
    pace = step.groupby("step").agg(t=("t_start", "min"), wall=("wall_s", "max"), n=("rank", "size"))
    pace = pace[pace.n == args.world]
    ratios, stopped_all, running_all = [], [], []
    for a, b, c in cycles:
        stopped = pace[(pace.t >= a) & (pace.t < b)]["wall"]
        running = pace[(pace.t >= b) & (pace.t < c)]["wall"]
        if len(stopped) >= 5 and len(running) >= 5:
            ratios.append(stopped.median() / running.median())
            stopped_all += list(stopped)
            running_all += list(running)
    lo, hi = bootstrap_ci(ratios)
    out = {
        "pairs": len(ratios), "block_s": args.block, "world": args.world,
        "ratio_median": statistics.median(ratios), "ratio_mean": statistics.fmean(ratios), "ratio_mean_ci95": [lo, hi],
        "median_step_ms_stopped": 1e3 * statistics.median(stopped_all),
        "median_step_ms_running": 1e3 * statistics.median(running_all),
        "agent_cpu_core_fraction": cpu * 2,  # the agent runs half the time: per running second
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
