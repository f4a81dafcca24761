"""Versioned record schema: the contract between ranks (writers), the node agent and the run store.

Every record kind is one Arrow schema, and one record type generated from it (``agent.contract.records``;
rows are built by keyword, so no producer depends on the order of the fields here). Ranks batch rows of one
kind into an Arrow record batch and the spool frames it (see ``agent.transport``); the agent validates a
batch against the schema of its kind and version, derives metrics from it and appends it to the store as
Parquet under ``<store>/tables/<kind>/run=<run>/rank=<rank>/``. ``run`` and ``rank`` are the hive partition
keys and are therefore not columns of the stored files (DuckDB's ``hive_partitioning`` adds them back).

Conventions: times are float64 seconds since the Unix epoch (``agent.contract.clock``: a per-process anchor
of ``time.time()`` advanced by ``time.perf_counter()``, so intervals are monotonic and ranks share one time
base); durations are float64 seconds; sizes are int64 bytes; ``step`` is the optimizer step (0-based). Bump
``SCHEMA_VERSION`` on any incompatible change (a reordered field is one: readers compare whole schemas);
readers reject versions they do not know.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 6

# The parallel dimensions a collective can belong to (taken from the DeviceMesh dim names).
DIMS = ("dp", "fsdp", "tp", "pp", "cp", "ep", "world", "other")
# Collective / P2P op names as recorded (nccl-tests naming).
OPS = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
    "send", "recv", "barrier",
)
# The point-to-point kinds: a pipeline stage waiting in one waits for its neighbour, so the step record counts
# that wait as bubble, not exposed communication (agent.instrument.stepstate; dashboard.diff reads it so).
P2P_OPS = frozenset({"send", "recv"})


def is_stage_wait(op: str, dim: str) -> bool:
    """Whether the time a rank waits in this op is a pipeline stage waiting for the other stages (bubble in
    the step record) rather than exposed communication: a P2P op between stages, or any collective over the
    pipeline dim. The first reduction over ``pp`` after the schedule (the gradient norm's, a loss's) is where
    the last stage waits for the first one's final backward, the schedule's drain; its data is a scalar."""
    return op in P2P_OPS or dim == "pp"
# Pipeline span kinds.
SPAN_KINDS = ("forward", "backward", "weight")
# Event kinds (run timeline).
EVENT_KINDS = (
    "start", "end", "crash", "aborted_step", "nonfinite_loss", "skipped_step", "restart", "telemetry_error", "hang",
)

_f64, _i64, _i32, _str, _bool = pa.float64(), pa.int64(), pa.int32(), pa.string(), pa.bool_()

SCHEMAS: dict[str, pa.Schema] = {
    # One per rank and attempt, at start. Run-level facts repeat on every rank (cheap, and any rank alone
    # is enough to describe the run).
    "run": pa.schema([
        ("rank", _i32), ("world_size", _i32), ("local_rank", _i32), ("host", _str), ("pid", _i64),
        ("attempt", _i32),  # torchrun restart count (TORCHELASTIC_RESTART_COUNT)
        ("t_start", _f64),
        ("strategy", _str),  # e.g. "ddp", "fsdp", "tp", "pp", "fsdp+tp", "pp+fsdp", "pp+tp+fsdp"
        ("mesh", _str),  # JSON: {"dp": 2, "tp": 1, "pp": 1}
        ("coords", _str),  # JSON: this rank's coordinate per mesh dim, e.g. {"dp": 1, "tp": 0, "pp": 0}
        ("schedule", _str), ("microbatches", _i32), ("virtual_stages", _i32),
        ("model", _str), ("n_params", _i64), ("n_params_nonembedding", _i64),
        ("n_layers", _i32), ("d_model", _i32), ("seq_len", _i32), ("global_batch", _i32),
        ("flops_per_token", _f64),  # 6*N_ne + 12*L*D*S (training, causal not discounted)
        ("peak_flops", _f64), ("peak_source", _str),  # "table:H100", "override", "calibrated-cpu"
        ("device", _str), ("backend", _str), ("dtype", _str),
        ("torch_version", _str), ("meshscope_version", _str), ("python_version", _str),
        ("config", _str),  # JSON of the full trainer/user config
        # v4: how flops_per_token was found ("trainer: ...", "analytic: 6*N ...") or why it is absent
        # ("off", "absent: <reason>"): what a page says where MFU is n/a
        ("flops_method", _str),
        # v6: JSON of what the run ran on beyond its config (agent.instrument.runenv): CUDA, NCCL and driver
        # versions, the CPU, and the environment flags of NCCL, torch and the thread pools
        ("environment", _str),
    ]),
    # One per rank and optimizer step. wall = compute + exposed_comm + bubble + other.
    "step": pa.schema([
        ("step", _i64), ("t_start", _f64), ("t_end", _f64), ("wall_s", _f64),
        ("compute_s", _f64), ("exposed_comm_s", _f64), ("bubble_s", _f64), ("other_s", _f64),
        ("data_s", _f64), ("forward_s", _f64), ("backward_s", _f64), ("optimizer_s", _f64),
        ("tokens", _i64),  # tokens this rank's replica processed (global tokens / dp)
        ("flops", _f64),  # model FLOPs attributed to this rank in this step
        ("mfu", _f64),  # flops / wall_s / peak_flops
        ("loss", _f64), ("loss_nonfinite", _bool), ("grad_norm", _f64), ("lr", _f64),
        ("skipped", _bool),  # optimizer step skipped (non-finite gradients)
        ("n_collectives", _i32),
        ("dropped_records_total", _i64),  # telemetry records this rank could not write so far
        # v2: the training thread's CPU time in the step, and the time it was runnable but waited for a CPU
        # (the kernel's run-queue delay; NaN where the kernel does not report it). Beside compute_s +
        # other_s (the time that thread was not blocked) they say whether the rank had a core to itself:
        # see dashboard.environment.
        ("cpu_s", _f64), ("cpu_wait_s", _f64),
    ]),
    # One per collective or P2P op. wait_s is the time the training thread was blocked on it (exposed).
    "collective": pa.schema([
        ("step", _i64), ("op", _str), ("dim", _str), ("group", _str), ("group_size", _i32),
        ("seq", _i64),  # per-group sequence number (per rank, counts ops issued on that group)
        ("bytes", _i64), ("t_start", _f64), ("t_end", _f64), ("duration_s", _f64), ("wait_s", _f64),
        ("algbw", _f64), ("busbw", _f64),  # bytes/s
        ("peer", _i32),  # P2P peer global rank, -1 for collectives
        ("source", _str),  # which hook saw it: "ddp_comm_hook", "fsdp_comm", "funcol", "c10d", "nccl_fr"
        # v4: the job's own name of the group's mesh dim ("dp_shard", "tp", "dp_replicate", ...; "world" for
        # the default group, "" for a group that is neither); ``dim`` is its kind in DIMS
        ("mesh_dim", _str),
    ]),
    # Pipeline compute spans (waits excluded).
    "span": pa.schema([
        ("step", _i64), ("stage", _i32), ("microbatch", _i32), ("kind", _str),
        ("t_start", _f64), ("t_end", _f64),
    ]),
    "memory": pa.schema([
        ("step", _i64), ("t", _f64), ("rss_bytes", _i64), ("rss_peak_bytes", _i64),
        ("allocated_bytes", _i64), ("allocated_peak_bytes", _i64),
        ("reserved_bytes", _i64), ("reserved_peak_bytes", _i64),
        ("active_bytes", _i64), ("active_peak_bytes", _i64),
        ("alloc_retries", _i64), ("ooms", _i64),
        ("device_free_bytes", _i64), ("device_total_bytes", _i64),  # -1 where not applicable (CPU)
        # The bytes the rank's tensors hold (local shards; one storage counted once), measured once after
        # the first optimizer step that leaves state; -1 in the other samples.
        ("param_bytes", _i64), ("grad_bytes", _i64), ("optimizer_bytes", _i64),
    ]),
    # Timeline events: start, end, crash, non-finite loss, restarts, telemetry errors.
    "event": pa.schema([
        ("t", _f64), ("step", _i64), ("kind", _str), ("message", _str),
    ]),
    # v5: one per rank and stall, written by the rank's hang watchdog (agent.instrument.hangdump) when its
    # training thread made no progress for the hang threshold: where that thread is, which op it waits in,
    # each group's last entered and completed sequence number, and every thread's Python stack. What
    # dashboard.hang names the culprit from.
    "hang": pa.schema([
        ("t", _f64), ("step", _i64), ("since_s", _f64),  # no progress for since_s when taken at t
        ("phase", _str), ("in_collective", _bool),
        ("op", _str),  # the op the training thread waits in, read from its stack ("" when not in one)
        ("where", _str),  # the stack's frame that says so ("function (file:line)")
        # JSON list: per group {group, dim, mesh_dim, size, ranks, entered, completed, completed_op, completed_t}
        ("groups", _str),
        # JSON list: per thread {thread, training, frames: [[file, line, function], ...] outermost first},
        # the training thread first
        ("stacks", _str),
    ]),
    # Agent-side GPU samples (NVML). rank = -1; the gpu index is a column.
    "gpu": pa.schema([
        ("t", _f64), ("host", _str), ("gpu", _i32), ("uuid", _str), ("name", _str),
        ("util_ratio", _f64), ("mem_util_ratio", _f64), ("mem_used_bytes", _i64), ("mem_total_bytes", _i64),
        ("power_watts", _f64), ("temperature_celsius", _f64), ("sm_clock_hz", _f64), ("sm_clock_max_hz", _f64),
        ("throttle_reasons", _i64), ("xid_errors_total", _i64), ("ecc_errors_total", _i64),
    ]),
}

KINDS = tuple(SCHEMAS)

# Older versions, as the columns added since: readers lift their batches to the current schema (the
# columns NULL). Version 2 added ``step.cpu_s`` and ``step.cpu_wait_s``; version 3 ``memory.param_bytes``,
# ``memory.grad_bytes`` and ``memory.optimizer_bytes``; version 4 ``run.flops_method`` and ``collective.mesh_dim``;
# version 6 ``run.environment``.
_ADDED = {2: {"step": ("cpu_s", "cpu_wait_s")}, 3: {"memory": ("param_bytes", "grad_bytes", "optimizer_bytes")},
          4: {"run": ("flops_method",), "collective": ("mesh_dim",)}, 6: {"run": ("environment",)}}
# Kinds added since version 1 (version 5 added ``hang``): an older writer never wrote one.
_KINDS_ADDED = {5: ("hang",)}


def _before(version: int) -> dict[str, pa.Schema]:
    later = [added for v, added in _ADDED.items() if v > version]
    absent = {kind for v, kinds in _KINDS_ADDED.items() if v > version for kind in kinds}
    return {kind: pa.schema([f for f in schema if not any(f.name in a.get(kind, ()) for a in later)])
            for kind, schema in SCHEMAS.items() if kind not in absent}


# Every version a reader accepts, the current one included (agent.transport.frame lifts the older ones).
SCHEMAS_BY_VERSION: dict[int, dict[str, pa.Schema]] = {
    **{v: _before(v) for v in range(1, SCHEMA_VERSION)}, SCHEMA_VERSION: SCHEMAS}
SCHEMAS_V1 = SCHEMAS_BY_VERSION[1]


def empty_table(kind: str) -> pa.Table:
    """An empty table of one kind (for readers that must return a well-typed nothing)."""
    return SCHEMAS[kind].empty_table()
