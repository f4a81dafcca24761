"""The run store's Parquet parts: the schema the agent writes each kind with.

Every path of the store (spools, ``tables/<kind>/run=<run>/rank=<rank>``, packs, the agent's offsets),
local and in an object store, is ``agent.contract.storelayout``'s.

Part files are named ``part-<stream>-<start>-<end>.parquet``: ``stream`` is the spool file generation
(its header's stream id; ``gpu<agent id>`` for GPU samples) and ``start``/``end`` the byte range of the
spool the part holds (a sample sequence range for GPU parts); see ``agent.store.parts``.

Reading is ``agent.store.reader`` (``Store``, ``read_table``): the one reader, which keeps the newest
attempt of re-executed steps. This module stays free of DuckDB and pandas because the ingest path
imports it.
"""

from __future__ import annotations

import pyarrow as pa

from meshscope.agent.contract import SCHEMAS
from meshscope.agent.contract.storelayout import PARTITION_KEYS


def stored_schema(kind: str) -> pa.Schema:
    """The schema of a kind's part files: its record schema less the partition keys."""
    schema = SCHEMAS[kind]
    for key in PARTITION_KEYS:
        if key in schema.names:
            schema = schema.remove(schema.get_field_index(key))
    return schema
