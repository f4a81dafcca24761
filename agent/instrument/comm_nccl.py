"""Timing of collectives on CUDA tensors (NCCL), kept apart so it can be checked on a GPU machine.

Written from torch 2.13's source on a machine without a GPU. Its c10d path (blocking and async
all-reduce and all-gather, ``Work.wait``) and its funcol path (all-reduce, all-gather, ``wait_tensor``) are
checked on a GPU by the GPU kit's section 2 (``make gpu-check``: against torch.profiler's GPU time of the
same ops, within 0.8-1.25x or 5 us in all 30 cells on one H100 with torch 2.11, 2026-11-27), its DDP path
by section 8 (one record per bucket, bytes as DDP's reducer reports). Its FSDP2 path has not run on a GPU
yet: check it with a profiler trace before trusting its numbers.

Why CUDA events: on NCCL a ``Work``'s future completes when the op is *enqueued*, and ``Work.wait`` /
``wait_tensor`` only make the current stream wait for the NCCL stream; CPU timestamps say nothing about
when the transfer ran. ProcessGroupNCCL makes its stream wait for the current stream before launching, so:

- ``start``: an event recorded on the current stream at issue; the NCCL kernel starts no earlier.
- synchronous call (c10d ``async_op=False``): the call ends with a stream wait, so an event recorded on
  the current stream after it fires when the op is done: ``start → end`` is the op's duration and also
  the time the issuing stream stalled on it (its exposed part).
- wait points (``Work.wait``, ``wait_tensor``): events right before and after; their gap is the time the
  compute stream stalled on the op (``wait_s``). Duration: ``Work._get_duration()`` when the process group
  was created with ``TORCH_NCCL_ENABLE_TIMING=1`` (NCCL's own start/end events), otherwise
  ``start → after-wait`` — an upper bound when the op finished before the wait.
- FSDP2 (ops on its own streams, the compute stream waits on an event FSDP records): duration from events
  on the side stream; exposure not observable here, ``wait_s`` = NaN.
- DDP: the reducer's finalize window (``comm_ddp``) is timed by events at the two final callbacks; the
  stall is assigned to the last bucket (completion order is not known without NCCL timing); per-bucket
  duration only with ``TORCH_NCCL_ENABLE_TIMING=1``, else NaN.

Records are made by ``resolve`` once all their events have completed (``query()`` never blocks). It runs
where the tracer is drained: on the telemetry's flusher thread (``CollectiveTracer.drain``), not on the
training thread, which per op only records its events (``torch.Event``: made and recorded on the
current stream in C) and queues the op with the step it belongs to. Events are not reused: on an H100
(GPU check, 2026-11-27) an event recorded again after completing read 1.5-2 µs longer intervals than a
new one (async c10d ops then fell outside the check's ±5 µs of the profiler), for 2.3 µs of CPU saved.
A recorder without a flusher (``ListRecorder``) gets them at ``flush()``. ``t_start`` is the CPU issue
time; ``t_end`` is ``t_start + duration`` (GPU and CPU clocks are not aligned; the interval is what is
measured).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

_NAN = float("nan")
SIDE_STREAM = object()  # ``queue_fast``'s ``w0`` for an op issued on a side stream: its stall is not observable
_MAX_QUEUED = 8192  # bound of the queue, and of the ops waiting for their events; beyond it the oldest go (counted)


class _CudaOp:
    __slots__ = ("start", "end", "waits", "work", "exposure_known")

    def __init__(self, start: Any) -> None:
        self.start = start
        self.end: Any = None
        self.waits: list[tuple[Any, Any]] = []
        self.work: Any = None
        self.exposure_known = True


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


def _set_device(index: int) -> None:
    import torch

    torch.cuda.set_device(index)


def _new_event() -> Any:
    import torch

    # torch.Event: constructor and record() in C, record() on the current stream without the Python
    # detour of torch.cuda.Event.record (torch.cuda.current_stream() builds a Stream object per call):
    # 2.7-4.8 µs of CPU per event made and recorded against 9.1-14.4 (one H100, GPU check section 7, two
    # runs on 2026-11-27).
    make = getattr(torch, "Event", None)
    if make is None:  # (a torch before 2.5: no torch.Event)
        return torch.cuda.Event(enable_timing=True)
    return make("cuda", enable_timing=True)


class CudaCommTimer:
    """Per-tracer CUDA timing state. The training thread records events and queues ops (``_queue``, with
    the open step's key); ``resolve`` (one caller at a time, usually the flusher) makes the records of
    those whose events have completed. The queue is shared by the two threads through deque operations
    that are each atomic (append, popleft), a popleft of an emptied queue being expected (the other
    thread got there first).

    Another thread that resolves (the flusher) first makes the training thread's device its own current
    device: CUDA calls there would otherwise create a context on device 0 (its default), on every rank."""

    def __init__(self, *, live: Any = None, stats: Any = None) -> None:
        from meshscope.agent.instrument.ops import _Direct

        self._live = live if live is not None else _Direct()
        self._stats: Any = stats if stats is not None else collections.Counter()
        self._queue: collections.deque[tuple[Any, Any]] = collections.deque()
        self._waiting: list[tuple[Any, Any]] = []  # the resolver's: taken from the queue, not complete yet
        self._lock = threading.Lock()
        self._nccl_timing = True  # until a Work says otherwise
        self._device: int | None = None  # the recording thread's device, read at its first event
        self._owner = 0  # that thread
        self._on_device: set[int] = set()  # threads that resolve and were set to it
        self.unresolved: frozenset = frozenset()  # step keys of the ops left waiting by the last resolve

    def event(self) -> Any:
        """A new event, recorded now on the current stream."""
        ev = _new_event()
        ev.record()
        if self._device is None:
            self._device, self._owner = _current_device(), threading.get_ident()
        return ev

    def on_issue(self, p: Any) -> None:
        p.cuda = _CudaOp(self.event())

    def on_sync_return(self, p: Any) -> None:
        p.cuda.end = self.event()
        self._push(p)

    def on_side_stream_return(self, p: Any) -> None:
        p.cuda.end = self.event()
        p.cuda.exposure_known = False
        self._push(p)

    def wait(self, tracer: Any, ops: list[Any], original: Callable, work: Any, args: tuple, kwargs: dict) -> Any:
        try:
            e0 = self.event()
        except Exception as exc:  # telemetry never raises into the loop: the wait goes on untimed
            tracer.error("cuda_wait", exc)
            return original(work, *args, **kwargs)
        result = original(work, *args, **kwargs)
        try:
            e1 = self.event()
            for p in ops:
                p.cuda.work = work
                p.cuda.waits.append((e0, e1))
                self._push(p)
        except Exception as exc:
            tracer.error("cuda_wait", exc)
        return result

    def wait_fast(self, tracer: Any, issued: tuple, e0: Any, original: Callable, tensor: Any) -> Any:
        """The wait of a fast site's op in flight (its ``Issued``, ``e0`` recorded at its issue): two events
        around it, then the op is queued (``queue_fast``)."""
        try:
            w0 = self.event()
        except Exception as exc:
            tracer.error("cuda_wait_tensor", exc)
            return original(tensor)
        out = original(tensor)
        try:
            self.queue_fast(issued, e0, self.event(), w0)
        except Exception as exc:
            tracer.error("cuda_wait_tensor", exc)
        return out

    def wait_tensor(self, tracer: Any, p: Any, original: Callable, tensor: Any) -> Any:
        try:
            e0 = self.event()
        except Exception as exc:
            tracer.error("cuda_wait_tensor", exc)
            return original(tensor)
        out = original(tensor)
        try:
            if p is not None and p.cuda is not None:
                p.cuda.waits.append((e0, self.event()))
                if tracer.current() is p:  # a wait inside the issuing call: queued when that call returns
                    p.waited = True
                else:
                    self._push(p)
            elif p is None:
                tracer.stats["unmatched_waits"] += 1
        except Exception as exc:
            tracer.error("cuda_wait_tensor", exc)
        return out

    def queue(self, p: Any) -> None:
        self._push(p)

    def queue_fast(self, issued: tuple, e0: Any, e1: Any, w0: Any = None) -> None:
        """One op of a fast site (its ``Issued`` tuple), with no op object: ``e0`` recorded before its
        issue, ``e1`` after its (blocking) call or its wait, ``w0`` before that wait (None: a blocking call,
        whose whole interval is the issuing stream's stall; ``SIDE_STREAM``: a call on a side stream, FSDP's,
        whose stall is not observable: NaN)."""
        self._push((issued, e0, e1, w0))

    def on_ddp_backward_end(self, ops: list[tuple[Any, Any]], ev_a: Any, ev_b: Any) -> None:
        for i, (p, work) in enumerate(ops):
            p.cuda.work = work
            if i == len(ops) - 1:
                p.cuda.waits.append((ev_a, ev_b))
            self._push(p)

    def resolve(self, tracer: Any) -> int:
        """Record every queued op whose events have completed (non-blocking); keep the rest for the next
        call. Any thread; one at a time."""
        with self._lock:
            work, queue = self._waiting, self._queue
            tid = threading.get_ident()
            if self._device is not None and tid != self._owner and tid not in self._on_device:
                _set_device(self._device)
                self._on_device.add(tid)
            for _ in range(len(queue)):
                try:
                    work.append(queue.popleft())
                except IndexError:  # the training thread dropped the oldest meanwhile (a full queue)
                    break
            emitted, keep = 0, []
            for p, context in work:
                if type(p) is tuple:  # a fast site's op: (Issued, start, end, before-wait or None)
                    try:
                        issued, e0, e1, w0 = p
                        side = w0 is SIDE_STREAM
                        if not (e0.query() and e1.query() and (w0 is None or side or w0.query())):
                            keep.append((p, context))
                            continue
                        duration = e0.elapsed_time(e1) / 1e3
                        wait_s = duration if w0 is None else _NAN if side else w0.elapsed_time(e1) / 1e3
                    except Exception as exc:
                        tracer.error("cuda_resolve", exc)
                        continue
                    tracer.put(issued + (issued[6] + duration, wait_s, context))
                    emitted += 1
                    continue
                try:
                    c = p.cuda
                    events = [c.start] + ([c.end] if c.end is not None else []) + [e for pair in c.waits for e in pair]
                    if not all(ev.query() for ev in events):
                        keep.append((p, context))
                        continue
                    duration = self._duration(c)
                    if c.end is not None and c.exposure_known:
                        wait_s = c.start.elapsed_time(c.end) / 1e3
                    elif c.exposure_known:
                        wait_s = sum(e0.elapsed_time(e1) for e0, e1 in c.waits) / 1e3
                    else:
                        wait_s = _NAN
                except Exception as exc:  # this op's events (a CUDA error): it goes, counted; the rest still flow
                    tracer.error("cuda_resolve", exc)
                    continue
                tracer.put((p.op, p.key, p.nbytes, p.peer, p.source, p.seq, p.t_start, p.t_start + duration, wait_s,
                            context))
                emitted += 1
            if len(keep) > _MAX_QUEUED:  # a GPU that never completes them: the oldest go
                # its own key: the training thread adds to "dropped_pending" (``_push``), and a Counter's += is
                # a read and a write that two threads could interleave
                self._stats["dropped_unresolved"] += len(keep) - _MAX_QUEUED
                keep = keep[-_MAX_QUEUED:]
            self._waiting = keep
            self.unresolved = frozenset(context for _, context in keep)
            return emitted

    def settle(self, tracer: Any, *, timeout_s: float, clock: Callable[[], float], sleep: Callable[[float], None]
               ) -> None:
        """Resolve until nothing is left or ``timeout_s`` has passed (a detach: the last step's ops may
        still be running on the GPU)."""
        deadline = clock() + timeout_s
        while True:
            self.resolve(tracer)
            if not self.pending() or clock() >= deadline:
                return
            sleep(0.005)

    def pending(self) -> int:
        return len(self._queue) + len(self._waiting)

    def clear(self) -> int:
        """Forget every op not resolved yet (the tracer detaches); returns how many."""
        with self._lock:
            n = self.pending()
            self._queue.clear()
            self._waiting = []
            self.unresolved = frozenset()  # no step waits for ops that will never be recorded
            return n

    def _duration(self, c: _CudaOp) -> float:
        if c.work is not None and self._nccl_timing:
            try:
                return c.work._get_duration() / 1e3  # ms; needs TORCH_NCCL_ENABLE_TIMING=1
            except Exception:
                self._nccl_timing = False  # not enabled for this job: do not pay the exception again
        if c.end is not None:
            return c.start.elapsed_time(c.end) / 1e3
        if c.waits:
            return c.start.elapsed_time(c.waits[-1][1]) / 1e3
        return _NAN

    def _push(self, p: Any) -> None:
        queue = self._queue
        if len(queue) >= _MAX_QUEUED:
            try:
                queue.popleft()
                self._stats["dropped_pending"] += 1
            except IndexError:  # the resolver took them all meanwhile
                pass
        queue.append((p, self._live.key))
