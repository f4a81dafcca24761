"""The run store on disk, and how to read it.

Layout (hive partitions; ``run``/``rank`` are not columns of the files, DuckDB adds them back)::

    <store>/spool/<run>/rank-<rank>.a<attempt>.spool              rank spools (agent.transport)
    <store>/tables/<kind>/run=<run>/rank=<rank>/part-*.parquet     ingested records (rank=-1: GPU samples)
    <store>/agent/offsets.json                                     the agent's durable spool offsets

Part files are named ``part-<stream>-<start>-<end>.parquet``: ``stream`` is the spool file generation
(its header's stream id; ``gpu<agent id>`` for GPU samples) and ``start``/``end`` the byte range of the
spool the part holds (a sample sequence range for GPU parts); see ``agent.collector.parts``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import pyarrow as pa

from meshscope.agent.contract import KINDS, SCHEMAS, check_run_name

if TYPE_CHECKING:  # pandas only loads when a reader asks for a frame; the ingest path never does
    import pandas as pd

PARTITION_KEYS = ("run", "rank")


def tables_dir(store: str | Path, kind: str) -> Path:
    return Path(store) / "tables" / kind


def partition_dir(store: str | Path, kind: str, *, run: str, rank: int) -> Path:
    return tables_dir(store, kind) / f"run={run}" / f"rank={int(rank)}"


def stored_schema(kind: str) -> pa.Schema:
    """The schema of a kind's part files: its record schema less the partition keys."""
    schema = SCHEMAS[kind]
    for key in PARTITION_KEYS:
        if key in schema.names:
            schema = schema.remove(schema.get_field_index(key))
    return schema


def list_runs(store: str | Path) -> list[str]:
    """Runs that have records in the store (any kind), sorted."""
    runs: set[str] = set()
    for kind in KINDS:
        base = tables_dir(store, kind)
        if base.is_dir():
            runs.update(p.name[len("run="):] for p in base.iterdir() if p.name.startswith("run=") and p.is_dir())
    return sorted(runs)


def _empty_frame(kind: str, columns: Iterable[str] | None) -> pd.DataFrame:
    schema = stored_schema(kind).append(pa.field("run", pa.string())).append(pa.field("rank", pa.int32()))
    frame = schema.empty_table().to_pandas()
    return frame[list(columns)] if columns is not None else frame


def read_table(
    store: str | Path, kind: str, *, run: str | None = None, ranks: Iterable[int] | None = None,
    steps: tuple[int | None, int | None] | None = None, columns: Iterable[str] | None = None,
    order_by: str | None = None,
) -> pd.DataFrame:
    """Records of one kind as a DataFrame (with ``run`` and ``rank`` columns), read with DuckDB.

    ``steps=(a, b)`` keeps a <= step < b (either end may be None); ``columns`` selects columns. Returns
    an empty, well-typed frame when there is nothing to read.
    """
    if kind not in SCHEMAS:
        raise ValueError(f"unknown record kind {kind!r} (known: {', '.join(KINDS)})")
    cols = list(columns) if columns is not None else None
    known = set(stored_schema(kind).names) | set(PARTITION_KEYS)
    for name in (cols or []) + ([order_by] if order_by else []):
        if name not in known:
            raise ValueError(f"{kind} has no column {name!r}")
    run_glob = "run=*" if run is None else f"run={check_run_name(run)}"
    base = tables_dir(store, kind)
    if not any(base.glob(f"{run_glob}/rank=*/*.parquet")):
        return _empty_frame(kind, cols)
    import duckdb  # noqa: PLC0415 - only readers need it; the ingest path does not

    where, params = [], []
    if run is not None:
        where.append("run = ?")
        params.append(run)
    if ranks is not None:
        rank_list = [int(r) for r in ranks]
        if not rank_list:
            return _empty_frame(kind, cols)
        where.append(f"rank IN ({', '.join('?' * len(rank_list))})")
        params.extend(rank_list)
    if steps is not None and "step" in known:
        lo, hi = steps
        if lo is not None:
            where.append("step >= ?")
            params.append(int(lo))
        if hi is not None:
            where.append("step < ?")
            params.append(int(hi))
    # Columns in schema order, then the partition keys (DuckDB would put the keys in path order).
    select = ", ".join(f'"{c}"' for c in cols) if cols is not None else "* EXCLUDE (run, rank), run, rank"
    sql = (
        f"SELECT {select} FROM read_parquet(?, hive_partitioning = true, union_by_name = true, "
        "hive_types = {'run': 'VARCHAR', 'rank': 'INTEGER'})"
    )
    if where:
        sql += " WHERE " + " AND ".join(where)
    if order_by:
        sql += f' ORDER BY "{order_by}"'
    pattern = str(base / run_glob / "rank=*" / "*.parquet")
    for attempt in range(3):
        try:
            with duckdb.connect() as con:
                return con.execute(sql, [pattern, *params]).df()
        except duckdb.IOException:
            # The agent compacts parts (write merged file, then delete the sources): a file listed by
            # the glob can vanish before it is read. Listing again sees the merged file.
            if attempt == 2:
                raise
    raise AssertionError("unreachable")
