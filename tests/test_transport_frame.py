"""Spool framing: round trips, the header frame, and typed rows in."""

from __future__ import annotations

import struct
import zlib

import pyarrow as pa
import pytest

from meshscope.agent.contract import SCHEMA_VERSION, SCHEMAS, EventRecord, StepRecord, event_record, span_record
from meshscope.agent.transport.frame import (
    FRAME_HEADER_SIZE, KIND_CODES, MAGIC, FrameError, decode_payload, encode_data_frame, encode_file_header,
    encode_frame, parse_frame_header, rows_to_batch,
)
from meshscope.agent.transport.reader import SpoolReader

STEP_ROW = StepRecord(
    step=7, t_start=10.0, t_end=11.0, wall_s=1.0, compute_s=0.6, exposed_comm_s=0.2, bubble_s=0.1, other_s=0.1,
    data_s=0.01, forward_s=0.2, backward_s=0.4, optimizer_s=0.02, tokens=4096, flops=1e12, mfu=0.4, loss=2.5,
    loss_nonfinite=False, grad_norm=0.9, lr=3e-4, skipped=False, n_collectives=12, dropped_records_total=0, cpu_s=0.7,
    cpu_wait_s=0.01)


def ev(t: float, step: int, kind: str, message: str) -> EventRecord:
    return EventRecord(t=t, step=step, kind=kind, message=message)


def test_data_frame_round_trip():
    batch = rows_to_batch("step", [STEP_ROW, STEP_ROW._replace(t_start=8.0)])
    frame = encode_data_frame("step", batch)
    assert frame[:4] == MAGIC
    kind, version, length, crc = parse_frame_header(memoryview(frame), 0)
    assert (kind, version, length) == ("step", SCHEMA_VERSION, len(frame) - FRAME_HEADER_SIZE)
    table = decode_payload(kind, version, memoryview(frame)[FRAME_HEADER_SIZE:], crc)
    assert table.schema.equals(SCHEMAS["step"])
    assert table.to_pylist()[0]["tokens"] == 4096 and table.column("t_start").to_pylist() == [10.0, 8.0]


def test_header_frame_round_trip_and_alignment():
    frame = encode_file_header(run="r-1", rank=3, attempt=2, host="n0", stream_id="ab" * 8, created=5.0)
    kind, version, length, crc = parse_frame_header(frame, 0)
    meta = decode_payload(kind, version, memoryview(frame)[FRAME_HEADER_SIZE:], crc)
    assert kind == "header" and length % 8 == 0  # payloads stay 8-byte aligned for zero-copy Arrow reads
    assert meta["run"] == "r-1" and meta["rank"] == 3 and meta["attempt"] == 2 and meta["host"] == "n0"
    assert meta["schema_version"] == SCHEMA_VERSION and meta["stream_id"] == "ab" * 8


def test_every_schema_kind_has_a_code_and_round_trips():
    for kind, schema in SCHEMAS.items():
        frame = encode_data_frame(kind, schema.empty_table())
        parsed_kind, version, _, crc = parse_frame_header(frame, 0)
        assert parsed_kind == kind and KIND_CODES[kind] > 0
        assert decode_payload(parsed_kind, version, memoryview(frame)[FRAME_HEADER_SIZE:], crc).num_rows == 0


@pytest.mark.parametrize("mutate, reason", [
    (lambda f: b"XXXX" + f[4:], "bad_magic"),
    (lambda f: f[:9] + bytes([f[9] ^ 1]) + f[10:], "bad_header_crc"),  # length field flipped
])
def test_damaged_headers_are_rejected(mutate, reason):
    frame = mutate(encode_data_frame("event", rows_to_batch("event", [ev(1.0, 2, "start", "hi")])))
    with pytest.raises(FrameError) as err:
        parse_frame_header(frame, 0)
    assert err.value.reason == reason


def _frame_with_header(fmt=1, code=6, version=SCHEMA_VERSION, payload=b"12345678"):
    head = struct.pack("<4sBBHIII", MAGIC, fmt, code, version, len(payload), zlib.crc32(payload), 0)
    return head + struct.pack("<I", zlib.crc32(head)) + payload


@pytest.mark.parametrize("frame, reason", [
    (_frame_with_header(fmt=9), "unknown_format_version"),
    (_frame_with_header(code=99), "unknown_kind"),
    (_frame_with_header(version=SCHEMA_VERSION + 7), "unknown_schema_version"),
])
def test_unknown_versions_and_kinds(frame, reason):
    with pytest.raises(FrameError) as err:
        parse_frame_header(frame, 0)
    assert err.value.reason == reason


def test_payload_errors_name_their_reason():
    good = encode_data_frame("event", rows_to_batch("event", [ev(1.0, 2, "end", "")]))
    kind, version, _, crc = parse_frame_header(good, 0)
    payload = bytearray(good[FRAME_HEADER_SIZE:])
    payload[-9] ^= 0xFF
    with pytest.raises(FrameError) as err:
        decode_payload(kind, version, memoryview(bytes(payload)), crc)
    assert err.value.reason == "bad_payload_crc"
    junk = b"not arrow at all"
    with pytest.raises(FrameError) as err:
        decode_payload("event", version, memoryview(junk), zlib.crc32(junk))
    assert err.value.reason == "decode_error"
    wrong = encode_frame("event", encode_data_frame("memory", SCHEMAS["memory"].empty_table())[FRAME_HEADER_SIZE:])
    kind, version, _, crc = parse_frame_header(wrong, 0)
    with pytest.raises(FrameError) as err:
        decode_payload(kind, version, memoryview(wrong)[FRAME_HEADER_SIZE:], crc)
    assert err.value.reason == "schema_mismatch"


def test_rows_must_be_the_kinds_records():
    # A positional tuple, even of the right length, another kind's record, or another kind's factory row:
    # a ValueError naming the kind and what it got.
    for row, got in [((1.0, 2, "start", ""), "a tuple tagged 1.0"), (STEP_ROW, type(STEP_ROW).__name__),
                     (span_record(step=0, stage=0, microbatch=0, kind="forward", t_start=0.0, t_end=1.0),
                      "a tuple tagged 'span:step,stage")]:
        with pytest.raises(ValueError, match=rf"event rows must come from .* event_record\(\) .* got {got}"):
            rows_to_batch("event", [ev(1.0, 2, "start", ""), row])
    # the factory's rows and the record type, alone: the same batch
    tagged = rows_to_batch("event", [event_record(t=1.0, step=2, kind="start", message="")])
    assert tagged.equals(rows_to_batch("event", [ev(1.0, 2, "start", "")]))
    with pytest.raises(ValueError, match="no event rows"):
        rows_to_batch("event", [])
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError, TypeError)):
        rows_to_batch("event", [ev("not a float", 2, "start", "")])


def test_reader_reads_a_written_file(tmp_path):
    path = tmp_path / "f.spool"
    header = encode_file_header(run="r", rank=0, attempt=0, host="h", stream_id="0123456789abcdef", created=1.0)
    data = encode_data_frame("event", rows_to_batch("event", [ev(1.0, 0, "start", "go")]))
    path.write_bytes(header + data)
    res = SpoolReader(path).read(0)
    assert [f.kind for f in res.frames] == ["header", "event"] and res.offset == len(header) + len(data)
    assert res.frames[1].offset == len(header) and res.frames[1].table.column("message").to_pylist() == ["go"]
    assert not res.rejected and not res.more


def test_a_version_1_step_batch_is_lifted_to_the_current_schema():
    # Spools written before step.cpu_s existed (schema v1) still ingest: the column is NULL.
    from meshscope.agent.contract.schema import SCHEMAS_V1
    from meshscope.agent.transport.frame import encode_batch

    v1 = pa.RecordBatch.from_arrays([pa.array([getattr(STEP_ROW, f.name)], type=f.type) for f in SCHEMAS_V1["step"]],
                                    schema=SCHEMAS_V1["step"])
    frame = encode_frame("step", encode_batch(v1), schema_version=1)
    kind, version, length, crc = parse_frame_header(frame, 0)
    table = decode_payload(kind, version, memoryview(frame)[FRAME_HEADER_SIZE:FRAME_HEADER_SIZE + length], crc)
    assert version == 1 and table.schema.equals(SCHEMAS["step"])
    assert table.column("cpu_s").null_count == table.column("cpu_wait_s").null_count == 1
    assert table.column("wall_s")[0].as_py() == STEP_ROW.wall_s
