"""Typed records: one named tuple per record kind, its fields the kind's schema columns in schema order.

Producers build records by keyword (``StepRecord(step=3, t_start=..., ...)``), so a value is tied to its
column's name where it is made, and ``agent.transport.frame.rows_to_batch`` accepts only the kind's
record type and maps columns by name. Reordering, inserting or renaming schema fields therefore can never
put a value under the wrong column: a producer that was not updated fails at construction (a missing or
unknown keyword) instead of writing mislabelled data. Named tuples keep the training thread's cost at one
tuple allocation per record and need no per-row validation there.
"""

from __future__ import annotations

from collections import namedtuple

import pyarrow as pa

from meshscope.agent.contract.schema import SCHEMAS


def record_types(schemas: dict[str, pa.Schema]) -> dict[str, type]:
    """One named tuple class per kind of ``schemas``, named ``<Kind>Record``, fields = the schema's names.

    Built from the schemas rather than written out so the field order cannot diverge from the schema's."""
    return {kind: namedtuple(f"{kind.capitalize()}Record", schema.names, module=__name__)
            for kind, schema in schemas.items()}


RECORDS: dict[str, type] = record_types(SCHEMAS)

# The same classes under their own names, for producers (one name per kind, imported where records are made).
RunRecord = RECORDS["run"]
StepRecord = RECORDS["step"]
CollectiveRecord = RECORDS["collective"]
SpanRecord = RECORDS["span"]
MemoryRecord = RECORDS["memory"]
EventRecord = RECORDS["event"]
GpuRecord = RECORDS["gpu"]
