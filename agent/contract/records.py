"""Typed records: one named tuple per record kind, its fields the kind's schema columns in schema order.

Producers build records by keyword (``StepRecord(step=3, t_start=..., ...)``), so a value is tied to its
column's name where it is made, and ``agent.transport.frame.rows_to_batch`` accepts only the kind's
record type and maps columns by name. Reordering, inserting or renaming schema fields therefore can never
put a value under the wrong column: a producer that was not updated fails at construction (a missing or
unknown keyword) instead of writing mislabelled data.

Producers on the training thread call the keyword-only factories (``collective_record(step=..., ...)``):
they return the same named tuple, but calling a named tuple class by keyword goes through the type's
``__new__`` with a keyword dict: 0.94 µs for a collective against 0.35 µs for the factory and 0.04 µs for
a positional tuple (``python bench/records.py``, 2-core VM). Either way there is no per-row validation on the
training thread.
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


def record_factory(record: type):
    """A keyword-only function building ``record``: ``f(*, a, b) -> record(a, b)``, generated (as
    ``collections.namedtuple`` generates its own ``__new__``) so that each field is a named parameter."""
    fields = ", ".join(record._fields)
    namespace = {"_new": tuple.__new__, "_record": record}
    exec(f"def make(*, {fields}):\n    return _new(_record, ({fields},))", namespace)  # noqa: S102 - fields are schema names
    make = namespace["make"]
    make.__name__ = make.__qualname__ = f"{record.__name__[:-len('Record')].lower()}_record"
    make.__doc__ = f"A {record.__name__} built by keyword (every field required)."
    return make


RECORDS: dict[str, type] = record_types(SCHEMAS)
FACTORIES = {kind: record_factory(record) for kind, record in RECORDS.items()}

# The same classes under their own names, for producers (one name per kind, imported where records are made).
RunRecord = RECORDS["run"]
StepRecord = RECORDS["step"]
CollectiveRecord = RECORDS["collective"]
SpanRecord = RECORDS["span"]
MemoryRecord = RECORDS["memory"]
EventRecord = RECORDS["event"]
GpuRecord = RECORDS["gpu"]

run_record = FACTORIES["run"]
step_record = FACTORIES["step"]
collective_record = FACTORIES["collective"]
span_record = FACTORIES["span"]
memory_record = FACTORIES["memory"]
event_record = FACTORIES["event"]
gpu_record = FACTORIES["gpu"]
