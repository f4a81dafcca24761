"""The spool reader: incomplete tails wait, damage is rejected with a reason, good frames keep flowing."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshscope.agent.contract import EventRecord, StepRecord
from meshscope.agent.transport.frame import (
    FRAME_HEADER_SIZE, MAGIC, REJECT_REASONS, encode_data_frame, encode_file_header, encode_frame, rows_to_batch,
)
from meshscope.agent.transport.reader import SpoolReader

HEADER = encode_file_header(run="r", rank=1, attempt=0, host="h", stream_id="0123456789abcdef", created=1.0)


def event_frame(i: int) -> bytes:
    return encode_data_frame("event", rows_to_batch("event", [EventRecord(t=float(i), step=i, kind="start",
                                                                          message=f"m{i}")]))


def steps_of(result) -> list[int]:
    return [f.table.column("step")[0].as_py() for f in result.frames if f.kind == "event"]


def read_all(path, offset=0, **kw):
    reader = SpoolReader(path, **kw)
    frames, rejected = [], []
    while True:
        res = reader.read(offset)
        frames += res.frames
        rejected += res.rejected
        if res.offset == offset:
            return frames, rejected, offset, reader
        offset = res.offset


def test_follows_a_growing_file_and_waits_at_an_incomplete_tail(tmp_path):
    path = tmp_path / "s.spool"
    f1, f2 = event_frame(1), event_frame(2)
    path.write_bytes(HEADER + f1 + f2[:10])  # the writer is in the middle of frame 2's header
    reader = SpoolReader(path)
    res = reader.read(0)
    assert steps_of(res) == [1] and res.offset == len(HEADER) + len(f1) and not res.rejected
    with open(path, "ab") as fh:
        fh.write(f2[10:-5])  # header complete, payload still short
    assert reader.read(res.offset).frames == [] and reader.read(res.offset).offset == res.offset
    with open(path, "ab") as fh:
        fh.write(f2[-5:])
    res2 = reader.read(res.offset)
    assert steps_of(res2) == [2] and res2.offset == path.stat().st_size
    assert sum(reader.rejections.values()) == 0


def test_partial_magic_at_the_tail_is_waited_for(tmp_path):
    path = tmp_path / "s.spool"
    path.write_bytes(HEADER + MAGIC[:3])
    res = SpoolReader(path).read(len(HEADER))
    assert res.offset == len(HEADER) and not res.rejected


def test_bit_flip_in_a_payload_rejects_only_that_frame(tmp_path):
    frames = [event_frame(i) for i in range(5)]
    bad = bytearray(frames[2])
    bad[FRAME_HEADER_SIZE + 40] ^= 0x55
    path = tmp_path / "s.spool"
    path.write_bytes(HEADER + b"".join(frames[:2]) + bytes(bad) + b"".join(frames[3:]))
    got, rejected, end, reader = read_all(path)
    assert [f.table.column("step")[0].as_py() for f in got if f.kind == "event"] == [0, 1, 3, 4]
    assert [r[1] for r in rejected] == ["bad_payload_crc"] and end == path.stat().st_size
    assert reader.rejections["bad_payload_crc"] == 1 and reader.recent_rejections[0][1] == "bad_payload_crc"


def test_garbage_between_frames_and_a_frame_cut_short(tmp_path):
    f = [event_frame(i) for i in range(4)]
    path = tmp_path / "s.spool"
    # garbage, then a frame whose writer died half way (the next frame starts inside its payload)
    path.write_bytes(HEADER + f[0] + b"\x00garbage\xff" * 3 + f[1] + f[2][: len(f[2]) // 2] + f[3])
    got, rejected, end, _ = read_all(path)
    assert [f.table.column("step")[0].as_py() for f in got if f.kind == "event"] == [0, 1, 3]
    assert [r[1] for r in rejected] == ["bad_magic", "truncated"] and end == path.stat().st_size


def test_schema_mismatch_and_decode_errors_are_skipped_whole(tmp_path):
    step = StepRecord(
        step=0, t_start=1.0, t_end=2.0, wall_s=1.0, compute_s=0.5, exposed_comm_s=0.2, bubble_s=0.2, other_s=0.1,
        data_s=0.0, forward_s=0.2, backward_s=0.3, optimizer_s=0.0, tokens=1, flops=1.0, mfu=0.1, loss=1.0,
        loss_nonfinite=False, grad_norm=1.0, lr=0.1, skipped=False, n_collectives=0, dropped_records_total=0,
        cpu_s=0.4, cpu_wait_s=0.0)
    wrong = encode_frame("event", encode_data_frame("step", rows_to_batch("step", [step]))[FRAME_HEADER_SIZE:])
    junk = encode_frame("event", b"this is not an arrow stream!")
    path = tmp_path / "s.spool"
    path.write_bytes(HEADER + wrong + event_frame(1) + junk + event_frame(2))
    got, rejected, _, _ = read_all(path)
    assert [f.table.column("step")[0].as_py() for f in got if f.kind == "event"] == [1, 2]
    assert [r[1] for r in rejected] == ["schema_mismatch", "decode_error"]
    assert all("event" in r[2] for r in rejected)


def test_frames_larger_than_the_read_size_are_read_whole(tmp_path):
    rows = [EventRecord(t=float(i), step=i, kind="start", message="x" * 50) for i in range(2000)]
    big = encode_data_frame("event", rows_to_batch("event", rows))
    path = tmp_path / "s.spool"
    path.write_bytes(HEADER + big + event_frame(7))
    got, rejected, end, _ = read_all(path, max_read_bytes=1024)
    assert [f.table.num_rows for f in got if f.kind == "event"] == [2000, 1] and not rejected
    assert end == path.stat().st_size


def test_max_bytes_reports_more(tmp_path):
    path = tmp_path / "s.spool"
    path.write_bytes(HEADER + b"".join(event_frame(i) for i in range(20)))
    res = SpoolReader(path).read(0, max_bytes=len(HEADER) + 10)
    assert res.more and [f.kind for f in res.frames] == ["header"]


def test_a_vanished_file_reads_as_nothing(tmp_path):
    res = SpoolReader(tmp_path / "gone.spool").read(0)
    assert res.frames == [] and res.offset == 0 and not res.rejected


def test_stop_replays_an_exact_range(tmp_path):
    path = tmp_path / "s.spool"
    frames = [event_frame(i) for i in range(3)]
    path.write_bytes(HEADER + b"".join(frames))
    stop = len(HEADER) + len(frames[0]) + len(frames[1])
    res = SpoolReader(path).read(len(HEADER), stop=stop)
    assert steps_of(res) == [0, 1] and res.offset == stop


# -- property: whatever happens to some frames, the untouched ones are all delivered, in order ---------

damage = st.sampled_from(["none", "flip", "garbage", "cut", "drop_tail"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.tuples(damage, st.integers(0, 10**6), st.binary(min_size=1, max_size=40)),
                     min_size=1, max_size=12),
       read_size=st.sampled_from([64, 300, 1 << 20]))
def test_damage_never_stops_good_frames(tmp_path_factory, plan, read_size):
    path = tmp_path_factory.mktemp("prop") / "s.spool"
    data, expected = bytearray(HEADER), []
    rnd = random.Random(len(plan))
    for i, (how, where, junk) in enumerate(plan):
        frame = bytearray(event_frame(i))
        if how == "none":
            expected.append(i)
        elif how == "flip":
            frame[where % len(frame)] ^= 1 << rnd.randrange(8)
        elif how == "garbage":
            expected.append(i)
            data += junk.replace(MAGIC, b"")  # junk between frames (a real magic in junk is a frame start)
        elif how == "cut":
            frame = frame[: FRAME_HEADER_SIZE + (where % 30)]
        data += frame if how != "drop_tail" else b""
    path.write_bytes(bytes(data))
    got, rejected, end, reader = read_all(path, max_read_bytes=read_size)
    steps = [f.table.column("step")[0].as_py() for f in got if f.kind == "event"]
    # Every untouched frame arrives, in order. A cut frame at the very end may legitimately wait as an
    # incomplete tail; everything else must be consumed.
    assert [s for s in steps if s in expected] == expected
    assert set(steps) <= set(range(len(plan)))
    assert all(r[1] in REJECT_REASONS for r in rejected)
    assert sum(reader.rejections.values()) == len(rejected)
    damaged = [p for p in plan if p[0] in ("flip", "cut")]
    if not damaged:
        assert not rejected or all(r[1] == "bad_magic" for r in rejected)
        assert end == len(data)
