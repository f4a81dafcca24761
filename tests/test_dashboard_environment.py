"""Environment warnings, the CPU-contention straggler cause and the schedule replay (pure functions)."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from meshscope.dashboard import environment, stragglers
from meshscope.dashboard.analysis import bubble_theory
from meshscope.dashboard.pipeline_sim import replay, simulate


def _steps(wait_share: dict[int, float], *, n: int = 8, busy: float = 0.5) -> pd.DataFrame:
    rows = [(r, s, busy * 0.98, busy * 0.02, busy * (1 - w), busy * w) for r, w in wait_share.items() for s in range(n)]
    return pd.DataFrame(rows, columns=["rank", "step", "compute_s", "other_s", "cpu_s", "cpu_wait_s"])


def test_cpu_contention_is_warned_on_cpu_runs_only_and_names_the_ranks():
    shares = environment.run_queue_share(_steps({0: 0.3, 1: 0.02, 2: 0.45}))
    assert shares.set_index("rank")["cpu_wait_share"].round(3).to_dict() == {0: 0.3, 1: 0.02, 2: 0.45}
    hosts = pd.DataFrame({"rank": [0, 1, 2], "host": ["a", "a", "a"]})
    (w,) = environment.warnings(device="cpu", shares=shares, n_steady=10, hosts=hosts)
    assert w.startswith("CPU contention: ranks 0, 2 waited for a CPU 30%-45%") and "a 3" in w
    assert environment.warnings(device="cuda:0", shares=shares, n_steady=10) == []
    quiet = environment.run_queue_share(_steps({0: 0.05, 1: 0.08}))
    assert environment.warnings(device="cpu", shares=quiet, n_steady=10) == []


def test_old_stores_without_cpu_columns_give_no_contention_verdict():
    old = _steps({0: 0.3}).drop(columns=["cpu_s", "cpu_wait_s"])
    nan = _steps({0: 0.3}).assign(cpu_wait_s=np.nan)
    for share in (environment.cpu_wait_share, environment.run_queue_share):
        assert share(old).empty and share(nan).empty


def _pipeline_steps(n: int = 8) -> pd.DataFrame:
    """Step records shaped like a real contended pipeline run (4 ranks of the tiny model on 2 cores): rank 1
    spends most of its step waiting for its neighbour (exposed P2P and bubble), and is woken from those
    waits into a run queue, so its run-queue delay is 1.63 times its compute + other time. The phases add up
    to the wall time, and CPU time + delay stay within it, as the kernel counts them."""
    ranks = {0: dict(compute_s=0.090, exposed_comm_s=0.010, bubble_s=0.0, other_s=0.005, cpu_s=0.070, cpu_wait_s=0.021),
             1: dict(compute_s=0.030, exposed_comm_s=0.070, bubble_s=0.030, other_s=0.005, cpu_s=0.028,
                     cpu_wait_s=0.057)}
    rows = [{"rank": r, "step": s, **v} for r, v in ranks.items() for s in range(n)]
    t = pd.DataFrame(rows)
    t["wall_s"] = t[["compute_s", "exposed_comm_s", "bubble_s", "other_s"]].sum(axis=1)
    assert (t["cpu_s"] + t["cpu_wait_s"] <= t["wall_s"]).all()
    return t


def test_cpu_contention_is_a_share_of_the_time_the_ranks_were_ready_to_run():
    # The user's report: "waited for a CPU 22 %-163 % of the time". The delay over compute + other exceeds 1
    # when the thread waits for a core after a peer wakes it; over the time it was runnable it is a share.
    steps = _pipeline_steps()
    assert environment.cpu_wait_share(steps)["cpu_wait_share"].max() == pytest.approx(1.63, abs=0.01)
    shares = environment.run_queue_share(steps)
    assert shares.set_index("rank")["cpu_wait_share"].round(2).to_dict() == {0: 0.23, 1: 0.67}
    (w,) = environment.warnings(device="cpu", shares=shares, n_steady=8)
    assert w.startswith("CPU contention: ranks 0, 1 waited for a CPU 23%-67% of the time they were ready to run"), w
    assert all(0 <= int(p) <= 100 for p in re.findall(r"(\d+)%", w)), w
    # Any step the kernel can report (phases adding up to the wall, CPU + delay within it): at most 100 %.
    rng = np.random.default_rng(0)
    n = 2000
    parts = rng.dirichlet(np.ones(4), n) * rng.uniform(0.01, 2.0, (n, 1))
    wall = parts.sum(axis=1)
    on_cpu = rng.uniform(0, 1, n) * wall
    random = pd.DataFrame({"rank": np.arange(n) % 16, "step": np.arange(n), "compute_s": parts[:, 0],
                           "exposed_comm_s": parts[:, 1], "bubble_s": parts[:, 2], "other_s": parts[:, 3],
                           "cpu_s": on_cpu, "cpu_wait_s": rng.uniform(0, 1, n) * (wall - on_cpu)})
    shares = environment.run_queue_share(random)
    assert len(shares) == 16 and shares["cpu_wait_share"].between(0, 1).all()
    for w in environment.warnings(device="cpu", shares=shares, n_steady=100):
        assert all(int(p) <= 100 for p in re.findall(r"(\d+)%", w)), w


def test_short_runs_and_throttled_clocks_are_warned():
    empty = environment.cpu_wait_share(_steps({}))
    (w,) = environment.warnings(device="cpu", shares=empty, n_steady=3)
    assert w.startswith("Only 3 steps after warm-up")
    clocks = pd.DataFrame({"rank": [1, 0], "clock_ratio": [0.7, 0.99]})
    (w,) = environment.warnings(device="cuda", shares=empty, n_steady=20, clocks=clocks)
    assert "rank 1 70%" in w and "rank 0" not in w
    # With NVML's slowdown reasons sampled, a clock below 90 % needs a reason in most samples.
    reasons = pd.DataFrame({"rank": [0, 1, 2], "clock_ratio": [0.89, 0.68, 0.99], "throttle_share": [0.03, 0.97, 0.0]})
    (w,) = environment.warnings(device="cuda", shares=empty, n_steady=20, clocks=reasons)
    assert "rank 1 68%" in w and "rank 0" not in w and "rank 2" not in w
    # Thousands of throttled ranks: the lowest eight named, then a count.
    many = pd.DataFrame({"rank": range(1000), "clock_ratio": [0.8 - r / 10_000 for r in range(1000)],
                         "throttle_share": 1.0})
    (w,) = environment.warnings(device="cuda", shares=empty, n_steady=20, clocks=many)
    assert "rank 999 70%" in w and "rank 0 " not in w and "and 992 more ranks" in w and len(w) < 400


def _verdict_steps(*, extra_s: float, extra_wait_s: float, n: int = 10) -> pd.DataFrame:
    rows = []
    for s in range(n):
        for r in range(2):
            slow = r == 1
            rows.append({"rank": r, "step": s, "compute_s": 0.1 + (extra_s if slow else 0.0),
                         "exposed_comm_s": 0.0 if slow else extra_s, "cpu_wait_s": 0.005 + (extra_wait_s if slow else 0.0)})
    return pd.DataFrame(rows)


@pytest.mark.parametrize(("extra_wait", "cause"), [(0.04, "CPU contention"), (0.0, "compute"), (0.01, "compute")])
def test_a_straggler_that_waited_for_a_cpu_is_blamed_on_the_machine(extra_wait, cause):
    # 50 ms slower than its peer; when most of it is run-queue delay the cause is the machine, not the job.
    table = stragglers.straggler_table(stragglers.rank_step_verdicts(_verdict_steps(extra_s=0.05, extra_wait_s=extra_wait)))
    assert table["rank"].tolist() == [1]
    assert table["cause"].iloc[0].startswith(cause), table["cause"].iloc[0]


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("Interleaved1F1B", 2)])
def test_replay_of_balanced_ops_is_the_closed_form_and_recovers_transfer_and_host_gaps(schedule, v):
    p, m = 2, 4
    spans = simulate(schedule=schedule, p=p, m=m, v=v, f=1.0, b=2.0, hop=0.1, gap=0.05).assign(step=7)
    (row,) = replay(spans, schedule=schedule, p=p, m=m, v=v).to_dict("records")
    assert row["step"] == 7 and row["schedule_idle"] == pytest.approx(bubble_theory(schedule=schedule, p=p, m=m, v=v))
    assert row["hop_s"] == pytest.approx(0.1) and row["gap_s"] == pytest.approx(0.05)
    extent = spans["t_end"].max() - spans["t_start"].min()
    busy = (spans["t_end"] - spans["t_start"]).groupby(spans["rank"]).sum().max()
    assert row["replay_bubble"] == pytest.approx(1 - busy / extent)  # the measured timeline, reproduced
    assert row["balanced_idle"] == pytest.approx(bubble_theory(schedule=schedule, p=p, m=m, v=v))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_an_order_taken_from_the_run_replays_as_the_known_order(schedule):
    # A schedule name replay has no order for (torch's zero-bubble, looped BFS, a user's own) is replayed
    # in the order its spans ran: on a 1F1B or interleaved timeline, that gives the very same figures.
    p, m, v = 2, 4, (2 if schedule == "interleaved" else 1)
    spans = simulate(schedule=schedule, p=p, m=m, v=v, f=1.0, b=2.0, hop=0.1, gap=0.05).assign(step=3)
    known = replay(spans, schedule=schedule, p=p, m=m, v=v)
    taken = replay(spans, schedule="SomeoneElsesSchedule", p=p, m=m, v=v)
    pd.testing.assert_frame_equal(known, taken)


def test_zero_bubble_theory_is_below_1f1b_and_its_replay_is_the_timeline():
    # Split weight gradients fill the drain: with F = I = W the schedule's own theory is well under 1F1B's.
    p, m, v = 2, 4, 2
    spans = simulate(schedule="interleavedzerobubble", p=p, m=m, v=v, f=1.0, b=1.0, w=1.0, hop=0.05).assign(step=0)
    (row,) = replay(spans, schedule="interleaved-zb", p=p, m=m, v=v).to_dict("records")
    extent = spans["t_end"].max() - spans["t_start"].min()
    busy = (spans["t_end"] - spans["t_start"]).groupby(spans["rank"]).sum().max()
    assert row["replay_bubble"] == pytest.approx(1 - busy / extent)
    assert row["balanced_idle"] < bubble_theory(schedule="interleaved", p=p, m=m, v=v)


def test_replay_follows_uneven_op_times_where_the_closed_form_cannot():
    # Fill and drain ops twice as fast as the steady ones (one stage running alone on a shared CPU): the
    # schedule's own idle is below (p-1)/(m+p-1), and the replay says by how much.
    p, m = 2, 4
    base = simulate(schedule="1f1b", p=p, m=m, f=1.0, b=2.0)
    fast = {("F", 0, 0): 0.5, ("B", 0, m - 1): 1.0, ("F", 1, 0): 0.5, ("B", 1, m - 1): 1.0}
    uneven = simulate(schedule="1f1b", p=p, m=m, f=1.0, b=2.0, durations=fast).assign(step=0)
    (row,) = replay(uneven, schedule="1f1b", p=p, m=m).to_dict("records")
    extent = uneven["t_end"].max()
    busy = (uneven["t_end"] - uneven["t_start"]).groupby(uneven["rank"]).sum().max()
    assert row["schedule_idle"] == pytest.approx(1 - busy / extent)
    assert row["schedule_idle"] < bubble_theory(schedule="1f1b", p=p, m=m) - 0.02
    assert base["t_end"].max() > extent


def test_replay_skips_steps_that_do_not_fit_the_schedule():
    spans = simulate(schedule="1f1b", p=2, m=4).assign(step=1)
    assert replay(spans, schedule="1f1b", p=2, m=8).empty  # half the microbatches missing
    assert replay(spans, schedule="1f1b", p=3, m=4).empty  # ranks missing


def test_replay_takes_one_pipeline_replica_of_a_pp_x_dp_run():
    one = simulate(schedule="1f1b", p=2, m=4, f=1.0, b=2.0, hop=0.1).assign(step=0)
    other = one.assign(rank=one["rank"] + 2, t_start=one["t_start"] + 0.3, t_end=one["t_end"] + 0.3)
    both = pd.concat([one, other], ignore_index=True)
    assert replay(both, schedule="1f1b", p=2, m=4).equals(replay(one, schedule="1f1b", p=2, m=4))
