"""The run store on disk: its layout, and the paths and schemas the agent writes it with.

Layout (hive partitions; ``run``/``rank`` are not columns of the files, readers add them back)::

    <store>/spool/<run>/rank-<rank>.a<attempt>.spool              rank spools (agent.transport)
    <store>/tables/<kind>/run=<run>/rank=<rank>/part-*.parquet     ingested records (rank=-1: GPU samples)
    <store>/agent/offsets.json                                     the agent's durable spool offsets

Part files are named ``part-<stream>-<start>-<end>.parquet``: ``stream`` is the spool file generation
(its header's stream id; ``gpu<agent id>`` for GPU samples) and ``start``/``end`` the byte range of the
spool the part holds (a sample sequence range for GPU parts); see ``agent.collector.parts``.

Reading is ``agent.collector.reader`` (``Store``, ``read_table``): the one reader, which keeps the newest
attempt of re-executed steps. This module stays free of DuckDB and pandas because the ingest path
imports it.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from meshscope.agent.contract import SCHEMAS

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
