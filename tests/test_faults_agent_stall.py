"""The node agent stopped (SIGSTOP) for 30 s in the middle of a training run: training does not notice,
rank memory and spools stay bounded, and after SIGCONT the agent catches up completely.

Ranks never talk to the agent (they append to their spool files; the agent follows them), so the only
channel through which the agent can affect training is CPU. The test measures both ends of it:

- throughput from the step records: the pace of a step is its maximum wall time over the ranks; windows
  are cut by ``t_start`` at the SIGSTOP / SIGCONT instants (warm-up and the catch-up excluded). The
  figure is the stalled window's *median* step time over the median of the unstalled windows of the same
  run (before the stop and after the catch-up): ``> 1`` means slower while the agent was stopped. On a
  shared 2-core machine the background load drifts by 5-30 % within a minute, so the two unstalled
  windows are also compared with each other: that disagreement is the resolution of the wall-clock
  figure on this machine at this moment (printed with it). A 1 % effect cannot be resolved this way here;
  the wall-clock bound only catches a gross regression (ranks waiting for the agent would stop making
  steps during the stall). A control run started alongside drifted *differently* from the stalled run
  (the two jobs compete for the same two cores), so it made the estimate noisier, not better.
- the agent's CPU: its CPU seconds per second of training before the stop and the CPU seconds of the
  catch-up burst (psutil), an upper bound on what stopping it can give or take from the ranks. This
  one does not depend on the background load, and it is what shows the 1 % bound.
"""

from __future__ import annotations

import os
import signal
import time

import pandas as pd
import psutil
import pytest

from meshscope.agent.store.reader import read_table
from tests.support.harness import (
    AgentProcess, Job, compare_store_to_truth, poll_until, private_dir, spool_sizes_of, spool_truth,
)

# serial: step times while the agent is stopped against those before and after it
pytestmark = [pytest.mark.gloo, pytest.mark.serial]

# The newest record is at most one pipeline old when the agent has caught up: the telemetry flusher
# (0.25 s), the spool writer's flush (0.5 s) and the agent's poll (1 s, the production default below),
# plus 1 s for a scheduler on a loaded 2-core machine.
LAG_BOUND_S = 0.25 + 0.5 + 1.0 + 1.0


@pytest.fixture
def tmp_path():
    """Not pytest's (concurrent sessions on this machine clean each other's): see harness.private_dir."""
    with private_dir() as d:
        yield d


WORLD, RUN = 2, "stall"
WARMUP_S = 3.0  # first seconds of steps excluded (allocations, DDP bucket rebuild)
BEFORE_S, STALL_S, AFTER_S = 6.0, 30.0, 6.0


def pace(store, run):
    """Per step: its first start and its wall time (max over ranks), complete steps only."""
    step = read_table(store, "step", run=run)
    out = step.groupby("step").agg(t_start=("t_start", "min"), wall=("wall_s", "max"), ranks=("rank", "size"))
    return out[out["ranks"] == WORLD]


def window(p, lo, hi):
    return p[(p.t_start >= lo) & (p.t_start < hi)]


def cpu_s(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def test_agent_sigstop_30s_training_unaffected_bounded_and_full_catch_up(tmp_path):
    job = Job(WORLD, "--steps", 100_000, "--log-every", 1000, "--store", tmp_path, "--run-name", RUN,
              log=tmp_path / "job.log")
    agent = AgentProcess(tmp_path, poll_interval=1.0)  # the production default
    me = psutil.Process(agent.pid)
    marks: dict[str, float] = {}
    sizes: dict[str, dict[str, int]] = {}
    agent_rss, agent_cpu = {}, {}
    try:
        poll_until(lambda: agent.scrape().value("meshscope_rank_last_step", run=RUN, rank="0") is not None,
                   timeout_s=120, what="first steps ingested")
        time.sleep(WARMUP_S)
        marks["before"], agent_cpu["before"] = time.time(), cpu_s(me)
        time.sleep(BEFORE_S)  # the unstalled window before the stop (time, not a condition)
        agent_rss["before"] = agent.rss_bytes()
        sizes["stop"] = spool_sizes_of(tmp_path, RUN)
        marks["stop"], agent_cpu["stop"] = time.time(), cpu_s(me)
        agent.signal(signal.SIGSTOP)
        time.sleep(STALL_S)
        sizes["cont"] = spool_sizes_of(tmp_path, RUN)
        backlog = spool_truth(tmp_path, RUN)["step"].groupby("rank")["step"].max()  # spooled during the stall
        marks["cont"], agent_cpu["cont"] = time.time(), cpu_s(me)
        agent.signal(signal.SIGCONT)
        assert job.running(), job.tail()

        # Catch-up: every rank's step spooled by the SIGCONT instant is in /metrics, no backlog left, lag
        # back to ~0 while the job still runs. (Until its first poll after SIGCONT the agent still shows
        # its pre-stop values, hence the step check.) Track the agent's memory meanwhile.
        peak = [agent.rss_bytes()]

        def caught_up():
            peak.append(agent.rss_bytes())
            m = agent.scrape()
            last = m.by("meshscope_rank_last_step", "rank", run=RUN)
            ok = (len(last) == WORLD and all(last[str(r)] >= backlog[r] for r in range(WORLD))
                  and m.value("meshscope_agent_backlog_bytes") == 0
                  and m.value("meshscope_agent_lag_seconds") < LAG_BOUND_S)
            return m if ok else None

        m = poll_until(caught_up, timeout_s=30, interval_s=0.05, what="catch-up after SIGCONT")
        marks["caught_up"] = time.time()
        agent_rss["peak_catch_up"] = max(peak)
        lag = m.value("meshscope_agent_lag_seconds")
        time.sleep(1.0)
        agent_cpu["catch_up_end"] = cpu_s(me)
        marks["after"] = time.time()
        time.sleep(AFTER_S)  # the unstalled window after the catch-up
        marks["end"], agent_cpu["end"] = time.time(), cpu_s(me)
        assert job.running(), job.tail()
    finally:
        job.kill()
        # Everything the ranks spooled reaches the store (SIGTERM writes what the agent buffered); stop()
        # kills an agent that does not exit, so a failed test leaves none behind (not even a stopped one).
        code = agent.stop()
    assert code == 0, agent.stderr

    a = pace(tmp_path, RUN)
    spans = {"before": (marks["before"], marks["stop"]), "stall": (marks["stop"], marks["cont"]),
             "after": (marks["after"], marks["end"])}
    med = {name: window(a, *span)["wall"].median() for name, span in spans.items()}
    n = {name: len(window(a, *span)) for name, span in spans.items()}
    unstalled = pd.concat([window(a, *spans["before"]), window(a, *spans["after"])])["wall"].median()
    ratio = med["stall"] / unstalled  # > 1: slower while the agent was stopped
    resolution = abs(med["before"] / med["after"] - 1)
    steady_cpu = (agent_cpu["stop"] - agent_cpu["before"]) / (marks["stop"] - marks["before"])
    after_cpu = (agent_cpu["end"] - agent_cpu["catch_up_end"]) / (marks["end"] - marks["after"])
    burst_cpu = agent_cpu["catch_up_end"] - agent_cpu["cont"] - after_cpu * (marks["after"] - marks["cont"])

    # Rank memory and spool growth.
    mem = read_table(tmp_path, "memory", run=RUN).rename(columns={"t": "t_start"})
    rss_growth = (window(mem, *spans["stall"]).groupby("rank")["rss_bytes"].max()
                  - window(mem, *spans["before"]).groupby("rank")["rss_bytes"].max()).max()
    per_step = {k: (sizes["cont"][k] - sizes["stop"][k]) / max(1, n["stall"]) for k in sizes["stop"]}
    total_steps = read_table(tmp_path, "step", run=RUN).groupby("rank")["step"].max().min() + 1
    per_step_run = {k: os.stat(tmp_path / "spool" / RUN / k).st_size / total_steps for k in sizes["stop"]}
    report = compare_store_to_truth(tmp_path, RUN, spool_truth(tmp_path, RUN))
    print(
        "\nmedian step ms: " + ", ".join(f"{name} {med[name] * 1e3:.2f} ({n[name]} steps)" for name in spans)
        + f"\nstall/unstalled step-time ratio {ratio:.4f} (throughput ratio {1 / ratio:.4f}); resolution here "
        f"(before vs after, both unstalled) {100 * resolution:.2f} %"
        f"\nagent CPU: steady {100 * steady_cpu:.2f} % of a core, catch-up burst {burst_cpu:.3f} CPU-s, "
        f"catch-up {marks['caught_up'] - marks['cont']:.2f} s, lag after {lag:.2f} s; agent RSS "
        f"{agent_rss['before'] / 2**20:.1f} MiB before, {agent_rss['peak_catch_up'] / 2**20:.1f} MiB peak in catch-up"
        f"\nrank RSS growth during the stall {rss_growth / 2**20:.2f} MiB; spool bytes/step/rank in the stall "
        f"{ {k: round(v) for k, v in per_step.items()} } vs whole run { {k: round(v) for k, v in per_step_run.items()} }"
        f"\nstore vs spool {report}")

    assert n["stall"] > 100 and n["before"] > 20 and n["after"] > 20
    # Gross-regression guard only (ranks waiting for the agent would make no steps in the stall): the
    # stalled window is no slower than the slower unstalled one by more than 25 %.
    assert med["stall"] < 1.25 * max(med["before"], med["after"]), "training slowed while the agent was stopped"
    # The CPU channel, which is robust to background load: the running agent takes under 2 % of one core
    # (1 % of this 2-core machine) and the catch-up after 30 s costs under 1 % of the CPU time the ranks
    # had in those 30 s.
    assert steady_cpu < 0.02, f"agent uses {100 * steady_cpu:.2f} % of a core in steady state"
    assert burst_cpu < 0.01 * WORLD * STALL_S, f"catch-up burst {burst_cpu:.3f} CPU-s"
    assert rss_growth < 8 * 2**20, "rank memory grew while the agent was stopped"
    for name, value in per_step.items():  # spools grow with steps, not with the agent's absence
        assert value <= 1.15 * per_step_run[name], (name, value, per_step_run[name])
    assert marks["caught_up"] - marks["cont"] < 10
    assert agent_rss["peak_catch_up"] - agent_rss["before"] < 64 * 2**20
    for kind, r in report.items():
        assert r["lost"] == 0 and r["duplicated"] == 0, (kind, r)
