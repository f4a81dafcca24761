"""The rank-side spool writer: never blocks, never raises, counts what it loses, recovers."""

from __future__ import annotations

import shutil
import time

import pytest

from meshscope.agent.contract import EventRecord, spool_path
from meshscope.agent.transport.reader import SpoolReader
from meshscope.agent.transport.writer import SpoolWriter
from tests.support.harness import poll_until


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


def ev(i: int) -> EventRecord:
    return EventRecord(t=float(i), step=i, kind="start", message=f"m{i}")


def read_events(path) -> list[int]:
    reader, offset, steps = SpoolReader(path), 0, []
    while True:
        res = reader.read(offset)
        steps += [s for f in res.frames if f.kind == "event" for s in f.table.column("step").to_pylist()]
        if res.offset == offset:
            assert not res.rejected
            return steps
        offset = res.offset


def make(tmp_path, **kw) -> SpoolWriter:
    return SpoolWriter(path=spool_path(tmp_path, run="r", rank=0, attempt=0), run="r", rank=0, attempt=0,
                       host="h", **kw)


def test_background_thread_writes_frames(tmp_path):
    w = make(tmp_path, flush_interval_s=0.01)
    assert w.submit("event", [ev(1), ev(2)]) and w.submit("event", [ev(3)])
    poll_until(lambda: w.written_records == 3, timeout_s=5, interval_s=0.01, what="3 records written")
    assert w.close(timeout_s=5) and read_events(w.path) == [1, 2, 3]
    assert w.spool_bytes == w.path.stat().st_size and w.dropped_records == 0 and w.write_errors == 0
    res = SpoolReader(w.path).read(0)
    assert res.frames[0].header["stream_id"] == w.stream_id and res.frames[0].header["rank"] == 0


def test_large_submits_are_split_into_frames(tmp_path):
    w = make(tmp_path, start=False, max_rows_per_frame=100)
    w.submit("event", [ev(i) for i in range(250)])
    w.flush()
    res = SpoolReader(w.path).read(0)
    assert [f.table.num_rows for f in res.frames if f.kind == "event"] == [100, 100, 50]
    assert w.close()


@pytest.mark.serial  # 10,000 submits against 50 µs each
def test_full_queue_drops_and_counts_without_blocking(tmp_path):
    w = make(tmp_path, start=False, max_pending_batches=4)  # no thread: nothing drains the queue
    t0 = time.perf_counter()
    accepted = [w.submit("event", [ev(i), ev(i)]) for i in range(10_000)]
    per_call = (time.perf_counter() - t0) / 10_000
    assert accepted[:4] == [True] * 4 and not any(accepted[4:])
    assert w.dropped_records == 2 * (10_000 - 4)
    assert per_call < 50e-6, f"submit took {per_call * 1e6:.1f} us"
    w.flush()
    assert w.written_records == 8 and w.close()


def test_submit_never_raises_on_nonsense(tmp_path):
    w = make(tmp_path, start=False)
    assert w.submit("event", None) is False  # type: ignore[arg-type]
    assert w.submit("nope", [ev(1)]) is True  # unknown kind: counted when encoded
    assert w.submit("event", [("bad", "row")]) is True
    assert w.submit("event", [(7.0, 7, "start", "m7")]) is True  # positional, even of the right length
    assert w.submit("event", [ev(5)]) is True
    w.flush()
    assert w.encode_errors == 3 and w.dropped_records == 4
    assert "event rows must come from" in w.last_error and "got a tuple tagged 7.0" in w.last_error
    assert read_events(w.path) == [5] and w.close()
    assert w.submit("event", [ev(6)]) is False and w.dropped_records == 5  # closed


def test_outage_within_the_hold_loses_nothing_and_recovers_at_the_first_retry(tmp_path):
    clock = FakeClock()
    blocker = tmp_path / "spool"
    blocker.write_text("a file where the spool directory should be")
    w = make(tmp_path, start=False, clock=clock, retry_first_s=0.05, retry_max_s=1.0)
    w.submit("event", [ev(1)])
    w.flush()
    assert w.write_errors == 1 and w.dropped_records == 0 and w.held_records == 1 and "open" in w.last_error
    w.submit("event", [ev(2)])
    w.flush()  # within the back-off: held, no other attempt
    assert w.write_errors == 1 and w.dropped_records == 0 and w.held_records == 2
    blocker.unlink()
    clock.t += 0.05  # the first retry comes one short interval later
    w.submit("event", [ev(3)])
    w.flush()
    assert w.write_errors == 1 and w.held_records == 0 and w.held_bytes == 0 and w.dropped_records == 0
    assert read_events(w.path) == [1, 2, 3] and w.written_records == 3 and w.close()


def test_retries_back_off_from_a_short_interval_to_the_cap_and_reset_on_success(tmp_path):
    clock = FakeClock()
    blocker = tmp_path / "spool"
    blocker.write_text("in the way")
    w = make(tmp_path, start=False, clock=clock, retry_first_s=0.05, retry_max_s=0.3)
    attempts_at = []
    t0 = clock.t
    while clock.t - t0 < 2.0:  # a 2 s outage, flushed every 10 ms
        before = w.write_errors
        w.submit("event", [ev(len(attempts_at))])
        w.flush()
        if w.write_errors > before:
            attempts_at.append(round(clock.t - t0, 3))
        clock.t += 0.01
    gaps = [b - a for a, b in zip(attempts_at, attempts_at[1:])]
    want = [min(0.05 * 2 ** i, 0.3) for i in range(len(gaps))]  # doubling to the cap
    assert len(gaps) >= 6 and all(0 <= g - e < 0.0101 for g, e in zip(gaps, want)), (gaps, want)  # one 10 ms tick
    blocker.unlink()
    clock.t += 0.3
    w.flush()
    assert w.held_records == 0 and w.dropped_records == 0
    blocker_file = tmp_path / "other"  # after a success the next failure starts from the short interval
    w.path = blocker_file / "x.spool"
    blocker_file.write_text("in the way")
    errors = w.write_errors
    w.submit("event", [ev(99)])
    w.flush()
    clock.t += 0.05
    w.flush()
    assert w.write_errors == errors + 2
    assert w.close()


def test_an_outage_past_the_hold_drops_the_newest_and_counts_them_exactly(tmp_path):
    clock = FakeClock()
    blocker = tmp_path / "spool"
    blocker.write_text("in the way")
    w = make(tmp_path, start=False, clock=clock, max_hold_bytes=4096, retry_first_s=0.05, retry_max_s=0.05)
    for i in range(200):
        w.submit("event", [ev(i)])
        w.flush()
        assert w.held_bytes <= 4096
        clock.t += 0.01
    held, dropped = w.held_records, w.dropped_records
    assert 0 < held < 200 and held + dropped == 200
    blocker.unlink()
    clock.t += 0.05
    w.submit("event", [ev(1000)])
    w.flush()
    # The onset of the outage is kept (the oldest rows), then what came after the space returned.
    assert read_events(w.path) == list(range(held)) + [1000]
    assert w.dropped_records == dropped and w.written_records + w.dropped_records == 201 and w.close()


def test_disk_full_is_held_then_counted_at_close_and_never_raises(tmp_path):
    w = SpoolWriter(path="/dev/full", run="r", rank=0, attempt=0, host="h", start=False)
    for i in range(3):
        w.submit("event", [ev(i)])
        w.flush()
    assert w.write_errors >= 1 and w.dropped_records == 0 and w.held_records == 3 and w.written_records == 0
    assert "No space" in w.last_error or "ENOSPC" in w.last_error or "28" in w.last_error
    assert w.close() and w.dropped_records == 3 and w.held_records == 0


def test_close_on_a_full_disk_retries_for_a_bounded_time_then_counts(tmp_path):
    w = SpoolWriter(path="/dev/full", run="r", rank=0, attempt=0, host="h", flush_interval_s=0.01)
    for i in range(10):
        w.submit("event", [ev(i)])
    poll_until(lambda: w.write_errors >= 1, timeout_s=5, interval_s=0.01, what="a write error counted")
    t0 = time.monotonic()
    assert w.close(timeout_s=1.0)
    took = time.monotonic() - t0
    assert 0.4 <= took < 1.0, took  # retried for half the timeout, not for ever
    assert w.write_errors >= 3 and w.dropped_records == 10 and w.written_records == 0


def test_deleted_spool_directory_is_recreated_with_a_new_stream(tmp_path):
    w = make(tmp_path, start=False)
    w.submit("event", [ev(1)])
    w.flush()
    first_stream = w.stream_id
    shutil.rmtree(tmp_path / "spool")
    w.submit("event", [ev(2)])
    w.flush()
    assert read_events(w.path) == [2] and w.stream_id != first_stream and w.write_errors == 0
    assert w.close()


def test_close_drains_the_queue_and_is_bounded(tmp_path):
    w = make(tmp_path, flush_interval_s=60)  # the thread would sleep for a minute
    for i in range(100):
        w.submit("event", [ev(i)])
    t0 = time.monotonic()
    assert w.close(timeout_s=5)
    assert time.monotonic() - t0 < 5 and read_events(w.path) == list(range(100))


@pytest.mark.parametrize("kw", [{"max_pending_batches": 0}, {"flush_interval_s": 0}])
def test_bad_configuration_is_a_value_error(tmp_path, kw):
    with pytest.raises(ValueError):
        make(tmp_path, **kw)


def test_a_reader_following_a_live_writer_sees_no_damage(tmp_path):
    w = make(tmp_path, flush_interval_s=0.001)
    reader, offset, seen = None, 0, []
    for i in range(300):
        w.submit("event", [ev(i)])
        if i % 7 == 0 and w.path.exists():
            reader = reader or SpoolReader(w.path)
            res = reader.read(offset)
            seen += [s for f in res.frames if f.kind == "event" for s in f.table.column("step").to_pylist()]
            offset = res.offset
    assert w.close()
    reader = reader or SpoolReader(w.path)
    res = reader.read(offset)
    seen += [s for f in res.frames if f.kind == "event" for s in f.table.column("step").to_pylist()]
    assert seen == list(range(300)) and sum(reader.rejections.values()) == 0
