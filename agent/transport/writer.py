"""Rank side of the transport: a non-blocking, never-raising spool writer.

``submit`` runs on the training thread. It only appends the caller's row list to a bounded deque (a
length check and an append: no lock, no I/O, no Arrow). A daemon thread wakes every ``flush_interval_s``
(or early when the queue is half full), converts the queued rows of each kind to one Arrow record batch,
frames it (``agent.transport.frame``) and appends the frames to the spool file with one ``os.write``.

Failure policy (telemetry must never hurt training): a full queue drops the submitted batch and counts
its rows; a write that fails (disk full, directory deleted or replaced, file unwritable) drops that
flush's rows, counts a write error, rolls the file back to the last whole frame so no torn frame is left
before later good ones, and retries after ``retry_interval_s``. A spool file deleted under the writer is
noticed (inode check per flush) and recreated with a fresh file header. Nothing here raises out of
``submit`` or ``close``.

Durability: frames are written with ``os.write`` (no fsync). A process crash loses at most the queued
rows; a machine crash can lose what the page cache had not written back.
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
from pathlib import Path

from agent.instrument.recorder import AnchoredClock, Clock
from agent.schema import SCHEMAS
from agent.transport.frame import check_run_name, encode_data_frame, encode_file_header, rows_to_batch


class SpoolWriter:
    """Appends telemetry batches to one rank's spool file from a background thread.

    Counters (read them any time; each is written by one thread only, so no lock is needed):
    ``dropped_records`` rows lost (queue full, bad rows, failed writes), ``write_errors`` failed
    writes/opens, ``encode_errors`` batches whose rows did not fit the schema, ``written_records`` rows
    appended, ``spool_bytes`` size of the spool file as this writer knows it. ``last_error`` holds the
    most recent failure as text.
    """

    def __init__(
        self, *, path: str | Path, run: str, rank: int, attempt: int, host: str,
        max_pending_batches: int = 4096, flush_interval_s: float = 0.5, max_rows_per_frame: int = 8192,
        retry_interval_s: float = 2.0, clock: Clock | None = None, start: bool = True,
    ) -> None:
        if max_pending_batches < 1 or flush_interval_s <= 0 or max_rows_per_frame < 1:
            raise ValueError(
                f"max_pending_batches ({max_pending_batches}) and max_rows_per_frame ({max_rows_per_frame}) "
                f"must be >= 1 and flush_interval_s ({flush_interval_s}) > 0"
            )
        self.path = Path(path)
        self.run, self.rank, self.attempt, self.host = check_run_name(run), int(rank), int(attempt), host
        self.stream_id = ""
        self._clock = clock if clock is not None else AnchoredClock()
        self._max_pending = max_pending_batches
        self._wake_at = max(1, max_pending_batches // 2)
        self._flush_interval_s = flush_interval_s
        self._max_rows = max_rows_per_frame
        self._retry_interval_s = retry_interval_s
        self._queue: collections.deque[tuple[str, list[tuple]]] = collections.deque()
        self._wake = threading.Event()
        self._drain_lock = threading.Lock()  # flush() from another thread vs the writer thread
        self._closing = False
        self._fd: int | None = None
        self._ino: int | None = None
        self._good_size = 0  # file size after the last whole frame this writer wrote
        self._retry_at = 0.0
        # Counters, each owned by one thread (see class docstring).
        self._dropped_submit = 0  # training thread
        self._dropped_flush = 0  # writer thread
        self.write_errors = 0
        self.encode_errors = 0
        self.written_records = 0
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name=f"meshscope-spool-{self.rank}", daemon=True)
        if start:
            self._thread.start()

    @property
    def dropped_records(self) -> int:
        return self._dropped_submit + self._dropped_flush

    @property
    def spool_bytes(self) -> int:
        return self._good_size

    @property
    def pending_batches(self) -> int:
        return len(self._queue)

    def submit(self, kind: str, rows: list[tuple]) -> bool:
        """Queue ``rows`` (tuples in ``SCHEMAS[kind]`` field order; the list is handed over, do not
        mutate it afterwards). Returns False, counting the rows as dropped, when the queue is full or
        the writer is closed. Never blocks, never raises."""
        try:
            n = len(rows)  # also rejects non-sequences here rather than in the writer thread
            if self._closing or len(self._queue) >= self._max_pending:
                self._dropped_submit += n
                return False
            self._queue.append((kind, rows))
            if len(self._queue) >= self._wake_at and not self._wake.is_set():
                self._wake.set()
            return True
        except Exception:  # noqa: BLE001 - e.g. rows without len(): never into the training loop
            self._dropped_submit += 1
            return False

    def flush(self) -> None:
        """Write what is queued now, on the calling thread (for tests and shutdown paths)."""
        self._drain()

    def close(self, *, timeout_s: float = 5.0) -> bool:
        """Stop accepting rows, write what is queued and close the file. Returns True if everything
        queued was handled within ``timeout_s``. Never raises."""
        self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            done = not self._thread.is_alive()
        else:
            self._drain()
            done = True
        if done:
            self._close_fd()
        return done

    # -- writer thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            self._drain()
        self._drain()

    def _drain(self) -> None:
        with self._drain_lock:
            self._drain_locked()

    def _drain_locked(self) -> None:
        try:
            items = []
            while self._queue:
                items.append(self._queue.popleft())
            if not items:
                return
            if self._clock.now() < self._retry_at:
                # Backing off after a failure: do not spend CPU encoding rows that cannot be written.
                self._dropped_flush += sum(len(rows) for _, rows in items)
                return
            by_kind: dict[str, list[list[tuple]]] = {}
            for kind, rows in items:
                by_kind.setdefault(kind, []).append(rows)
            frames: list[bytes] = []
            n_rows = 0
            for kind, batches in by_kind.items():
                rows = [row for batch in batches for row in batch]
                frame = self._encode(kind, rows)
                if frame is not None:
                    frames.append(frame)
                    n_rows += len(rows)
                    continue
                # One caller's bad rows must not cost the others theirs: encode submit by submit.
                for batch in batches:
                    frame = self._encode(kind, batch) if len(batches) > 1 else None
                    if frame is None:
                        self.encode_errors += 1
                        self._dropped_flush += len(batch)
                    else:
                        frames.append(frame)
                        n_rows += len(batch)
            if frames:
                self._write(b"".join(frames), n_rows)
        except Exception as exc:  # noqa: BLE001 - the thread must survive anything
            self.write_errors += 1
            self.last_error = f"flush: {type(exc).__name__}: {exc}"

    def _encode(self, kind: str, rows: list[tuple]) -> bytes | None:
        """Frames of at most max_rows_per_frame rows; None (with ``last_error`` set) if the rows do not
        fit the kind's schema."""
        try:
            if kind not in SCHEMAS:
                raise ValueError(f"unknown record kind {kind!r}")
            return b"".join(encode_data_frame(kind, rows_to_batch(kind, rows[i:i + self._max_rows]))
                            for i in range(0, len(rows), self._max_rows))
        except Exception as exc:  # noqa: BLE001 - a caller's bad rows: counted by the caller, never raised
            self.last_error = f"encode {kind}: {type(exc).__name__}: {exc}"
            return None

    def _write(self, data: bytes, n_rows: int) -> None:
        if not self._ensure_open():
            self._dropped_flush += n_rows
            return
        try:
            _write_all(self._fd, data)
            self._good_size += len(data)
            self.written_records += n_rows
        except OSError as exc:
            self._fail(f"write: {exc}", n_rows)
            self._rollback()

    def _ensure_open(self) -> bool:
        if self._fd is not None:
            try:
                alive = os.stat(self.path).st_ino == self._ino
            except OSError:
                alive = False
            if alive:
                return True
            self._close_fd()  # deleted or replaced under us: start a new file (new stream id)
        if self._clock.now() < self._retry_at:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            self._fail(f"open {self.path}: {exc}", 0)
            return False
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                stream_id = secrets.token_hex(8)
                header = encode_file_header(
                    run=self.run, rank=self.rank, attempt=self.attempt, host=self.host,
                    stream_id=stream_id, created=time.time(),
                )
                _write_all(fd, header)
                self.stream_id = stream_id
                size = len(header)
            else:
                size = st.st_size  # an earlier writer of this rank and attempt: append after it
        except OSError as exc:
            try:  # a torn header would make the agent reject the whole file: leave it empty instead
                os.ftruncate(fd, 0)
            except OSError:
                pass
            os.close(fd)
            self._fail(f"header {self.path}: {exc}", 0)
            return False
        self._fd, self._ino, self._good_size = fd, st.st_ino, size
        return True

    def _rollback(self) -> None:
        """Cut a partly written frame off, so readers never see a torn frame followed by good ones."""
        try:
            if self._fd is not None and os.fstat(self._fd).st_size > self._good_size:
                os.ftruncate(self._fd, self._good_size)
        except OSError:
            self._close_fd()  # cannot repair now; a reader resynchronises past the torn frame anyway

    def _fail(self, message: str, n_rows: int) -> None:
        self.write_errors += 1
        self._dropped_flush += n_rows
        self.last_error = message
        self._retry_at = self._clock.now() + self._retry_interval_s

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = self._ino = None


def _write_all(fd: int, data: bytes) -> None:
    view, done = memoryview(data), 0
    while done < len(data):
        done += os.write(fd, view[done:])
