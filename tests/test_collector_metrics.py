"""Metric state and exposition: hand-computed values, the series budget, exemplars, expiry."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from meshscope.agent import catalog
from meshscope.agent.collector.exposition import MeshscopeCollector
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.contract import CollectiveRecord, EventRecord, GpuRecord, HangRecord, MemoryRecord, StepRecord
from meshscope.agent.transport.frame import rows_to_batch
from tests.support.spools import ALL_OPS_DIMS, collective_table, run_table


def table(kind: str, rows: list[tuple]) -> pa.Table:
    return pa.Table.from_batches([rows_to_batch(kind, rows)])


def step(i, *, wall=1.0, compute=0.6, exposed=0.2, bubble=0.1, other=0.1, loss=2.0, nonfinite=False,
         skipped=False, mfu=0.4, dropped=0, t0=100.0):
    return StepRecord(
        step=i, t_start=t0 + i, t_end=t0 + i + wall, wall_s=wall, compute_s=compute, exposed_comm_s=exposed,
        bubble_s=bubble, other_s=other, data_s=0.0, forward_s=0.2, backward_s=0.4, optimizer_s=0.0, tokens=1000,
        flops=5e12, mfu=mfu, loss=loss, loss_nonfinite=nonfinite, grad_norm=1.0, lr=1e-4, skipped=skipped,
        n_collectives=10, dropped_records_total=dropped, cpu_s=compute + other, cpu_wait_s=0.0)


def coll(seq, *, op="all_reduce", dim="dp", dur=0.5, nbytes=100):
    return CollectiveRecord(step=seq // 10, op=op, dim=dim, group=f"{dim}0", group_size=2, seq=seq, bytes=nbytes,
                            t_start=1.0, t_end=1.0 + dur, duration_s=dur, wait_s=0.1, algbw=1.0, busbw=1.0, peer=-1,
                            source="c10d", mesh_dim="")


def mem(i, *, t, **fields):
    """A memory record of a CPU rank (-1: what a CPU lacks, tensor bytes not measured); ``fields`` override."""
    values = dict.fromkeys(MemoryRecord._fields, -1)
    values.update(step=i, t=t, alloc_retries=0, ooms=0)
    values.update(fields)
    return MemoryRecord(**values)


def ev(t, step, kind, message):
    return EventRecord(t=t, step=step, kind=kind, message=message)


def hang(t, *, in_collective, step=5):
    return HangRecord(t=t, step=step, since_s=12.0, phase="", in_collective=in_collective,
                      op="all_reduce" if in_collective else "", where="x", groups="[]", stacks="[]")


def scrape(state: MetricsState) -> tuple[CollectorRegistry, str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MeshscopeCollector(state, host="node0", version="test"))
    return registry, generate_latest(registry).decode()


def test_step_records_fold_into_hand_computed_values():
    st = MetricsState()
    st.observe("step", table("step", [step(0, wall=1.0, compute=0.5), step(1, wall=2.0, compute=1.5, loss=math.nan,
                                                                          nonfinite=True, mfu=0.3, dropped=4),
                                      step(2, wall=1.5, skipped=True, mfu=0.35, loss=1.5, dropped=6)]),
               run="r", rank=3, attempt=0, now=200.0)
    reg, _ = scrape(st)
    lab = {"run": "r", "rank": "3"}
    v = lambda name, **extra: reg.get_sample_value("meshscope_" + name, {**lab, **extra})  # noqa: E731
    assert v("rank_steps_total") == 3 and v("rank_step_wall_seconds_total") == pytest.approx(4.5)
    assert v("rank_step_phase_seconds_total", phase="compute") == pytest.approx(0.5 + 1.5 + 0.6)
    assert v("rank_step_phase_seconds_total", phase="bubble") == pytest.approx(0.3)
    assert v("rank_last_step") == 2 and v("rank_last_step_timestamp_seconds") == pytest.approx(103.5)
    assert v("rank_mfu_ratio") == pytest.approx(0.35) and v("rank_loss") == pytest.approx(1.5)
    assert v("rank_nonfinite_loss_total") == 1 and v("rank_skipped_steps_total") == 1
    assert v("rank_tokens_total") == 3000 and v("rank_model_flops_total") == pytest.approx(1.5e13)
    assert v("rank_dropped_records_total") == 6
    # Job histogram: one observation per rank-step; buckets are cumulative.
    assert reg.get_sample_value("meshscope_step_wall_seconds_count", {"run": "r"}) == 3
    assert reg.get_sample_value("meshscope_step_wall_seconds_bucket", {"run": "r", "le": "1.0"}) == 1
    assert reg.get_sample_value("meshscope_step_wall_seconds_bucket", {"run": "r", "le": "2.5"}) == 3
    assert reg.get_sample_value("meshscope_step_wall_seconds_sum", {"run": "r"}) == pytest.approx(4.5)


def test_exemplars_name_the_slowest_rank_and_step():
    st = MetricsState(exemplar_window_s=60)
    for rank, compute in ((0, 0.60), (1, 0.90), (2, 0.70)):
        st.observe("step", table("step", [step(7, compute=compute), step(8, compute=0.3)]), run="r", rank=rank,
                   attempt=0, now=10.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MeshscopeCollector(st, host="h", version="t"))
    om = generate_openmetrics(registry).decode()
    line = next(ln for ln in om.splitlines() if ln.startswith('meshscope_step_compute_seconds_bucket{le="1.0"'))
    assert '# {rank="1",step="7"} 0.9' in line
    # A later, faster observation does not replace it inside the window; after the window any does.
    st.observe("step", table("step", [step(9, compute=0.8)]), run="r", rank=4, attempt=0, now=20.0)
    hist = st.runs["r"].compute_hist
    assert (hist.exemplars[7].rank, hist.exemplars[7].step) == (1, 7)
    st.observe("step", table("step", [step(10, compute=0.8)]), run="r", rank=5, attempt=0, now=100.0)
    assert (hist.exemplars[7].rank, hist.exemplars[7].step) == (5, 10)


def test_collectives_group_by_op_and_dim_with_last_seq():
    st = MetricsState()
    rows = [coll(1, dur=0.5, nbytes=10), coll(2, dur=0.25, nbytes=30), coll(3, op="all_gather", dim="fsdp"),
            coll(5, op="send", dim="pp", nbytes=7)]
    st.observe("collective", table("collective", rows), run="r", rank=0, attempt=0, now=1.0)
    reg, _ = scrape(st)
    v = lambda name, **lab: reg.get_sample_value("meshscope_" + name, {"run": "r", "rank": "0", **lab})  # noqa
    assert v("rank_collective_seconds_total", op="all_reduce", dim="dp") == pytest.approx(0.75)
    assert v("rank_collective_bytes_total", op="all_reduce", dim="dp") == 40
    assert v("rank_collectives_total", op="all_reduce", dim="dp") == 2
    assert v("rank_collectives_total", op="send", dim="pp") == 1
    assert v("rank_collective_last_seq", dim="dp") == 2 and v("rank_collective_last_seq", dim="pp") == 5
    # A restart (new attempt) starts sequence numbers again.
    st.observe("collective", table("collective", [coll(0)]), run="r", rank=0, attempt=1, now=2.0)
    reg, _ = scrape(st)
    assert v("rank_collective_last_seq", dim="dp") == 0 and v("rank_collective_last_seq", dim="pp") is None
    assert v("rank_collectives_total", op="all_reduce", dim="dp") == 3  # counters keep counting


def series_per_rank(text: str) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "rank" in sample.labels:
                key = (sample.labels["run"], sample.labels["rank"])
                counts[key] = counts.get(key, 0) + 1
    return counts


def test_series_budget_holds_for_every_op_and_dim():
    st = MetricsState()
    rng = np.random.default_rng(0)
    mesh = {"dp": 2, "fsdp": 2, "tp": 2, "pp": 2}
    st.observe("run", run_table(rank=0, world_size=16, t0=1.0, mesh=mesh),
               run="r", rank=0, attempt=0, now=1.0)
    device = dict(allocated_bytes=3, allocated_peak_bytes=4, reserved_bytes=5, reserved_peak_bytes=6, active_bytes=7,
                  active_peak_bytes=8, device_free_bytes=9, device_total_bytes=10)
    st.observe("memory", table("memory", [mem(0, t=1.0, rss_bytes=1, rss_peak_bytes=2, **device)]), run="r", rank=0,
               attempt=0, now=1.0)
    st.observe("step", table("step", [step(0)]), run="r", rank=0, attempt=0, now=1.0)
    st.observe("collective", collective_table(n=5000, seq0=0, step0=0, per_step=50, t0=1.0, rng=rng,
                                              ops_dims=ALL_OPS_DIMS), run="r", rank=0, attempt=0, now=1.0)
    _, text = scrape(st)
    counts = series_per_rank(text)
    assert counts[("r", "0")] <= catalog.SERIES_PER_RANK_MAX
    assert counts[("r", "0")] >= catalog.SERIES_PER_RANK_MAX - catalog.rank_budget().per_op_dim
    assert 'op="other",rank="0"' in text and st.overflow_records > 0
    # The mesh pre-created the expected collectives at 0 before any was seen (increase() pitfall).
    fresh = MetricsState()
    fresh.observe("run", run_table(rank=1, world_size=4, t0=1.0, mesh={"fsdp": 4, "tp": 1}), run="q", rank=1,
                  attempt=0, now=1.0)
    reg, _ = scrape(fresh)
    for op in ("all_gather", "reduce_scatter"):
        assert reg.get_sample_value("meshscope_rank_collectives_total",
                                    {"run": "q", "rank": "1", "op": op, "dim": "fsdp"}) == 0
    assert reg.get_sample_value("meshscope_rank_collectives_total",
                                {"run": "q", "rank": "1", "op": "all_reduce", "dim": "tp"}) is None


def test_memory_events_run_info_and_cpu_only_fields():
    st = MetricsState()
    st.observe("memory", table("memory", [mem(0, t=1.0, rss_bytes=100, rss_peak_bytes=150),
                                          mem(1, t=2.0, rss_bytes=120, rss_peak_bytes=160, alloc_retries=2, ooms=1)]),
               run="r", rank=0, attempt=0, now=1.0)
    st.observe("event", table("event", [ev(1.0, 0, "crash", "x"), ev(2.0, 0, "crash", "y"), ev(3.0, 1, "end", "")]),
               run="r", rank=0, attempt=0, now=1.0)
    st.observe("run", run_table(rank=0, world_size=8, t0=1.0), run="r", rank=0, attempt=0, now=1.0)
    reg, text = scrape(st)
    lab = {"run": "r", "rank": "0"}
    assert reg.get_sample_value("meshscope_rank_memory_rss_bytes", lab) == 120
    assert reg.get_sample_value("meshscope_rank_memory_rss_peak_bytes", lab) == 160
    assert reg.get_sample_value("meshscope_rank_device_memory_allocated_peak_bytes", lab) is None  # CPU: -1
    assert reg.get_sample_value("meshscope_rank_device_ooms_total", lab) == 1
    assert reg.get_sample_value("meshscope_rank_device_alloc_retries_total", lab) == 2
    assert reg.get_sample_value("meshscope_run_events_total", {"run": "r", "kind": "crash"}) == 2
    assert reg.get_sample_value("meshscope_run_events_total", {"run": "r", "kind": "hang"}) == 0
    assert reg.get_sample_value("meshscope_run_world_size", {"run": "r"}) == 8
    info = {"run": "r", "strategy": "fsdp", "mesh": json.dumps({"fsdp": 8}), "schedule": "", "model": "synthetic",
            "device": "cpu", "backend": "gloo", "dtype": "bf16", "peak_source": "table:H100",
            "torch_version": "2.13", "meshscope_version": "0.1.0"}
    assert reg.get_sample_value("meshscope_run_info", info) == 1
    assert reg.get_sample_value("meshscope_rank_info", {**lab, "host": "node0", "local_rank": "0",
                                                        "attempt": "0"}) == 1
    assert "_created" not in text


def test_runs_expire_after_their_last_record():
    st = MetricsState(run_ttl_s=60)
    st.observe("step", table("step", [step(0)]), run="old", rank=0, attempt=0, now=0.0)
    st.observe("step", table("step", [step(0)]), run="new", rank=0, attempt=0, now=50.0)
    assert st.expire(61.0) == ["old"]
    _, text = scrape(st)
    assert 'run="old"' not in text and 'run="new"' in text
    assert st.active_runs(61.0, window_s=30) == ["new"]


def test_every_exported_name_is_in_the_catalog():
    st = MetricsState()
    st.observe("step", table("step", [step(0)]), run="r", rank=0, attempt=0, now=1.0)
    st.gpus[0] = GpuRecord(t=1.0, host="h", gpu=0, uuid="GPU-x", name="H100", util_ratio=0.5, mem_util_ratio=0.1,
                           mem_used_bytes=1, mem_total_bytes=2, power_watts=3.0, temperature_celsius=4.0,
                           sm_clock_hz=5.0, sm_clock_max_hz=6.0, throttle_reasons=0, xid_errors_total=0,
                           ecc_errors_total=-1)._asdict()
    _, text = scrape(st)
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert names <= catalog.sample_names()
    assert "meshscope_gpu_ecc_errors_total" not in names  # -1: not supported, not exported
    assert "meshscope_gpu_power_watts" in names and "meshscope_agent_info" in names


def test_a_hang_record_sets_the_ranks_hang_gauge_until_a_later_step_ends():
    st = MetricsState()
    st.observe("step", table("step", [step(0), step(1)]), run="r", rank=0, attempt=0, now=1.0)
    st.observe("step", table("step", [step(0), step(1)]), run="r", rank=1, attempt=0, now=1.0)
    st.observe("hang", table("hang", [hang(500.0, in_collective=True)]), run="r", rank=0, attempt=0, now=2.0)
    st.observe("hang", table("hang", [hang(501.0, in_collective=False)]), run="r", rank=1, attempt=0, now=2.0)
    reg, _ = scrape(st)
    assert reg.get_sample_value("meshscope_rank_hang_in_collective", {"run": "r", "rank": "0"}) == 1.0
    assert reg.get_sample_value("meshscope_rank_hang_in_collective", {"run": "r", "rank": "1"}) == 0.0
    # an older hang record (a rank's stall before its last step) sets nothing; a step after the stall clears it
    st.observe("step", table("step", [step(0)]), run="q", rank=0, attempt=0, now=2.0)
    st.observe("hang", table("hang", [hang(50.0, in_collective=False)]), run="q", rank=0, attempt=0, now=2.0)
    st.observe("step", table("step", [step(2, t0=600.0)]), run="r", rank=1, attempt=0, now=3.0)
    reg, _ = scrape(st)
    assert reg.get_sample_value("meshscope_rank_hang_in_collective", {"run": "q", "rank": "0"}) is None
    assert reg.get_sample_value("meshscope_rank_hang_in_collective", {"run": "r", "rank": "1"}) is None
    assert reg.get_sample_value("meshscope_rank_hang_in_collective", {"run": "r", "rank": "0"}) == 1.0
