"""Reader-side compaction: one sorted **segment** in the reader's cache stands in for many packs.

Node packs (``agent.store.packs``) bound the files per run and kind to about one per node, but the
largest jobs have thousands of nodes: at 16,384 ranks a page reads 2,048 packs per kind, and opening them
costs more than the rows (one step of collectives from 2,048 packs 0.8 s, from one file sorted by step
0.05 s; bench/dashboard_pages.py). No agent sees more than its node, so the reader merges what it reads:
once a run has ``MIN_PACKS`` settled packs of a kind not yet in a segment, it writes them as one segment
(rows sorted by step then rank, 64 k-row groups with statistics, the pack layout, so every rule that reads
packs reads it unchanged) under::

    $MESHSCOPE_CACHE_DIR/compact/<hash of the store's roots>/<kind>/run=<run>/packs/pack-<id>.parquet

A segment names its source packs (by name: a pack's name is a hash of its kind and contents) in its
footer, and stands in for them only while every one of them is still listed: an agent that merges small
packs again, or a crash's leftovers the superseded rule drops, make it stale, and a stale segment is
deleted and its sources' successors are read as they are until they settle into a new segment. So a
segment is never read beside a row it holds, and a listing never misses one.

``settled``: a pack the agent will not merge again: one of ``packs.SMALL_BYTES`` or more (a minute after it
was written), or a small one ``SETTLE_S`` old (an agent merges its small packs once 8 have gathered, within
minutes on a live run, so a segment built from them would go stale and be rebuilt over and over). A
live run's newest packs are read as they are; a finished run's all settle. A segment that looks stale is
deleted only once it is a minute old: another reader whose listing is newer than this one may just have
built it.

Modes (``Store.compaction``): "off" reads packs only; "use" (the default) reads the segments present;
"background" also builds new ones on one worker thread per process, with one DuckDB thread, so the pages
keep a core (the dashboard); "now" builds before the query returns (benchmarks, tests, a one-off report
over a run that will be read again).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from meshscope.agent.store import duckconn, packs
from meshscope.agent.store.parts import META_PREFIX
from meshscope.agent.contract import PACK_RE, SCHEMA_VERSION, pack_name
from meshscope.agent.contract.storelayout import StoreLayout

MODES = ("off", "use", "background", "now")
MIN_PACKS = 64  # below this a run's packs are read as they are (1,024 ranks: 128 packs per kind)
SETTLE_S = 600.0  # a small pack's age before it is settled
SETTLE_BIG_S = 60.0  # a big pack's (never merged again; the margin covers a clock step or a slow rename)
STALE_AFTER_S = 60.0  # a stale-looking segment younger than this is left (see the module docstring)
RETRY_S = 600.0  # a failed build of the same sources is tried again after this
SOURCES_KEY = f"{META_PREFIX}sources".encode()
MEMORY_LIMIT = "1GB"  # a build's sort spills beyond this (65 M collective rows at 16,384 ranks)
STALE_TMP_S = 3600.0  # a build killed with its process leaves a temporary file; removed after this


def cache_base() -> Path:
    """The reader's cache directory (buckets' copies, segments): ``env.cache_root``; absolute, so the paths
    handed to DuckDB are."""
    from meshscope.agent.env import cache_root

    return cache_root()


def segment_dir(roots: Sequence[Path], *, kind: str, run: str) -> Path:
    # A hash of the roots, not their names: a "key=value" component would read as a partition key.
    digest = hashlib.sha256("|".join(sorted(map(str, roots))).encode()).hexdigest()[:16]
    # The segments sit in a store layout of their own (tables/<kind>/run=<run>/packs) under the digest.
    return Path(StoreLayout.of(cache_base() / "compact" / digest).packs(kind, run))


def sources(path: Path) -> frozenset[str] | None:
    """The pack names a segment holds (None when its footer is unreadable). Read once per process."""
    return packs.footer_value(path, SOURCES_KEY, _parse_sources)


def _parse_sources(raw: bytes | None) -> frozenset[str] | None:
    try:
        return frozenset(json.loads(raw)) if raw is not None else None
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True, slots=True)
class Plan:
    files: list[Path]  # what to read: segments in use, packs no segment holds, everything else as listed
    todo: tuple[Path, ...]  # settled packs no segment holds, when there are enough of them for a new one


def plan(files: Sequence[Path], *, directory: Path, now: float, settle_s: float | None = None,
         min_packs: int | None = None) -> Plan:
    """One run and kind's listing (``Store.files``, superseded already dropped) with the segments in
    ``directory`` in place of the packs they hold. Deletes the segments that have gone stale.
    ``settle_s``, ``min_packs``: default SETTLE_S, MIN_PACKS."""
    settle_s = SETTLE_S if settle_s is None else settle_s
    min_packs = MIN_PACKS if min_packs is None else min_packs
    names = {p.name for p in files if PACK_RE.match(p.name)}
    chosen: list[Path] = []
    held: set[str] = set()
    for seg in sorted(packs.list_packs(directory), key=lambda s: -len(sources(s) or ())):
        src = sources(seg)
        if src and src <= names and not src & held:
            chosen.append(seg)
            held |= src
        elif _age(seg, now) >= STALE_AFTER_S:
            # Stale (its sources were merged away), unreadable, or overlapping one in use (two readers
            # built from different listings): never read, so removed.
            _unlink(seg)
    rest = [p for p in files if p.name not in held]
    todo = tuple(p for p in rest if PACK_RE.match(p.name) and _settled(p, now=now, settle_s=settle_s))
    return Plan(chosen + rest, todo if len(todo) >= min_packs else ())


def _settled(pack: Path, *, now: float, settle_s: float) -> bool:
    try:
        st = pack.stat()
    except OSError:
        return False
    age = now - st.st_mtime
    return age >= settle_s or (age >= min(settle_s, SETTLE_BIG_S) and st.st_size >= packs.SMALL_BYTES)


def build(sources_: Sequence[Path], *, directory: Path, kind: str, threads: int = 1) -> Path:
    """Write one segment of the packs ``sources_`` into ``directory`` (temporary name, then rename: a
    reader sees all of it or nothing). Returns its path; the same sources make the same name, so a second
    build of them returns at once. Raises OSError, or a DuckDB/Arrow error for an unreadable pack."""
    names = sorted({p.name for p in sources_})
    final = directory / pack_name(hashlib.sha256(f"segment|{kind}|{'|'.join(names)}".encode()).hexdigest()[:24])
    if final.exists():
        return final
    directory.mkdir(parents=True, exist_ok=True)
    _sweep_tmp(directory)
    ranges: list[packs.Range] = []
    for p in sources_:
        ranges.extend(packs.manifest(p) or ())
    metadata = {packs.MANIFEST_KEY: json.dumps([list(r) for r in packs.merge_ranges(ranges)], separators=(",", ":")),
                SOURCES_KEY: json.dumps(names), f"{META_PREFIX}kind": kind,
                f"{META_PREFIX}schema_version": str(SCHEMA_VERSION), f"{META_PREFIX}source": "segment"}
    tmp = directory / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    # Its own spill directory: DuckDB 1.x names its temporary files alike in every process and removes
    # every one it finds in its directory when it closes.
    spill = Path(tempfile.mkdtemp(prefix=".spill-", dir=directory.parent.parent))
    listing = ", ".join("'" + str(p).replace("'", "''") + "'" for p in sources_)
    config = {"threads": threads, "memory_limit": MEMORY_LIMIT, "temp_directory": str(spill),
              "preserve_insertion_order": False}
    try:
        with duckconn.connect(config=config) as con:
            scan = f"read_parquet([{listing}], union_by_name = true, hive_partitioning = false)"
            columns = [row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {scan}").fetchall()]
            keys = [c for c in ("step", "rank", "t_start", "t") if c in columns]
            order = f" ORDER BY {', '.join(keys)}" if keys else ""
            rel = con.sql(f"SELECT * FROM {scan}{order}")
            # DuckDB 2 renamed the relation's record_batch (pyproject allows 1.x).
            reader = (getattr(rel, "to_arrow_reader", None) or rel.record_batch)(packs.ROW_GROUP_ROWS)
            schema = reader.schema.with_metadata(metadata)
            strings = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
            floats = [f.name for f in schema if pa.types.is_floating(f.type)]
            # As packs are written (packs.write_tables): statistics on the sort keys let a step window
            # or a set of ranks skip the rest.
            with pq.ParquetWriter(tmp, schema, compression="zstd", use_dictionary=strings,
                                  use_byte_stream_split=floats, write_statistics=keys) as writer:
                for batch in reader:
                    if duckconn.stopping():
                        raise InterruptedError("the process is exiting")
                    writer.write_batch(batch, row_group_size=packs.ROW_GROUP_ROWS)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------- background builds
_jobs: queue.Queue = queue.Queue()
_pending: set[Path] = set()
_guard = threading.Lock()
_worker: threading.Thread | None = None


def _stop_builds() -> None:
    """At exit: interrupt a build in progress (``duckconn.stop``) and wait for the worker, which then
    leaves its temporary segment and spill directory removed."""
    duckconn.stop()
    if _worker is not None:
        _worker.join(timeout=duckconn.time_left())  # one exit deadline for both (duckconn.stop)


failures = 0  # builds that raised (the pages read the packs as they are meanwhile)
_failed: dict[tuple[Path, frozenset[str]], float] = {}  # (directory, sources) -> when it failed


def submit(sources_: Sequence[Path], *, directory: Path, kind: str) -> bool:
    """Build a segment on the process's one worker thread; False when the same directory already has a
    build waiting or running (its listing is at most one build old)."""
    global _worker
    with _guard:
        if directory in _pending:
            return False
        _pending.add(directory)
        if duckconn.stopping():
            _pending.discard(directory)
            return False
        if _worker is None or not _worker.is_alive():
            if _worker is None:
                atexit.register(_stop_builds)
            _worker = threading.Thread(target=_work, name="meshscope-compact", daemon=True)
            _worker.start()
    _jobs.put((tuple(sources_), directory, kind))
    return True


def wait_idle(timeout_s: float) -> bool:
    """True once no build is waiting or running (tests, benchmarks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with _guard:
            if not _pending:
                return True
        time.sleep(0.05)
    return False


def try_build(sources_: Sequence[Path], *, directory: Path, kind: str, threads: int = 1) -> Path | None:
    """``build``, with a failure counted instead of raised: a source merged away meanwhile, a damaged
    pack (the reader then skips it as it skips any), a full disk. The packs are read as they are."""
    global failures
    key = (directory, frozenset(p.name for p in sources_))
    with _guard:
        # Not again on every page load (a damaged pack): after RETRY_S (a disk that was full), or at once
        # for another listing.
        if time.monotonic() - _failed.get(key, -RETRY_S) < RETRY_S:
            return None
    try:
        return build(sources_, directory=directory, kind=kind, threads=threads)
    except Exception:  # noqa: BLE001 - see the docstring
        with _guard:
            failures += 1
            if len(_failed) >= 1024:
                _failed.clear()
            _failed[key] = time.monotonic()
        return None


def _work() -> None:
    while not duckconn.stopping():
        try:
            srcs, directory, kind = _jobs.get(timeout=0.5)
        except queue.Empty:
            continue
        try:
            try_build(srcs, directory=directory, kind=kind)
        finally:
            with _guard:
                _pending.discard(directory)


def _age(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except OSError:
        return 0.0


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass  # another reader removed it first, or the cache is read-only: it is skipped either way


def _sweep_tmp(directory: Path) -> None:
    """What builds killed with their process left: temporary segments here, spill directories above."""
    now = time.time()
    for e in os.scandir(directory):
        if e.name.endswith(".tmp") and _age(Path(e.path), now) > STALE_TMP_S:
            _unlink(Path(e.path))
    for e in os.scandir(directory.parent.parent):
        if e.name.startswith(".spill-") and _age(Path(e.path), now) > STALE_TMP_S:
            shutil.rmtree(e.path, ignore_errors=True)
