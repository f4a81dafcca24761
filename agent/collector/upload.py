"""``meshscope agent --upload s3://bucket/prefix``: every sealed Parquet part of the store, exactly once, in
an S3-compatible bucket (layout: ``agent.store.objectstore``).

- **Exactly once.** Parts are final when they appear (written to a temporary name and renamed) and their
  names are idempotent, so an upload is a PUT of the part to its own key: repeating it after a crash
  rewrites the same bytes. What is up is what the bucket lists (listed once at start, then tracked), so a
  restarted agent uploads only what is missing. A local compaction's merged part replaces its sources:
  once it is up, the sources' objects are deleted (readers ignore contained parts meanwhile).
- **Never in the way.** Uploads run on a thread of their own with the S3 client's own threads; ingest and
  /metrics never wait on them. A failure (endpoint down, bad credentials, missing bucket) is counted,
  said once on stderr per kind of failure, and retried with backoff (``agent.transport.backoff``).
- **Local parts are kept until acknowledged**, then for ``keep_local_s`` more, and only below the
  durable spool offset (``retain``, called on the ingest thread: the crash-recovery rule of
  ``agent.store.parts`` looks for parts at the durable offset, and compaction works on the same
  files).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from meshscope.agent.store import objectstore, packs
from meshscope.agent.store.parts import list_parts
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.contract import KINDS, Clock
from meshscope.agent.contract.storelayout import StoreLayout, rank_of, run_of
from meshscope.agent.transport.backoff import Backoff


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadConfig:
    url: str  # s3://bucket/prefix
    interval_s: float = 1.0  # between passes over the store when nothing failed
    keep_local_s: float = 3600.0  # acknowledged parts stay on local disk this long
    workers: int = 8  # concurrent PUTs (small objects: latency-bound)
    retry_first_s: float = 0.5
    retry_max_s: float = 10.0

    def __post_init__(self) -> None:
        objectstore.parse_url(self.url)  # ValueError naming the bad value
        if self.interval_s <= 0 or self.keep_local_s < 0 or self.workers < 1:
            raise ValueError(f"upload interval ({self.interval_s}) must be > 0, local retention ({self.keep_local_s}) "
                             f">= 0 and workers ({self.workers}) >= 1")
        Backoff(first_s=self.retry_first_s, max_s=self.retry_max_s)  # same checks as every retry rule


@dataclass(frozen=True, slots=True)
class _Local:
    rel: str
    path: Path
    stream: str
    end: int
    size: int


class Uploader:
    """The upload thread. ``filesystem``: a pyarrow filesystem (tests); default: ``objectstore.filesystem()``."""

    def __init__(self, *, store: Path, config: UploadConfig, state: MetricsState, clock: Clock,
                 filesystem=None, log: Callable[[str], None] | None = None) -> None:
        self.store = Path(store)
        self.config = config
        self.url = objectstore.parse_url(config.url)
        self.state = state
        self.clock = clock
        self._fs = filesystem
        self._log = log or (lambda line: print(f"meshscope agent: {line}", file=sys.stderr, flush=True))
        self._remote: dict[str, int] | None = None  # key below the prefix -> size, once listed
        self._acked: dict[str, float] = {}  # local parts known to be up -> when that was first known
        self._lock = threading.Lock()  # _acked: written here, read by retain() on the ingest thread
        self._backoff = Backoff(first_s=config.retry_first_s, max_s=config.retry_max_s)
        self._said: str | None = None  # the failure last said, so an outage is one line, not one per retry
        self._stop = threading.Event()
        self._abort = threading.Event()  # set by stop() once its wait is over: start nothing more
        # pack key -> manifest, for the packs this agent has seen on disk: kept after local retention
        # deletes the file, so a merged pack's sources can still be recognised (and deleted) in the bucket.
        self._manifests: dict[str, tuple | None] = {}
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- the thread ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=self.config.workers, thread_name_prefix="meshscope-upload")
        self._thread = threading.Thread(target=self._run, name="meshscope-uploader", daemon=True)
        self._thread.start()

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """One last pass for what the agent's final flush wrote, bounded by ``timeout_s``; what is not up
        by then is uploaded by the next agent on this store. Returns with no request of this uploader in
        flight (the interpreter's exit must not find the S3 client in use)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._abort.set()
        if self._pool is not None:  # queued PUTs cancelled; those in flight end within the client's timeouts
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            try:
                self.run_pass()
            except OSError as exc:
                self._failed(exc)
            except Exception as exc:  # noqa: BLE001 - a bug here must not end uploads silently: counted, said
                self._failed(exc)
            else:
                self._backoff.succeeded()
                if self._said is not None:
                    self._log(f"uploads to {self.url} resumed")
                    self._said = None
            if stopping:
                return
            now = self.clock.now()
            wait = max(self._backoff.next_at - now, 0.0) if self._backoff.failures else self.config.interval_s
            self._stop.wait(wait)

    def _failed(self, exc: Exception) -> None:
        self._backoff.failed(self.clock.now())
        line = (objectstore.describe_error(exc, url=self.url) if isinstance(exc, OSError)
                else f"internal error {type(exc).__name__}: {exc}")
        with self.state.lock:
            self.state.upload_errors += 1
        if line != self._said:
            self._log(f"upload failed: {line}; retrying (training and /metrics are not affected)")
            self._said = line

    # -- one pass -----------------------------------------------------------------------------------
    def run_pass(self) -> int:
        """Upload every local part the bucket lacks, then drop superseded objects. Returns parts uploaded.
        Raises OSError on the first failure (the parts acknowledged before it stay acknowledged)."""
        fs = self._filesystem()
        if self._abort.is_set():
            return 0
        if self._remote is None:
            self._remote = {rel: p.size for rel, p in objectstore.list_parts(fs, self.url).items()}
        local = self._scan()
        todo = [p for p in local if self._remote.get(p.rel) != p.size]
        now = self.clock.now()
        with self._lock:
            for p in local:
                if p.rel in self._remote and self._remote[p.rel] == p.size:
                    self._acked.setdefault(p.rel, now)
        self._set_pending(len(todo))
        uploaded = 0
        pool = self._pool or ThreadPoolExecutor(max_workers=1)
        try:
            futures = [pool.submit(self._put_quietly, p) for p in todo]
        except RuntimeError:  # the pool is shut down: stop() is over
            return 0
        for part, future in zip(todo, futures):
            try:
                result = future.result()
            except CancelledError:
                return uploaded
            if isinstance(result, FileNotFoundError):
                continue  # compacted away since the scan: its merged part comes next pass
            if isinstance(result, OSError):
                raise result
            self._remote[part.rel] = part.size
            with self._lock:
                self._acked[part.rel] = self.clock.now()
            uploaded += 1
            with self.state.lock:
                self.state.upload_parts += 1
                self.state.upload_bytes += part.size
                self.state.upload_pending_parts = max(0, self.state.upload_pending_parts - 1)
                self.state.upload_last_success = self.clock.now()
        if not self._stop.is_set():  # deletes can wait for the next agent; the final pass is for uploads
            self._drop_superseded(fs)
        here = {p.rel for p in local}  # manifests of packs neither in the bucket nor on disk are not needed
        self._manifests = {k: m for k, m in self._manifests.items() if k in self._remote or k in here}
        return uploaded

    def _put_quietly(self, part: _Local) -> OSError | None:
        if self._abort.is_set():
            raise CancelledError  # not uploaded: the caller stops here
        try:
            data = part.path.read_bytes()
            with self._filesystem().open_output_stream(self.url.path(part.rel)) as out:
                out.write(data)
        except OSError as exc:
            return exc
        return None

    def _drop_superseded(self, fs) -> None:
        """Delete what a compaction or a packing replaced. Only packs whose manifest this agent read can
        supersede (another node's packs are left to it: reading their footers would cost a GET each)."""
        parts = [p for rel, size in self._remote.items() if (p := objectstore.table_part(rel, size)) is not None]
        for rel in objectstore.superseded(parts, self._manifests):
            if self._abort.is_set():
                return
            try:
                fs.delete_file(self.url.path(rel))
            except FileNotFoundError:
                pass
            del self._remote[rel]

    def _scan(self) -> list[_Local]:
        """The store's sealed parts (temporary files have other names), as keys below the prefix."""
        out = []
        local, keys = StoreLayout.of(self.store), StoreLayout.keys()
        for kind in KINDS:
            base = Path(local.table(kind))
            if not base.is_dir():
                continue
            for run, run_dir in _subdirs(base, run_of):
                for rank, rank_dir in _subdirs(run_dir, rank_of):
                    rel_dir = keys.partition(kind, run=run, rank=rank)
                    for p in list_parts(rank_dir):
                        out.append(_Local(str(rel_dir / p.path.name), p.path, p.stream, p.end, p.size))
                for path in packs.list_packs(packs.packs_dir(run_dir)):
                    rel = str(keys.packs(kind, run) / path.name)
                    if rel not in self._manifests:
                        self._manifests[rel] = packs.manifest(path)
                    size = _size(path)
                    if size is not None:  # packs are final when they appear: no durable offset to wait for
                        out.append(_Local(rel, path, "", 0, size))
        return out

    def _set_pending(self, n: int) -> None:
        with self.state.lock:
            self.state.upload_pending_parts = n

    def _filesystem(self):
        if self._fs is None:
            self._fs = objectstore.filesystem()
        return self._fs

    # -- local retention (ingest thread) ------------------------------------------------------------
    def retain(self, *, durable: Callable[[str], float]) -> int:
        """Delete local parts acknowledged more than ``keep_local_s`` ago whose range lies below the
        durable offset of their stream. Returns how many were deleted."""
        now = self.clock.now()
        with self._lock:
            due = [rel for rel, t in self._acked.items() if now - t >= self.config.keep_local_s]
        removed = 0
        for rel in due:
            part = objectstore.table_part(rel, 0)
            if part is None or (not part.pack and part.end > durable(part.stream)):
                continue
            try:
                (self.store / rel).unlink()
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                continue
            with self._lock:
                self._acked.pop(rel, None)
        return removed


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None  # merged away since the listing


def _subdirs(directory: Path, parse: Callable[[str], object]) -> list[tuple]:
    """(what ``parse`` reads from the name, path) of the partition directories below ``directory``."""
    with os.scandir(directory) as it:
        return [(key, Path(e.path)) for e in it
                if (key := parse(e.name)) is not None and e.is_dir(follow_symlinks=False)]
