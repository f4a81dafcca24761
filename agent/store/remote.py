"""Readers over a bucket: ``--store s3://bucket/prefix`` reads through a local cache of the bucket's parts.

Parts are immutable under their names (``agent.store.objectstore``), so a cache never goes stale: a
sync lists the prefix once (one flat listing), downloads the parts the cache lacks, and removes those the
bucket no longer has or that a compacted part or a pack supersedes (packs are fetched first: their
manifests say which). The cache is then an ordinary local store root,
read by the one reader (``agent.store.reader.Store``) with DuckDB's own Parquet scan. So the first read
of a run costs its download, and every later read one listing plus what is new: cheaper than fetching
every file from the bucket on every page load (DuckDB's httpfs extension cannot be installed here, and
an Arrow dataset over S3 would re-read each part each time).

Cache: ``$MESHSCOPE_CACHE_DIR`` (default ``~/.cache/meshscope``) ``/s3/<hash of the URL>``. Nothing from a
key becomes a path unless it matches the store's layout (``objectstore.table_part``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from meshscope.agent.store import compact, objectstore, packs
from meshscope.agent.store.objectstore import S3Url
from meshscope.agent.contract.storelayout import StoreLayout

MIN_SYNC_INTERVAL_S = 2.0  # several reads within this share one listing (a dashboard page runs many)
WORKERS = 16  # concurrent GETs: small objects, latency-bound

BACKGROUND_INTERVAL_S = 15.0  # a page load over a bucket starts a listing at most this often (page data
# is cached 30 s: dashboard/ui.py CACHE_TTL_S)
_locks: dict[str, threading.Lock] = {}
_last_sync: dict[str, float] = {}
_syncing: set[str] = set()  # background syncs running
_failed: dict[str, bool] = {}  # background syncs that raised
_guard = threading.Lock()


@dataclass(frozen=True, slots=True)
class SyncResult:
    root: Path
    listed: int
    downloaded: int
    removed: int
    bytes: int


def cache_root(url: S3Url) -> Path:
    base = compact.cache_base()
    # A hash, not the bucket and prefix: a "key=value" in a prefix would read as a partition key, and two
    # endpoints may hold the same bucket name.
    digest = hashlib.sha256(f"{objectstore.endpoint_from_env()}|{url}".encode()).hexdigest()[:16]
    return base / "s3" / digest


def sync_in_background(url: S3Url, *, interval_s: float | None = None) -> Path:
    """The cache of ``url`` for a page load: synced now the first time in this process and after a
    failed sync (so the error reaches the page), otherwise returned at once while a sync runs on a
    thread of its own when the last one is ``interval_s`` (default BACKGROUND_INTERVAL_S) old. A listing
    of a 16,384-rank run's 14,336 objects takes seconds (bench/dashboard_pages.py --s3); the page reads
    what the last one brought."""
    interval_s = BACKGROUND_INTERVAL_S if interval_s is None else interval_s
    root = cache_root(url)
    key = str(root)
    with _guard:
        # Set until a sync succeeds: during an outage every page load tries in the foreground and says why,
        # rather than every other one showing the cache as if nothing were wrong.
        failed = key in _failed
        foreground = failed or key not in _last_sync or not root.is_dir()
        due = not foreground and time.monotonic() - _last_sync[key] >= interval_s and key not in _syncing
        if due:
            _syncing.add(key)
    if foreground:
        return sync(url, min_interval_s=0.0 if failed else MIN_SYNC_INTERVAL_S).root
    if due:
        threading.Thread(target=_sync_quietly, args=(url, key), name="meshscope-s3-sync", daemon=True).start()
    return root


def _sync_quietly(url: S3Url, key: str) -> None:
    try:
        sync(url, min_interval_s=0)
    except Exception:  # noqa: BLE001 - said by the next page load, which syncs in the foreground
        with _guard:
            _failed[key] = True
    finally:
        with _guard:
            _syncing.discard(key)


def sync(url: S3Url, *, filesystem=None, min_interval_s: float = MIN_SYNC_INTERVAL_S) -> SyncResult:
    """Bring the cache of ``url`` up to the bucket. Raises OSError (pyarrow's S3 errors included)."""
    root = cache_root(url)
    key = str(root)
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        if time.monotonic() - _last_sync.get(key, -1e9) < min_interval_s and root.is_dir():
            return SyncResult(root, 0, 0, 0, 0)
        s3 = filesystem if filesystem is not None else objectstore.filesystem()
        parts = objectstore.list_parts(s3, url)
        Path(StoreLayout.of(root).tables).mkdir(parents=True, exist_ok=True)
        have = _cached_files(root)
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            # Packs first: their manifests (footers, read from the cache) say which parts and packs are
            # superseded, and those are neither downloaded nor kept.
            new_packs = [p for p in parts.values() if p.pack and have.get(p.rel) != p.size]
            sizes = list(pool.map(lambda p: _download(s3, url, p, root), new_packs))
            manifests = {p.rel: packs.manifest(root / p.rel) for p in parts.values() if p.pack}
            drop = objectstore.superseded(list(parts.values()), manifests)
            wanted = {rel: p for rel, p in parts.items() if rel not in drop}
            missing = [p for p in wanted.values() if not p.pack and have.get(p.rel) != p.size]
            sizes += pool.map(lambda p: _download(s3, url, p, root), missing)
        missing += new_packs
        removed = 0
        # Superseded packs still in the bucket stay cached (the reader skips them by the same rule):
        # removing them would fetch them again at the next sync.
        keep = set(wanted) | {rel for rel, p in parts.items() if p.pack}
        for rel in set(have) - keep:
            try:
                (root / rel).unlink()
                removed += 1
            except FileNotFoundError:
                pass
        _last_sync[key] = time.monotonic()
        with _guard:
            _failed.pop(key, None)
        return SyncResult(root, len(wanted), len(missing), removed, sum(sizes))


def _download(s3, url: S3Url, part: objectstore.RemotePart, root: Path) -> int:
    final = root / part.rel
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with s3.open_input_stream(url.path(part.rel)) as src:
            data = src.read()
        tmp.write_bytes(data)
        os.replace(tmp, final)  # whole or absent: a reader scanning the cache never sees half a file
    except OSError as exc:
        if not objectstore.gone(exc):
            raise
        return 0  # deleted since the listing (a merge's or a compaction's sources): the next sync drops it
    finally:
        tmp.unlink(missing_ok=True)
    return len(data)


def _cached_files(root: Path) -> dict[str, int]:
    """Parts in the cache by key below the prefix (temporary files of a download in flight excluded)."""
    out = {}
    base = StoreLayout.of(root).tables
    for dirpath, _dirs, files in os.walk(base):
        rel_dir = os.path.relpath(dirpath, root)
        for name in files:
            if name.startswith("."):
                continue
            rel = f"{rel_dir}/{name}"
            try:
                out[rel] = os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return out
