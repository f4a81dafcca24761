"""Metric state the agent derives from ingested record batches (vectorised: no per-row Python).

``MetricsState.observe(kind, table, ...)`` folds one Arrow table of records from one rank into per-rank,
per-run and agent-level aggregates; :mod:`agent.collector.exposition` turns them into Prometheus families
at scrape time. Everything is guarded by one lock because ingest (main loop) and scrapes (HTTP thread)
run concurrently.

Counters restart at zero when the agent restarts (Prometheus treats that as a counter reset). Series of a
run disappear ``run_ttl_s`` after its last record (bounded memory and cardinality).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from meshscope.agent.catalog import OVERFLOW_DIM, OVERFLOW_OP, PHASES, SERIES_PER_RANK_MAX, STEP_BUCKETS, rank_budget
from meshscope.agent.contract import EVENT_KINDS, KINDS

# Collectives a mesh dim of degree > 1 is expected to issue: their series are created at 0 when the run
# record arrives, so increase()/rate() see the first increment (a series born at N loses those N).
EXPECTED_OPS: dict[str, tuple[str, ...]] = {
    "dp": ("all_reduce",), "fsdp": ("all_gather", "reduce_scatter"), "tp": ("all_reduce",),
    "pp": ("send", "recv"),
}
# The record field holding each kind's record time (for lag and the run's newest-record time).
TIME_FIELD = {"run": "t_start", "step": "t_end", "collective": "t_end", "span": "t_end", "memory": "t",
              "event": "t", "gpu": "t", "hang": "t"}


@dataclass(slots=True)
class Exemplar:
    value: float
    rank: int
    step: int
    t: float  # record time (exemplar timestamp)
    seen: float  # agent time it was chosen (window for "slowest recently")


class Histogram:
    """A cumulative histogram whose bucket exemplars point at the slowest observation of the bucket in
    the last ``window_s`` seconds (older exemplars are replaced by any newer observation)."""

    __slots__ = ("bounds", "counts", "total", "exemplars", "window_s")

    def __init__(self, bounds: tuple[float, ...], *, window_s: float) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)  # last: +Inf
        self.total = 0.0
        self.exemplars: list[Exemplar | None] = [None] * (len(bounds) + 1)
        self.window_s = window_s

    def observe(self, values: np.ndarray, *, rank: int, steps: np.ndarray, times: np.ndarray, now: float) -> None:
        ok = np.isfinite(values)
        if not ok.all():
            values, steps, times = values[ok], steps[ok], times[ok]
        if values.size == 0:
            return
        idx = np.searchsorted(self.bounds, values, side="left")  # bucket i holds bounds[i-1] < v <= bounds[i]
        self.counts += np.bincount(idx, minlength=self.counts.size)
        self.total += float(values.sum())
        order = np.lexsort((values, idx))  # by bucket, then value: the last of each bucket is its max
        sorted_idx = idx[order]
        last = np.flatnonzero(np.r_[sorted_idx[1:] != sorted_idx[:-1], True])
        for pos in order[last]:
            bucket, value = int(idx[pos]), float(values[pos])
            ex = self.exemplars[bucket]
            if ex is None or value >= ex.value or now - ex.seen > self.window_s:
                self.exemplars[bucket] = Exemplar(value, rank, int(steps[pos]), float(times[pos]), now)


@dataclass(slots=True)
class RankState:
    attempt: int = -1
    info: dict[str, str] | None = None
    last_step: int | None = None
    last_step_t: float | None = None
    mfu: float | None = None
    loss: float | None = None
    steps: int = 0
    wall: float = 0.0
    phases: np.ndarray = field(default_factory=lambda: np.zeros(len(PHASES)))
    tokens: float = 0.0
    flops: float = 0.0
    nonfinite: int = 0
    skipped: int = 0
    dropped: int = 0
    high_step: int = -1  # highest step counted: steps re-executed after a restart are not counted again
    memory: dict[str, float] | None = None
    seq: dict[str, int] = field(default_factory=dict)
    # the newest hang record's (in_collective, t) while no step ended after it (the watchdog's stall)
    hang: tuple[bool, float] | None = None
    # (op, dim) -> [seconds, bytes, count]
    coll: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    series: int = rank_budget().fixed  # series this rank exports at most (admission control)


@dataclass(slots=True)
class RunState:
    wall_hist: Histogram
    compute_hist: Histogram
    ranks: dict[int, RankState] = field(default_factory=dict)
    world_size: int | None = None
    info: dict[str, str] | None = None
    info_t: float = -1.0
    events: Counter = field(default_factory=lambda: Counter({k: 0 for k in EVENT_KINDS}))
    last_record_t: float = 0.0
    last_seen: float = 0.0  # agent clock when a record of the run was last ingested
    ended: bool = False


class MetricsState:
    """All exported state. ``observe`` for rank records; ``agent`` counters are plain attributes the
    ingest loop updates; ``gpus`` holds the latest NVML sample per GPU index."""

    def __init__(self, *, run_ttl_s: float = 600.0, exemplar_window_s: float = 60.0,
                 max_series_per_rank: int = SERIES_PER_RANK_MAX) -> None:
        self.lock = threading.Lock()
        self.run_ttl_s = run_ttl_s
        self.exemplar_window_s = exemplar_window_s
        self.max_series_per_rank = max_series_per_rank
        self._budget = rank_budget()
        self.runs: dict[str, RunState] = {}
        self.ingested: Counter = Counter({k: 0 for k in KINDS})
        self.rejected: Counter = Counter()
        self.ingested_bytes = 0
        self.dropped = 0
        self.overflow_records = 0
        self.parts_written = 0
        self.store_write_errors = 0
        self.upload_parts = 0  # agent.collector.upload (all stay 0 without --upload)
        self.upload_bytes = 0
        self.upload_errors = 0
        self.upload_pending_parts = 0
        self.upload_last_success: float | None = None
        self.metric_errors = 0
        self.gpu_errors = 0
        self.lag_s: float | None = None
        self.spool_bytes = 0
        self.backlog_bytes = 0
        self.spool_files = 0
        self.poll_duration_s: float | None = None
        self.last_poll_t: float | None = None
        self.gpus: dict[int, dict] = {}

    # -- ingest side -----------------------------------------------------------------------------------

    def observe(self, kind: str, table: pa.Table, *, run: str, rank: int, attempt: int, now: float) -> None:
        """Fold ``table`` (records of ``kind`` from one rank's spool) into the state."""
        n = table.num_rows
        if n == 0:
            return
        with self.lock:
            self.ingested[kind] += n
            rs = self._run(run)
            rs.last_seen = now
            newest = _nanmax(_col(table, TIME_FIELD[kind]))
            if newest is not None:
                rs.last_record_t = max(rs.last_record_t, newest)
                self.lag_s = max(0.0, now - newest)
            if kind == "gpu":
                return
            rank_state = self._rank(rs, rank)
            if attempt > rank_state.attempt:
                # A restarted rank: its sequence numbers start again (the dims keep their series).
                rank_state.attempt = attempt
                for dim in rank_state.seq:
                    rank_state.seq[dim] = -1
            current = attempt == rank_state.attempt
            handler = _HANDLERS.get(kind)
            if handler is not None:
                handler(self, rs, rank_state, table, rank=rank, current=current, now=now)

    def note_rejections(self, reasons: list[str]) -> None:
        with self.lock:
            self.rejected.update(reasons)

    def expire(self, now: float) -> list[str]:
        """Forget runs with no record for ``run_ttl_s``; returns their names."""
        with self.lock:
            gone = [name for name, rs in self.runs.items() if now - rs.last_seen > self.run_ttl_s]
            for name in gone:
                del self.runs[name]
            return gone

    def active_runs(self, now: float, *, window_s: float) -> list[str]:
        """Runs with a record in the last ``window_s`` that have not ended (GPU samples go to these)."""
        with self.lock:
            return [n for n, rs in self.runs.items() if not rs.ended and now - rs.last_seen <= window_s]

    def _run(self, run: str) -> RunState:
        rs = self.runs.get(run)
        if rs is None:
            rs = self.runs[run] = RunState(
                wall_hist=Histogram(STEP_BUCKETS, window_s=self.exemplar_window_s),
                compute_hist=Histogram(STEP_BUCKETS, window_s=self.exemplar_window_s),
            )
        return rs

    @staticmethod
    def _rank(rs: RunState, rank: int) -> RankState:
        state = rs.ranks.get(rank)
        if state is None:
            state = rs.ranks[rank] = RankState()
        return state

    def _admit_dim(self, state: RankState, dim: str) -> bool:
        if dim in state.seq:
            return True
        if self._fits(state, self._budget.per_dim):
            state.seq[dim] = -1
            state.series += self._budget.per_dim
            return True
        return False

    def _collective_key(self, state: RankState, op: str, dim: str) -> tuple[str, str]:
        """(op, dim) if the rank's series budget allows another label set, else the overflow set."""
        key = (op, dim)
        if key in state.coll:
            return key
        if self._fits(state, self._budget.per_op_dim):
            state.coll[key] = [0.0, 0.0, 0.0]
            state.series += self._budget.per_op_dim
            return key
        overflow = (OVERFLOW_OP, OVERFLOW_DIM)
        if overflow not in state.coll:
            state.coll[overflow] = [0.0, 0.0, 0.0]
            state.series += self._budget.per_op_dim
        return overflow

    def _fits(self, state: RankState, extra: int) -> bool:
        # Always keep room for the overflow label set, so the budget holds whatever arrives later.
        reserve = 0 if (OVERFLOW_OP, OVERFLOW_DIM) in state.coll else self._budget.per_op_dim
        return state.series + extra + reserve <= self.max_series_per_rank

    def precreate(self, state: RankState, mesh: dict) -> None:
        for dim, degree in mesh.items():
            if isinstance(degree, int) and degree > 1 and dim in EXPECTED_OPS:
                if self._admit_dim(state, dim):
                    for op in EXPECTED_OPS[dim]:
                        if self._fits(state, self._budget.per_op_dim):
                            self._collective_key(state, op, dim)


def _col(table: pa.Table, name: str, dtype=np.float64) -> np.ndarray:
    # Nulls (a rank may leave a field empty) come back as NaN for numbers and False for booleans.
    return np.asarray(table.column(name).to_numpy(zero_copy_only=False), dtype=dtype)


def _nanmax(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return float(finite.max()) if finite.size else None


def _on_step(st: MetricsState, rs: RunState, r: RankState, table: pa.Table, *, rank: int, current: bool,
             now: float) -> None:
    if table.column("step").null_count:  # a step record without a step number says nothing about progress
        table = table.filter(table.column("step").is_valid())
        if table.num_rows == 0:
            return
    wall = _col(table, "wall_s")
    compute = _col(table, "compute_s")
    steps = _col(table, "step", np.int64)
    t_end = _col(table, "t_end")
    # A torchrun restart resumes from a checkpoint and runs steps again: count a step only when it is
    # above every step counted before it (records arrive in order per spool), so totals stay per step.
    before = np.maximum.accumulate(np.concatenate(([r.high_step], steps[:-1])))
    new = steps > before
    r.high_step = max(r.high_step, int(steps.max()))
    r.steps += int(np.count_nonzero(new))
    r.wall += float(np.nansum(wall[new]))
    r.phases += [float(np.nansum(compute[new]))] + [float(np.nansum(_col(table, f"{p}_s")[new])) for p in PHASES[1:]]
    r.tokens += float(np.nansum(_col(table, "tokens")[new]))
    r.flops += float(np.nansum(_col(table, "flops")[new]))
    r.nonfinite += int(np.count_nonzero(_col(table, "loss_nonfinite", bool)[new]))
    r.skipped += int(np.count_nonzero(_col(table, "skipped", bool)[new]))
    if current:
        i = int(np.argmax(steps[::-1]))  # the newest of the highest step
        i = len(steps) - 1 - i
        r.last_step, r.last_step_t = int(steps[i]), float(t_end[i])
        if r.hang is not None and r.last_step_t > r.hang[1]:  # progress again: the stall is over
            r.hang = None
        r.mfu = float(_col(table, "mfu")[i])
        r.loss = float(_col(table, "loss")[i])
        dropped = _nanmax(_col(table, "dropped_records_total"))
        r.dropped = int(dropped) if dropped is not None else r.dropped
    rs.wall_hist.observe(wall, rank=rank, steps=steps, times=t_end, now=now)
    rs.compute_hist.observe(compute, rank=rank, steps=steps, times=t_end, now=now)


def _on_collective(st: MetricsState, rs: RunState, r: RankState, table: pa.Table, *, rank: int, current: bool,
                   now: float) -> None:
    groups = table.group_by(["op", "dim"], use_threads=False).aggregate(
        [("duration_s", "sum"), ("bytes", "sum"), ("seq", "max"), ([], "count_all")]
    ).to_pydict()
    for op, dim, secs, nbytes, seq, count in zip(
        groups["op"], groups["dim"], groups["duration_s_sum"], groups["bytes_sum"], groups["seq_max"],
        groups["count_all"],
    ):
        key = st._collective_key(r, str(op), str(dim))
        if key[0] == OVERFLOW_OP and op != OVERFLOW_OP:
            st.overflow_records += count
        acc = r.coll[key]
        acc[0] += secs or 0.0
        acc[1] += nbytes or 0
        acc[2] += count
        if current and seq is not None and st._admit_dim(r, str(dim)):
            r.seq[str(dim)] = max(r.seq[str(dim)], int(seq))


def _on_memory(st: MetricsState, rs: RunState, r: RankState, table: pa.Table, *, rank: int, current: bool,
               now: float) -> None:
    if not current:
        return
    i = int(np.nanargmax(_col(table, "t"))) if np.isfinite(_col(table, "t")).any() else table.num_rows - 1
    row = table.slice(i, 1).to_pylist()[0]
    r.memory = {k: row[k] for k in ("rss_bytes", "rss_peak_bytes", "allocated_peak_bytes",
                                    "reserved_peak_bytes", "ooms", "alloc_retries")}


def _on_event(st: MetricsState, rs: RunState, r: RankState, table: pa.Table, *, rank: int, current: bool,
              now: float) -> None:
    counts = table.column("kind").value_counts().to_pylist()
    for item in counts:
        if item["values"] in _EVENT_KINDS:
            rs.events[item["values"]] += item["counts"]
        else:
            # A null or unknown kind would become a label value: None breaks every later scrape, and any
            # string a rank invents is a new series. Stored as is; its metric is counted as lost.
            st.metric_errors += item["counts"]
    if any(item["values"] == "end" for item in counts):
        rs.ended = True


def _on_run(st: MetricsState, rs: RunState, r: RankState, table: pa.Table, *, rank: int, current: bool,
            now: float) -> None:
    rows = table.to_pylist()  # one row per rank and attempt: tiny
    row = max(rows, key=lambda x: x["t_start"] or 0.0)
    if current:
        r.info = {"host": str(row["host"]), "local_rank": str(row["local_rank"]), "attempt": str(row["attempt"])}
        try:
            mesh = json.loads(row["mesh"] or "{}")
        except ValueError:
            mesh = {}
        if isinstance(mesh, dict):
            st.precreate(r, mesh)
    if (row["t_start"] or 0.0) >= rs.info_t:
        rs.info_t = row["t_start"] or 0.0
        rs.world_size = row["world_size"]
        rs.info = {k: "" if row.get(k) is None else str(row[k]) for k in (
            "strategy", "mesh", "schedule", "model", "device", "backend", "dtype", "peak_source",
            "torch_version", "meshscope_version")}
        rs.ended = False


_EVENT_KINDS = frozenset(EVENT_KINDS)
def _on_hang(st: MetricsState, rs: RunState, r: RankState, table: pa.Table, *, rank: int, current: bool,
             now: float) -> None:
    if not current:
        return
    t = _col(table, "t")
    i = int(np.nanargmax(t)) if np.isfinite(t).any() else table.num_rows - 1
    t_i = float(t[i]) if np.isfinite(t[i]) else now
    if r.last_step_t is None or t_i > r.last_step_t:
        r.hang = (bool(table.column("in_collective")[i].as_py()), t_i)


_HANDLERS = {"hang": _on_hang, "step": _on_step, "collective": _on_collective, "memory": _on_memory, "event": _on_event,
             "run": _on_run}
