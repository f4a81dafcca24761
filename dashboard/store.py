"""Read-only access to a run store: the one place where the dashboard touches the file system.

Layout (written by the node agent, see ``agent.collector.store``)::

    <root>/tables/<kind>/run=<run>/rank=<rank>/part-*.parquet

Several stores read as one: a multi-node job has one agent per node, each writing the ranks of its node
into that node's store, so ``Store.open_many([A, B])`` lists and queries the union. A run present in
several stores is one run with the ranks of all of them.

Restarts: a torchrun restart resumes from the last checkpoint, so the steps after it run again and a
rank's records of those steps exist once per attempt (one spool stream per attempt, in the part names).
The step-indexed kinds (step, collective, span, memory) then keep, per (run, rank, step), the newest
attempt's rows only (``_view_sql``), in one store or across several (a rank moved to another node).

Confinement, per root: each root is resolved once; run names come only from listing ``run=*``
directories; kinds come only from ``agent.schema.KINDS``; below a root no symlink is followed (a link
that could lead out is ignored), so every file handed to DuckDB lies under one of the roots. User input
never becomes a path or SQL text: it only selects among listed names, and values go to DuckDB as bound
parameters.

Robustness: a kind may be missing entirely (an empty, typed view stands in), files may lack newer
columns (NULL of the schema type is projected), and a file may be corrupt or of the wrong schema (it is
skipped, and the skipped paths are reported in ``DataFrame.attrs["skipped_files"]`` so the page can say
so). A part the agent's compaction deletes between listing and reading is handled by listing again.
Anything else DuckDB rejects becomes a ``StoreError`` with a one-line message.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from meshscope.agent.contract import KINDS, PART_RE, SCHEMAS

SKIPPED = "skipped_files"  # key in DataFrame.attrs

_DUCK_TYPES = {pa.int64(): "BIGINT", pa.int32(): "INTEGER", pa.float64(): "DOUBLE", pa.string(): "VARCHAR",
               pa.bool_(): "BOOLEAN"}
# Partition keys come from the path; fixing their types stops DuckDB from turning run "0042" into 42.
_HIVE_TYPES = "{'run': VARCHAR, 'rank': INTEGER}"
_VIEW_NAME = re.compile(r"^[a-z_]+$")
PARTITION_KEYS = ("run", "rank")
# What unreadable or mismatched files raise. Parser/binder errors are bugs in our SQL and propagate.
_DATA_ERRORS = (duckdb.IOException, duckdb.InvalidInputException, duckdb.ConversionException,
                duckdb.SerializationException)
# kind -> (SQL condition, its params, the columns to keep); see Store.query_all.
Materialize = tuple[str, Sequence, Sequence[str]]


class StoreError(Exception):
    """A store that cannot be read (missing directory, unreadable data). The message is for the user."""


@dataclass(frozen=True, slots=True)
class Store:
    """One or more store roots, resolved, read as one store. Construct with ``Store.open`` (one root) or
    ``Store.open_many`` (the stores of several nodes)."""

    roots: tuple[Path, ...]

    @classmethod
    def open(cls, path: str | os.PathLike) -> Store:
        return cls.open_many([path])

    @classmethod
    def open_many(cls, paths: Iterable[str | os.PathLike]) -> Store:
        """The union of the stores at ``paths`` (order kept; the same directory twice counts once)."""
        roots: list[Path] = []
        seen: set[tuple[int, int]] = set()
        for path in paths:
            root = Path(path).expanduser().resolve()
            if not root.is_dir():
                raise StoreError(f"store directory not found: {path}")
            st = root.stat()  # (device, inode): one directory reached by two names is read once
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                roots.append(root)
        if not roots:
            raise StoreError("no store directory given")
        _check_hive_keys(roots)
        return cls(roots=tuple(roots))

    @property
    def root(self) -> Path:
        """The root of a single store (a store over several roots has no one root: use ``roots``)."""
        if len(self.roots) != 1:
            raise ValueError(f"this store reads {len(self.roots)} roots; use .roots")
        return self.roots[0]

    def describe(self) -> str:
        """The roots for messages, each as a Markdown code span, comma-separated."""
        return ", ".join(f"`{r}`" for r in self.roots)

    # ---------------------------------------------------------------- listing
    def runs(self) -> list[str]:
        """Run names present under any kind in any root, sorted."""
        names: set[str] = set()
        for kind in KINDS:
            names.update(self._run_dirs(kind))
        return sorted(names)

    def _run_dirs(self, kind: str) -> dict[str, list[Path]]:
        """run name -> its directories of this kind, one per root that has it."""
        out: dict[str, list[Path]] = {}
        for root in self.roots:
            tables = root / "tables"
            base = tables / kind
            # Neither <root>/tables nor <root>/tables/<kind> may be a link: nothing below a root is followed.
            if tables.is_symlink() or not base.is_dir() or base.is_symlink():
                continue
            for name, path in _entries(base, prefix="run=", want_dir=True):
                out.setdefault(name[len("run="):], []).append(path)
        return out

    def files(self, kind: str, *, runs: Iterable[str]) -> list[Path]:
        """Parquet files of one kind for the given runs, from every root (names not in the listing are
        ignored)."""
        if kind not in KINDS:
            raise ValueError(f"unknown record kind {kind!r}; expected one of {', '.join(KINDS)}")
        dirs = self._run_dirs(kind)
        out: set[Path] = set()
        for run in runs:
            for run_dir in dirs.get(run, ()):
                for _, rank_dir in _entries(run_dir, prefix="rank=", want_dir=True):
                    out.update(path for name, path in _entries(rank_dir, prefix="", want_dir=False)
                               if name.endswith(".parquet"))
        return sorted(out)

    def _display(self, path: Path) -> str:
        """A file for messages: relative to its root, prefixed with the root when there are several."""
        root = next(r for r in self.roots if path.is_relative_to(r))
        rel = str(path.relative_to(root))
        return rel if len(self.roots) == 1 else f"{root}/{rel}"

    # ---------------------------------------------------------------- querying
    def query(self, sql: str, *, kinds: Sequence[str], runs: Sequence[str],
              params: Sequence | None = None) -> pd.DataFrame:
        """Run ``sql`` with one view per kind (named after the kind) over the selected runs' files.

        The views have exactly the schema's columns plus ``run`` and ``rank``. Corrupt files are skipped
        and listed in ``attrs["skipped_files"]``.
        """
        return self.query_all([(sql, params)], kinds=kinds, runs=runs)[0]

    def query_all(self, statements: Sequence[tuple[str, Sequence | None]], *, kinds: Sequence[str],
                  runs: Sequence[str], materialize: Mapping[str, Materialize] | None = None,
                  ) -> list[pd.DataFrame]:
        """Several (sql, params) over the same kinds, on one connection. Returns one frame per statement
        (empty for statements that return no rows, e.g. DDL).

        ``materialize``: kind -> (SQL condition, params, columns). That kind becomes a temporary table of
        those columns of the rows matching the condition, read once; otherwise it is a view and every
        statement that uses it scans the files again. A scan costs opening every file (1,024 at 1,024
        ranks) plus decoding the columns it reads, so several aggregates over the same rows share one
        read of just the columns they need. The table's rows are in no particular order (DuckDB fills it
        20-40 % faster when it need not keep the files' order), so statements over it must not rely on
        one: aggregate, or ORDER BY."""
        for attempt in range(3):
            sources = {kind: self.files(kind, runs=runs) for kind in kinds}
            try:
                frames, skipped = self._read(statements, sources=sources, materialize=materialize or {})
                break
            except _DATA_ERRORS as err:  # only when listed files vanished (see _read)
                if attempt == 2:
                    raise StoreError(f"could not read the store: {_first_line(err)}") from err
        for df in frames:
            df.attrs[SKIPPED] = skipped
        return frames

    def _read(self, statements, *, sources: dict[str, list[Path]],
              materialize: Mapping[str, Materialize]) -> tuple[list[pd.DataFrame], list[str]]:
        """Fast path first; then by column name; then without the files whose footer is unreadable."""
        run = functools.partial(self._execute, statements, sources=sources, materialize=materialize)
        try:
            return run(union=False), []
        except _DATA_ERRORS as err:
            if any(not p.exists() for paths in sources.values() for p in paths):
                # The agent compacts parts (writes the merged file, then deletes the sources), so a
                # listed file can vanish before it is read: the caller lists again.
                raise
            first = err
        try:
            # Files of an older agent may lack columns ("schema mismatch"): read by name instead.
            return run(union=True), []
        except _DATA_ERRORS as err:
            first = err
        # Only now pay for checking every footer: the common case stays one scan.
        skipped = []
        for kind, paths in sources.items():
            good = [p for p in paths if _readable(p, kind)]
            skipped += [self._display(p) for p in paths if p not in good]
            sources[kind] = good
        if not skipped:
            raise StoreError(f"could not read the store: {_first_line(first)}") from first
        try:
            return run(union=True), skipped
        except _DATA_ERRORS as again:
            raise StoreError(f"could not read the store: {_first_line(again)}") from again

    def _execute(self, statements, *, sources: dict[str, list[Path]], union: bool,
                 materialize: Mapping[str, Materialize]) -> list[pd.DataFrame]:
        # A fresh in-memory connection per call: DuckDB connections are not shared across Streamlit's
        # script threads, and opening one costs well under a millisecond.
        with duckdb.connect(config={"threads": min(4, os.cpu_count() or 1)}) as con:
            for kind, paths in sources.items():
                assert _VIEW_NAME.match(kind)
                select = _view_sql(con, kind, paths, union=union, newest_attempt=_restarted(kind, paths))
                if kind in materialize:
                    cond, params, columns = materialize[kind]
                    cols = ", ".join(f'"{c}"' for c in columns)
                    con.execute("SET preserve_insertion_order = false")  # see query_all
                    con.execute(f"CREATE TEMP TABLE {kind} AS SELECT {cols} FROM ({select}) WHERE {cond}", params)
                    con.execute("SET preserve_insertion_order = true")  # raw rows come back in file order
                else:
                    con.execute(f"CREATE TEMP VIEW {kind} AS {select}")
            frames = []
            for sql, params in statements:
                con.execute(sql, params)
                frames.append(con.df() if con.description else pd.DataFrame())
            return frames


def _check_hive_keys(roots: Sequence[Path]) -> None:
    """DuckDB reads every ``key=value`` component of a file's path as a partition key and refuses files
    whose key sets differ ("Hive partition mismatch"); roots whose own paths differ in such components
    cannot be read together, so say so now rather than fail on the first query."""
    keys = [frozenset(part.split("=", 1)[0] for part in r.parts if "=" in part) for r in roots]
    for root, k in zip(roots[1:], keys[1:]):
        if k != keys[0]:
            raise StoreError(f"stores {roots[0]} and {root} cannot be read together: their paths differ in "
                             f"'key=value' directory names ({', '.join(sorted(k ^ keys[0]))}), which the "
                             "reader takes for partition keys; rename one")


def _entries(directory: Path, *, prefix: str, want_dir: bool) -> list[tuple[str, Path]]:
    """Directory entries by name prefix, never following symlinks: with each root resolved once and
    every later component a real directory entry, no path can leave its root (and no per-file
    ``resolve()`` is needed, which matters at thousands of files)."""
    out = []
    with os.scandir(directory) as it:
        for e in it:
            if e.name.startswith(prefix) and not e.is_symlink() and (
                    e.is_dir(follow_symlinks=False) if want_dir else e.is_file(follow_symlinks=False)):
                out.append((e.name, Path(e.path)))
    return out


# Kinds whose rows belong to a step, and the column that orders a rank's records in time.
_STEP_KINDS = {"step": "t_start", "collective": "t_start", "span": "t_start", "memory": "t"}
# The stream of a row's part file, from the agent's own part-name pattern (DuckDB's RE2 reads the same
# syntax), matched on the path's last component.
_STREAM_SQL = (f"regexp_extract(filename, '(?:^|/){PART_RE.pattern.removeprefix('^')}', "
               f"{PART_RE.groupindex['stream']})")


def _restarted(kind: str, paths: list[Path]) -> bool:
    """Whether some rank of these files wrote more than one spool stream (a torchrun restart: one spool,
    hence one stream, per attempt). Part names carry the stream (``agent.collector.parts``), so this costs
    a regex per file name, and runs that never restarted pay nothing more."""
    if kind not in _STEP_KINDS:
        return False
    streams: dict[tuple[str, str], str] = {}
    for p in paths:
        m = PART_RE.match(p.name)
        if m is None:
            continue
        key = (p.parent.parent.name, p.parent.name)  # (run=<run>, rank=<rank>), across roots
        if streams.setdefault(key, m["stream"]) != m["stream"]:
            return True
    return False


def _view_sql(con: duckdb.DuckDBPyConnection, kind: str, paths: list[Path], *, union: bool,
              newest_attempt: bool = False) -> str:
    """The SELECT that exposes one kind's files as the schema's columns plus ``run`` and ``rank``.

    ``newest_attempt``: a restarted job re-executes the steps after its last checkpoint, so a rank's
    records of those steps exist once per attempt. Keep, per (run, rank, step), only the rows of the
    newest stream that has the step (streams ordered by their first record), as the job's final history
    does: every page then counts each step once, and a step's collectives, spans and memory samples come
    from the same attempt as its step record. The old attempt's other rows (steps that were never
    re-executed, e.g. a crashed attempt's last steps before the checkpoint) stay."""
    inner = _plain_view_sql(con, kind, paths, union=union, filename=newest_attempt)
    if not newest_attempt:
        return inner
    t = _STEP_KINDS[kind]
    return (f"SELECT * EXCLUDE (_stream, _stream_t0) FROM ("
            f"SELECT *, min(\"{t}\") OVER (PARTITION BY run, rank, _stream) AS _stream_t0 FROM ({inner})) "
            f"QUALIFY _stream_t0 = max(_stream_t0) OVER (PARTITION BY run, rank, step)")


def _plain_view_sql(con: duckdb.DuckDBPyConnection, kind: str, paths: list[Path], *, union: bool,
                    filename: bool) -> str:
    # ``run`` and ``rank`` come from the path (the agent drops them from the files, e.g. the run kind's
    # ``rank``), so they are appended once at the end.
    schema = [f for f in SCHEMAS[kind] if f.name not in PARTITION_KEYS]
    if not paths:
        cols = ", ".join(f'CAST(NULL AS {_DUCK_TYPES[f.type]}) AS "{f.name}"' for f in schema)
        return f"SELECT {cols}, CAST(NULL AS VARCHAR) AS run, CAST(NULL AS INTEGER) AS rank WHERE false"
    # Paths come from our own listing (confined to the roots); quote them as SQL literals.
    listing = ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths)

    def source(by_name: bool) -> str:
        return (f"read_parquet([{listing}], hive_partitioning = true, union_by_name = {str(by_name).lower()}, "
                f"hive_types = {_HIVE_TYPES}, filename = {str(filename).lower()})")

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
        duck = _DUCK_TYPES[f.type]
        # Quoted: "group" is a column name and an SQL keyword. A column no file has becomes a typed NULL.
        cols.append(f'CAST("{f.name}" AS {duck}) AS "{f.name}"' if f.name in present
                    else f'CAST(NULL AS {duck}) AS "{f.name}"')
    stream = f", {_STREAM_SQL} AS _stream" if filename else ""
    return f"SELECT {', '.join(cols)}, run, rank{stream} FROM {source(union)}"


def _columns(path: Path) -> set[str] | None:
    """Column names in a Parquet file's footer, plus the hive keys of its path (as DuckDB's DESCRIBE with
    ``hive_partitioning`` lists them); None when the footer cannot be read."""
    try:
        names = set(pq.read_schema(path).names)
    except (OSError, pa.ArrowException):
        return None
    return names | {part.split("=", 1)[0] for part in path.parts if "=" in part}


def _readable(path: Path, kind: str) -> bool:
    """Footer readable and every known column of a compatible type."""
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
