"""The fast sites' CUDA path (``comm_c10d._cuda_blocking``, ``comm_funcol.single``'s ``_cuda`` and its wait)
against the real torch API on the ``fake`` backend, without a GPU: tensors tagged ``_looks_cuda`` answer
``is_cuda`` True (a property patched on ``torch.Tensor`` in this process only), and CUDA events are stand-ins
that read 1 ms later each. Prints one JSON object: what each case recorded. Used by
tests/test_hooks_cuda_sites.py; ``MESHSCOPE_NATIVE`` picks the C or the Python form of the sites."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshscope.agent.instrument import comm_nccl, native
from meshscope.agent.instrument.collectives import CollectiveTracer
from meshscope.agent.instrument.recorder import ListRecorder

_real_is_cuda = torch._C.TensorBase.is_cuda
torch.Tensor.is_cuda = property(lambda self: self.__dict__.get("_looks_cuda", False) or _real_is_cuda.__get__(self))
_ticks = itertools.count()
MADE: list[float] = []
CURRENT: list[Any] = [None]  # the case's tracer


class Event:
    """A recorded CUDA event's stand-in: its GPU time (ms) is the order it was made in."""

    def __init__(self) -> None:
        self.ms = float(next(_ticks))
        MADE.append(self.ms)

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "Event") -> float:
        return end.ms - self.ms


class PerfClock:
    now = staticmethod(time.perf_counter)


def case(name: str, fn: Any, out: dict) -> None:
    rec = ListRecorder(clock=PerfClock())
    tracer = CURRENT[0] = CollectiveTracer(rec)
    tracer.attach(None)
    MADE.clear()
    try:
        fn()
    finally:
        tracer.flush()
        tracer.detach()
    keep = ("op", "nbytes", "t_start", "t_end", "wait_s", "source", "seq", "group_size")
    records = [{k: r[k] for k in keep} for r in rec.collectives]
    for r in records:  # JSON has no NaN
        r["wait_s"] = None if r["wait_s"] != r["wait_s"] else r["wait_s"]
    out[name] = {"records": records, "events": len(MADE),
                 "errors": [f"{w}: {e}" for w, e in rec.errors],
                 "stats": {k: v for k, v in tracer.stats.items() if v}}


def main() -> None:
    comm_nccl._new_event = Event
    comm_nccl._current_device = lambda: 0
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    world = dist.group.WORLD
    t = torch.ones(2, 8)  # 64 bytes
    t._looks_cuda = True
    assert t.is_cuda and not torch.ones(1).is_cuda
    out: dict[str, Any] = {"_form": {"active": native.active(CollectiveTracer(ListRecorder(clock=PerfClock())))}}
    case("c10d_blocking", lambda: [dist.all_reduce(t) for _ in range(3)], out)
    case("c10d_blocking_keywords", lambda: dist.all_reduce(tensor=t, group=world, async_op=False), out)
    case("c10d_async_wait", lambda: dist.all_reduce(t, async_op=True).wait(), out)
    case("funcol_issue_then_wait", lambda: [funcol.all_reduce(t, "sum", world).wait() for _ in range(3)], out)
    case("funcol_nested_wait", lambda: funcol.all_gather_single(t, 1, world), out)

    def raises() -> None:
        try:
            dist.all_reduce(t, op="not an op")
        except Exception:
            pass
        dist.all_reduce(t)
    case("c10d_blocking_raises_then_one", raises, out)

    def fsdp(async_op: bool) -> Any:
        # FSDP2's comm objects, as fully_shard calls them on its own stream (comm_fsdp: C site or Python)
        from meshscope.agent.instrument.comm_fsdp import TracedAllGather, TracedReduceScatter

        def run() -> None:
            tracer = CURRENT[0]
            gather = TracedAllGather(tracer, lambda o, i, g, a: dist.all_gather_into_tensor(o, i, g, async_op=a))
            scatter = TracedReduceScatter(tracer, lambda o, i, g, op, a: dist.reduce_scatter_tensor(
                o, i, op=op, group=g, async_op=a))
            out, inp = torch.ones(8, 8), torch.ones(8, 8)  # 4 ranks × (2, 8)
            out._looks_cuda = inp._looks_cuda = True
            for result in (gather(out, t, world, async_op), scatter(t, inp, world, dist.ReduceOp.SUM, async_op)):
                if async_op:
                    result.wait()
        return run
    case("fsdp_blocking", fsdp(False), out)
    case("fsdp_async", fsdp(True), out)

    def broken_events() -> None:  # a CUDA error when an event is made: every call still runs, counted
        def fail() -> Any:
            raise RuntimeError("CUDA error: an event could not be made")
        comm_nccl._new_event = fail
        try:
            dist.all_reduce(t)
            funcol.all_reduce(t, "sum", world).wait()
            dist.all_reduce(t, async_op=True).wait()
        finally:
            comm_nccl._new_event = Event
    case("events_fail", broken_events, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
