"""Scrape-time exposition: turns :class:`MetricsState` into Prometheus metric families.

Families are built from the catalog entries (``agent.catalog``), so a name that is not in the catalog
cannot be exported. Plain metric families carry no ``_created`` series. Example of what it yields::

    # TYPE meshscope_rank_last_step gauge
    meshscope_rank_last_step{rank="3",run="llama-8b"} 1200.0
    # TYPE meshscope_rank_collective_seconds_total counter
    meshscope_rank_collective_seconds_total{dim="fsdp",op="all_gather",rank="3",run="llama-8b"} 41.7
    # TYPE meshscope_step_compute_seconds histogram
    meshscope_step_compute_seconds_bucket{le="0.5",run="llama-8b"} 9600.0 # {rank="5",step="1187"} 0.49 ...
"""

from __future__ import annotations

import math
from typing import Iterator

from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily, Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar as PromExemplar

from meshscope.agent.catalog import CATALOG, PHASES
from meshscope.agent.collector.state import Histogram, MetricsState
from meshscope.agent.transport.frame import REJECT_REASONS

_FAMILY_TYPES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                 "histogram": HistogramMetricFamily, "info": InfoMetricFamily}


class Families:
    """One metric family per catalog entry, keyed by the catalog name without the prefix."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {}
        for spec in CATALOG:
            family = _FAMILY_TYPES[spec.type](spec.family_name, spec.help, labels=spec.labels)
            self.by_name[spec.name.removeprefix("meshscope_")] = family

    def add(self, name: str, labels: list[str], value) -> None:
        self.by_name[name].add_metric(labels, value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self.by_name.values())


class MeshscopeCollector(Collector):
    """Yields every meshscope family from a :class:`MetricsState` at scrape time."""

    def __init__(self, state: MetricsState, *, host: str, version: str) -> None:
        self._state = state
        self._host = host
        self._version = version

    def describe(self) -> list[Metric]:
        # Avoid a collect() at registration time (the registry calls describe() if present).
        return []

    def collect(self) -> Iterator[Metric]:
        f = Families()
        st = self._state
        with st.lock:
            f.add("agent_info", [], {"host": self._host, "version": self._version})
            for run, rs in st.runs.items():
                _collect_run(f, run, rs)
            _collect_agent(f, st)
            _collect_gpus(f, st, self._host)
        yield from (family for family in f if family.samples)


def _collect_run(f: Families, run: str, rs) -> None:
    if rs.info is not None:
        f.add("run_info", [run], rs.info)
    if rs.world_size is not None:
        f.add("run_world_size", [run], rs.world_size)
    f.add("run_ranks_reporting", [run], len(rs.ranks))
    f.add("run_last_record_timestamp_seconds", [run], rs.last_record_t)
    for kind, count in rs.events.items():
        f.add("run_events_total", [run, kind], count)
    _add_histogram(f, "step_wall_seconds", run, rs.wall_hist)
    _add_histogram(f, "step_compute_seconds", run, rs.compute_hist)
    for rank, r in rs.ranks.items():
        lab = [run, str(rank)]
        # Counters exist from the rank's first record on, at 0 (increase() then sees the first steps).
        f.add("rank_steps_total", lab, r.steps)
        f.add("rank_step_wall_seconds_total", lab, r.wall)
        for phase, value in zip(PHASES, r.phases):
            f.add("rank_step_phase_seconds_total", lab + [phase], float(value))
        f.add("rank_tokens_total", lab, r.tokens)
        f.add("rank_model_flops_total", lab, r.flops)
        f.add("rank_nonfinite_loss_total", lab, r.nonfinite)
        f.add("rank_skipped_steps_total", lab, r.skipped)
        f.add("rank_dropped_records_total", lab, r.dropped)
        if r.hang is not None:
            f.add("rank_hang_in_collective", lab, float(r.hang[0]))
        if r.last_step is not None:
            f.add("rank_last_step", lab, r.last_step)
            f.add("rank_last_step_timestamp_seconds", lab, r.last_step_t)
            f.add("rank_mfu_ratio", lab, r.mfu)
            f.add("rank_loss", lab, r.loss)
        if r.info is not None:
            f.add("rank_info", lab, r.info)
        if r.memory is not None:
            mem = r.memory
            _add_if(f, "rank_memory_rss_bytes", lab, mem["rss_bytes"])
            _add_if(f, "rank_memory_rss_peak_bytes", lab, mem["rss_peak_bytes"])
            _add_if(f, "rank_device_memory_allocated_peak_bytes", lab, mem["allocated_peak_bytes"])
            _add_if(f, "rank_device_memory_reserved_peak_bytes", lab, mem["reserved_peak_bytes"])
            f.add("rank_device_ooms_total", lab, max(0, mem["ooms"] or 0))
            f.add("rank_device_alloc_retries_total", lab, max(0, mem["alloc_retries"] or 0))
        for dim, seq in r.seq.items():
            if seq >= 0:
                f.add("rank_collective_last_seq", lab + [dim], seq)
        for (op, dim), (secs, nbytes, count) in r.coll.items():
            f.add("rank_collective_seconds_total", lab + [op, dim], secs)
            f.add("rank_collective_bytes_total", lab + [op, dim], nbytes)
            f.add("rank_collectives_total", lab + [op, dim], count)


def _add_if(f: Families, name: str, labels: list[str], value) -> None:
    """Gauges whose source field is -1 / empty when not applicable (e.g. device memory on CPU)."""
    if value is not None and value >= 0:
        f.add(name, labels, value)


def _add_histogram(f: Families, name: str, run: str, hist: Histogram) -> None:
    if hist.counts.sum() == 0:
        return
    buckets = []
    cumulative = 0
    bounds = [*map(float, hist.bounds), math.inf]
    for i, le in enumerate(bounds):
        cumulative += int(hist.counts[i])
        ex = hist.exemplars[i]
        le_s = "+Inf" if math.isinf(le) else repr(le)
        if ex is None:
            buckets.append((le_s, cumulative))
        else:
            buckets.append((le_s, cumulative, PromExemplar(
                {"rank": str(ex.rank), "step": str(ex.step)}, ex.value, ex.t)))
    f.by_name[name].add_metric([run], buckets, hist.total)


def _collect_agent(f: Families, st: MetricsState) -> None:
    for kind, count in st.ingested.items():
        f.add("agent_records_ingested_total", [kind], count)
    for reason in REJECT_REASONS:
        f.add("agent_frames_rejected_total", [reason], st.rejected.get(reason, 0))
    f.add("agent_ingested_bytes_total", [], st.ingested_bytes)
    f.add("agent_dropped_records_total", [], st.dropped)
    f.add("agent_series_overflow_records_total", [], st.overflow_records)
    f.add("agent_spool_bytes", [], st.spool_bytes)
    f.add("agent_backlog_bytes", [], st.backlog_bytes)
    f.add("agent_spool_files", [], st.spool_files)
    f.add("agent_runs", [], len(st.runs))
    f.add("agent_store_parts_written_total", [], st.parts_written)
    f.add("agent_store_write_errors_total", [], st.store_write_errors)
    f.add("agent_upload_parts_total", [], st.upload_parts)
    f.add("agent_upload_bytes_total", [], st.upload_bytes)
    f.add("agent_upload_errors_total", [], st.upload_errors)
    f.add("agent_upload_pending_parts", [], st.upload_pending_parts)
    if st.upload_last_success is not None:
        f.add("agent_upload_last_success_timestamp_seconds", [], st.upload_last_success)
    f.add("agent_metric_errors_total", [], st.metric_errors)
    f.add("agent_gpu_sample_errors_total", [], st.gpu_errors)
    if st.lag_s is not None:
        f.add("agent_lag_seconds", [], st.lag_s)
    if st.poll_duration_s is not None:
        f.add("agent_poll_duration_seconds", [], st.poll_duration_s)
        f.add("agent_last_poll_timestamp_seconds", [], st.last_poll_t)


# gpu sample column -> catalog name (without prefix)
_GPU_GAUGES = (
    ("util_ratio", "gpu_utilization_ratio"), ("mem_util_ratio", "gpu_memory_utilization_ratio"),
    ("mem_used_bytes", "gpu_memory_used_bytes"), ("mem_total_bytes", "gpu_memory_total_bytes"),
    ("power_watts", "gpu_power_watts"), ("temperature_celsius", "gpu_temperature_celsius"),
    ("sm_clock_hz", "gpu_sm_clock_hertz"), ("sm_clock_max_hz", "gpu_sm_clock_max_hertz"),
    ("throttle_reasons", "gpu_throttle_reasons"), ("xid_errors_total", "gpu_xid_errors_total"),
    ("ecc_errors_total", "gpu_ecc_errors_total"),
)


def _collect_gpus(f: Families, st: MetricsState, host: str) -> None:
    for index, sample in sorted(st.gpus.items()):
        lab = [str(index)]
        f.add("gpu_info", lab, {"uuid": sample["uuid"], "name": sample["name"], "host": host})
        for column, name in _GPU_GAUGES:
            value = sample[column]
            # NVML fields a GPU does not support are stored as NaN / -1 and not exported.
            if value is not None and not (isinstance(value, float) and math.isnan(value)) and value >= 0:
                f.add(name, lab, value)

