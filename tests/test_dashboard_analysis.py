"""Dashboard analyses on small hand-computed tables (formulas brief)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from meshscope.dashboard import analysis as A


# ------------------------------------------------------------------------------------------ busbw
@pytest.mark.parametrize(("op", "n", "factor"), [
    ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75), ("all_reduce", 1, 0.0), ("all_gather", 4, 0.75),
    ("reduce_scatter", 2, 0.5), ("all_to_all", 8, 0.875), ("broadcast", 8, 1.0), ("send", 2, 1.0),
    ("recv", 2, 1.0), ("reduce", 4, 1.0)])
def test_busbw_factor_follows_nccl_tests(op, n, factor):
    from meshscope.agent.contract import busbw_factor

    assert A.busbw_factor(op, n) == pytest.approx(factor) == busbw_factor(op, n)  # the ranks' own factor


def test_busbw_has_no_factor_for_a_barrier_or_an_unknown_op():
    assert np.isnan(A.busbw_factor("barrier", 4)) and np.isnan(A.busbw_factor("other", 4))


# -------------------------------------------------------------------------------------- breakdown
def test_breakdown_means_fractions_and_residual():
    rows = pd.DataFrame({
        "rank": [0, 0, 1, 1], "wall_s": [1.0, 1.0, 1.0, 1.0],
        "compute_s": [0.6, 0.5, 0.4, 0.4], "exposed_comm_s": [0.2, 0.3, 0.4, 0.4],
        "bubble_s": [0.1, 0.1, np.nan, np.nan], "other_s": [0.1, 0.1, 0.1, 0.1]})
    bd = A.breakdown(rows).set_index("rank")
    assert bd.loc[0, "compute_s"] == pytest.approx(0.55)
    assert bd.loc[0, "exposed_comm_s"] == pytest.approx(0.25)
    assert bd.loc[0, "compute_frac"] == pytest.approx(0.55)
    assert bd.loc[0, "unattributed_s"] == pytest.approx(0.0)
    # A missing component counts as 0 and the residual shows what is unaccounted for.
    assert bd.loc[1, "bubble_s"] == 0.0
    assert bd.loc[1, "unattributed_s"] == pytest.approx(0.1)


# -------------------------------------------------------------------------------------- stragglers
def test_robust_z_uses_median_and_mad():
    z = A.robust_z(pd.Series([1.0, 2.0, 3.0, 4.0, 100.0]))
    # median 3, |x - 3| = 2, 1, 0, 1, 97 -> MAD 1 -> scale 1.4826
    assert z.iloc[4] == pytest.approx(97 / 1.4826)
    assert z.iloc[0] == pytest.approx(-2 / 1.4826)
    assert z.iloc[2] == 0.0


def test_robust_z_falls_back_when_mad_is_zero():
    z = A.robust_z(pd.Series([1.0, 1.0, 1.0, 1.0, 5.0]))
    # MAD 0 -> mean absolute deviation 0.8 x 1.2533
    assert z.iloc[4] == pytest.approx(4 / (1.2533 * 0.8))
    assert (A.robust_z(pd.Series([2.0, 2.0, 2.0])) == 0).all()


def test_decode_throttle_keeps_slowdown_reasons_only():
    assert A.decode_throttle(0x1 | 0x4 | 0x40 | 0x100) == ["SW power cap", "HW thermal"]
    assert A.decode_throttle(0) == []


# -------------------------------------------------------------------------------------- pipeline
@pytest.mark.parametrize(("schedule", "p", "m", "v", "expected"), [
    ("GPipe", 4, 4, 1, 3 / 7), ("1F1B", 4, 8, 1, 3 / 11), ("1F1B", 4, 16, 1, 3 / 19), ("1f1b", 4, 32, 1, 3 / 35),
    ("Interleaved1F1B", 4, 8, 2, 3 / 19), ("interleaved-1f1b", 2, 4, 4, 1 / 17), ("ZBVZeroBubble", 4, 8, 2, None),
    ("1F1B", 1, 8, 1, 0.0)])
def test_bubble_theory(schedule, p, m, v, expected):
    got = A.bubble_theory(schedule=schedule, p=p, m=m, v=v)
    assert got == (None if expected is None else pytest.approx(expected))


def test_bubble_theory_examples_from_the_brief():
    pct = [round(100 * A.bubble_theory(schedule="1F1B", p=4, m=m), 1) for m in (4, 8, 16, 32)]
    assert pct == [42.9, 27.3, 15.8, 8.6]


def test_measured_bubble_against_wall_and_span_extent():
    spans = pd.DataFrame({"step": [0] * 4, "rank": [0, 0, 1, 1], "stage": [0, 0, 1, 1],
                          "t_start": [0.0, 2.0, 1.0, 3.0], "t_end": [1.0, 3.0, 2.0, 4.0]})
    walls = pd.DataFrame({"step": [0, 0], "rank": [0, 1], "wall_s": [5.0, 5.0]})
    m = A.measured_bubble(spans, windows=walls).set_index("rank")
    assert m.loc[0, "bubble"] == pytest.approx(1 - 2 / 5)
    assert m.loc[1, "busy_s"] == pytest.approx(2.0)
    # Without step records the window is the pipeline's extent in the step (0..4).
    assert A.measured_bubble(spans)["bubble"].tolist() == pytest.approx([0.5, 0.5])


def test_measured_bubble_splits_stage_imbalance_from_the_schedule():
    # GPipe, p=2, m=2, stage 1 twice as slow (F=B=2 against 1): stage 0 runs F F ... B B, stage 1 F F B B.
    f0, f1 = 1.0, 2.0
    rows = [(0, 0, 0.0, f0), (0, 0, f0, 2 * f0),                                # stage 0 forwards
            (1, 1, f0, f0 + f1), (1, 1, f0 + f1, f0 + 2 * f1),                  # stage 1 forwards
            (1, 1, f0 + 2 * f1, f0 + 3 * f1), (1, 1, f0 + 3 * f1, f0 + 4 * f1),  # stage 1 backwards
            (0, 0, f0 + 3 * f1, 2 * f0 + 3 * f1), (0, 0, f0 + 4 * f1, 2 * f0 + 4 * f1)]
    spans = pd.DataFrame(rows, columns=["rank", "stage", "t_start", "t_end"]).assign(step=0)
    m = A.measured_bubble(spans).set_index("rank")
    extent = 2 * f0 + 4 * f1  # 10
    assert m["bubble"].tolist() == pytest.approx([1 - 4 * f0 / extent, 1 - 4 * f1 / extent])  # 0.6, 0.2
    assert m["imbalance"].tolist() == pytest.approx([4 * (f1 - f0) / extent, 0.0])
    # The schedule's share is the same for both stages: the slowest stage's idle, 2·f0 of 10.
    assert m["schedule_bubble"].tolist() == pytest.approx([0.2, 0.2])


def test_idle_gaps_complement_spans():
    spans = pd.DataFrame({"rank": [0, 0, 0], "t_start": [1.0, 3.0, 3.5], "t_end": [2.0, 4.0, 3.8]})
    gaps = A.idle_gaps(spans, t0=0.0, t1=5.0)
    assert list(zip(gaps["t_start"], gaps["t_end"])) == [(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)]


# --------------------------------------------------------------------------------- communication
def test_comm_summary_per_rank_step():
    rows = pd.DataFrame({"rank": [0, 0, 1, 1], "step": [0, 1, 0, 1], "op": ["all_reduce"] * 4, "dim": ["dp"] * 4,
                         "bytes": [100] * 4, "duration_s": [0.4, 0.4, 0.2, 0.2], "wait_s": [0.1, 0.1, 0.1, 0.1]})
    s = A.comm_summary(rows).iloc[0]
    assert s["exposed_s"] == pytest.approx(0.1)  # 0.4 s waited over 4 rank-steps
    assert s["overlapped_s"] == pytest.approx(0.2)  # (1.2 - 0.4) / 4
    assert s["ops_per_step"] == 1.0 and s["bytes_per_step"] == 100
    assert s["exposed_share"] == pytest.approx(0.4 / 1.2)


def _collectives() -> pd.DataFrame:
    return pd.DataFrame({
        "rank": [0, 1, 2, 0, 1, 2, 0],
        "group": ["g"] * 6 + ["p"], "seq": [0, 0, 0, 1, 1, 1, 0], "peer": [-1] * 6 + [1],
        "t_start": [10.0, 10.5, 11.0, 20.2, 20.0, 20.1, 0.0]})


def test_arrival_skew_and_who_made_others_wait():
    s = A.arrival_skew(_collectives())
    assert len(s) == 6  # the P2P row is left out
    first = s[s["seq"] == 0].set_index("rank")
    assert first["skew_s"].tolist() == pytest.approx([0.0, 0.5, 1.0])
    assert first["is_last"].tolist() == [False, False, True]
    assert first.loc[2, "caused_wait_s"] == pytest.approx(1.5)  # (11 - 10) + (11 - 10.5)
    by = A.skew_by_rank(s).set_index("rank")
    assert by.loc[2, "mean_skew_s"] == pytest.approx((1.0 + 0.1) / 2)
    assert by.loc[0, "caused_wait_s"] == pytest.approx(0.3)  # last in seq 1: 0.2 + 0.1
    assert by["last_count"].sum() == 2


def test_arrival_skew_blames_one_rank_on_ties():
    rows = pd.DataFrame({"rank": [0, 1, 2], "group": ["g"] * 3, "seq": [5] * 3, "t_start": [1.0, 2.0, 2.0]})
    s = A.arrival_skew(rows)
    assert s["is_last"].sum() == 1
    assert s["caused_wait_s"].sum() == pytest.approx(1.0)


def test_collective_instances_net_busbw_excludes_arrival_skew():
    rows = pd.DataFrame({"rank": [0, 1, 2, 3], "op": ["all_reduce"] * 4, "dim": ["dp"] * 4, "group": ["dp:0"] * 4,
                         "group_size": [4] * 4, "bytes": [10**9] * 4, "seq": [0] * 4,
                         "t_start": [0.0, 0.1, 0.2, 0.3], "t_end": [1.3, 1.3, 1.35, 1.3]})
    inst = A.collective_instances(rows)
    assert len(inst) == 1
    assert inst.iloc[0]["net_s"] == pytest.approx(1.0)  # earliest end 1.3 - last start 0.3
    assert inst.iloc[0]["busbw"] == pytest.approx(1e9 * 1.5 / 1.0)


def test_link_ratios_groups_and_each_ranks_worst_group():
    inst = pd.DataFrame({"op": ["all_reduce"] * 3 + ["all_gather"] * 2, "dim": ["dp"] * 3 + ["tp"] * 2,
                         "group": ["dp:0", "dp:1", "dp:2", "tp:0", "tp:1"], "group_size": [2] * 5,
                         "bytes": [8] * 5, "busbw": [10.0, 10.0, 5.0, 100.0, 100.0]})
    members = pd.DataFrame({"rank": [0, 1, 2, 0, 1, 2], "dim": ["dp", "dp", "dp", "tp", "tp", "tp"],
                            "group": ["dp:0", "dp:1", "dp:2", "tp:0", "tp:0", "tp:1"]})
    ranks, groups = A.link_ratios(inst, members=members)
    g = groups.set_index("group")["busbw_ratio"]
    assert g["dp:2"] == pytest.approx(0.5) and g["dp:0"] == pytest.approx(1.0) and g["tp:1"] == pytest.approx(1.0)
    r = ranks.set_index("rank")
    assert r.loc[2, "busbw_ratio"] == pytest.approx(0.5) and r.loc[2, "link_group"] == "dp:2"
    assert r.loc[0, "busbw_ratio"] == pytest.approx(1.0)


def test_busbw_spread_quantiles():
    inst = pd.DataFrame({"op": ["all_reduce"] * 5, "dim": ["dp"] * 5, "bytes": [8] * 5,
                         "busbw": [1.0, 2.0, 3.0, 4.0, 5.0]})
    s = A.busbw_spread(inst).iloc[0]
    assert (s["count"], s["busbw"]) == (5, 3.0)
    assert s["busbw_p10"] == pytest.approx(1.4) and s["busbw_p90"] == pytest.approx(4.6)


def test_slow_groups_need_low_z_and_a_real_drop():
    groups = pd.DataFrame({"dim": ["dp"] * 6, "group": [f"dp:{i}" for i in range(6)],
                           "busbw_ratio": [1.0, 1.01, 0.99, 1.0, 1.0, 0.5]})
    assert A.slow_groups(groups)["group"].tolist() == ["dp:5"]
    near = groups.assign(busbw_ratio=[1.0, 1.0001, 0.9999, 1.0, 1.0, 0.98])
    assert A.slow_groups(near).empty


# ---------------------------------------------------------------------------------- throughput
def test_parallel_degrees_and_tokens_per_second():
    assert A.parallel_degrees({"pp": 2, "dp": 2, "fsdp": 4, "tp": 2}, world_size=32) == {"dp": 8, "tp": 2, "pp": 2}
    assert A.parallel_degrees({}, world_size=8) == {"dp": 8, "tp": 1, "pp": 1}
    t = A.step_throughput(pd.DataFrame({"step": [0], "tokens_mean": [1000.0], "step_time_s": [2.0]}), dp=8)
    assert t["tokens_per_s"].iloc[0] == pytest.approx(4000.0)
