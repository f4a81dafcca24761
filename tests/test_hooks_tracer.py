"""CollectiveTracer internals without a process group: DDP's exposure split, record emission, patching
and restoring, and the CUDA timing arithmetic (stand-in events: the CUDA path itself needs a GPU)."""

from __future__ import annotations

import math
import types

import pytest

from meshscope.agent.instrument.collectives import CollectiveTracer
from meshscope.agent.instrument.comm_ddp import split_window
from meshscope.agent.instrument.comm_nccl import CudaCommTimer, _CudaOp
from meshscope.agent.instrument.meshinfo import GroupInfo, MeshInfo
from meshscope.agent.instrument.recorder import ListRecorder


class FixedMesh(MeshInfo):
    """Every group is a 4-rank tp group named after the designator."""

    def lookup(self, group):
        return GroupInfo(dim="tp", size=4, name=str(group), ranks=(0, 1, 2, 3))


class StrictRecorder:
    """The Recorder protocol exactly as agent/instrument/recorder.py declares it (no ``seq``)."""

    def __init__(self) -> None:
        self.clock = ListRecorder().clock
        self.rows: list[dict] = []
        self.errors: list[str] = []

    def record_collective(self, *, op, dim, group, group_size, nbytes, t_start, t_end, wait_s, peer=-1, source):
        self.rows.append(dict(op=op, group=group, nbytes=nbytes, wait_s=wait_s, peer=peer, source=source))

    def record_span(self, *, stage, microbatch, kind, t_start, t_end):
        pass

    def record_error(self, where, exc):
        self.errors.append(where)


# ------------------------------------------------------------------------------------ DDP exposure
def test_split_window_hand_computed() -> None:
    # Window [2, 6]: bucket a done at 1 (during backward: hidden), b at 3, c at 5; finalize returns at 6.
    assert split_window([1.0, 3.0, 5.0], 2.0, 6.0) == [0.0, 1.0, 3.0]  # c: 5 − 3 plus the tail 6 − 5
    # Completion order differs from issue order; the shares follow completion.
    assert split_window([5.0, 3.0], 2.0, 6.0) == [3.0, 1.0]
    # A bucket whose completion was not stamped counts as done at the end of the window.
    assert split_window([None, 3.0], 2.0, 6.0) == [3.0, 1.0]
    # Everything finished during backward: the whole (short) window is the copy-out tail of the last one.
    assert split_window([0.5, 1.0], 2.0, 2.25) == [0.0, 0.25]
    assert split_window([], 2.0, 3.0) == []


def test_split_window_always_sums_to_the_window() -> None:
    done = [4.2, None, 2.5, 9.0, 3.3]
    assert sum(split_window(done, 3.0, 7.5)) == pytest.approx(4.5)


# --------------------------------------------------------------------------------------- emission
def test_seq_numbers_per_group_in_issue_order() -> None:
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    ops = [tracer.begin("all_reduce", "g1", 8, "c10d"), tracer.begin("all_gather", "g2", 16, "funcol"),
           tracer.begin("send", "g1", 4, "c10d", group_peer=2)]
    for p in reversed(ops):  # recorded in a different order than issued (async completions)
        tracer.emit(p, t_end=p.t_start + 1.0, wait_s=0.5)
    got = [(r["op"], r["group"], r["seq"], r["peer"]) for r in rec.collectives]
    assert got == [("send", "g1", 2, 2), ("all_gather", "g2", 1, -1), ("all_reduce", "g1", 1, -1)]
    assert {(r["dim"], r["group_size"]) for r in rec.collectives} == {("tp", 4)}


def test_recorder_without_seq_gets_the_protocol_fields_only() -> None:
    rec = StrictRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    p = tracer.begin("broadcast", "g", 32, "c10d")
    tracer.emit(p, t_end=p.t_start, wait_s=0.0)
    assert rec.rows == [dict(op="broadcast", group="g", nbytes=32, wait_s=0.0, peer=-1, source="c10d")]
    assert rec.errors == []


def test_failing_recorder_is_reported_not_raised() -> None:
    class Failing(StrictRecorder):
        def record_collective(self, **kw):
            raise OSError("spool full")

    rec = Failing()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    tracer.emit(tracer.begin("all_reduce", "g", 8, "c10d"), t_end=0.0, wait_s=0.0)
    assert rec.errors == ["collectives.record_collective"] and tracer.stats["errors"] == 1


# ------------------------------------------------------------------------------------- patching
def fake_namespace(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.op = lambda x: x + 1
    return module


def test_patch_installs_one_wrapper_in_every_owner_and_restores() -> None:
    a, b = fake_namespace("a"), fake_namespace("b")
    b.op = a.op  # a re-export, like torch.distributed ↔ distributed_c10d
    original = a.op
    tracer = CollectiveTracer(ListRecorder(), mesh_info=FixedMesh())
    calls = []
    wrapper = tracer.patch((a, b), "op", lambda orig: lambda x: calls.append(x) or orig(x))
    assert a.op is wrapper and b.op is wrapper and wrapper.__wrapped__ is original
    assert b.op(1) == 2 and calls == [1]
    with pytest.raises(RuntimeError, match="already patched"):
        CollectiveTracer(ListRecorder()).patch((a,), "op", lambda orig: orig)
    tracer.detach()
    assert a.op is original and b.op is original


def test_detach_leaves_a_later_patch_alone() -> None:
    a = fake_namespace("a")
    original = a.op
    tracer = CollectiveTracer(ListRecorder(), mesh_info=FixedMesh())
    tracer.patch((a,), "op", lambda orig: lambda x: orig(x))
    someone_else = lambda x: -x  # noqa: E731 - patched on top of ours by another tool
    a.op = someone_else
    tracer.detach()
    assert a.op is someone_else and tracer.stats["detach_conflicts"] == 1
    assert original(1) == 2


# ---------------------------------------------------------------------------------- CUDA arithmetic
class Event:
    """Stand-in for torch.cuda.Event: a GPU timestamp in ms and whether it has completed."""

    def __init__(self, ms: float, done: bool = True) -> None:
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "Event") -> float:
        return end.ms - self.ms


class TimedWork:
    def __init__(self, ms: float | None) -> None:
        self.ms = ms

    def _get_duration(self) -> float:
        if self.ms is None:
            raise RuntimeError("Enable TORCH_NCCL_ENABLE_TIMING to use getDuration")
        return self.ms


def cuda_op(tracer: CollectiveTracer, start: Event) -> object:
    p = tracer.begin("all_reduce", "g", 1024, "c10d")
    p.cuda = _CudaOp(start)
    return p


def test_cuda_resolution_sync_wait_side_stream_and_pending() -> None:
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    timer = CudaCommTimer()
    sync = cuda_op(tracer, Event(10.0))  # blocking call: start → end is duration and stall
    sync.cuda.end = Event(12.0)
    waited = cuda_op(tracer, Event(20.0))  # async, waited: stall = the gap around the wait
    waited.cuda.waits.append((Event(25.0), Event(26.5)))
    side = cuda_op(tracer, Event(30.0))  # FSDP side stream: exposure unknown
    side.cuda.end, side.cuda.exposure_known = Event(33.0), False
    pending = cuda_op(tracer, Event(40.0))  # not finished on the GPU yet
    pending.cuda.end = Event(41.0, done=False)
    for p in (sync, waited, side, pending):
        timer.queue(p)
    assert timer.resolve(tracer) == 3
    by_seq = {r["seq"]: r for r in rec.collectives}
    us = dict(abs=1e-6)  # t_start is epoch seconds: float64 resolves ~0.24 µs there
    assert by_seq[1]["t_end"] - by_seq[1]["t_start"] == pytest.approx(0.002, **us)
    assert by_seq[1]["wait_s"] == pytest.approx(0.002)
    # start → after the wait: an upper bound of the duration
    assert by_seq[2]["t_end"] - by_seq[2]["t_start"] == pytest.approx(0.0065, **us)
    assert by_seq[2]["wait_s"] == pytest.approx(0.0015)
    assert by_seq[3]["t_end"] - by_seq[3]["t_start"] == pytest.approx(0.003, **us)
    assert math.isnan(by_seq[3]["wait_s"])
    pending.cuda.end.done = True  # the next flush picks it up
    assert timer.resolve(tracer) == 1 and rec.collectives[-1]["seq"] == 4


def test_cuda_duration_prefers_nccl_timing_and_falls_back_once() -> None:
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    timer = CudaCommTimer()
    timed = cuda_op(tracer, Event(0.0))
    timed.cuda.work = TimedWork(0.75)  # TORCH_NCCL_ENABLE_TIMING=1: NCCL's own events
    timed.cuda.waits.append((Event(5.0), Event(5.0)))
    timer.queue(timed)
    untimed = cuda_op(tracer, Event(0.0))
    untimed.cuda.work = TimedWork(None)
    untimed.cuda.waits.append((Event(1.0), Event(4.0)))
    timer.queue(untimed)
    assert timer.resolve(tracer) == 2
    d = [r["t_end"] - r["t_start"] for r in rec.collectives]
    assert d == [pytest.approx(0.00075, abs=1e-6), pytest.approx(0.004, abs=1e-6)]
    assert timer._nccl_timing is False  # the failing getDuration is not retried on every op


def test_patch_of_a_name_this_torch_lacks_creates_nothing() -> None:
    a = fake_namespace("a")
    tracer = CollectiveTracer(ListRecorder(), mesh_info=FixedMesh())
    assert tracer.patch((a,), "all_gather_single", lambda orig: lambda x: orig(x)) is None
    assert not hasattr(a, "all_gather_single")
    tracer.detach()
    assert not hasattr(a, "all_gather_single")


class DeferredRecorder(StrictRecorder):
    """A recorder with a flusher (as Telemetry): a ``live`` view of the open step and an ``epoch``."""

    def __init__(self) -> None:
        super().__init__()
        self.live = types.SimpleNamespace(key="step-1")
        self.epoch = 0.0

    def record_collective(self, *, context=None, seq=0, **kw):
        self.rows.append(dict(kw, context=context, seq=seq))


def test_cuda_ops_are_resolved_by_drain_not_on_the_training_thread_and_keep_their_step() -> None:
    """With a flusher, ``flush()`` (the training thread's step end) reads no event; ``drain()`` (the
    flusher) makes the records, each accounted to the step open when its events were recorded."""
    rec = DeferredRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    timer = tracer.cuda_timer()
    p = cuda_op(tracer, Event(10.0))
    p.cuda.end = Event(12.0)
    queried = []
    p.cuda.start.query = lambda: queried.append(1) or True
    timer.queue(p)
    rec.live.key = "step-2"  # the next step opened before the flusher ran
    tracer.flush()
    assert queried == [] and rec.rows == []
    assert tracer.drain() == 1 and queried
    [row] = rec.rows
    assert row["context"] == "step-1" and row["wait_s"] == pytest.approx(0.002)


def test_cuda_queue_and_resolve_on_two_threads_lose_nothing() -> None:
    import threading

    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    timer = tracer.cuda_timer()
    n, stop = 6000, threading.Event()  # under the queue's bound (8192): nothing may be dropped

    def resolver() -> None:
        while not stop.is_set():
            timer.resolve(tracer)

    thread = threading.Thread(target=resolver)
    thread.start()
    for i in range(n):
        p = cuda_op(tracer, Event(float(i)))
        p.cuda.end = Event(i + 0.5)
        timer.queue(p)
    stop.set()
    thread.join()
    timer.resolve(tracer)
    assert len(rec.collectives) == n and timer.pending() == 0 and tracer.stats["dropped_pending"] == 0
    assert sorted(r["seq"] for r in rec.collectives) == list(range(1, n + 1))


def test_an_op_whose_events_fail_is_counted_and_the_others_still_recorded() -> None:
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    timer = tracer.cuda_timer()
    bad, good = cuda_op(tracer, Event(0.0)), cuda_op(tracer, Event(1.0))
    bad.cuda.end, good.cuda.end = Event(2.0), Event(3.0)

    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    bad.cuda.start.query = broken
    timer.queue(bad)
    timer.queue(good)
    assert timer.resolve(tracer) == 1 and timer.pending() == 0
    assert [r["seq"] for r in rec.collectives] == [2] and [w for w, _ in rec.errors] == ["collectives.cuda_resolve"]
    assert timer.resolve(tracer) == 0 and len(rec.collectives) == 1  # not made twice


def test_cuda_ops_beyond_the_bound_are_counted_apart_on_each_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ops that never complete are kept up to ``_MAX_QUEUED``: the oldest beyond it go, counted by the
    resolver under its own key (``dropped_unresolved``) and by the training thread's queue under
    ``dropped_pending``, so that no += of one thread overwrites the other's. Both are records lost."""
    from meshscope.agent.instrument import comm_nccl
    from meshscope.agent.instrument.readout import tracer_losses

    monkeypatch.setattr(comm_nccl, "_MAX_QUEUED", 2)
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    timer = tracer.cuda_timer()
    for i in range(2):  # resolved, none complete: kept
        stuck = cuda_op(tracer, Event(float(i)))
        stuck.cuda.end = Event(9.0, done=False)
        timer.queue(stuck)
    timer.resolve(tracer)
    for i in range(3):  # the queue's own bound: its oldest goes at the third
        stuck = cuda_op(tracer, Event(float(i)))
        stuck.cuda.end = Event(9.0, done=False)
        timer.queue(stuck)
    assert tracer.stats["dropped_pending"] == 1
    timer.resolve(tracer)  # 2 kept + 2 queued: the 2 oldest go
    assert tracer.stats["dropped_unresolved"] == 2 and timer.pending() == 2 and rec.collectives == []
    assert tracer_losses([tracer]) == 3


def test_detach_counts_cuda_ops_whose_events_never_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshscope.agent.instrument import collectives

    monkeypatch.setattr(collectives, "_CUDA_SETTLE_S", 0.05)
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    timer = tracer.cuda_timer()
    done, stuck = cuda_op(tracer, Event(0.0)), cuda_op(tracer, Event(1.0))
    done.cuda.end, stuck.cuda.end = Event(2.0), Event(3.0, done=False)
    timer.queue(done)
    timer.queue(stuck)
    tracer.detach()
    assert [r["seq"] for r in rec.collectives] == [1]
    assert tracer.stats["dropped_pending"] == 1 and timer.pending() == 0


def test_detach_waits_for_the_last_cuda_ops_to_complete() -> None:
    """The last step's ops may still run on the GPU when the job closes: detach resolves until they
    complete (within its bound) rather than dropping them."""
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    p = cuda_op(tracer, Event(0.0))
    p.cuda.end = Event(4.0, done=False)
    polls = []

    def query() -> bool:  # completes on the GPU at the third look
        polls.append(1)
        return len(polls) >= 3
    p.cuda.end.query = query
    tracer.cuda_timer().queue(p)
    tracer.detach()
    assert len(rec.collectives) == 1 and rec.collectives[0]["wait_s"] == pytest.approx(0.004)
    assert tracer.stats["dropped_pending"] == 0


def test_an_op_queued_while_resolve_runs_waits_for_the_next_resolve() -> None:
    """The training thread may queue an op while the flusher resolves: a pass takes what was queued when
    it began, and the op queued meanwhile is the next pass's (neither lost nor recorded twice)."""
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    timer = tracer.cuda_timer()
    first, second = cuda_op(tracer, Event(0.0)), cuda_op(tracer, Event(1.0))
    first.cuda.end, second.cuda.end = Event(2.0), Event(3.0)
    first.cuda.start.query = lambda: timer.queue(second) or True  # queued "meanwhile", mid-resolve
    timer.queue(first)
    assert timer.resolve(tracer) == 1 and timer.pending() == 1
    assert timer.resolve(tracer) == 1 and [r["seq"] for r in rec.collectives] == [1, 2]


def test_a_resolving_thread_takes_the_recording_threads_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flusher resolves CUDA events of the training thread's device: it makes that device its own
    first (a CUDA call on a thread without one creates a context on device 0, on every rank); the
    recording thread itself is never switched."""
    import threading

    from meshscope.agent.instrument import comm_nccl

    class Recordable(Event):
        def record(self) -> None:
            pass

    switched = []
    monkeypatch.setattr(comm_nccl, "_new_event", lambda: Recordable(0.0))
    monkeypatch.setattr(comm_nccl, "_current_device", lambda: 3)
    monkeypatch.setattr(comm_nccl, "_set_device", switched.append)
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=FixedMesh())
    timer = tracer.cuda_timer()
    for _ in range(2):
        p = cuda_op(tracer, timer.event())
        p.cuda.end = timer.event()
        timer.queue(p)
        timer.resolve(tracer)  # the recording thread: stays as it is
    assert switched == [] and len(rec.collectives) == 2

    def flusher() -> None:
        for _ in range(2):
            p = cuda_op(tracer, Event(0.0))
            p.cuda.end = Event(1.0)
            timer.queue(p)
            timer.resolve(tracer)
    thread = threading.Thread(target=flusher)
    thread.start()
    thread.join()
    assert switched == [3] and len(rec.collectives) == 4
