"""Node packs: the run store's layout for large jobs.

A part holds one rank's records of one spool byte range (``agent.store.parts``): the unit of the
agent's exactly-once ingest. At 16,384 ranks that is ~100,000 small files per flush, and every page read
opens all of them (~0.15 ms each with DuckDB, before reading a row). So once parts are final (below their
stream's durable offset), the agent merges all of a run's parts of one kind on its node into one **pack**::

    <store>/tables/<kind>/run=<run>/packs/pack-<id>.parquet

A pack has the kind's stored columns plus ``rank`` and ``_stream`` (the spool stream each row came from:
the newest-attempt rule of ``agent.store.tableview`` needs it), rows sorted by step then rank (pages
read step windows: row-group statistics let DuckDB skip the rest), and a **manifest** in its key-value
metadata: the ``(rank, stream, start, end)`` spool ranges it holds, adjacent ranges merged. Small packs of
a run are merged again the same way once enough have gathered, so a node keeps a few packs per run and kind
however long the run (one size threshold, not tiers: a pack below it is rewritten at each merge).

Exactly once, as for parts: a pack is written whole (temporary name, rename) under a name derived from its
manifest (the same sources make the same pack), and its sources are deleted only after. Whatever a crash
leaves between the two is **superseded**: a part whose range lies inside a pack's range for its rank and
stream, or a pack whose every range lies inside another pack. ``superseded`` is that one rule; the agent's
cleanup deletes, the readers skip, the uploader deletes in the bucket.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from meshscope.agent.store.parts import META_PREFIX, Part, contained, list_parts
from meshscope.agent.contract import PACK_RE, SCHEMA_VERSION, pack_name
from meshscope.agent.contract.storelayout import PACKS, rank_of

STREAM_COLUMN = "_stream"
ROW_GROUP_ROWS = 64 * 1024  # statistics granularity: a step window reads few row groups of a big pack
SMALL_BYTES = 16 * 1024 * 1024  # packs below this merge again (the agent's default pack_small_bytes)
MANIFEST_KEY = f"{META_PREFIX}manifest".encode()

Range = tuple[int, str, int, int]  # (rank, stream, start, end)


def packs_dir(run_dir: Path) -> Path:
    """``run_dir`` is ``tables/<kind>/run=<run>``."""
    return run_dir / PACKS


def list_packs(directory: Path) -> list[Path]:
    try:
        with os.scandir(directory) as it:
            return sorted(Path(e.path) for e in it if PACK_RE.match(e.name) and e.is_file(follow_symlinks=False))
    except OSError:
        return []


def merge_ranges(ranges: Iterable[Range]) -> tuple[Range, ...]:
    """Sorted, with adjacent or overlapping ranges of one (rank, stream) joined."""
    out: list[list] = []
    for rank, stream, start, end in sorted(ranges):
        if out and out[-1][0] == rank and out[-1][1] == stream and start <= out[-1][3]:
            out[-1][3] = max(out[-1][3], end)
        else:
            out.append([rank, stream, start, end])
    return tuple((r, s, a, b) for r, s, a, b in out)


def manifest_of(metadata: dict | None) -> tuple[Range, ...] | None:
    return _parse_manifest((metadata or {}).get(MANIFEST_KEY))


def _parse_manifest(raw: bytes | None) -> tuple[Range, ...] | None:
    if raw is None:
        return None
    try:
        return tuple((int(r), str(s), int(a), int(b)) for r, s, a, b in json.loads(raw))
    except (ValueError, TypeError):
        return None


def manifest(path: Path) -> tuple[Range, ...] | None:
    """A pack's manifest (None when unreadable)."""
    return footer_value(path, MANIFEST_KEY, _parse_manifest)


def footer_value(path: Path, key: bytes, parse: Callable[[bytes | None], object]) -> object:
    """``parse`` of one key-value entry of a Parquet footer (of None when the entry is absent); None when
    the footer is unreadable. Packs and segments never change under their names, so it is read once per
    process (keyed by size and mtime too, in case a name is reused by a different store)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return _footer_value(str(path), st.st_size, st.st_mtime_ns, key, parse)


@functools.lru_cache(maxsize=65536)
def _footer_value(path: str, size: int, mtime_ns: int, key: bytes, parse: Callable) -> object:
    try:
        raw = (pq.read_metadata(path).metadata or {}).get(key)
    except (OSError, pa.ArrowException):
        return None
    return parse(raw)


@dataclass(frozen=True, slots=True)
class PartRef:
    key: object  # whatever the caller names a part by (a Path, an object key)
    rank: int
    stream: str
    start: int
    end: int


def superseded(parts: Sequence[PartRef], packs: Sequence[tuple[object, tuple[Range, ...] | None]]) -> set:
    """Keys of what a crash or an unfinished cleanup left behind: packs whose every range lies inside one
    other pack, parts inside a pack's range or inside another part of their stream. ``packs``: (key,
    manifest); a pack without a readable manifest supersedes nothing and is not superseded. Two packs
    with the same ranges (the same pack in two stores read as one) keep the one whose key sorts first."""
    manifests = {key: ranges for key, ranges in packs if ranges}
    index: dict[tuple[int, str], list[tuple[int, int, object]]] = {}
    for key, ranges in manifests.items():
        for rank, stream, start, end in ranges:
            index.setdefault((rank, stream), []).append((start, end, key))

    def holders(rank: int, stream: str, start: int, end: int) -> set:
        return {key for a, b, key in index.get((rank, stream), ()) if a <= start and end <= b}

    out: set = set()
    for key, ranges in manifests.items():
        common = set.intersection(*(holders(*r) for r in ranges)) - {key}
        if any(manifests[q] != ranges or str(q) < str(key) for q in common):
            out.add(key)  # a merge's source, still there (one pack holds it all)
    live = {k: m for k, m in manifests.items() if k not in out}
    index.clear()
    for key, ranges in live.items():
        for rank, stream, start, end in ranges:
            index.setdefault((rank, stream), []).append((start, end, key))
    for p in parts:
        if holders(p.rank, p.stream, p.start, p.end):
            out.add(p.key)
    out |= contained((p.key, (p.rank, p.stream), p.start, p.end) for p in parts if p.key not in out)
    return out


def ranked(table: pa.Table, *, rank: int, stream: str) -> pa.Table:
    """A part's rows as a pack holds them: with their ``rank`` and ``_stream`` columns."""
    table = table.append_column("rank", pa.array([rank] * len(table), pa.int32()))
    return table.append_column(STREAM_COLUMN, pa.array([stream] * len(table), pa.string()))


def write_pack(directory: Path, *, kind: str, parts: Sequence[tuple[int, Part]], packs: Sequence[Path]) -> tuple[Path, int]:
    """Merge ``parts`` ((rank, part) of one run and kind) and ``packs`` into one pack in ``directory``;
    returns (its path, bytes written: 0 when it already existed). The caller deletes the sources after.
    Raises OSError on I/O failure."""
    tables, ranges = [], []
    for rank, part in parts:
        t = pq.read_table(part.path, partitioning=None).replace_schema_metadata(None)
        tables.append(ranked(t, rank=rank, stream=part.stream))
        ranges.append((rank, part.stream, part.start, part.end))
    for path in packs:
        f = pq.ParquetFile(path)
        ranges.extend(manifest_of(f.metadata.metadata) or ())
        tables.append(f.read().replace_schema_metadata(None))
    return write_tables(directory, kind=kind, tables=tables, ranges=ranges)


def write_tables(directory: Path, *, kind: str, tables: Sequence[pa.Table], ranges: Iterable[Range]
                 ) -> tuple[Path, int]:
    """Write one pack of ``tables`` (``ranked`` rows) holding the spool ``ranges``: its name from the
    merged ranges, rows sorted by step and rank, the manifest in its footer. Returns (path, bytes written:
    0 when the same pack was already there)."""
    merged = merge_ranges(ranges)
    text = json.dumps([list(r) for r in merged], separators=(",", ":"))
    final = directory / pack_name(hashlib.sha256(f"{kind}|{text}".encode()).hexdigest()[:24])
    if final.exists():
        return final, 0
    table = pa.concat_tables(tables, promote_options="default")
    keys = [c for c in ("step", "rank", "t_start", "t") if c in table.column_names]
    if len(table):
        table = table.take(pc.sort_indices(table, [(k, "ascending") for k in keys]))
    table = table.replace_schema_metadata({
        MANIFEST_KEY: text, f"{META_PREFIX}kind": kind, f"{META_PREFIX}schema_version": str(SCHEMA_VERSION),
        f"{META_PREFIX}source": "pack"})
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    strings = [f.name for f in table.schema if pa.types.is_string(f.type)]
    floats = [f.name for f in table.schema if pa.types.is_floating(f.type)]
    try:
        # As parts are written (agent.store.parts.write_part), plus statistics on rank: a page that
        # looks at some ranks skips the row groups of the others.
        pq.write_table(table, tmp, compression="zstd", use_dictionary=strings, use_byte_stream_split=floats,
                       write_statistics=keys, row_group_size=ROW_GROUP_ROWS)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final, final.stat().st_size


def rank_parts(run_dir: Path) -> list[tuple[int, Part]]:
    """Every part under ``tables/<kind>/run=<run>/rank=*``, with its rank."""
    out = []
    try:
        entries = list(os.scandir(run_dir))
    except OSError:
        return []
    for e in entries:
        rank = rank_of(e.name)
        if rank is not None and e.is_dir(follow_symlinks=False):
            out.extend((rank, p) for p in list_parts(Path(e.path)))
    return out


def pack_run(run_dir: Path, *, kind: str, final: Callable[[str, int], bool], merge_min: int, small_bytes: int
             ) -> tuple[int, int]:
    """One packing pass over a run's directory of one kind: the parts that are ``final(stream, end)`` go
    into a new pack; when ``merge_min`` packs smaller than ``small_bytes`` have gathered, they are merged
    into one (size tiers: each row is rewritten a few times, not once per pass). Sources are deleted after
    the pack is in place. Returns (packs written, bytes written). Raises OSError (the caller retries)."""
    written = nbytes = 0
    # What a crash or a retried write left inside existing packs (e.g. a GPU part written again after its
    # first copy was packed) goes first: merged into a new pack, its rows would be there twice for good.
    cleanup_run(run_dir)
    ready = [(rank, p) for rank, p in rank_parts(run_dir) if final(p.stream, p.end)]
    directory = packs_dir(run_dir)
    if ready:
        _, n = write_pack(directory, kind=kind, parts=ready, packs=())
        written, nbytes = written + 1, nbytes + n
        for _, p in ready:
            p.path.unlink(missing_ok=True)
    small = [p for p in list_packs(directory) if _size(p) < small_bytes]
    if len(small) >= merge_min:
        _, n = write_pack(directory, kind=kind, parts=(), packs=small)
        written, nbytes = written + 1, nbytes + n
        for p in small:
            p.unlink(missing_ok=True)
    return written, nbytes


def cleanup_run(run_dir: Path) -> int:
    """Delete what a crash left: temporary pack files, superseded packs and parts. Returns files removed."""
    removed = 0
    directory = packs_dir(run_dir)
    for e in list(os.scandir(directory)) if directory.is_dir() else ():
        if e.name.startswith(".pack-") and e.name.endswith(".tmp"):
            Path(e.path).unlink(missing_ok=True)
            removed += 1
    packs = [(p, manifest(p)) for p in list_packs(directory)]
    if not packs:
        return removed
    parts = [PartRef(p.path, rank, p.stream, p.start, p.end) for rank, p in rank_parts(run_dir)]
    for path in superseded(parts, packs):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 1 << 62


def covered_end(run_dirs: Iterable[Path], *, rank: int, stream: str, start: int) -> int:
    """Where an agent that lost its saved offsets resumes ``stream`` of ``rank``: the end of the furthest
    range the packs under ``run_dirs`` (one per kind) hold for it, or ``start``. Packs hold only final
    ranges (below the durable offset), so everything before that end was committed, gaps included: a
    chunk of rejected frames writes no part, and local retention deletes old packs."""
    end = start
    for run_dir in run_dirs:
        for path in list_packs(packs_dir(run_dir)):
            end = max([end, *(b for r, s, _, b in manifest(path) or () if r == rank and s == stream)])
    return end
