"""Rank side of the transport: a non-blocking, never-raising spool writer.

``submit`` runs on the training thread. It only appends the caller's row list to a bounded deque (a
length check and an append: no lock, no I/O, no Arrow). A daemon thread wakes every ``flush_interval_s``
(or early when the queue is half full), converts the queued rows of each kind to one Arrow record batch,
frames it (``agent.transport.frame``) and appends the frames to the spool file with one ``os.write``.

Failure policy (telemetry must never hurt training): a full queue drops the submitted batch and counts
its rows. A write that fails (disk full, directory deleted or replaced, file unwritable) loses nothing at
first: the flush's encoded frames stay in an in-memory hold of at most ``max_hold_bytes`` (8 MiB per rank
by default: minutes of the reference trainer's records, see bench/spool_outage.py) and are written, in
order, once a retry succeeds. Retries back off from ``retry_first_s`` (50 ms) to ``retry_max_s`` (1 s)
(``agent.transport.backoff``), so a freed disk is written to within ``retry_max_s``. Past the hold the
*newest* rows are dropped and counted, as the full submit queue does: what is kept is the onset of the
outage and the run's first records (its ``run`` record, the ``start`` event), the part a person debugging
it needs; once writes succeed again the current state flows at once. A failed write is rolled back to the
last whole frame so no torn frame is left before later good ones. A spool file deleted under the writer is
noticed (inode check per flush) and recreated with a fresh file header. Nothing here raises out of
``submit`` or ``close``; rows still held when ``close`` gives up are counted as dropped.

Durability: frames are written with ``os.write`` (no fsync). A process crash loses at most the queued
rows; a machine crash can lose what the page cache had not written back.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import threading
import time
from pathlib import Path

from meshscope.agent.contract import SCHEMAS, AnchoredClock, Clock, check_run_name
from meshscope.agent.transport.backoff import Backoff
from meshscope.agent.transport.frame import encode_data_frame, encode_file_header, rows_to_batch


DEFAULT_MAX_HOLD_BYTES = 8 * 1024 * 1024


class SpoolWriter:
    """Appends telemetry batches to one rank's spool file from a background thread.

    Counters (read them any time; each is written by one thread only, so no lock is needed):
    ``dropped_records`` rows lost (queue full, bad rows, hold full, still held at close), ``write_errors``
    failed writes/opens, ``encode_errors`` batches whose rows were not the kind's records, ``written_records``
    rows appended, ``held_records`` / ``held_bytes`` rows encoded but not yet written (an outage),
    ``spool_bytes`` size of the spool file as this writer knows it. ``last_error`` holds the most recent
    failure as text.
    """

    def __init__(
        self, *, path: str | Path, run: str, rank: int, attempt: int, host: str,
        max_pending_batches: int = 4096, flush_interval_s: float = 0.5, max_rows_per_frame: int = 8192,
        max_hold_bytes: int = DEFAULT_MAX_HOLD_BYTES, retry_first_s: float = 0.05, retry_max_s: float = 1.0,
        clock: Clock | None = None, start: bool = True,
    ) -> None:
        if max_pending_batches < 1 or flush_interval_s <= 0 or max_rows_per_frame < 1 or max_hold_bytes < 0:
            raise ValueError(
                f"max_pending_batches ({max_pending_batches}) and max_rows_per_frame ({max_rows_per_frame}) "
                f"must be >= 1, flush_interval_s ({flush_interval_s}) > 0 and max_hold_bytes "
                f"({max_hold_bytes}) >= 0"
            )
        self.path = Path(path)
        self.run, self.rank, self.attempt, self.host = check_run_name(run), int(rank), int(attempt), host
        self.stream_id = ""
        self._clock = clock if clock is not None else AnchoredClock()
        self._max_pending = max_pending_batches
        self._wake_at = max(1, max_pending_batches // 2)
        self._flush_interval_s = flush_interval_s
        self._max_rows = max_rows_per_frame
        self._max_hold = max_hold_bytes
        self._backoff = Backoff(first_s=retry_first_s, max_s=retry_max_s)
        self._queue: collections.deque[tuple[str, list[tuple]]] = collections.deque()
        # Encoded flushes not yet written, oldest first: (whole frames, rows). Writer thread only.
        self._held: collections.deque[tuple[bytes, int]] = collections.deque()
        self._held_bytes = 0
        self._held_rows = 0
        self._wake = threading.Event()
        self._drain_lock = threading.Lock()  # flush() from another thread vs the writer thread
        self._closing = False
        self._close_by = 0.0  # time.monotonic() until which a closing writer retries what it holds
        self._fd: int | None = None
        self._ino: int | None = None
        self._good_size = 0  # file size after the last whole frame this writer wrote
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

    @property
    def held_records(self) -> int:
        return self._held_rows

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def submit(self, kind: str, rows: list[tuple]) -> bool:
        """Queue ``rows`` (``agent.contract.RECORDS[kind]`` records; the list is handed over, do not
        mutate it afterwards). Returns False, counting the rows as dropped, when the queue is full or
        the writer is closed. Never blocks, never raises. Row types are not checked here, so the training
        thread pays nothing for it: rows of another type are rejected when the writer thread encodes
        them, and counted (``encode_errors``, ``dropped_records``)."""
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
        """Write what is queued now, on the calling thread (for tests and shutdown paths). Within a
        retry's back-off, what cannot be written yet stays held."""
        self._drain()

    def close(self, *, timeout_s: float = 5.0) -> bool:
        """Stop accepting rows, write what is queued and close the file. Rows held by an outage are
        retried for up to half of ``timeout_s``, then counted as dropped. Returns True if everything
        queued was handled within ``timeout_s``. Never raises."""
        self._close_by = time.monotonic() + timeout_s / 2
        self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            done = not self._thread.is_alive()
        else:
            self._drain()
            done = True
        if done:
            self._dropped_flush += self._held_rows  # given up on: the counters stay exact
            self._held.clear()
            self._held_bytes = self._held_rows = 0
            self._close_fd()
        return done

    # -- writer thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait(self._wait_s())
            self._wake.clear()
            self._drain()
        self._drain()
        while self._held and time.monotonic() < self._close_by:
            time.sleep(min(self._wait_s(), max(0.0, self._close_by - time.monotonic())))
            self._drain()

    def _wait_s(self) -> float:
        """Until the next flush, or the next retry when rows are held (a freed disk is written to at
        the retry's time, not up to a flush interval later)."""
        if not self._held:
            return self._flush_interval_s
        return min(self._flush_interval_s, max(0.001, self._backoff.next_at - self._clock.now()))

    def _drain(self) -> None:
        with self._drain_lock:
            self._drain_locked()

    def _drain_locked(self) -> None:
        try:
            items = []
            while self._queue:
                items.append(self._queue.popleft())
            due = self._backoff.due(self._clock.now())
            if items:
                if not due and self._held_bytes >= self._max_hold:
                    # Hold full and no retry yet: the newest are dropped, without spending CPU on encoding.
                    self._dropped_flush += sum(len(rows) for _, rows in items)
                else:
                    self._hold(items)
            if self._held and due:
                self._write_held()
            while self._held_bytes > self._max_hold and self._held:  # over the bound: drop the newest
                blob, n = self._held.pop()
                self._held_bytes -= len(blob)
                self._held_rows -= n
                self._dropped_flush += n
        except Exception as exc:  # noqa: BLE001 - the thread must survive anything
            self.write_errors += 1
            self.last_error = f"flush: {type(exc).__name__}: {exc}"
            self._backoff.failed(self._clock.now())  # never spin on what held rows keep failing at

    def _hold(self, items: list[tuple[str, list[tuple]]]) -> None:
        """Encode queued rows, per kind, into whole frames appended to the hold."""
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
            blob = b"".join(frames)
            self._held.append((blob, n_rows))
            self._held_bytes += len(blob)
            self._held_rows += n_rows

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

    def _write_held(self) -> None:
        """Write the hold oldest first, one flush's frames per write, so a failure leaves exactly the
        unwritten flushes held (one write in the common case: the hold has one flush)."""
        if not self._ensure_open():
            return
        while self._held:
            blob, n = self._held[0]
            try:
                _write_all(self._fd, blob)
            except OSError as exc:
                self._fail(f"write: {exc}")
                self._rollback()
                return
            self._held.popleft()
            self._held_bytes -= len(blob)
            self._held_rows -= n
            self._good_size += len(blob)
            self.written_records += n
        self._backoff.succeeded()

    def _ensure_open(self) -> bool:
        if self._fd is not None:
            try:
                alive = os.stat(self.path).st_ino == self._ino
            except OSError:
                alive = False
            if alive:
                return True
            self._close_fd()  # deleted or replaced under us: start a new file (new stream id)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            self._fail(f"open {self.path}: {exc}")
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
            self._fail(f"header {self.path}: {exc}")
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

    def _fail(self, message: str) -> None:
        self.write_errors += 1
        self.last_error = message
        self._backoff.failed(self._clock.now())

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):  # already gone: nothing to release
                os.close(self._fd)
            self._fd = self._ino = None


def _write_all(fd: int, data: bytes) -> None:
    view, done = memoryview(data), 0
    while done < len(data):
        done += os.write(fd, view[done:])
