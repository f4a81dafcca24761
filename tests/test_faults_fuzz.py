"""Malformed, truncated and random spool bytes and odd record values, fuzzed with hypothesis (10,350
generated cases in all, plus 10 fixed regression cases), plus one real agent process fed garbage-laced
spools.

Properties (the reader and the ingest path are the agent's only contact with bytes written by ranks):

1. ``SpoolReader`` never raises on arbitrary bytes, always makes progress or waits at a tail, and every
   rejection carries a known reason and is counted.
2. Damage never costs a valid frame: every intact frame around any mix of garbage, truncated frames
   (cut in the header or the payload), bit flips, wrong schemas, unknown kinds / versions, absurd lengths
   and undecodable payloads is delivered, in order; each stretch of damage is rejected at least once, and
   no rejection points into an intact frame.
3. Following a file that grows in arbitrary pieces (as the agent does) gives the same frames as reading
   it whole.
4. The ingest path (``Ingestor`` → Parquet parts) stores exactly the records of the intact frames and
   counts rejections by reason.
5. Records with odd but schema-valid values (nulls, NaN, ±inf, extreme integers, any text) never break
   the agent's metric state or the /metrics exposition.
6. A real ``meshscope agent`` fed such spools stays up, exports the same rejection counts the reader
   computes, and stores every valid record.
"""

from __future__ import annotations

import os
import random
import struct
import tempfile
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import CollectorRegistry

from meshscope.agent.collector.exposition import MeshscopeCollector
from meshscope.agent.collector.ingest import Ingestor
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.store.reader import read_table
from meshscope.agent.contract import RECORDS, SCHEMAS, AnchoredClock, CollectiveRecord, EventRecord, StepRecord
from meshscope.agent.transport.frame import (
    FORMAT_VERSION, FRAME_HEADER_SIZE, HEADER, KIND_CODES, MAGIC, MAX_PAYLOAD, REJECT_REASONS, encode_batch,
    encode_data_frame, encode_file_header, encode_frame, rows_to_batch,
)
from meshscope.agent.transport.reader import SpoolReader
from tests.support.harness import AgentProcess, poll_until, private_dir

RUN = "fz"
FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                  HealthCheck.data_too_large])


@pytest.fixture
def tmp_path():
    """Not pytest's (concurrent sessions on this machine clean each other's): see harness.private_dir."""
    with private_dir() as d:
        yield d


def header(rank: int = 0) -> bytes:
    return encode_file_header(run=RUN, rank=rank, attempt=0, host="h", stream_id=f"{rank:016x}", created=1.0)


def step_row(step: int) -> StepRecord:
    return StepRecord(
        step=step, t_start=1.0 + step, t_end=2.0 + step, wall_s=1.0, compute_s=0.5, exposed_comm_s=0.2, bubble_s=0.2,
        other_s=0.1, data_s=0.0, forward_s=0.2, backward_s=0.3, optimizer_s=0.0, tokens=64, flops=1e6, mfu=0.1,
        loss=2.5, loss_nonfinite=False, grad_norm=1.0, lr=1e-3, skipped=False, n_collectives=2,
        dropped_records_total=0, cpu_s=0.6, cpu_wait_s=0.0)


def coll_row(seq: int) -> CollectiveRecord:
    return CollectiveRecord(step=seq // 2, op="all_reduce", dim="dp", group="0", group_size=2, seq=seq, bytes=4096,
                            t_start=1.0, t_end=1.5, duration_s=0.5, wait_s=0.1, algbw=8e3, busbw=8e3, peer=-1,
                            source="c10d", mesh_dim="")


# A pool of intact frames (encoded once): hypothesis picks among them.
POOL: list[tuple[str, int, bytes]] = []  # (kind, rows, frame)
for i in range(6):
    POOL.append(("step", i + 1, encode_data_frame(
        "step", rows_to_batch("step", [step_row(i * 10 + j) for j in range(i + 1)]))))
    POOL.append(("collective", 3 * i + 1, encode_data_frame(
        "collective", rows_to_batch("collective", [coll_row(i * 100 + j) for j in range(3 * i + 1)]))))
    POOL.append(("event", 1, encode_data_frame("event", rows_to_batch("event", [
        EventRecord(t=float(i), step=i, kind="start", message=f"m{i}é\n\"")]))))


def raw_frame(*, fmt: int = FORMAT_VERSION, code: int = KIND_CODES["event"], version: int = 1, payload: bytes = b"",
              length: int | None = None) -> bytes:
    """A frame with a valid header CRC but any field values (to reach the checks behind the CRC)."""
    head = HEADER.pack(MAGIC, fmt, code, version, len(payload) if length is None else length, zlib.crc32(payload), 0)
    return head + struct.pack("<I", zlib.crc32(head)) + payload


WRONG_SCHEMA = encode_frame("event", encode_batch(rows_to_batch("step", [step_row(0)])))


@st.composite
def damage(draw) -> bytes:
    """Bytes that are not an intact frame (and contain none)."""
    how = draw(st.sampled_from(["garbage", "cut", "flip", "schema", "kind", "version", "format", "too_large",
                                "decode"]))
    frame = draw(st.sampled_from(POOL))[2]
    if how == "garbage":
        junk = draw(st.binary(min_size=1, max_size=300))
        return junk.replace(MAGIC, b"MSPX") or b"\x00"
    if how == "cut":  # a writer that died mid-frame: in its header or in its payload
        return frame[: draw(st.integers(1, len(frame) - 1))]
    if how == "flip":
        buf = bytearray(frame)
        buf[draw(st.integers(0, len(buf) - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(buf)
    if how == "schema":
        return WRONG_SCHEMA
    if how == "kind":
        return raw_frame(code=draw(st.integers(len(KIND_CODES), 255)), payload=b"x" * 8)
    if how == "version":
        return raw_frame(version=draw(st.integers(2, 65535)), payload=b"x" * 8)
    if how == "format":
        return raw_frame(fmt=draw(st.integers(0, 255).filter(lambda v: v != FORMAT_VERSION)), payload=b"x" * 8)
    if how == "too_large":
        return raw_frame(length=draw(st.integers(MAX_PAYLOAD + 1, 2**32 - 1)))
    return raw_frame(payload=draw(st.binary(min_size=0, max_size=64)))  # decode error (or empty payload)


# A file: header, then segments, ending with an intact frame (so no damage is an "incomplete tail").
segments = st.lists(st.one_of(st.tuples(st.just("ok"), st.sampled_from(range(len(POOL)))),
                              st.tuples(st.just("bad"), damage())), min_size=0, max_size=10)


def build(segs, *, last: int = 0) -> tuple[bytes, list[int], list[tuple[int, int]], list[tuple[int, int]]]:
    """(file bytes, expected pool indexes, byte ranges of damage, byte ranges of intact frames)."""
    data = bytearray(header())
    expected, bad, good = [], [], [(0, len(data))]
    for tag, item in [*segs, ("ok", last)]:
        start = len(data)
        if tag == "ok":
            data += POOL[item][2]
            expected.append(item)
            good.append((start, len(data)))
        else:
            data += item
            bad.append((start, len(data)))
    return bytes(data), expected, bad, good


def rebuilds_a_frame(data: bytes, bad: list[tuple[int, int]]) -> bool:
    """A cut frame followed by bytes that happen to be its missing tail (e.g. a frame cut before its
    final zero byte, then a zero byte of garbage) is an intact frame again: not damage."""
    return any(data.startswith(f, start) for start, _ in bad for _, _, f in POOL)


def read_all(path: Path, *, max_bytes: int | None = None):
    reader = SpoolReader(path, max_read_bytes=max_bytes or 8 << 20)
    offset, frames, rejected = 0, [], []
    for _ in range(100_000):
        res = reader.read(offset)
        frames += res.frames
        rejected += res.rejected
        assert offset <= res.offset <= os.path.getsize(path)
        if res.offset == offset and not res.frames and not res.rejected:
            return frames, rejected, offset, reader
        offset = res.offset
    raise AssertionError("reader made no final progress")


def pool_index(frame, data: bytes) -> int:
    raw = data[frame.offset:frame.end]
    for i, (kind, _, encoded) in enumerate(POOL):
        if frame.kind == kind and raw == encoded:
            return i
    raise AssertionError(f"unexpected frame {frame.kind} at {frame.offset}")


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent damaged segments are one stretch of damage (the reader may reject it once)."""
    out: list[tuple[int, int]] = []
    for start, stop in ranges:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return out


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):  # thousands of tiny files: keep them off the disk
        with tempfile.TemporaryDirectory(dir=shm, prefix="meshscope-fuzz-") as tmp:
            yield Path(tmp)
    else:
        yield tmp_path_factory.mktemp("fuzz")


# 1. ------------------------------------------------------------------------------- arbitrary bytes

@settings(max_examples=6000, **FAST)
@given(body=st.binary(max_size=2048), with_header=st.booleans(), max_bytes=st.sampled_from([100, 1 << 20]))
def test_reader_never_raises_on_arbitrary_bytes(scratch, body, with_header, max_bytes):
    path = scratch / "arbitrary.spool"
    path.write_bytes((header() if with_header else b"") + body)
    frames, rejected, end, reader = read_all(path, max_bytes=max_bytes)
    assert all(reason in REJECT_REASONS for _, reason, _ in rejected)
    assert sum(reader.rejections.values()) == len(rejected)
    size = path.stat().st_size
    # Whatever is left unread is a possible incomplete tail: shorter than a frame header, or one
    # well-formed frame header whose payload has not "arrived".
    if end < size:
        rest = path.read_bytes()[end:]
        assert len(rest) < FRAME_HEADER_SIZE or rest[:4] == MAGIC


# 2. ---------------------------------------------------------------- damage never costs a valid frame

@settings(max_examples=2000, **FAST)
@given(segs=segments, max_bytes=st.sampled_from([256, 1 << 20]))
def test_damage_never_costs_a_valid_frame(scratch, segs, max_bytes):
    data, expected, bad, good = build(segs)
    assume(not rebuilds_a_frame(data, bad))
    path = scratch / "damaged.spool"
    path.write_bytes(data)
    frames, rejected, end, reader = read_all(path, max_bytes=max_bytes)
    assert end == len(data)
    assert [pool_index(f, data) for f in frames if f.kind != "header"] == expected
    assert [f.kind for f in frames].count("header") == 1
    for start, stop in merged(bad):  # every stretch of damage is rejected at least once ...
        assert any(start <= off < stop for off, _, _ in rejected), (start, stop, rejected)
    for off, reason, _ in rejected:  # ... and no rejection points into an intact frame
        assert reason in REJECT_REASONS
        assert not any(start <= off < stop for start, stop in good), (off, reason)
    assert sum(reader.rejections.values()) == len(rejected)


@pytest.mark.parametrize("missing", [1, 3, 4, 23, 24])
@pytest.mark.parametrize("max_bytes", [64, 1 << 20])
def test_a_frame_cut_in_its_last_bytes_does_not_cost_the_next_frame(scratch, missing, max_bytes):
    """Regression (found by the property above): a frame cut 1-23 bytes short followed by a good frame.
    The good frame starts inside the cut frame's declared length but its header runs past it; the
    reader used to skip the cut frame whole, and the good frame's first bytes with it."""
    cut, good = POOL[16][2][:-missing], POOL[0][2]
    data = header() + cut + good
    path = scratch / "cut.spool"
    path.write_bytes(data)
    frames, rejected, end, _ = read_all(path, max_bytes=max_bytes)
    assert [pool_index(f, data) for f in frames if f.kind != "header"] == [0]
    assert [r[1] for r in rejected] == ["truncated"] and end == len(data)


# 3. ------------------------------------------------------------- following a growing file, any pieces

@settings(max_examples=1500, **FAST)
@given(segs=segments, cuts=st.lists(st.integers(0, 1 << 14), max_size=8), max_bytes=st.sampled_from([64, 1 << 20]))
def test_following_a_growing_file_gives_the_same_frames(scratch, segs, cuts, max_bytes):
    data, expected, bad, _ = build(segs)
    assume(not rebuilds_a_frame(data, bad))
    path = scratch / "growing.spool"
    path.write_bytes(b"")
    reader = SpoolReader(path, max_read_bytes=max_bytes)
    offset, got = 0, []
    for cut in sorted({c % (len(data) + 1) for c in cuts}) + [len(data)]:
        with open(path, "r+b") as fh:
            fh.seek(0, 2)
            fh.write(data[fh.tell():cut])
        for _ in range(10_000):
            res = reader.read(offset)
            got += res.frames
            if res.offset == offset and not res.frames and not res.rejected:
                break
            offset = res.offset
    assert offset == len(data)
    assert [pool_index(f, data) for f in got if f.kind != "header"] == expected


# 4. ------------------------------------------------------------------- ingest stores exactly the valid

@settings(max_examples=150, **FAST)
@given(files=st.lists(segments, min_size=1, max_size=3), junk_file=st.binary(max_size=200))
def test_ingest_stores_exactly_the_records_of_intact_frames(files, junk_file):
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        spool = store / "spool" / RUN
        spool.mkdir(parents=True)
        want = {"step": 0, "collective": 0, "event": 0}
        damaged = 0
        for rank, segs in enumerate(files):
            data, expected, bad, _ = build(segs, last=rank)
            assume(not rebuilds_a_frame(data, bad))
            data = header(rank) + data[len(header()):]
            (spool / f"rank-{rank}.a0.spool").write_bytes(data)
            for i in expected:
                want[POOL[i][0]] += POOL[i][1]
            damaged += len(merged(bad))
        (spool / "rank-99.a0.spool").write_bytes(junk_file)  # no valid file header at all
        state = MetricsState()
        ingest = Ingestor(store=store, state=state, clock=AnchoredClock())
        ingest.ingest_all()
        for kind, n in want.items():
            assert state.ingested[kind] == n, kind
            files = list((store / "tables" / kind).glob(f"run={RUN}/*/*.parquet"))  # parts and packs
            assert sum(pq.read_metadata(p).num_rows for p in files) == n, kind
        assert set(state.rejected) <= set(REJECT_REASONS)
        assert sum(state.rejected.values()) - state.rejected["bad_file_header"] >= damaged
        assert state.rejected["bad_file_header"] <= 1  # the junk file, once (none if it may be a header)
        assert state.metric_errors == 0


# 5. ---------------------------------------------------------- odd values never break state or /metrics

def _value(field: pa.Field):
    t = field.type
    if pa.types.is_boolean(t):
        base = st.booleans()
    elif pa.types.is_integer(t):
        bits = t.bit_width
        base = st.one_of(st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1), st.sampled_from([-1, 0, 1]))
    elif pa.types.is_floating(t):
        base = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e308]))
    else:
        base = st.one_of(st.text(max_size=20), st.sampled_from(["", "dp", "all_reduce", "start", "{", "\n\"\\"]))
    return st.one_of(st.none(), base)


def records(kind: str):
    """Records of ``kind`` built by keyword, every field any value its column type allows (or NULL)."""
    return st.lists(st.builds(RECORDS[kind], **{f.name: _value(f) for f in SCHEMAS[kind]}), min_size=1,
                    max_size=3)


ODD_KINDS = ("run", "step", "collective", "memory", "event", "span")
ODD_RECORDS = {kind: records(kind) for kind in ODD_KINDS}  # built once: building strategies is the slow part


@settings(max_examples=700, **FAST)
@given(batches=st.lists(st.tuples(st.sampled_from(ODD_KINDS), st.integers(0, 3), st.integers(0, 2)),
                        min_size=1, max_size=3), data=st.data())
def test_odd_values_never_break_the_metric_state_or_the_exposition(batches, data):
    state = MetricsState(run_ttl_s=1e9)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MeshscopeCollector(state, host="h", version="t"))
    errors = 0
    for kind, rank, attempt in batches:
        rows = data.draw(ODD_RECORDS[kind])
        table = pa.Table.from_batches([rows_to_batch(kind, rows)])
        try:  # exactly the guard of Ingestor._take: a failure here is counted (metric_errors), not fatal
            state.observe(kind, table, run=RUN, rank=rank, attempt=attempt, now=1e9)
        except Exception:  # noqa: BLE001
            errors += 1
    # Both formats must render (Prometheus negotiates OpenMetrics; plain clients get the text format).
    assert b"meshscope_agent_records_ingested_total" in generate_latest(registry)
    assert generate_openmetrics(registry).endswith(b"# EOF\n")
    assert errors == 0, "MetricsState.observe raised on schema-valid records"


# 6. ------------------------------------------------------------------- a real agent fed garbage-laced spools

def test_real_agent_fed_garbage_laced_spools_stays_up_counts_and_stores_the_valid(tmp_path):
    rnd = random.Random(5)
    spool = tmp_path / "spool" / RUN
    spool.mkdir(parents=True)
    want = {"step": 0, "collective": 0, "event": 0}
    for rank in range(4):
        segs = []
        for _ in range(60):
            if rnd.random() < 0.5:
                segs.append(("ok", rnd.randrange(len(POOL))))
            else:
                frame = bytearray(POOL[rnd.randrange(len(POOL))][2])
                choice = rnd.randrange(6)
                if choice == 0:
                    segs.append(("bad", bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 200)))
                                 .replace(MAGIC, b"MSPX")))
                elif choice == 1:
                    segs.append(("bad", bytes(frame[:rnd.randrange(1, len(frame))])))
                elif choice == 2:
                    frame[rnd.randrange(len(frame))] ^= 1 << rnd.randrange(8)
                    segs.append(("bad", bytes(frame)))
                elif choice == 3:
                    segs.append(("bad", WRONG_SCHEMA))
                elif choice == 4:
                    segs.append(("bad", raw_frame(code=200, payload=b"x" * 8)))
                else:
                    segs.append(("bad", raw_frame(length=MAX_PAYLOAD + 7)))
        data, expected, bad, _ = build(segs, last=rank)
        assert not rebuilds_a_frame(data, bad)
        (spool / f"rank-{rank}.a0.spool").write_bytes(header(rank) + data[len(header()):])
        for i in expected:
            want[POOL[i][0]] += POOL[i][1]
    (spool / "rank-90.a0.spool").write_bytes(os.urandom(5000))  # random bytes named like a spool
    (spool / "rank-91.a0.spool").write_bytes(b"")  # empty
    (spool / "rank-92.a0.spool").write_bytes(header(92)[:30])  # a header still being written
    # Reference counts: the transport's reader over the same (headed) files, in-process. The agent does
    # not read past a file without a valid header (rank-90): one bad_file_header for it.
    reference: dict[str, int] = {}
    for rank in range(4):
        _, rejected, _, _ = read_all(spool / f"rank-{rank}.a0.spool")
        for _, reason, _ in rejected:
            reference[reason] = reference.get(reason, 0) + 1

    agent = AgentProcess(tmp_path, "--part-age", "0.2", poll_interval=0.1)
    try:
        def ingested():
            m = agent.scrape()
            got = {k: m.value("meshscope_agent_records_ingested_total", kind=k) for k in want}
            return m if got == {k: float(v) for k, v in want.items()} else None

        m = poll_until(ingested, timeout_s=60, what=f"agent ingests {want}")
        rejected = {r: m.value("meshscope_agent_frames_rejected_total", reason=r) for r in REJECT_REASONS}
        assert agent.alive()
        assert agent.stop() == 0, agent.stderr
    finally:
        agent.kill()
    got = {k: int(v) for k, v in rejected.items() if v}
    assert got == {**reference, "bad_file_header": 1}
    for kind, n in want.items():
        assert len(read_table(tmp_path, kind, run=RUN)) == n
    print(f"\nreal agent: ingested {want}, rejected {got}")
