"""The contract both ends of the data path share: names, and typed records that stay in their columns."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pyarrow as pa
import pytest

from meshscope.agent import contract
from meshscope.agent.contract import (
    PART_RE, RECORDS, SCHEMAS, SPOOL_NAME, StepRecord, part_name, record_types, spool_path,
)
from meshscope.agent.contract.records import FACTORIES, TAGS, layout_tag, record_factory
from meshscope.agent.instrument import memory, stepstate, telemetry
from meshscope.agent.transport.frame import (
    FRAME_HEADER_SIZE, decode_payload, encode_data_frame, parse_frame_header, rows_to_batch,
)


ROOT = Path(__file__).resolve().parents[1]


def _imports(folder: str) -> dict[str, set[str]]:
    """The meshscope modules each file under ``folder`` imports (module level and inside functions)."""
    found = {}
    for path in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[str(path.relative_to(ROOT))] = {n for n in names if n.startswith("meshscope")}
    return found


def test_imports_point_down_the_data_path():
    """The contract depends on nothing of meshscope's; transport, collector and dashboard get the rules from
    it, never from the instrumentation (which runs inside the training process)."""
    for path, names in _imports("agent/contract").items():
        assert all(n.startswith("meshscope.agent.contract") for n in names), (path, names)
    for folder in ("agent/transport", "agent/collector", "dashboard"):
        for path, names in _imports(folder).items():
            assert not any(n.startswith("meshscope.agent.instrument") for n in names), (path, names)


def test_spool_path_convention_and_validation(tmp_path):
    path = spool_path(tmp_path, run="llama_8b.v2", rank=12, attempt=1)
    assert path == tmp_path / "spool" / "llama_8b.v2" / "rank-12.a1.spool"
    assert SPOOL_NAME.match(path.name).groups() == ("12", "1")  # what the agent scans for
    for bad in ("", "../etc", "a/b", "x" * 200, "-lead"):
        with pytest.raises(ValueError, match="run name"):
            spool_path(tmp_path, run=bad, rank=0, attempt=0)
    with pytest.raises(ValueError, match="rank"):
        spool_path(tmp_path, run="ok", rank=-1, attempt=0)


def test_part_names_parse_back_and_sort_in_range_order():
    name = part_name("0a1b", 8, 4096)
    m = PART_RE.match(name)
    assert (m["stream"], int(m["start"]), int(m["end"])) == ("0a1b", 8, 4096)
    ranges = [(0, 9), (9, 100), (100, 12345)]
    assert sorted(part_name("s", a, b) for a, b in reversed(ranges)) == [part_name("s", a, b) for a, b in ranges]


def test_every_kind_has_a_record_type_whose_fields_are_the_schema_in_order():
    assert set(RECORDS) == set(SCHEMAS)
    for kind, schema in SCHEMAS.items():
        record = RECORDS[kind]
        assert record._fields == tuple(schema.names), kind
        assert getattr(contract, record.__name__) is record  # importable by name: contract.StepRecord, ...


def test_a_record_must_name_every_field_and_only_its_fields():
    values = {name: 0 for name in StepRecord._fields}
    with pytest.raises(TypeError):
        StepRecord(**{k: v for k, v in values.items() if k != "compute_s"})
    with pytest.raises(TypeError):
        StepRecord(**values, compute_seconds=1.0)


def _swapped(schema: pa.Schema, a: str, b: str) -> pa.Schema:
    """``schema`` with fields ``a`` and ``b`` (of one type) trading places."""
    ia, ib = schema.get_field_index(a), schema.get_field_index(b)
    assert schema.field(a).type == schema.field(b).type
    fields = list(schema)
    fields[ia], fields[ib] = fields[ib], fields[ia]
    return pa.schema(fields)


class _Capture:
    """Stands in for the spool writer: keeps what the telemetry core submits."""

    dropped_records = 0

    def __init__(self) -> None:
        self.rows: dict[str, list] = {kind: [] for kind in SCHEMAS}

    def submit(self, kind: str, rows: list) -> bool:
        self.rows[kind].extend(rows)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        pass


def test_reordering_same_typed_schema_fields_keeps_every_value_in_its_named_column(monkeypatch):
    """Swap two float64 step columns and two int64 memory columns, as an edit of the schema would. The
    producers (the telemetry core, the memory sampler) build records by keyword, so after the record types
    are regenerated from the edited schema each value still lands in the column of its name, through the
    encode / decode round trip; a record of the old layout is refused, not mislabelled."""
    old_step = FACTORIES["step"]
    edited = {"step": _swapped(SCHEMAS["step"], "compute_s", "exposed_comm_s"),
              "memory": _swapped(SCHEMAS["memory"], "rss_bytes", "param_bytes")}
    types = record_types(edited)
    for kind, schema in edited.items():
        monkeypatch.setitem(SCHEMAS, kind, schema)  # the same dict the frame codec validates against
        monkeypatch.setitem(RECORDS, kind, types[kind])
        monkeypatch.setitem(TAGS, kind, layout_tag(kind, types[kind]))
    monkeypatch.setattr(stepstate, "step_record", record_factory(types["step"], kind="step"))
    monkeypatch.setattr(memory, "memory_record", record_factory(types["memory"], kind="memory"))

    writer = _Capture()
    tel = telemetry.Telemetry(config=telemetry.TelemetryConfig(store="unused", run="r"), rank=0, world_size=1,
                              writer=writer)
    with tel.step(0):
        with tel.phase("backward"):
            time.sleep(0.05)
            now = tel.clock.now()
            tel.record_collective(op="all_reduce", dim="dp", group="g", group_size=2, nbytes=64, t_start=now - 0.01,
                                  t_end=now, wait_s=0.01, source="test")
    tel.close()

    tables = {}
    for kind in edited:
        frame = encode_data_frame(kind, rows_to_batch(kind, writer.rows[kind]))
        kind_, version, length, crc = parse_frame_header(frame, 0)
        tables[kind] = decode_payload(kind_, version, memoryview(frame)[FRAME_HEADER_SIZE:], crc).to_pylist()
    (step,) = tables["step"]
    assert step["exposed_comm_s"] == pytest.approx(0.01)  # the wait, not the ~40 ms of compute
    assert step["compute_s"] == pytest.approx(0.04, abs=0.03) and step["compute_s"] > step["exposed_comm_s"]
    (mem,) = tables["memory"]
    assert mem["rss_bytes"] > 0 and mem["param_bytes"] == -1  # RSS measured; tensor bytes not (no optimizer)

    values = dict(zip(types["step"]._fields, writer.rows["step"][0][1:]))
    stale = old_step(**values)  # the same values, built in the layout before the edit
    with pytest.raises(ValueError, match="step rows must come from .* got a tuple tagged 'step:step,t_start"):
        rows_to_batch("step", [stale])
    with pytest.raises(ValueError, match="got a tuple tagged 0"):  # by hand, positionally (step 0): refused too
        rows_to_batch("step", [tuple(values.values())])
