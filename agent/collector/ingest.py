"""Follow every rank spool under a store, feed the metric state and write the run store exactly once.

One ``Cursor`` per spool file. Each poll reads at most ``read_chunk_bytes`` per file, folds the new
record batches into :class:`MetricsState` at once (metrics are live) and buffers them; a file's buffer is
written as one part per kind covering the byte range ``[committed, read_pos)`` when it reaches
``part_target_bytes``, gets older than ``max_part_age_s``, or memory runs short (``max_buffer_bytes``
across files). Then the durable offsets are saved. See :mod:`agent.store.parts` for why this is
exactly once across crashes.

Store failures (disk full, read-only) are counted and retried: a file whose flush failed is not read
further until the flush succeeds, so a part's byte range never changes between attempts.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from meshscope.agent.store import packs
from meshscope.agent.store import parts as partio
from meshscope.agent.collector.offsets import OffsetStore
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.contract import KINDS, SPOOL_NAME, Clock, is_run_name
from meshscope.agent.contract.storelayout import StoreLayout, rank_of, run_of, spool_key
from meshscope.agent.transport.backoff import Backoff
from meshscope.agent.transport.frame import HEADER_KIND, rows_to_batch
from meshscope.agent.transport.reader import SpoolReader

GPU_RANK = -1


@dataclass(kw_only=True, slots=True)
class IngestConfig:
    # Sizes are spool bytes (Arrow IPC, about what the records take in memory). Measured with
    # bench/agent_ingest.py (8 ranks, one core): 24 MB held / 8 MB parts peak at ~165 MB RSS (32 MB held:
    # ~177 MB, 64: ~208 MB) at the same speed; an 8 MB part is ~2.5 MB of Parquet.
    part_target_bytes: int = 8 * 1024 * 1024
    max_buffer_bytes: int = 24 * 1024 * 1024  # held across all files before the largest are flushed
    max_part_age_s: float = 30.0  # how stale the store may be behind /metrics
    read_chunk_bytes: int = 4 * 1024 * 1024
    compact_interval_s: float = 60.0
    compact_min_parts: int = 16
    compact_small_bytes: int = 4 * 1024 * 1024
    # Node packs (agent.store.packs): final parts of a run go into one file per kind, small packs are
    # merged once pack_merge_min of them gather. Off: the parts stay (and are compacted per rank).
    pack: bool = True
    pack_merge_min: int = 8
    pack_small_bytes: int = packs.SMALL_BYTES
    # After a failed store write: retry after retry_first_s, doubling to retry_max_s (agent.transport.backoff).
    retry_first_s: float = 0.1
    retry_max_s: float = 5.0
    gpu_active_window_s: float = 120.0  # GPU samples go to runs with a record this recent
    max_gpu_rows: int = 100_000  # GPU rows held while the store cannot be written

    def __post_init__(self) -> None:
        for name in ("part_target_bytes", "max_buffer_bytes", "read_chunk_bytes", "compact_min_parts",
                     "compact_small_bytes", "max_gpu_rows", "pack_merge_min", "pack_small_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        for name in ("max_part_age_s", "compact_interval_s", "gpu_active_window_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0")
        if not 0 < self.retry_first_s <= self.retry_max_s:
            raise ValueError(f"retry delays must satisfy 0 < retry_first_s ({self.retry_first_s}) <= retry_max_s "
                             f"({self.retry_max_s})")

    def backoff(self) -> Backoff:
        return Backoff(first_s=self.retry_first_s, max_s=self.retry_max_s)


@dataclass(slots=True)
class Cursor:
    key: str  # path relative to the store: the offsets.json key
    reader: SpoolReader
    header: dict | None = None
    stream: str = ""
    run: str = ""
    rank: int = 0
    attempt: int = 0
    read_pos: int = 0
    committed: int = 0  # every record before this is in the store
    durable: int = 0  # committed as saved in offsets.json
    size: int = 0
    buffers: dict[str, list[pa.Table]] = field(default_factory=dict)
    buffered_bytes: int = 0
    since: float = 0.0  # when the oldest buffered record was read
    backoff: Backoff | None = None  # after a failed flush: when to retry
    pending: bool = False  # a flush failed: it must complete, same byte range, before reading more
    bad: bool = False  # no valid file header: ignored until the file changes
    bad_size: int = -1


class Ingestor:
    def __init__(self, *, store: str | Path, state: MetricsState, clock: Clock, config: IngestConfig | None = None,
                 offsets: OffsetStore | None = None) -> None:
        self.store = Path(store)
        self.layout = StoreLayout.of(self.store)
        self.state = state
        self.clock = clock
        self.config = config or IngestConfig()
        self.offsets = offsets or OffsetStore(Path(self.layout.offsets))
        self._saved = self.offsets.load()
        self.cursors: dict[str, Cursor] = {}
        self._bad_run_dirs: set[str] = set()
        self._dirty_offsets = False
        self._touched: set[tuple[str, Path]] = set()  # (kind, partition dir) written since last compaction
        self._next_compact = 0.0
        self._gpu_stream = "gpu" + secrets.token_hex(6)
        self._gpu_rows: list[tuple] = []
        self._gpu_seq = 0
        self._gpu_since = 0.0
        self._gpu_backoff = self.config.backoff()
        self._gpu_pending: tuple[pa.Table, int, int, list[str]] | None = None
        self.load_error = self.offsets.load_error
        self._cleanup()

    # -- public ----------------------------------------------------------------------------------------

    def poll(self, *, final: bool = False) -> bool:
        """One pass over all spools; returns True if any new bytes were consumed."""
        now = self.clock.now()
        self._discover()
        progress = False
        for cursor in list(self.cursors.values()):
            if self._advance(cursor, now):
                progress = True
                self._relieve(now)
        self._flush_due(now, final=final)
        self._flush_gpu(now, final=final)
        self._save_offsets()
        if self.config.pack:
            self._pack()
        elif final or now >= self._next_compact:
            self._compact()
            self._next_compact = now + self.config.compact_interval_s
        st = self.state
        with st.lock:
            st.spool_files = len(self.cursors)
            st.spool_bytes = sum(c.size for c in self.cursors.values())
            st.backlog_bytes = sum(max(0, c.size - c.read_pos) for c in self.cursors.values())
            st.poll_duration_s = max(0.0, self.clock.now() - now)
            st.last_poll_t = self.clock.now()
        return progress

    def ingest_all(self, *, max_polls: int = 1_000_000) -> None:
        """Consume everything there is now and write it to the store (``meshscope ingest``)."""
        for _ in range(max_polls):
            if not self.poll():
                break
        self.poll(final=True)

    def add_gpu_rows(self, rows: list[tuple]) -> None:
        """GPU samples (``GpuRecord``) for the runs active on this host (stored with rank = -1)."""
        if not rows:
            return
        if not self._gpu_rows:
            self._gpu_since = self.clock.now()
        self._gpu_rows.extend(rows)
        excess = len(self._gpu_rows) - self.config.max_gpu_rows
        if excess > 0:  # the store has been failing for long: keep the newest
            del self._gpu_rows[:excess]
            with self.state.lock:
                self.state.dropped += excess

    # -- discovery and reading -------------------------------------------------------------------------

    def _discover(self) -> None:
        spool = self.layout.spool
        seen = set()
        try:
            run_dirs = [e for e in os.scandir(spool) if e.is_dir()]
        except OSError:
            run_dirs = []
        for run_dir in run_dirs:
            if not is_run_name(run_dir.name):  # no writer makes such a directory: not a run, never a partition
                if run_dir.name not in self._bad_run_dirs:
                    self._bad_run_dirs.add(run_dir.name)
                    self.state.note_rejections(["bad_run_name"])
                continue
            try:
                entries = list(os.scandir(run_dir.path))
            except OSError:
                continue
            for entry in entries:
                if SPOOL_NAME.match(entry.name):
                    key = spool_key(run_dir.name, entry.name)
                    seen.add(key)
                    if key not in self.cursors:
                        self.cursors[key] = Cursor(
                            key=key, reader=SpoolReader(entry.path, max_read_bytes=self.config.read_chunk_bytes))
        for key in set(self.cursors) - seen:  # deleted spool: keep what was read, then forget it
            cursor = self.cursors[key]
            if self._flush(cursor, self.clock.now()):
                del self.cursors[key]
                self._dirty_offsets = True

    def _open(self, cursor: Cursor) -> bool:
        """Read the file header; position the cursor (saved offset, then crash recovery)."""
        if cursor.bad and cursor.size >= cursor.bad_size:
            return False
        res = cursor.reader.read(0, max_bytes=64 * 1024)
        first = res.frames[0] if res.frames else None
        if first is None or first.offset != 0 or first.kind != HEADER_KIND:
            if res.rejected or (first is not None):
                cursor.bad, cursor.bad_size = True, cursor.size
                self.state.note_rejections(["bad_file_header"])
            return False  # else: header still being written
        header = first.header
        cursor.bad = False
        cursor.header, cursor.stream = header, header["stream_id"]
        cursor.run, cursor.rank, cursor.attempt = header["run"], header["rank"], header["attempt"]
        saved = self._saved.get(cursor.key)
        if saved is not None and saved["stream"] == cursor.stream:
            cursor.committed = cursor.durable = saved["offset"]
        else:  # no saved offset (a new spool, or offsets.json lost): what packs hold was already final
            run_dirs = [Path(self.layout.run_dir(kind, cursor.run)) for kind in KINDS]
            start = packs.covered_end(run_dirs, rank=cursor.rank, stream=cursor.stream, start=first.end)
            cursor.committed, cursor.durable = start, 0
            self._dirty_offsets = True
        cursor.read_pos = cursor.committed
        self._recover(cursor)
        return True

    def _recover(self, cursor: Cursor) -> None:
        """Rule 3 of agent.store.parts: replay ranges written by a process that died before saving
        its offsets, writing only the parts that are missing."""
        ends: dict[int, int] = {}
        for kind in KINDS:
            for p in partio.list_parts(Path(self.layout.partition(kind, run=cursor.run, rank=cursor.rank))):
                if p.stream == cursor.stream and p.start >= cursor.committed:
                    ends[p.start] = max(ends.get(p.start, 0), p.end)
        while cursor.committed in ends:
            start, end = cursor.committed, ends[cursor.committed]
            res = cursor.reader.read(start, stop=end, max_bytes=end - start)
            if res.offset != end:
                return  # the file no longer holds that range (replaced): read it as new data instead
            self._take(cursor, res, self.clock.now())
            if not self._flush(cursor, self.clock.now()):
                return

    def _advance(self, cursor: Cursor, now: float) -> bool:
        size = cursor.reader.size()
        if cursor.header is not None and size < cursor.read_pos:
            # Truncated or replaced under us: store what was read of the old generation, then start over
            # on the new file (its header has a new stream id, so its parts get new names).
            self._flush(cursor, now)
            self.cursors[cursor.key] = Cursor(key=cursor.key, reader=cursor.reader)
            return False
        cursor.size = size
        if cursor.header is None and not self._open(cursor):
            return False
        if cursor.pending and not self._flush(cursor, now):
            return False
        if size <= cursor.read_pos:
            return False
        res = cursor.reader.read(cursor.read_pos, max_bytes=self.config.read_chunk_bytes)
        if res.offset == cursor.read_pos and not res.rejected:
            return False
        self._take(cursor, res, now)
        if cursor.buffered_bytes >= self.config.part_target_bytes:
            self._flush(cursor, now)
        return True

    def _take(self, cursor: Cursor, res, now: float) -> None:
        """Fold a read result into the metrics and the cursor's buffer."""
        if res.rejected:
            self.state.note_rejections([reason for _, reason, _ in res.rejected])
        by_kind: dict[str, list[pa.Table]] = {}
        for frame in res.frames:
            if frame.table is not None:  # a header frame mid-file (an earlier writer appended): skip
                by_kind.setdefault(frame.kind, []).append(frame.table)
        for kind, tables in by_kind.items():
            table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
            try:
                self.state.observe(kind, table, run=cursor.run, rank=cursor.rank, attempt=cursor.attempt, now=now)
            except Exception:  # noqa: BLE001 - odd values from a rank (nulls, NaN steps) must not stop the
                # agent; the records are still stored, only their metrics are lost (and counted).
                with self.state.lock:
                    self.state.metric_errors += 1
            cursor.buffers.setdefault(kind, []).append(table)
        consumed = res.offset - cursor.read_pos
        if consumed > 0 and cursor.buffered_bytes == 0:
            cursor.since = now
        cursor.buffered_bytes += consumed
        cursor.read_pos = res.offset
        with self.state.lock:
            self.state.ingested_bytes += consumed

    # -- writing ---------------------------------------------------------------------------------------

    def _flush_due(self, now: float, *, final: bool) -> None:
        cfg = self.config
        for cursor in self.cursors.values():
            if cursor.read_pos > cursor.committed and (
                    final or not cursor.buffers or now - cursor.since >= cfg.max_part_age_s
                    or cursor.buffered_bytes >= cfg.part_target_bytes):
                self._flush(cursor, now)
        self._relieve(now)

    def _relieve(self, now: float) -> None:
        """Bound memory: past ``max_buffer_bytes`` held across files, flush the largest buffers."""
        total = sum(c.buffered_bytes for c in self.cursors.values())
        if total <= self.config.max_buffer_bytes:
            return
        for cursor in sorted(self.cursors.values(), key=lambda c: -c.buffered_bytes):
            if total <= self.config.max_buffer_bytes // 2:
                break
            before = cursor.buffered_bytes
            if self._flush(cursor, now):
                total -= before

    def _flush(self, cursor: Cursor, now: float) -> bool:
        """Write the cursor's buffer as the parts of [committed, read_pos); True when done."""
        if cursor.read_pos <= cursor.committed:
            return True
        if cursor.backoff is not None and not cursor.backoff.due(now):
            return False
        start, end = cursor.committed, cursor.read_pos
        for kind in sorted(cursor.buffers):
            tables = cursor.buffers[kind]
            directory = Path(self.layout.partition(kind, run=cursor.run, rank=cursor.rank))
            try:
                table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
                written = partio.write_part(directory, table, kind=kind, stream=cursor.stream, start=start,
                                            end=end, source=cursor.key)
            except OSError:
                with self.state.lock:
                    self.state.store_write_errors += 1
                if cursor.backoff is None:
                    cursor.backoff = self.config.backoff()
                cursor.backoff.failed(now)
                cursor.pending = True
                return False
            if written:
                with self.state.lock:
                    self.state.parts_written += 1
                self._touched.add((kind, directory))
        cursor.buffers.clear()
        cursor.buffered_bytes = 0
        cursor.committed = end
        cursor.backoff, cursor.pending = None, False
        self._dirty_offsets = True
        return True

    def _flush_gpu(self, now: float, *, final: bool) -> None:
        """Write buffered GPU samples to every active run. A failed write keeps the frozen batch (same
        rows, same part name) so a retry never duplicates rows for runs already written."""
        if self._gpu_pending is None:
            if not self._gpu_rows or (not final and now - self._gpu_since < self.config.max_part_age_s):
                return
            runs = self.state.active_runs(now, window_s=self.config.gpu_active_window_s)
            start, end = self._gpu_seq, self._gpu_seq + len(self._gpu_rows)
            table = pa.Table.from_batches([rows_to_batch("gpu", self._gpu_rows)])
            self._gpu_pending = (table, start, end, runs)
            self._gpu_rows, self._gpu_seq = [], end
        if not self._gpu_backoff.due(now):
            return
        table, start, end, runs = self._gpu_pending
        for run in runs:
            directory = Path(self.layout.partition("gpu", run=run, rank=GPU_RANK))
            try:
                written = partio.write_part(directory, table, kind="gpu", stream=self._gpu_stream, start=start,
                                            end=end, source="nvml")
            except OSError:
                with self.state.lock:
                    self.state.store_write_errors += 1
                self._gpu_backoff.failed(now)
                return
            if written:
                with self.state.lock:
                    self.state.parts_written += 1
                self._touched.add(("gpu", directory))
        self._gpu_pending = None
        self._gpu_backoff.succeeded()

    def _save_offsets(self) -> None:
        if not self._dirty_offsets:
            return
        entries = dict(self._saved)
        for cursor in self.cursors.values():
            if cursor.header is not None:
                entries[cursor.key] = {"stream": cursor.stream, "offset": cursor.committed}
        for key in set(entries) - set(self.cursors):
            del entries[key]  # spool files that are gone
        try:
            self.offsets.save(entries)
        except OSError:
            with self.state.lock:
                self.state.store_write_errors += 1
            return
        self._saved = entries
        self._dirty_offsets = False
        for cursor in self.cursors.values():
            if cursor.header is not None:
                cursor.durable = cursor.committed

    # -- maintenance -----------------------------------------------------------------------------------

    def durable(self, stream: str) -> float:
        """The spool offset below which ``stream``'s parts are final (inf for GPU parts). Ingest thread only."""
        if stream.startswith("gpu"):
            return math.inf  # GPU parts are final when written
        return max((c.durable for c in self.cursors.values() if c.stream == stream), default=0)

    def _compact(self) -> None:
        cfg = self.config
        touched, self._touched = self._touched, set()
        for kind, directory in touched:
            try:
                written, _ = partio.compact_partition(
                    directory, kind=kind, durable=self.durable, small_bytes=cfg.compact_small_bytes,
                    target_bytes=cfg.part_target_bytes, min_parts=cfg.compact_min_parts)
            except OSError:
                with self.state.lock:
                    self.state.store_write_errors += 1
                self._touched.add((kind, directory))
                continue
            with self.state.lock:
                self.state.parts_written += written

    def _pack(self) -> None:
        """Pack the runs written to since the last pass (their new parts are durable by now: offsets were
        just saved). A failure leaves the parts where they are, for the next pass."""
        touched, self._touched = self._touched, set()
        runs = {(kind, directory.parent) for kind, directory in touched}
        cfg = self.config
        for kind, run_dir in sorted(runs):
            try:
                written, _ = packs.pack_run(run_dir, kind=kind, final=lambda stream, end: end <= self.durable(stream),
                                            merge_min=cfg.pack_merge_min, small_bytes=cfg.pack_small_bytes)
            except OSError:  # disk full, I/O: retried next pass
                with self.state.lock:
                    self.state.store_write_errors += 1
                self._touched.update((k, d) for k, d in touched if k == kind and d.parent == run_dir)
                continue
            except pa.ArrowException:
                # A source Arrow cannot read or merge (a damaged file, a type an older agent wrote): counted;
                # its parts stay readable as parts, and packing is tried again when the run gets new parts
                # rather than every pass (nor in a crash loop of the agent).
                with self.state.lock:
                    self.state.store_write_errors += 1
                continue
            with self.state.lock:
                self.state.parts_written += written

    def _cleanup(self) -> None:
        for kind in KINDS:
            base = Path(self.layout.table(kind))
            for run_dir in base.iterdir() if base.is_dir() else ():
                if run_of(run_dir.name) is None:
                    continue
                packs.cleanup_run(run_dir)  # first: a pack's sources must not go into a second pack
                for directory in run_dir.iterdir():
                    if rank_of(directory.name) is None:
                        continue
                    partio.cleanup_partition(directory)
                    self._touched.add((kind, directory))  # compact or pack what earlier runs left
