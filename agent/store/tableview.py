"""One kind's part files as one table: the SELECT that ``agent.store.reader.Store`` gives DuckDB.

The table has exactly the columns of the kind's part files (``agent.store.schema.stored_schema``) in
schema order, then ``run`` and ``rank`` from the path. Files that lack newer columns read as NULL of the
schema type. A restarted rank's re-executed steps keep only the newest attempt's rows (``select_sql``).
This module builds SQL text and checks footers; running it is the reader's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from meshscope.agent.store import packs
from meshscope.agent.contract import PACK_RE, PART_RE, SCHEMAS
from meshscope.agent.contract.storelayout import rank_dirname
from meshscope.agent.store.schema import stored_schema

if TYPE_CHECKING:  # the connection is the caller's; this module never opens one
    import duckdb

DUCK_TYPES = {pa.int64(): "BIGINT", pa.int32(): "INTEGER", pa.float64(): "DOUBLE", pa.string(): "VARCHAR",
              pa.bool_(): "BOOLEAN"}
# Partition keys come from the path; fixing their types stops DuckDB from turning run "0042" into 42.
HIVE_TYPES = "{'run': VARCHAR, 'rank': INTEGER}"
PACK_HIVE_TYPES = "{'run': VARCHAR}"  # packs (agent.store.packs) hold many ranks: rank is a column
# Kinds whose rows belong to a step, and the column that orders a rank's records in time.
STEP_KINDS = {"step": "t_start", "collective": "t_start", "span": "t_start", "memory": "t"}
# The stream of a row's part file, from the agent's own part-name pattern (DuckDB's RE2 reads the same
# syntax), matched on the path's last component.
_STREAM_SQL = (f"regexp_extract(filename, '(?:^|/){PART_RE.pattern.removeprefix('^')}', "
               f"{PART_RE.groupindex['stream']})")


def restarted(paths: list[Path], *, kind: str) -> bool:
    """Whether some rank of these files wrote more than one spool stream (a torchrun restart: one spool,
    hence one stream, per attempt). Part names carry the stream (``agent.store.parts``), so this costs
    a regex per file name, and runs that never restarted pay nothing more."""
    if kind not in STEP_KINDS:
        return False
    streams: dict[tuple[str, str], str] = {}
    for p in paths:
        m = PART_RE.match(p.name)
        if m is not None:
            pairs = [(p.parent.parent.name, p.parent.name, m["stream"])]  # (run=<run>, rank=<rank>), across roots
        elif PACK_RE.match(p.name):  # a pack's manifest lists its ranks' streams
            pairs = [(p.parent.parent.name, rank_dirname(r), stream) for r, stream, _, _ in packs.manifest(p) or ()]
        else:
            continue
        for run, rank, stream in pairs:
            if streams.setdefault((run, rank), stream) != stream:
                return True
    return False


def select_sql(con: duckdb.DuckDBPyConnection, *, kind: str, paths: list[Path], union: bool,
               newest_attempt: bool = False) -> str:
    """The SELECT that exposes one kind's files as the schema's columns plus ``run`` and ``rank``
    (``union``: bind the files by column name, for files of older agents).

    ``newest_attempt``: a restarted job re-executes the steps after its last checkpoint, so a rank's
    records of those steps exist once per attempt. Keep, per (run, rank, step), only the rows of the
    newest stream that has the step (streams ordered by their first record), as the job's final history
    does: every reader then counts each step once, and a step's collectives, spans and memory samples come
    from the same attempt as its step record. The old attempt's other rows (steps that were never
    re-executed, e.g. a crashed attempt's last steps before the checkpoint) stay."""
    inner = _plain_sql(con, kind=kind, paths=paths, union=union, filename=newest_attempt)
    if not newest_attempt:
        return inner
    t = STEP_KINDS[kind]
    return (f"SELECT * EXCLUDE (_stream, _stream_t0) FROM ("
            f"SELECT *, min(\"{t}\") OVER (PARTITION BY run, rank, _stream) AS _stream_t0 FROM ({inner})) "
            f"QUALIFY _stream_t0 = max(_stream_t0) OVER (PARTITION BY run, rank, step)")


def _plain_sql(con: duckdb.DuckDBPyConnection, *, kind: str, paths: list[Path], union: bool,
               filename: bool) -> str:
    schema = stored_schema(kind)
    if not paths:
        cols = ", ".join(f'CAST(NULL AS {DUCK_TYPES[f.type]}) AS "{f.name}"' for f in schema)
        return f"SELECT {cols}, CAST(NULL AS VARCHAR) AS run, CAST(NULL AS INTEGER) AS rank WHERE false"
    # Parts (one rank each: rank from the path) and packs (many ranks: rank a column) have different
    # hive keys, which one read_parquet refuses: one read each.
    # So do files whose paths hold different "key=value" components (a segment in the reader's cache
    # beside packs in a store whose own path has one).
    groups: dict[tuple[bool, frozenset[str]], list[Path]] = {}
    for p in paths:
        keys = frozenset(part.split("=", 1)[0] for part in p.parent.parts if "=" in part)
        groups.setdefault((bool(PACK_RE.match(p.name)), keys), []).append(p)
    selects = [_group_sql(con, schema=schema, paths=group, union=union, filename=filename, pack=pack)
               for (pack, _), group in sorted(groups.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1])))]
    return selects[0] if len(selects) == 1 else " UNION ALL ".join(f"({s})" for s in selects)


def _group_sql(con: duckdb.DuckDBPyConnection, *, schema: pa.Schema, paths: list[Path], union: bool,
               filename: bool, pack: bool) -> str:
    # ``run`` (and, for parts, ``rank``) come from the path (the agent drops them from part files, e.g.
    # the run kind's ``rank``), so they are appended once at the end.
    # Paths come from the reader's own listing (confined to its roots); quote them as SQL literals.
    listing = ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths)
    hive = PACK_HIVE_TYPES if pack else HIVE_TYPES

    def source(by_name: bool) -> str:
        return (f"read_parquet([{listing}], hive_partitioning = true, union_by_name = {str(by_name).lower()}, "
                f"hive_types = {hive}, filename = {str(filename and not pack).lower()})")

    # Without union_by_name DuckDB binds to the first file's schema (cheap: one footer); union_by_name
    # reads every footer first, which costs ~0.2 s at 1,024 files, so it is the fallback. The first
    # file's column names come from its footer directly: a DESCRIBE would make DuckDB bind the whole
    # list of files (~50 ms at 1,024 files) just for them; DuckDB says why a footer is unreadable.
    present = _columns(paths[0]) if not union else None
    if present is None:
        present = {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {source(union)}").fetchall()}
    if not union and any(f.name not in present for f in schema):  # the first file is an old one
        union = True
        present = {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {source(True)}").fetchall()}
    cols = []
    for f in schema:
        duck = DUCK_TYPES[f.type]
        # Quoted: "group" is a column name and an SQL keyword. A column no file has becomes a typed NULL.
        cols.append(f'CAST("{f.name}" AS {duck}) AS "{f.name}"' if f.name in present
                    else f'CAST(NULL AS {duck}) AS "{f.name}"')
    stream = (f", {packs.STREAM_COLUMN} AS _stream" if pack else f", {_STREAM_SQL} AS _stream") if filename else ""
    rank = "CAST(rank AS INTEGER) AS rank" if pack else "rank"
    return f"SELECT {', '.join(cols)}, run, {rank}{stream} FROM {source(union)}"


def _columns(path: Path) -> set[str] | None:
    """Column names in a Parquet file's footer, plus the hive keys of its path (as DuckDB's DESCRIBE with
    ``hive_partitioning`` lists them); None when the footer cannot be read."""
    try:
        names = set(pq.read_schema(path).names)
    except (OSError, pa.ArrowException):
        return None
    return names | {part.split("=", 1)[0] for part in path.parts if "=" in part}


def readable(path: Path, *, kind: str) -> bool:
    """Footer readable and every known column of a compatible type (what the reader checks only once a
    read has failed, to find the files to skip)."""
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException):
        return False
    expected = SCHEMAS[kind]
    for field in schema:
        i = expected.get_field_index(field.name)
        if i >= 0 and not _compatible(field.type, expected.field(i).type):
            return False
    return True


def _compatible(found: pa.DataType, expected: pa.DataType) -> bool:
    if found == expected:
        return True
    if pa.types.is_integer(expected):
        return pa.types.is_integer(found)
    if pa.types.is_floating(expected):
        return pa.types.is_floating(found) or pa.types.is_integer(found)
    if pa.types.is_string(expected):
        return pa.types.is_string(found) or pa.types.is_large_string(found) or pa.types.is_dictionary(found)
    return False
