"""Typed records: one named tuple per record kind, its fields the kind's schema columns in schema order.

Producers build records by keyword (``StepRecord(step=3, t_start=..., ...)``), so a value is tied to its
column's name where it is made, and ``agent.transport.frame.rows_to_batch`` accepts only the kind's
record type and maps columns by name. Reordering, inserting or renaming schema fields therefore can never
put a value under the wrong column: a producer that was not updated fails at construction (a missing or
unknown keyword) instead of writing mislabelled data.

Producers on the training thread call the keyword-only factories (``collective_record(step=..., ...)``)
instead. They return a plain tuple whose first item is the kind's layout tag (``TAGS[kind]``: the kind
and its field names in order), then the values in schema order. Two reasons, measured on this project's 2-core VM (``python
bench/records.py`` prints the current figures):

- a tuple subclass (a named tuple) stays tracked by the garbage collector, a tuple of plain values does
  not: with records buffered between flushes, every collection walks them, and one
  ``Telemetry.record_collective`` cost 2.7-3.1 µs of CPU, against 1.6 µs with these tagged tuples and 1.5 µs
  with the untyped tuples before them;
- calling a named tuple class by keyword goes through the type's ``__new__`` with a keyword dict
  (0.85-1.06 µs for a collective, against 0.24-0.35 µs for the factory).

The tag keeps the guarantee: ``rows_to_batch`` accepts a tagged tuple only when its tag is the current
layout's, so a row built under another field order, or by hand without a factory, is refused, never
mislabelled.
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


def layout_tag(kind: str, record: type) -> str:
    """The tag of a kind's field layout: ``<kind>:<field>,<field>,...`` (a str: the row stays untracked)."""
    return f"{kind}:{','.join(record._fields)}"


def record_factory(record: type, *, kind: str):
    """A keyword-only function building a tagged row of ``record``'s layout: ``f(*, a, b) -> (tag, a, b)``,
    generated (as ``collections.namedtuple`` generates its own ``__new__``) so that each field is a named
    parameter."""
    fields = ", ".join(record._fields)
    namespace = {"_tag": layout_tag(kind, record)}
    exec(f"def make(*, {fields}):\n    return (_tag, {fields})", namespace)  # noqa: S102 - fields are schema names
    make = namespace["make"]
    make.__name__ = make.__qualname__ = f"{record.__name__[:-len('Record')].lower()}_record"
    make.__doc__ = f"A tagged {record.__name__} row built by keyword (every field required)."
    return make


RECORDS: dict[str, type] = record_types(SCHEMAS)
TAGS: dict[str, str] = {kind: layout_tag(kind, record) for kind, record in RECORDS.items()}
FACTORIES = {kind: record_factory(record, kind=kind) for kind, record in RECORDS.items()}

# The same classes under their own names, for producers (one name per kind, imported where records are made).
RunRecord = RECORDS["run"]
StepRecord = RECORDS["step"]
CollectiveRecord = RECORDS["collective"]
SpanRecord = RECORDS["span"]
MemoryRecord = RECORDS["memory"]
EventRecord = RECORDS["event"]
GpuRecord = RECORDS["gpu"]
HangRecord = RECORDS["hang"]

run_record = FACTORIES["run"]
step_record = FACTORIES["step"]
collective_record = FACTORIES["collective"]
span_record = FACTORIES["span"]
memory_record = FACTORIES["memory"]
event_record = FACTORIES["event"]
gpu_record = FACTORIES["gpu"]
hang_record = FACTORIES["hang"]
