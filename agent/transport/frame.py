"""The spool frame format: how a rank's telemetry batches sit in its append-only spool file.

A spool file (``<store>/spool/<run>/rank-<rank>.a<attempt>.spool``, see ``agent.contract.spool_path``) is
a sequence of frames. The first frame is a *file header* frame; every later frame carries one Arrow record
batch of one record kind (``agent.contract.SCHEMAS``).

Frame layout (little-endian, 24-byte frame header, then the payload)::

    offset size field
         0    4 magic                b"MSPL"
         4    1 format version       FORMAT_VERSION (1)
         5    1 kind code            KIND_CODES: 0 file header, 1 run, 2 step, 3 collective, 4 span,
                                     5 memory, 6 event, 7 gpu
         6    2 schema version       agent.contract.SCHEMA_VERSION the payload was written with
         8    4 payload length       bytes, at most MAX_PAYLOAD
        12    4 payload CRC32        zlib.crc32 of the payload
        16    4 reserved             0 (keeps the payload 8-byte aligned for zero-copy Arrow reads)
        20    4 header CRC32         zlib.crc32 of bytes 0..19
        24    n payload

The header CRC is not in the minimal contract but it matters: without it a flipped bit in the length
field makes a reader wait forever for a "tail" that will never be written. With it a damaged frame
header is rejected at once and the reader resynchronises to the next magic.

Payloads: the file header frame holds UTF-8 JSON ``{"format_version", "schema_version", "run", "rank",
"attempt", "host", "stream_id", "created"}`` padded with spaces to a multiple of 8 bytes; ``stream_id`` is
a random token naming this file's generation (a file deleted and recreated gets a new one, so the agent
never confuses the two). A data frame's payload is one Arrow IPC *stream* (schema message + record
batch), so it is self-describing and the reader can check it against the schema of its kind/version.
"""

from __future__ import annotations

import json
import re
import struct
import zlib

import pyarrow as pa
import pyarrow.ipc as ipc

from meshscope.agent.contract import RECORDS, SCHEMA_VERSION, TAGS, SCHEMAS, SCHEMAS_BY_VERSION, check_run_name
from meshscope.agent.transport.columns import column

MAGIC = b"MSPL"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBBHIII")  # magic, format, kind, schema version, length, payload crc, reserved
FRAME_HEADER_SIZE = HEADER.size + 4  # + header CRC32
MAX_PAYLOAD = 256 * 1024 * 1024

HEADER_KIND = "header"
# Fixed codes (never derived from dict order: the codes are on disk).
KIND_CODES: dict[str, int] = {
    HEADER_KIND: 0, "run": 1, "step": 2, "collective": 3, "span": 4, "memory": 5, "event": 6, "gpu": 7, "hang": 8,
}
CODE_KINDS: dict[int, str] = {code: kind for kind, code in KIND_CODES.items()}
assert set(KIND_CODES) - {HEADER_KIND} == set(SCHEMAS), "every schema kind needs a frame code"

# Schemas by the version the agent can read (agent.contract.schema derives the older ones from the columns
# each version added); their batches are lifted to the current schema on decode (columns added since are NULL),
# so everything past the reader sees one schema per kind.
KNOWN_SCHEMAS: dict[int, dict[str, pa.Schema]] = SCHEMAS_BY_VERSION

# Why a reader rejected bytes (the label values of meshscope_agent_frames_rejected_total).
REJECT_REASONS = (
    "bad_magic",  # bytes that are not a frame header (garbage, or the middle of a damaged frame)
    "bad_header_crc",  # frame header damaged
    "bad_payload_crc",  # payload damaged
    "too_large",  # declared payload length above MAX_PAYLOAD
    "truncated",  # frame cut short (another frame header starts inside its declared payload)
    "unknown_format_version",
    "unknown_kind",
    "unknown_schema_version",
    "decode_error",  # payload is not a readable Arrow IPC stream (or header JSON)
    "schema_mismatch",  # readable, but not the schema of its kind/version
    "bad_file_header",  # the file does not start with a valid header frame
    "bad_run_name",  # a spool directory whose name the run-name rule refuses (counted once per directory)
)

class FrameError(Exception):
    """A frame that cannot be used; ``reason`` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def encode_frame(kind: str, payload: bytes, *, schema_version: int = SCHEMA_VERSION) -> bytes:
    head = HEADER.pack(
        MAGIC, FORMAT_VERSION, KIND_CODES[kind], schema_version, len(payload), zlib.crc32(payload), 0
    )
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def encode_file_header(
    *, run: str, rank: int, attempt: int, host: str, stream_id: str, created: float
) -> bytes:
    meta = {
        "format_version": FORMAT_VERSION, "schema_version": SCHEMA_VERSION, "run": run, "rank": int(rank),
        "attempt": int(attempt), "host": host, "stream_id": stream_id, "created": float(created),
    }
    raw = json.dumps(meta, sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    return encode_frame(HEADER_KIND, raw)


def encode_batch(batch: pa.RecordBatch | pa.Table) -> bytes:
    """One Arrow IPC stream holding ``batch`` (the payload of a data frame)."""
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, batch.schema) as writer:
        writer.write(batch)
    return sink.getvalue().to_pybytes()


def encode_data_frame(kind: str, batch: pa.RecordBatch | pa.Table) -> bytes:
    return encode_frame(kind, encode_batch(batch))


def rows_to_batch(kind: str, rows: list[tuple]) -> pa.RecordBatch:
    """Records of ``kind`` to a record batch: rows from the contract's factories (tuples tagged with the
    kind's current layout, ``TAGS[kind]``) or instances of ``RECORDS[kind]``, built by keyword either way.

    Columns are taken by field name, not position. Any other row (a hand-made tuple, a row tagged with
    another layout or kind) is a ValueError naming the kind and what it got: a positional tuple matched
    only by its length would put values under the wrong columns after a schema reorder. Runs on the
    writer's and the agent's threads, never the training thread, so checking every row costs training
    nothing."""
    schema, record, tag = SCHEMAS[kind], RECORDS[kind], TAGS[kind]
    if not rows:
        raise ValueError(f"no {kind} rows")
    if all(type(row) is tuple and row[:1] == (tag,) for row in rows):
        columns = list(zip(*rows))[1:]
        if len(columns) != len(record._fields):
            raise ValueError(f"{kind} rows have {len(columns)} values, the layout {len(record._fields)}")
    elif all(type(row) is record for row in rows):
        columns = list(zip(*rows))
    else:
        bad = next(r for r in rows if not (type(r) is record or (type(r) is tuple and r[:1] == (tag,))))
        got = f"a {type(bad).__name__} tagged {bad[0]!r}" if type(bad) is tuple and bad else type(bad).__name__
        raise ValueError(f"{kind} rows must come from agent.contract's {kind}_record() or be {record.__name__} "
                         f"records, got {got}"[:300])
    by_name = dict(zip(record._fields, columns))
    arrays = [column(by_name[field.name], field.type) for field in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def parse_frame_header(buf: memoryview | bytes, pos: int) -> tuple[str, int, int, int]:
    """Validate the frame header at ``pos`` (which must have FRAME_HEADER_SIZE bytes).

    Returns (kind, schema version, payload length, payload crc); raises FrameError. Checks that need the
    payload (CRC, decoding) happen in :func:`decode_payload`.
    """
    magic, fmt, code, version, length, crc, _reserved = HEADER.unpack_from(buf, pos)
    if magic != MAGIC:
        raise FrameError("bad_magic", f"no frame magic at offset {pos}")
    (head_crc,) = struct.unpack_from("<I", buf, pos + HEADER.size)
    if zlib.crc32(buf[pos:pos + HEADER.size]) != head_crc:
        raise FrameError("bad_header_crc", f"frame header CRC mismatch at offset {pos}")
    if fmt != FORMAT_VERSION:
        raise FrameError("unknown_format_version", f"format version {fmt} (this reader knows {FORMAT_VERSION})")
    if length > MAX_PAYLOAD:
        raise FrameError("too_large", f"payload length {length} > {MAX_PAYLOAD}")
    kind = CODE_KINDS.get(code)
    if kind is None:
        raise FrameError("unknown_kind", f"kind code {code}")
    if kind != HEADER_KIND and version not in KNOWN_SCHEMAS:
        raise FrameError("unknown_schema_version", f"schema version {version} (known: {sorted(KNOWN_SCHEMAS)})")
    return kind, version, length, crc


def decode_payload(kind: str, version: int, payload: memoryview, crc: int) -> pa.Table | dict:
    """Check the CRC and decode: a dict for the file header, else a pa.Table of the kind's schema."""
    if zlib.crc32(payload) != crc:
        raise FrameError("bad_payload_crc", f"{kind} payload CRC mismatch")
    if kind == HEADER_KIND:
        try:
            meta = json.loads(bytes(payload))
            meta["run"] = check_run_name(meta["run"])
            meta["rank"], meta["attempt"] = int(meta["rank"]), int(meta["attempt"])
            meta["stream_id"] = str(meta["stream_id"])
            if not re.fullmatch(r"[0-9a-f]{8,64}", meta["stream_id"]):
                raise ValueError(f"bad stream_id {meta['stream_id']!r}")
        except (ValueError, KeyError, TypeError) as exc:
            raise FrameError("decode_error", f"file header: {exc}") from None
        return meta
    try:
        table = ipc.open_stream(pa.py_buffer(payload)).read_all()
    except Exception as exc:  # noqa: BLE001 - untrusted bytes into a C++ decoder: any failure is a reject
        raise FrameError("decode_error", f"{kind}: {type(exc).__name__}: {exc}") from None
    expected = KNOWN_SCHEMAS[version].get(kind)
    if expected is None:  # a kind its version did not have (a damaged or forged frame)
        raise FrameError("schema_mismatch", f"{kind} did not exist in schema v{version}")
    if not table.schema.equals(expected, check_metadata=False):
        raise FrameError("schema_mismatch", f"{kind} v{version}: got {table.schema.names}")
    return _lift(table, SCHEMAS[kind])


def _lift(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A table of an older schema version in the current schema: the columns it lacks are NULL."""
    if table.schema.equals(schema, check_metadata=False):
        return table
    return pa.Table.from_arrays(
        [table.column(f.name) if f.name in table.schema.names else pa.nulls(len(table), f.type) for f in schema],
        schema=schema)
