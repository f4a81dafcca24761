"""The one reader of the run store: ``Store`` (SQL over the store's kinds) and ``read_table`` (one kind
as a DataFrame) for everything that reads it: the dashboard, ``meshscope export-trace``, ``meshscope
sweep`` and the tests.

Layout (written by the node agent, see ``agent.store.schema``)::

    <root>/tables/<kind>/run=<run>/rank=<rank>/part-*.parquet

Several stores read as one: a multi-node job has one agent per node, each writing the ranks of its node
into that node's store, so ``Store.open_many([A, B])`` lists and queries the union. A run present in
several stores is one run with the ranks of all of them.

Restarts: a torchrun restart resumes from the last checkpoint, so the steps after it run again and a
rank's records of those steps exist once per attempt (one spool stream per attempt, in the part names).
The step-indexed kinds (step, collective, span, memory) then keep, per (run, rank, step), the newest
attempt's rows only (``agent.store.tableview.select_sql``), in one store or across several (a rank
moved to another node). ``all_attempts=True`` reads every stored row instead (what the exactly-once
checks compare with the spools).

Confinement, per root: each root is resolved once; run names come only from listing ``run=*``
directories; kinds come only from ``agent.schema.KINDS``; below a root no symlink is followed (a link
that could lead out is ignored), so every file handed to DuckDB lies under one of the roots, or is a
segment the reader wrote into its own cache (``agent.store.compact``). User input
never becomes a path or SQL text: it only selects among listed names, and values go to DuckDB as bound
parameters.

Robustness: a kind may be missing entirely (an empty, typed view stands in), files may lack newer
columns (NULL of the schema type is projected), and a file may be corrupt or of the wrong schema (it is
skipped, and the skipped paths are reported in ``DataFrame.attrs["skipped_files"]`` so a page can say
so). A part the agent's compaction deletes between listing and reading is handled by listing again.
Anything else DuckDB rejects becomes a ``StoreError`` with a one-line message.

DuckDB and pandas load with this module: the agent's ingest path (``agent.collector.ingest``) never
imports it.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pandas as pd

from meshscope.agent.store import compact, duckconn, packs, tableview
from meshscope.agent.store.objectstore import is_remote
from meshscope.agent.store.schema import PARTITION_KEYS, stored_schema
from meshscope.agent.contract import KINDS, PACK_RE, PART_RE, SCHEMAS, check_run_name, is_run_name
from meshscope.agent.contract.storelayout import PACKS, StoreLayout, rank_of, run_of

SKIPPED = "skipped_files"  # key in DataFrame.attrs

_VIEW_NAME = re.compile(r"^[a-z_]+$")
# What unreadable or mismatched files raise. Parser/binder errors are bugs in our SQL and propagate.
_DATA_ERRORS = (duckdb.IOException, duckdb.InvalidInputException, duckdb.ConversionException,
                duckdb.SerializationException)
# kind -> (SQL condition, its params, the columns to keep); see Store.query_all.
Materialize = tuple[str, Sequence, Sequence[str]]
VIEW_MAX_FILES = 4  # a kind read from at most this many files is not materialized (see _execute)


class StoreError(Exception):
    """A store that cannot be read (missing directory, unreadable data). The message is for the user."""


@dataclass(frozen=True, slots=True)
class Store:
    """One or more store roots, resolved, read as one store. Construct with ``Store.open`` (one root) or
    ``Store.open_many`` (the stores of several nodes)."""

    roots: tuple[Path, ...]
    # What each root was opened as: its directory, or the s3:// URL whose local cache it is. Re-opening a
    # Store from its sources syncs the caches again (``agent.store.remote``).
    sources: tuple[str, ...] = ()
    # Segments in the reader's cache in place of many packs (``agent.store.compact``): one of MODES.
    compaction: str = "use"

    def __post_init__(self) -> None:
        if self.compaction not in compact.MODES:
            raise ValueError(f"compaction must be one of {', '.join(compact.MODES)}, not {self.compaction!r}")

    @classmethod
    def open(cls, path: str | os.PathLike, *, compaction: str = "use", background_sync: bool = False) -> Store:
        return cls.open_many([path], compaction=compaction, background_sync=background_sync)

    @classmethod
    def open_many(cls, paths: Iterable[str | os.PathLike], *, compaction: str = "use",
                  background_sync: bool = False) -> Store:
        """The union of the stores at ``paths`` (order kept; the same directory twice counts once). A path
        may be an ``s3://bucket/prefix`` URL: its parts are synced into a local cache first, or, with
        ``background_sync``, on a thread while the cache as last synced is read
        (``agent.store.remote.sync_in_background``: the dashboard). ``compaction``: see
        ``agent.store.compact``."""
        roots: list[Path] = []
        sources: list[str] = []
        seen: set[tuple[int, int]] = set()
        for path in paths:
            if is_remote(path):
                root, source = _synced(str(path), background=background_sync), str(path)
            else:
                root = Path(path).expanduser().resolve()
                source = str(root)
                if not root.is_dir():
                    raise StoreError(f"store directory not found: {path}")
            st = root.stat()  # (device, inode): one directory reached by two names is read once
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                roots.append(root)
                sources.append(source)
        if not roots:
            raise StoreError("no store directory given")
        _check_hive_keys(roots)
        return cls(roots=tuple(roots), sources=tuple(sources), compaction=compaction)

    def local_roots(self) -> tuple[Path, ...]:
        """The roots that are store directories (not caches of a bucket): where spools may wait for a
        catch-up (``agent.collector.catchup``)."""
        return tuple(r for r, s in zip(self.roots, self.sources or map(str, self.roots)) if not is_remote(s))

    @property
    def root(self) -> Path:
        """The root of a single store (a store over several roots has no one root: use ``roots``)."""
        if len(self.roots) != 1:
            raise ValueError(f"this store reads {len(self.roots)} roots; use .roots")
        return self.roots[0]

    def describe(self) -> str:
        """The roots for messages, each as a Markdown code span, comma-separated."""
        return ", ".join(f"`{r}`" for r in (self.sources or self.roots))

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
            layout = StoreLayout.of(root)
            tables, base = Path(layout.tables), Path(layout.table(kind))
            # Neither <root>/tables nor <root>/tables/<kind> may be a link: nothing below a root is followed.
            if tables.is_symlink() or not base.is_dir() or base.is_symlink():
                continue
            for name, path in _entries(base, prefix="", want_dir=True):
                run = run_of(name)
                if run is not None and is_run_name(run):  # the one run-name rule: no writer makes others
                    out.setdefault(run, []).append(path)
        return out

    def files(self, kind: str, *, runs: Iterable[str]) -> list[Path]:
        """Parquet files of one kind for the given runs, from every root (names not in the listing are
        ignored)."""
        if kind not in KINDS:
            raise ValueError(f"unknown record kind {kind!r}; expected one of {', '.join(KINDS)}")
        dirs = self._run_dirs(kind)
        out: list[Path] = []
        for run in runs:
            if run in dirs:  # only listed names become paths (the cache's segment directory included)
                out += self._compacted(self._run_files(dirs[run], kind=kind), kind=kind, run=run)
        return sorted(out)

    def _run_files(self, run_dirs: Sequence[Path], *, kind: str) -> list[Path]:
        out: set[Path] = set()
        parts: list[packs.PartRef] = []
        found: list[Path] = []
        for run_dir in run_dirs:
            for name, sub in _entries(run_dir, prefix="", want_dir=True):
                rank = rank_of(name)
                if rank is None:
                    continue
                for file, path in _entries(sub, prefix="", want_dir=False):
                    if file.endswith(".parquet"):
                        out.add(path)
                        m = PART_RE.match(file)
                        if m:
                            parts.append(packs.PartRef(path, rank, m["stream"], int(m["start"]), int(m["end"])))
            for name, pack_dir in _entries(run_dir, prefix=PACKS, want_dir=True):
                if name == PACKS:
                    found += [path for file, path in _entries(pack_dir, prefix="pack-", want_dir=False)
                              if PACK_RE.match(file)]
        if found:  # what a crash or a cleanup in progress left beside the packs is read once
            out.update(found)
            out -= _superseded(tuple(parts), tuple(sorted(found)))
        return sorted(out)

    def _compacted(self, files: list[Path], *, kind: str, run: str) -> list[Path]:
        """``files`` with segments in place of the packs they hold, building new ones as the mode says."""
        if self.compaction == "off":
            return files
        directory = compact.segment_dir(self.roots, kind=kind, run=run)
        plan = compact.plan(files, directory=directory, now=time.time(),
                            settle_s=0.0 if self.compaction == "now" else None)
        if plan.todo and self.compaction == "now":
            compact.try_build(plan.todo, directory=directory, kind=kind, threads=min(4, os.cpu_count() or 1))
            plan = compact.plan(files, directory=directory, now=time.time(), settle_s=0.0)
        elif plan.todo and self.compaction == "background":
            compact.submit(plan.todo, directory=directory, kind=kind)
        return plan.files

    def _display(self, path: Path) -> str:
        """A file for messages: relative to its root, prefixed with the root when there are several."""
        root = next((r for r in self.roots if path.is_relative_to(r)), None)
        if root is None:  # a segment in the reader's cache (agent.store.compact)
            return str(path)
        rel = str(path.relative_to(root))
        return rel if len(self.roots) == 1 else f"{root}/{rel}"

    # ---------------------------------------------------------------- querying
    def query(self, sql: str, *, kinds: Sequence[str], runs: Sequence[str], params: Sequence | None = None,
              all_attempts: bool = False) -> pd.DataFrame:
        """Run ``sql`` with one view per kind (named after the kind) over the selected runs' files.

        The views have exactly the schema's columns plus ``run`` and ``rank``. Corrupt files are skipped
        and listed in ``attrs["skipped_files"]``. ``all_attempts``: see the module docstring.
        """
        return self.query_all([(sql, params)], kinds=kinds, runs=runs, all_attempts=all_attempts)[0]

    def query_all(self, statements: Sequence[tuple[str, Sequence | None]], *, kinds: Sequence[str],
                  runs: Sequence[str], materialize: Mapping[str, Materialize] | None = None,
                  all_attempts: bool = False) -> list[pd.DataFrame]:
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
                frames, skipped = self._read(statements, sources=sources, materialize=materialize or {},
                                             all_attempts=all_attempts)
                break
            except _DATA_ERRORS as err:  # only when listed files vanished (see _read)
                if attempt == 2:
                    raise StoreError(f"could not read the store: {_first_line(err)}") from err
        for df in frames:
            df.attrs[SKIPPED] = skipped
        return frames

    def _read(self, statements, *, sources: dict[str, list[Path]], materialize: Mapping[str, Materialize],
              all_attempts: bool) -> tuple[list[pd.DataFrame], list[str]]:
        """Fast path first; then by column name; then without the files whose footer is unreadable."""
        run = functools.partial(self._execute, statements, sources=sources, materialize=materialize,
                                all_attempts=all_attempts)
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
            good = [p for p in paths if tableview.readable(p, kind=kind)]
            skipped += [self._display(p) for p in paths if p not in good]
            sources[kind] = good
        if not skipped:
            raise StoreError(f"could not read the store: {_first_line(first)}") from first
        try:
            return run(union=True), skipped
        except _DATA_ERRORS as again:
            raise StoreError(f"could not read the store: {_first_line(again)}") from again

    def _execute(self, statements, *, sources: dict[str, list[Path]], union: bool,
                 materialize: Mapping[str, Materialize], all_attempts: bool) -> list[pd.DataFrame]:
        # A fresh in-memory connection per call: DuckDB connections are not shared across Streamlit's
        # script threads, and opening one costs well under a millisecond.
        with duckconn.connect(config={"threads": min(4, os.cpu_count() or 1)}) as con:
            for kind, paths in sources.items():
                assert _VIEW_NAME.match(kind)
                newest = not all_attempts and tableview.restarted(paths, kind=kind)
                select = tableview.select_sql(con, kind=kind, paths=paths, union=union, newest_attempt=newest)
                if kind in materialize:
                    cond, params, columns = materialize[kind]
                    cols = ", ".join(f'"{c}"' for c in columns)
                    if len(paths) <= VIEW_MAX_FILES and all(type(v) is int for v in params or ()):
                        # A few files (a segment, agent.store.compact): scanning them again per statement,
                        # each for its own columns and row groups, is cheaper than one table of every column
                        # (16,384-rank Overview: 0.46 s against 0.70 s). The integer bounds become literals:
                        # a view takes no parameters.
                        for v in params or ():
                            cond = cond.replace("?", str(v), 1)
                        con.execute(f"CREATE TEMP VIEW {kind} AS SELECT {cols} FROM ({select}) WHERE {cond}")
                        continue
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


@functools.lru_cache(maxsize=64)
def _superseded(parts: tuple[packs.PartRef, ...], found: tuple[Path, ...]) -> frozenset:
    """``packs.superseded`` of one listing, computed once per process: a pack's manifest never changes
    under its name, and a page lists the same packs for each of its loads (at 2,048 packs the rule alone
    is 60 ms a listing)."""
    return frozenset(packs.superseded(parts, [(path, packs.manifest(path)) for path in found]))


def list_runs(store: Store | str | os.PathLike) -> list[str]:
    """Runs that have records in the store (any kind), sorted; [] when the directory does not exist."""
    if not isinstance(store, Store):
        if not is_remote(store) and not Path(store).is_dir():
            return []
        store = Store.open(store)
    return store.runs()


def read_table(
    store: Store | str | os.PathLike, kind: str, *, run: str | None = None, ranks: Iterable[int] | None = None,
    steps: tuple[int | None, int | None] | None = None, columns: Iterable[str] | None = None,
    order_by: str | None = None, all_attempts: bool = False,
) -> pd.DataFrame:
    """Records of one kind as a DataFrame (the schema's columns, then ``run`` and ``rank``), read through
    ``Store``: a restarted rank's re-executed steps once (the newest attempt) unless ``all_attempts``,
    several stores as one when ``store`` is a ``Store`` over several roots, corrupt files skipped (listed
    in ``attrs["skipped_files"]``).

    ``run=None`` reads every run; ``steps=(a, b)`` keeps a <= step < b (either end may be None);
    ``columns`` selects columns. Returns an empty, well-typed frame when there is nothing to read (a store
    directory that does not exist included). Raises ValueError for an unknown kind, column or an invalid
    run name, and StoreError when the store cannot be read.
    """
    if kind not in SCHEMAS:
        raise ValueError(f"unknown record kind {kind!r} (known: {', '.join(KINDS)})")
    cols = list(columns) if columns is not None else None
    known = set(stored_schema(kind).names) | set(PARTITION_KEYS)
    for name in (cols or []) + ([order_by] if order_by else []):
        if name not in known:
            raise ValueError(f"{kind} has no column {name!r}")
    if run is not None:
        check_run_name(run)  # the one run-name rule: a name no writer accepts is a mistake, not an empty run
    select = ", ".join(f'"{c}"' for c in cols) if cols is not None else "*"
    where, params = [], []
    if run is not None:
        where.append("run = ?")
        params.append(run)
    if ranks is not None:
        rank_list = [int(r) for r in ranks]
        where.append(f"rank IN ({', '.join('?' * len(rank_list))})" if rank_list else "false")
        params.extend(rank_list)
    if steps is not None and "step" in known:
        lo, hi = steps
        if lo is not None:
            where.append("step >= ?")
            params.append(int(lo))
        if hi is not None:
            where.append("step < ?")
            params.append(int(hi))
    sql = f"SELECT {select} FROM {kind}" + (" WHERE " + " AND ".join(where) if where else "")
    if order_by:
        sql += f' ORDER BY "{order_by}"'
    if not isinstance(store, Store):
        if not is_remote(store) and not Path(store).is_dir():
            return _empty(kind, select=select)
        store = Store.open(store)
    return store.query(sql, kinds=[kind], runs=[run] if run is not None else store.runs(), params=params,
                       all_attempts=all_attempts)


def _empty(kind: str, *, select: str) -> pd.DataFrame:
    """A kind's empty frame, typed as a query over its files would be (the same SQL over no files)."""
    with duckconn.connect() as con:
        df = con.execute(f"SELECT {select} FROM ({tableview.select_sql(con, kind=kind, paths=[], union=False)})").df()
    df.attrs[SKIPPED] = []
    return df


def _synced(url: str, *, background: bool) -> Path:
    """The local cache of a bucket's store, synced now (at most every few seconds per process), or in
    the background (see ``Store.open_many``)."""
    from meshscope.agent.store import objectstore, remote

    try:
        parsed = objectstore.parse_url(url)
    except ValueError as e:
        raise StoreError(str(e)) from None
    try:
        return remote.sync_in_background(parsed) if background else remote.sync(parsed).root
    except OSError as e:
        raise StoreError(f"cannot read the store: {objectstore.describe_error(e, url=parsed)}") from None


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
