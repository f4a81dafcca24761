"""Parquet part files of the run store: exactly-once writes, crash cleanup and compaction.

Exactly once across agent crashes rests on three rules:

1. A part holds the records of one byte range ``[start, end)`` of one spool stream and is named after it
   (``part-<stream>-<start>-<end>.parquet``, see ``agent.contract.part_name``; the range also in the Parquet
   key-value metadata). It is written to a hidden temporary file and renamed into place, so it exists whole
   or not at all.
2. The agent advances its durable offset for a spool only after every part of the range is in place.
3. On restart, before reading at the durable offset ``s``, the agent looks for parts starting at ``s``:
   if there are, that range was written (possibly only for some kinds) by a process that died before
   saving the offset; it replays exactly ``[s, end)``, writes only the parts that are missing, and moves
   on to ``end``.

Compaction merges runs of small, adjacent parts of one stream whose range lies below the durable offset
(so rule 3 never needs them) into one part covering the union. It writes the merged part first and then
deletes the sources; a crash in between leaves parts contained in another part of the same stream, which
``cleanup_partition`` removes at the next start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Hashable, Iterable
from typing import Callable, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from meshscope.agent.store.schema import PARTITION_KEYS
from meshscope.agent.contract import PART_RE, SCHEMA_VERSION, part_name

META_PREFIX = "meshscope."
K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class Part:
    path: Path
    stream: str
    start: int
    end: int
    size: int


def list_parts(directory: Path) -> list[Part]:
    parts = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        m = PART_RE.match(entry.name)
        if m:
            try:
                size = entry.stat().st_size
            except OSError:
                continue  # removed meanwhile (compaction)
            parts.append(Part(Path(entry.path), m["stream"], int(m["start"]), int(m["end"]), size))
    return sorted(parts, key=lambda p: (p.stream, p.start, p.end))


def read_part_range(path: Path) -> tuple[int, int]:
    """The (start, end) recorded in a part's key-value metadata."""
    meta = pq.read_metadata(path).metadata or {}
    return int(meta[b"meshscope.start"]), int(meta[b"meshscope.end"])


def write_part(
    directory: Path, table: pa.Table, *, kind: str, stream: str, start: int, end: int, source: str,
) -> int:
    """Write ``table`` as the part of ``[start, end)`` of ``stream``; returns bytes written, 0 when the
    part already exists (a replay after a crash). Raises OSError on I/O failure (the caller retries)."""
    name = part_name(stream, start, end)
    final = directory / name
    if final.exists():
        return 0
    directory.mkdir(parents=True, exist_ok=True)
    drop = [key for key in PARTITION_KEYS if key in table.column_names]
    if drop:
        table = table.drop_columns(drop)
    table = table.replace_schema_metadata({
        f"{META_PREFIX}kind": kind, f"{META_PREFIX}stream": stream, f"{META_PREFIX}start": str(start),
        f"{META_PREFIX}end": str(end), f"{META_PREFIX}source": source,
        f"{META_PREFIX}schema_version": str(SCHEMA_VERSION),
    })
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    strings = [f.name for f in table.schema if pa.types.is_string(f.type)]
    floats = [f.name for f in table.schema if pa.types.is_floating(f.type)]
    stats = [c for c in ("step", "t_start", "t", "t_end") if c in table.column_names]
    try:
        # Measured on collective records (bench/agent_ingest.py, one core): zstd with byte-stream-split
        # floats writes ~3.2 M rows/s at 7.1 MB per 200k rows, vs 1.8 M rows/s and 8.2 MB with the
        # defaults. Dictionaries only for the (low-cardinality) strings; statistics only for the step and
        # time columns readers filter on.
        pq.write_table(table, tmp, compression="zstd", use_dictionary=strings, use_byte_stream_split=floats,
                       write_statistics=stats)
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return final.stat().st_size


def cleanup_partition(directory: Path) -> int:
    """Remove leftovers of a crash: temporary files, and parts contained in another part of the same
    stream (sources of a compaction that finished writing). Returns how many files were removed."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if entry.name.startswith(".part-") and entry.name.endswith(".tmp"):
            removed += _unlink(Path(entry.path))
    for path in contained((p.path, p.stream, p.start, p.end) for p in list_parts(directory)):
        removed += _unlink(path)
    return removed


def contained(ranges: Iterable[tuple[K, Hashable, int, int]]) -> set[K]:
    """Keys of the ``(key, stream, start, end)`` ranges contained in another range of the same stream:
    the sources of a compaction whose merged part exists. The one rule for the local store's cleanup and
    for the bucket's readers and uploader (``agent.store.objectstore``)."""
    by_stream: dict[Hashable, list[tuple[int, int, K]]] = {}
    for key, stream, start, end in ranges:
        by_stream.setdefault(stream, []).append((start, -end, key))
    out: set[K] = set()
    for group in by_stream.values():
        group.sort(key=lambda r: (r[0], r[1]))  # by start, the widest first at a tie
        reach = -1  # the furthest end among the ranges before, all of which start at or before this one
        for start, neg_end, key in group:
            if -neg_end <= reach:
                out.add(key)
            reach = max(reach, -neg_end)
    return out


def compact_partition(
    directory: Path, *, kind: str, durable: Callable[[str], float], small_bytes: int, target_bytes: int,
    min_parts: int,
) -> tuple[int, int]:
    """Merge runs of at least ``min_parts`` adjacent small parts (file size < ``small_bytes``, range end
    at or below ``durable(stream)``) into parts of at most about ``target_bytes``. Returns (parts
    written, bytes written)."""
    written = nbytes = 0
    parts = list_parts(directory)
    by_stream: dict[str, list[Part]] = {}
    for p in parts:
        by_stream.setdefault(p.stream, []).append(p)
    for stream, stream_parts in by_stream.items():
        limit = durable(stream)
        run: list[Part] = []
        # Only runs of *adjacent* parts: a merged range must not contain a part that is not merged,
        # or cleanup_partition would take it for a compaction source.
        for p in stream_parts + [None]:
            eligible = p is not None and p.size < small_bytes and p.end <= limit
            if eligible and sum(x.size for x in run) + p.size <= target_bytes:
                run.append(p)
                continue
            if len(run) >= min_parts:
                n = _merge(directory, run, kind=kind, stream=stream)
                written, nbytes = written + 1, nbytes + n
            run = [p] if eligible else []
    return written, nbytes


def _merge(directory: Path, run: list[Part], *, kind: str, stream: str) -> int:
    table = pa.concat_tables([pq.ParquetFile(p.path).read() for p in run], promote_options="default")
    n = write_part(directory, table.replace_schema_metadata(None), kind=kind, stream=stream,
                   start=run[0].start, end=run[-1].end, source="compaction")
    for p in run:
        _unlink(p.path)
    return n


def _unlink(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except FileNotFoundError:
        return 0

