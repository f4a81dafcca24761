"""Warm-up and straggler verdicts (dashboard.stragglers) on hand-computed tables, at every world size."""

from __future__ import annotations

import itertools
import statistics

import numpy as np
import pandas as pd
import pytest

from meshscope.dashboard import stragglers as S


def _steps(compute: list[list[float]], exposed: list[list[float]] | None = None,
           groups: list[int] | None = None) -> pd.DataFrame:
    """``compute[step][rank]`` (and ``exposed``) as rank_steps rows. Without ``exposed``, synchronous
    training: each rank waits at its gradient sync for the slowest rank of its group (``groups[rank]``,
    default one group), plus 10 ms of transfer."""
    rows = []
    for step, per_rank in enumerate(compute):
        group = groups or [0] * len(per_rank)
        for rank, c in enumerate(per_rank):
            slowest = max(x for x, g in zip(per_rank, group) if g == group[rank])
            e = exposed[step][rank] if exposed else slowest - c + 0.01
            rows.append({"rank": rank, "step": step, "compute_s": c, "exposed_comm_s": e})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("n", range(1, 8))
def test_others_median_is_the_median_of_the_others(n):
    rng = np.random.default_rng(n)
    for values in (rng.normal(size=n), np.round(rng.normal(size=n)), np.ones(n)):
        got = S._others_median(values)
        for i in range(n):
            others = np.delete(values, i)
            want = statistics.median(others) if len(others) else np.nan
            assert (np.isnan(want) and np.isnan(got[i])) or got[i] == pytest.approx(want)


def test_a_straggler_of_two_ranks_is_flagged_and_costs_what_its_peer_waits():
    # The case: rank 1 computes 0.117 s against 0.018 s; rank 0 waits ~0.1 s at the all-reduce.
    rng = np.random.default_rng(0)
    compute = [[0.018 * (1 + 0.05 * rng.normal()), 0.118 * (1 + 0.02 * rng.normal())] for _ in range(20)]
    exposed = [[0.105 + 0.003 * rng.normal(), 0.005] for _ in range(20)]
    v = S.rank_step_verdicts(_steps(compute, exposed))
    t = S.straggler_table(v)
    assert t["rank"].tolist() == [1]
    assert t.iloc[0]["slow_share"] == 1.0 and t.iloc[0]["cost_s_per_step"] == pytest.approx(0.1, rel=0.05)
    assert t.iloc[0]["excess_s"] == pytest.approx(0.1, rel=0.05) and t.iloc[0]["cause"].startswith("compute")
    cost = S.step_cost(v)
    assert (cost["rank"] == 1).all() and cost["cost_s"].mean() == pytest.approx(0.1, rel=0.05)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_clean_ranks_with_noise_flag_nobody(n):
    rng = np.random.default_rng(n)
    compute = [[0.05 * (1 + 0.08 * rng.normal()) for _ in range(n)] for _ in range(30)]
    assert S.straggler_table(S.rank_step_verdicts(_steps(compute))).empty


@pytest.mark.parametrize("n", [3, 4, 8])
def test_one_slow_rank_among_n(n):
    compute = [[0.05] * n for _ in range(10)]
    exposed = [[0.03] * n for _ in range(10)]
    for step in range(10):
        compute[step][n - 1] = 0.08
        exposed[step][n - 1] = 0.001
    t = S.straggler_table(S.rank_step_verdicts(_steps(compute, exposed)))
    assert t["rank"].tolist() == [n - 1] and t.iloc[0]["cost_s_per_step"] == pytest.approx(0.029)


def test_persistence_a_rank_slow_in_a_minority_of_steps_is_not_a_straggler():
    def table(slow_steps: int):
        compute = [[0.05, 0.05, 0.09 if s < slow_steps else 0.05] for s in range(10)]
        return S.straggler_table(S.rank_step_verdicts(_steps(compute)))

    assert table(4).empty and table(5)["rank"].tolist() == [2]


def test_the_excess_must_reach_the_relative_threshold_and_the_absolute_floor():
    assert S.straggler_table(S.rank_step_verdicts(_steps([[1.0, 1.15]] * 5))).empty  # 15 % < 20 %
    assert S.straggler_table(S.rank_step_verdicts(_steps([[1.0, 1.15]] * 5), rel=0.1))["rank"].tolist() == [1]
    assert S.straggler_table(S.rank_step_verdicts(_steps([[0.001, 0.0025]] * 5))).empty  # 1.5 ms < 2 ms


def test_pipeline_stages_are_compared_within_their_stage():
    # pp=2 x dp=2: stage 1 (ranks 1, 3) also runs the head and loss, 40 % more compute by design.
    peers = pd.DataFrame({"rank": [0, 1, 2, 3], "peer_group": [0, 1, 0, 1]})
    compute = [[0.10, 0.14, 0.10, 0.14]] * 6
    assert S.straggler_table(S.rank_step_verdicts(_steps(compute))).shape[0] == 2  # all peers: wrong
    stages = [0, 1, 0, 1]
    assert S.straggler_table(S.rank_step_verdicts(_steps(compute, groups=stages), peers=peers)).empty
    slow = [[0.10, 0.14, 0.13, 0.14]] * 6  # rank 2 slow within stage 0
    assert S.straggler_table(S.rank_step_verdicts(_steps(slow, groups=stages), peers=peers))["rank"].tolist() == [2]
    # A rank alone in its stage has no peers: no verdict on it.
    alone = pd.DataFrame({"rank": [0, 1], "peer_group": [0, 1]})
    assert S.straggler_table(S.rank_step_verdicts(_steps([[0.1, 0.5]] * 6), peers=alone)).empty


def test_a_slower_rank_nobody_waits_for_is_not_a_straggler():
    # 4 ranks on 2 cores: rank 3 takes 110 ms (the straggler); rank 2's 11-24 ms is 50 % over its peers'
    # median in most steps, but it arrives long before rank 3, so nobody waits for it.
    compute = [[0.011, 0.012, 0.019 if s % 3 else 0.012, 0.111] for s in range(9)]
    t = S.straggler_table(S.rank_step_verdicts(_steps(compute)))
    assert t["rank"].tolist() == [3] and t.iloc[0]["cost_s_per_step"] == pytest.approx(0.1, abs=0.002)
    v = S.rank_step_verdicts(_steps(compute))
    mine = v[v["rank"] == 2]
    assert (mine["excess_s"] >= 0.2 * mine["peers_compute_s"]).mean() > 0.5  # it was slower than its peers
    assert not mine["slow"].any()  # but never the one they waited for


def test_cause_throttling_from_gpu_reasons_and_clocks():
    compute = [[1.0, 1.01, 0.99, 1.0, 1.3]] * 4
    gpu = pd.DataFrame({"rank": range(5), "clock_ratio": [0.9, 0.9, 0.9, 0.9, 0.7],
                        "throttle_share": [0.03, 0.0, 0.05, 0.0, 0.9], "reasons": [4, 0, 4, 0, 0x20 | 0x40]})
    t = S.straggler_table(S.rank_step_verdicts(_steps(compute)), gpu=gpu)
    assert t["rank"].tolist() == [4] and t.iloc[0]["cause"].startswith("GPU throttling (SW thermal, HW thermal")


def test_cause_link_from_low_busbw():
    link = pd.DataFrame({"rank": range(10), "busbw_ratio": [1.0] * 9 + [0.6], "link_group": ["dp:0"] * 10})
    t = S.straggler_table(S.rank_step_verdicts(_steps([[1.0] * 10] * 3)), link=link)
    assert t["rank"].tolist() == [9] and t.iloc[0]["cause"] == "link (group dp:0 busbw 60% of peer groups)"


@pytest.mark.parametrize(("times", "first"), [
    ([3.61] + [0.4] * 19, 1),  # the case: step 0 is 9x the median
    ([2.0, 1.2, 0.9] + [0.4] * 17, 3),  # FSDP2-like lazy init over three steps
    ([0.4] * 20, 1),  # step 0 always: allocations happen there even when its time hides them
    ([5.0] * 6 + [0.4] * 14, 5),  # at most a quarter of the range
    ([0.4], 0),  # one step: nothing to exclude
])
def test_warmup_rule(times, first):
    series = pd.DataFrame({"step": range(len(times)), "step_time_s": times})
    assert S.first_steady_step(series) == first


def test_warmup_is_at_the_start_of_a_run_only():
    later = pd.DataFrame({"step": range(10, 30), "step_time_s": [0.9] + [0.4] * 19})
    assert S.first_steady_step(later) == 10  # a slow step 10 mid-run is no warm-up
    resumed = later.assign(step_time_s=[3.0] + [0.4] * 19)
    assert S.first_steady_step(resumed, run_first_step=10) == 11  # a run that starts at step 10 warms up there
    assert S.first_steady_step(later.iloc[0:0]) is None


def test_rule_text_names_the_thresholds():
    assert "20%" in S.RULE and "50%" in S.RULE and "peers" in S.RULE


def test_every_world_size_finds_the_injected_rank():
    for n, slow in itertools.product(range(2, 7), range(6)):
        if slow >= n:
            continue
        compute = [[0.05] * n for _ in range(8)]
        for step in compute:
            step[slow] = 0.1
        assert S.straggler_table(S.rank_step_verdicts(_steps(compute)))["rank"].tolist() == [slow], (n, slow)


def test_two_equally_slow_ranks_are_both_stragglers():
    compute = [[0.05, 0.05, 0.15, 0.15] for _ in range(6)]
    t = S.straggler_table(S.rank_step_verdicts(_steps(compute)))
    assert sorted(t["rank"]) == [2, 3] and t["cost_s_per_step"].tolist() == pytest.approx([0.1, 0.1])
