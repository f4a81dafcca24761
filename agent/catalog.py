"""The Prometheus metric catalog, kept as data.

One table drives everything that names a metric: the agent's collector builds each family from its
entry here (so nothing can be exported that is not listed), ``markdown_table()`` renders the
metric table of docs/metrics.md, and the Grafana/alert-rule checks resolve every PromQL metric name through
``sample_names()``.

Conventions (checked by tests/test_catalog.py): one prefix ``meshscope_``; base units as the last word
before ``_total`` (``_seconds``, ``_bytes``, ``_ratio``, ``_watts``, ``_celsius``, ``_hertz``); counters
end in ``_total``; timestamps are ``_timestamp_seconds``; metadata lives in ``_info`` metrics whose extra
labels are listed in ``info_labels``; no ``_created`` series (the collector yields plain metric families,
which carry none).

Cardinality: per-rank metrics carry ``run`` and ``rank``. ``per_rank`` says how many series a metric has
per rank: ``fixed`` (one per label set listed in ``values``), ``dim`` (one per parallel dim the rank
uses) or ``op_dim`` (one per collective op × dim seen). The agent admits ``dim`` and ``op_dim`` label
sets only while the rank stays within ``SERIES_PER_RANK_MAX`` (see ``rank_budget``); collectives beyond
that are folded into ``op="other", dim="other"``. Per-collective detail stays in the run store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshscope.agent.contract import EVENT_KINDS, KINDS
from meshscope.agent.transport.frame import REJECT_REASONS

PREFIX = "meshscope_"
SERIES_PER_RANK_MAX = 40
TYPES = ("counter", "gauge", "histogram", "info")
# Unit words that must appear as the name's last word (before _total for counters).
BASE_UNITS = ("seconds", "bytes", "ratio", "watts", "celsius", "hertz")
PHASES = ("compute", "exposed_comm", "bubble", "other")  # wall = compute + exposed_comm + bubble + other
OVERFLOW_OP = OVERFLOW_DIM = "other"
# Buckets of the job-level step histograms (seconds): 5 ms .. 5 min, roughly ×2.5 apart.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)

RANK = ("run", "rank")
OP_DIM = ("run", "rank", "op", "dim")


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One exported metric family."""

    name: str  # as written in PromQL: counters with _total; histograms without _bucket/_sum/_count
    type: str  # counter | gauge | histogram | info
    unit: str  # base unit word, or "" for pure numbers / counts
    labels: tuple[str, ...]
    help: str
    source: str  # where the value comes from (record kind and field, or the agent itself)
    scope: str  # rank | run | agent | gpu
    per_rank: str = ""  # rank scope only: fixed | dim | op_dim
    values: dict[str, tuple[str, ...]] = field(default_factory=dict)  # known label values (created at 0)
    info_labels: tuple[str, ...] = ()  # info metrics: the metadata labels
    when: str = ""  # condition for the series to exist, if any

    @property
    def family_name(self) -> str:
        """The name prometheus_client's metric families take (they add _total / _info themselves)."""
        if self.type == "counter":
            return self.name[: -len("_total")]
        if self.type == "info":
            return self.name[: -len("_info")]
        return self.name

    def sample_names(self) -> tuple[str, ...]:
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)

    def series_per_label_set(self) -> int:
        count = 1
        for values in self.values.values():
            count *= len(values)
        return count


def _m(name: str, type_: str, unit: str, labels: tuple[str, ...], help_: str, source: str, scope: str,
       **kw) -> MetricSpec:
    return MetricSpec(name=PREFIX + name, type=type_, unit=unit, labels=labels, help=help_, source=source,
                      scope=scope, **kw)


CATALOG: tuple[MetricSpec, ...] = (
    # --- per rank: progress and step breakdown (from `step` records) ---------------------------------
    _m("rank_last_step", "gauge", "", RANK, "Last optimizer step the rank completed.",
       "step.step of the rank's newest step record", "rank", per_rank="fixed"),
    _m("rank_last_step_timestamp_seconds", "gauge", "seconds", RANK,
       "End time of the rank's last completed step (Unix seconds).", "step.t_end (newest)", "rank",
       per_rank="fixed"),
    _m("rank_steps_total", "counter", "", RANK, "Optimizer steps the rank completed.",
       "count of step records", "rank", per_rank="fixed"),
    _m("rank_step_wall_seconds_total", "counter", "seconds", RANK,
       "Wall time of the rank's steps (sum of step.wall_s).", "step.wall_s (sum)", "rank", per_rank="fixed"),
    _m("rank_step_phase_seconds_total", "counter", "seconds", RANK + ("phase",),
       "Step wall time split by phase; the phases add up to the wall time "
       "(wall = compute + exposed_comm + bubble + other).",
       "step.compute_s / exposed_comm_s / bubble_s / other_s (sums)", "rank", per_rank="fixed",
       values={"phase": PHASES}),
    _m("rank_tokens_total", "counter", "", RANK, "Tokens processed by the rank's model replica.",
       "step.tokens (sum)", "rank", per_rank="fixed"),
    _m("rank_model_flops_total", "counter", "", RANK, "Model FLOPs attributed to the rank.",
       "step.flops (sum)", "rank", per_rank="fixed"),
    _m("rank_mfu_ratio", "gauge", "ratio", RANK,
       "Model FLOPs utilisation of the rank's last step (flops / wall_s / peak_flops).", "step.mfu (newest)",
       "rank", per_rank="fixed"),
    _m("rank_loss", "gauge", "", RANK, "Loss of the rank's last step (NaN when non-finite).",
       "step.loss (newest)", "rank", per_rank="fixed"),
    _m("rank_nonfinite_loss_total", "counter", "", RANK, "Steps whose loss was NaN or infinite.",
       "step.loss_nonfinite (count true)", "rank", per_rank="fixed"),
    _m("rank_skipped_steps_total", "counter", "", RANK,
       "Optimizer steps skipped (non-finite gradients).", "step.skipped (count true)", "rank",
       per_rank="fixed"),
    _m("rank_dropped_records_total", "counter", "", RANK,
       "Telemetry records the rank could not write or make: full buffers, and the collectives and pipeline "
       "spans its tracers had to drop (its own count; resets when the rank restarts).",
       "step.dropped_records_total (newest)", "rank", per_rank="fixed"),
    # --- per rank: memory (from `memory` records) -----------------------------------------------------
    _m("rank_memory_rss_bytes", "gauge", "bytes", RANK, "Resident set size of the rank's process.",
       "memory.rss_bytes (newest)", "rank", per_rank="fixed"),
    _m("rank_memory_rss_peak_bytes", "gauge", "bytes", RANK, "Peak resident set size of the rank's process.",
       "memory.rss_peak_bytes (newest)", "rank", per_rank="fixed"),
    _m("rank_device_memory_allocated_peak_bytes", "gauge", "bytes", RANK,
       "Peak device memory allocated by tensors (CUDA caching allocator).",
       "memory.allocated_peak_bytes (newest)", "rank", per_rank="fixed", when="value >= 0 (device present)"),
    _m("rank_device_memory_reserved_peak_bytes", "gauge", "bytes", RANK,
       "Peak device memory reserved by the caching allocator.", "memory.reserved_peak_bytes (newest)",
       "rank", per_rank="fixed", when="value >= 0 (device present)"),
    _m("rank_device_ooms_total", "counter", "", RANK, "Device out-of-memory errors the allocator reported.",
       "memory.ooms (newest)", "rank", per_rank="fixed", when="after the rank's first memory record"),
    _m("rank_device_alloc_retries_total", "counter", "", RANK,
       "Allocations that had to free cached blocks and retry (memory pressure).",
       "memory.alloc_retries (newest)", "rank", per_rank="fixed", when="after the rank's first memory record"),
    _m("rank_info", "info", "", RANK, "Where the rank runs; attempt is the torchrun restart count.",
       "run record of the rank's newest attempt", "rank", per_rank="fixed",
       info_labels=("host", "local_rank", "attempt")),
    _m("rank_hang_in_collective", "gauge", "", RANK,
       "While the rank's hang watchdog reports a stall: 1 if its training thread waits in a collective, 0 if it "
       "is outside any (in synchronous training, the rank its peers wait for: the culprit).",
       "hang.in_collective (newest)", "rank", per_rank="fixed",
       when="from the rank's hang record until one of its steps ends after it"),
    # --- per rank: collectives (from `collective` records) --------------------------------------------
    _m("rank_collective_last_seq", "gauge", "", RANK + ("dim",),
       "Sequence number of the last collective the rank completed on its group of this dim "
       "(a rank whose number lags its peers is where a hang is).", "collective.seq (max per dim)", "rank",
       per_rank="dim"),
    _m("rank_collective_seconds_total", "counter", "seconds", OP_DIM,
       "Time from issue to completion of the rank's collectives.", "collective.duration_s (sum)", "rank",
       per_rank="op_dim"),
    _m("rank_collective_bytes_total", "counter", "bytes", OP_DIM,
       "Buffer bytes of the rank's collectives (nccl-tests size).", "collective.bytes (sum)", "rank",
       per_rank="op_dim"),
    _m("rank_collectives_total", "counter", "", OP_DIM, "Collectives the rank completed.",
       "count of collective records", "rank", per_rank="op_dim"),
    # --- per run --------------------------------------------------------------------------------------
    _m("run_info", "info", "", ("run",), "Run metadata (from the newest run record).", "run record", "run",
       info_labels=("strategy", "mesh", "schedule", "model", "device", "backend", "dtype", "peak_source",
                    "torch_version", "meshscope_version")),
    _m("run_world_size", "gauge", "", ("run",), "World size of the run.", "run.world_size", "run"),
    _m("run_ranks_reporting", "gauge", "", ("run",), "Ranks the agent has records from.",
       "distinct ranks with records", "run"),
    _m("run_last_record_timestamp_seconds", "gauge", "seconds", ("run",),
       "Time of the newest record of the run (Unix seconds).", "max record time", "run"),
    _m("run_events_total", "counter", "", ("run", "kind"), "Timeline events of the run by kind.",
       "event records (count)", "run", values={"kind": EVENT_KINDS}),
    _m("step_wall_seconds", "histogram", "seconds", ("run",),
       "Step wall time, one observation per rank and step; exemplars name the slowest rank and step.",
       "step.wall_s", "run"),
    _m("step_compute_seconds", "histogram", "seconds", ("run",),
       "Per-rank compute time per step (a straggler shows here, not in wall time); exemplars name the "
       "slowest rank and step.", "step.compute_s", "run"),
    # --- agent health ---------------------------------------------------------------------------------
    _m("agent_info", "info", "", (), "The agent process.", "agent", "agent", info_labels=("host", "version")),
    _m("agent_records_ingested_total", "counter", "", ("kind",), "Records ingested, by record kind.",
       "valid frames read from spools", "agent", values={"kind": KINDS}),
    _m("agent_ingested_bytes_total", "counter", "bytes", (), "Spool bytes consumed.", "spool reader", "agent"),
    _m("agent_frames_rejected_total", "counter", "", ("reason",), "Spool frames or bytes rejected, by reason.",
       "spool reader", "agent", values={"reason": REJECT_REASONS}),
    _m("agent_dropped_records_total", "counter", "", (),
       "Records the agent itself dropped (GPU samples it could not store).", "agent", "agent"),
    _m("agent_series_overflow_records_total", "counter", "", (),
       "Collective records folded into op=\"other\",dim=\"other\" to keep a rank within the series budget.",
       "agent", "agent"),
    _m("agent_lag_seconds", "gauge", "seconds", (),
       "Age of the newest record when the agent ingested it (last poll).", "agent", "agent"),
    _m("agent_spool_bytes", "gauge", "bytes", (), "Size of the spool files followed.", "agent", "agent"),
    _m("agent_backlog_bytes", "gauge", "bytes", (), "Spool bytes not yet ingested.", "agent", "agent"),
    _m("agent_spool_files", "gauge", "", (), "Spool files followed.", "agent", "agent"),
    _m("agent_runs", "gauge", "", (), "Runs whose series are exported.", "agent", "agent"),
    _m("agent_store_parts_written_total", "counter", "", (), "Parquet part files written (incl. compaction).",
       "agent", "agent"),
    _m("agent_store_write_errors_total", "counter", "", (), "Failed run-store writes (retried).", "agent",
       "agent"),
    _m("agent_upload_parts_total", "counter", "", (),
       "Parquet parts acknowledged by the --upload bucket (0 without --upload).", "agent", "agent"),
    _m("agent_upload_bytes_total", "counter", "bytes", (), "Bytes of the parts acknowledged by the --upload bucket.",
       "agent", "agent"),
    _m("agent_upload_errors_total", "counter", "", (),
       "Failed upload passes (endpoint unreachable, access denied, missing bucket); retried with backoff.",
       "agent", "agent"),
    _m("agent_upload_pending_parts", "gauge", "", (), "Local parts the --upload bucket does not have yet.",
       "agent", "agent"),
    _m("agent_upload_last_success_timestamp_seconds", "gauge", "seconds", (),
       "When a part was last acknowledged by the --upload bucket.", "agent", "agent",
       when="after the first part is up"),
    _m("agent_poll_duration_seconds", "gauge", "seconds", (), "Duration of the last ingest poll.", "agent",
       "agent"),
    _m("agent_last_poll_timestamp_seconds", "gauge", "seconds", (), "When the last ingest poll ended.",
       "agent", "agent"),
    _m("agent_metric_errors_total", "counter", "", (),
       "Record batches whose metrics could not be derived (odd values); they are still stored.", "agent",
       "agent"),
    _m("agent_gpu_sample_errors_total", "counter", "", (), "NVML queries that failed.", "agent", "agent"),
    _m("agent_otlp_export_errors_total", "counter", "", (),
       "OTLP pushes the receiver did not take (unreachable, rejected, timed out); the next push sends it all again.",
       "OTLP pusher (agent.collector.otlp)", "agent", when="--otlp-endpoint is given"),
    # --- GPUs of this host (NVML, when present) -------------------------------------------------------
    _m("gpu_info", "info", "", ("gpu",), "GPU identity.", "NVML", "gpu", info_labels=("uuid", "name", "host")),
    _m("gpu_utilization_ratio", "gauge", "ratio", ("gpu",), "Fraction of time a kernel was running.",
       "nvmlDeviceGetUtilizationRates.gpu / 100", "gpu"),
    _m("gpu_memory_utilization_ratio", "gauge", "ratio", ("gpu",),
       "Fraction of time device memory was read or written.", "nvmlDeviceGetUtilizationRates.memory / 100",
       "gpu"),
    _m("gpu_memory_used_bytes", "gauge", "bytes", ("gpu",), "Device memory used.",
       "nvmlDeviceGetMemoryInfo.used", "gpu"),
    _m("gpu_memory_total_bytes", "gauge", "bytes", ("gpu",), "Device memory total.",
       "nvmlDeviceGetMemoryInfo.total", "gpu"),
    _m("gpu_power_watts", "gauge", "watts", ("gpu",), "Power draw.", "nvmlDeviceGetPowerUsage / 1000", "gpu"),
    _m("gpu_temperature_celsius", "gauge", "celsius", ("gpu",), "GPU temperature.",
       "nvmlDeviceGetTemperature(GPU)", "gpu"),
    _m("gpu_sm_clock_hertz", "gauge", "hertz", ("gpu",), "Current SM clock.", "nvmlDeviceGetClockInfo(SM)",
       "gpu"),
    _m("gpu_sm_clock_max_hertz", "gauge", "hertz", ("gpu",), "Maximum SM clock.",
       "nvmlDeviceGetMaxClockInfo(SM)", "gpu"),
    _m("gpu_throttle_reasons", "gauge", "", ("gpu",),
       "Clock throttle reason bit mask (NVML clocks event reasons; test bit k with floor(x / 2^k) % 2 == 1).",
       "nvmlDeviceGetCurrentClocksEventReasons", "gpu"),
    _m("gpu_xid_errors_total", "counter", "", ("gpu",), "XID critical errors seen since the agent started.",
       "NVML XID events", "gpu", when="NVML event support"),
    _m("gpu_ecc_errors_total", "counter", "", ("gpu",), "Uncorrected ECC errors (volatile).",
       "nvmlDeviceGetTotalEccErrors", "gpu", when="ECC supported"),
)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOG}


def spec(name: str) -> MetricSpec:
    """The catalog entry of ``name`` (with or without the prefix)."""
    return BY_NAME[name if name.startswith(PREFIX) else PREFIX + name]


def sample_names() -> frozenset[str]:
    """Every series name the agent can expose (what PromQL may reference)."""
    return frozenset(s for spec_ in CATALOG for s in spec_.sample_names())


@dataclass(frozen=True, slots=True)
class RankBudget:
    fixed: int  # series every rank has (at most)
    per_dim: int  # series added per parallel dim
    per_op_dim: int  # series added per op × dim


def rank_budget() -> RankBudget:
    """Series per rank implied by the catalog (used by the agent's admission control)."""
    fixed = sum(s.series_per_label_set() for s in CATALOG if s.per_rank == "fixed")
    per_dim = sum(1 for s in CATALOG if s.per_rank == "dim")
    per_op_dim = sum(1 for s in CATALOG if s.per_rank == "op_dim")
    return RankBudget(fixed, per_dim, per_op_dim)


def markdown_table() -> str:
    """The metric table of docs/metrics.md (between its ``metrics:begin``/``end`` markers)."""
    lines = ["| Metric | Type | Unit | Labels | Help | Source |", "| --- | --- | --- | --- | --- | --- |"]
    for s in CATALOG:
        labels = ", ".join(s.labels + tuple(f"{lab} (info)" for lab in s.info_labels)) or "—"
        help_ = s.help + (f" Present when {s.when}." if s.when else "")
        cells = [f"`{s.name}`", s.type, s.unit or "—", labels, help_, s.source]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
