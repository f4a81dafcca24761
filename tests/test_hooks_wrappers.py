"""Every traced issue wrapper (``traced_call`` at each site) around stand-in originals, without a process
group: what a working site records, that a telemetry failure is counted through ``record_error`` and never
reaches the caller (who gets the real call's result, the call made once), that the real call's own
exception reaches the caller unchanged, and that the wrapper steps aside when detached or nested — each in
both forms of the fast sites, C (``agent/instrument/_hot.c``) and Python (``MESHSCOPE_NATIVE=0``). Plus the
import graph of ``agent/instrument``: no module imports one that imports it back."""

from __future__ import annotations

import functools
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from meshscope.agent.instrument import comm_c10d, comm_funcol, native
from meshscope.agent.instrument.collectives import CollectiveTracer
from meshscope.agent.instrument.comm_fsdp import TracedAllGather, TracedReduceScatter
from meshscope.agent.instrument.meshinfo import GroupInfo, MeshInfo
from meshscope.agent.instrument.recorder import ListRecorder

ROOT = Path(__file__).resolve().parents[1]


class FixedMesh(MeshInfo):
    """Every group is a 4-rank tp group named after the designator."""

    def lookup(self, group):
        return GroupInfo(dim="tp", size=4, name=str(group), ranks=(0, 1, 2, 3))


class ExplodingMesh(MeshInfo):
    def lookup(self, group):
        raise KeyError("no such group")


class FailingRecorder(ListRecorder):
    def record_collective(self, **kw) -> None:
        raise OSError("spool full")


class UserError(Exception):
    """Raised by the real call (or its wait): the caller's own error."""


class Work(dist.Work):
    """A c10d ``Work`` (so the sites track it) with no future, like gloo's P2P works."""

    def __init__(self, fail: BaseException | None = None) -> None:
        super().__init__()
        self.fail = fail
        self.waits = 0

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        if self.fail is not None:
            raise self.fail
        return True


class Original:
    """Stands in for the wrapped torch function / FSDP comm: remembers its calls; returns a ``Work`` when
    asked for one, else ``result(args, kwargs)``; raises ``fail`` when given one."""

    def __init__(self, result: Callable[[tuple, dict], Any], *, fail: BaseException | None = None,
                 wait_fail: BaseException | None = None) -> None:
        self.result, self.fail, self.wait_fail = result, fail, wait_fail
        self.calls: list[tuple[tuple, dict]] = []
        self.works: list[Work] = []  # the works handed out for async calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        if self.fail is not None:
            raise self.fail
        if _asks_async(args, kwargs):
            self.works.append(Work(self.wait_fail))
            return self.works[-1]
        return self.result(args, kwargs)


T = torch.ones(4)  # 16 bytes


def _asks_async(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("async_op") is True or any(a is True for a in args)  # the only bool argument


def _shape(value: Any) -> Any:
    """A call's arguments as comparable data: tensors by shape, P2POps by what they send where (not by
    their function, which batch_isend_irecv swaps for the installed wrapper)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_shape, value))
    if isinstance(value, dict):
        return sorted((k, _shape(v)) for k, v in value.items())
    if isinstance(value, types.SimpleNamespace):
        return ("P2POp", _shape(value.tensor), value.peer, value.group)
    return value


def _untraced(site: Site) -> list:
    """The calls the site makes to its original while the tracer is detached (P2P: the public signature
    normalised to (tensor, peer, group, tag, group_peer), as before any tracing)."""
    tracer = _tracer()
    tracer.enabled = False
    original = Original(site.result)
    site.call(site.build(tracer, original))
    return _shape(original.calls)


def _none(args: tuple, kwargs: dict) -> None:
    return None


def _work(args: tuple, kwargs: dict) -> Work:
    return Work()


def _works(args: tuple, kwargs: dict) -> list[Work]:
    return [Work() for _ in args[0]]


def _same(args: tuple, kwargs: dict) -> Any:
    return args[0]  # funcol on a completed op: the output tensor(s) themselves, no AsyncCollectiveTensor


@dataclass(frozen=True)
class Site:
    name: str
    where: str  # record_error("collectives.<where>", ...)
    build: Callable[[CollectiveTracer, Original], Callable]
    call: Callable[[Callable], Any]
    result: Callable[[tuple, dict], Any]
    records: list[tuple[str, int, str, int]]  # (op, nbytes, source, peer) of what a working call records
    blocking: bool = False  # returns once its op completed: recorded at the return, the whole call waited


def _p2p(tracer: CollectiveTracer, original: Callable, *, op: str, is_async: bool) -> Callable:
    # As tracer.patch installs it: the wrapper knows the original as __wrapped__ (batch_isend_irecv's swap).
    return functools.wraps(original)(comm_c10d.p2p(original, tracer=tracer, op=op, is_async=is_async))


def _batch(tracer: CollectiveTracer, original: Callable) -> Callable:
    isend = _p2p(tracer, Original(_work), op="send", is_async=True)
    irecv = _p2p(tracer, Original(_work), op="recv", is_async=True)
    wrapper = comm_c10d.batch(original, tracer=tracer, isend=isend, irecv=irecv)
    ops = [types.SimpleNamespace(op=isend.__wrapped__, tensor=T, peer=1, group="g"),  # built before attach
           types.SimpleNamespace(op=irecv, tensor=torch.ones(2), peer=1, group="g")]
    return lambda: wrapper(ops)


def _c10d(name: str) -> Callable[[CollectiveTracer, Original], Callable]:
    op, bind = comm_c10d._COLLECTIVES[name]
    return lambda tracer, original: comm_c10d.collective(original, tracer=tracer, op=op, bind=bind)


def _funcol_single(name: str) -> Callable[[CollectiveTracer, Original], Callable]:
    op, group_index, nbytes = next(v for k, v in comm_funcol._SINGLE.items() if name in k)
    return lambda tracer, original: comm_funcol.single(original, tracer=tracer, op=op, group_index=group_index,
                                                       nbytes=nbytes)


def _funcol_coalesced(name: str) -> Callable[[CollectiveTracer, Original], Callable]:
    op, group_index, output_bytes = next(v for k, v in comm_funcol._COALESCED.items() if name in k)
    return lambda tracer, original: comm_funcol.coalesced(original, tracer=tracer, op=op,
                                                          group_index=group_index, output_bytes=output_bytes)


SITES = [
    Site("c10d_blocking", "all_reduce", _c10d("all_reduce"), lambda f: f(T, group="g"), _none,
         [("all_reduce", 16, "c10d", -1)], blocking=True),
    Site("c10d_async", "all_gather", _c10d("all_gather_into_tensor"),
         lambda f: f(torch.ones(8), T, "g", True), _work, [("all_gather", 32, "c10d", -1)]),
    Site("c10d_no_async_variant", "broadcast",
         lambda tracer, original: comm_c10d.collective(original, tracer=tracer, op="broadcast",
                                                       bind=comm_c10d._broadcast_coalesced),
         lambda f: f("g", [T, T], 1024, 0), _none, [("broadcast", 32, "c10d", -1)]),
    Site("p2p_isend", "send", functools.partial(_p2p, op="send", is_async=True), lambda f: f(T, 1, "g"), _work,
         [("send", 16, "c10d", 1)]),
    Site("p2p_recv", "recv", functools.partial(_p2p, op="recv", is_async=False), lambda f: f(T, src=1, group="g"),
         _none, [("recv", 16, "c10d", 1)]),
    Site("batch_isend_irecv", "batch_isend_irecv", _batch, lambda f: f(), _works,
         [("send", 16, "c10d", 1), ("recv", 8, "c10d", 1)]),
    Site("funcol_single", "all_gather", _funcol_single("all_gather_single"), lambda f: f(T, 0, "g"), _same,
         [("all_gather", 64, "funcol", -1)]),
    Site("funcol_coalesced", "reduce_scatter", _funcol_coalesced("reduce_scatter_single_coalesced"),
         lambda f: f([T, torch.ones(2)], "sum", [4, 2], "g"), _same,
         [("reduce_scatter", 16, "funcol", -1), ("reduce_scatter", 8, "funcol", -1)]),
    Site("fsdp_all_gather", "fsdp_all_gather", lambda tracer, original: TracedAllGather(tracer, original),
         lambda f: f(torch.empty(8), T, "g"), _none, [("all_gather", 32, "fsdp_comm", -1)], blocking=True),
    Site("fsdp_reduce_scatter", "fsdp_reduce_scatter",
         lambda tracer, original: TracedReduceScatter(tracer, original),
         lambda f: f(torch.empty(2), T, "g", "sum", async_op=True), _work,
         [("reduce_scatter", 16, "fsdp_comm", -1)]),
]


class PerfClock:
    """The recorder's clock: ``time.perf_counter`` itself, the clock the C sites are made for (a Telemetry's
    tracer reads it; a ListRecorder's AnchoredClock would keep the tracer on the Python sites)."""

    now = staticmethod(time.perf_counter)


def _recorder(cls: type = ListRecorder) -> ListRecorder:
    return cls(clock=PerfClock())


@pytest.fixture(autouse=True, params=["c", "python"])
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on both forms of the fast sites (``native.active`` reads the switch when a site
    is made)."""
    if request.param == "c" and not native._USABLE:
        pytest.skip("the C sites are not built here (tests/test_hooks_native.py says whether they must be)")
    monkeypatch.setenv("MESHSCOPE_NATIVE", "1" if request.param == "c" else "0")
    return request.param


@pytest.fixture(autouse=True)
def nccl_like_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """batch_isend_irecv traces a batch only on a backend that coalesces it (NCCL); no such backend on CPU,
    and no process group here: every batch counts as coalesced."""
    monkeypatch.setattr(comm_c10d, "_coalesced", lambda p2p_op_list: True)


def _tracer(*, mesh: MeshInfo | None = None, recorder: ListRecorder | None = None) -> CollectiveTracer:
    tracer = CollectiveTracer(recorder or _recorder(), mesh_info=mesh or FixedMesh())
    tracer.enabled = True  # what attach sets, without patching torch
    return tracer


def _run(site: Site, tracer: CollectiveTracer, original: Original) -> Any:
    """Call the site as a user would; then complete what the call left pending, as ``Work.wait`` (patched
    by comm_c10d) would."""
    result = site.call(site.build(tracer, original))
    for work in result if isinstance(result, list) else [result]:
        ops = tracer.take_work(work) if isinstance(work, Work) else None
        if ops is not None:
            t = tracer.now()
            tracer.waited(ops, t, t)
    return result


def _expected_result(site: Site, original: Original) -> Any:
    """What the caller gets without tracing: the original's own result (compared by type: works are new
    objects per call)."""
    return site.result(*original.calls[0])


def _same_result(got: Any, want: Any) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same_result, got, want))
    return type(got) is type(want) and (not isinstance(want, torch.Tensor) or got is want)


@pytest.mark.parametrize("site", SITES, ids=lambda s: s.name)
def test_a_working_site_records_its_ops(site: Site) -> None:
    rec = _recorder()
    tracer = _tracer(recorder=rec)
    original = Original(site.result)
    result = _run(site, tracer, original)
    assert len(original.calls) == 1
    assert _same_result(result, _expected_result(site, original))
    got = [(r["op"], r["nbytes"], r["source"], r["peer"]) for r in rec.collectives]
    assert sorted(got) == sorted(site.records)
    assert all(r["t_end"] >= r["t_start"] and r["wait_s"] >= 0 for r in rec.collectives)
    assert rec.errors == [] and not tracer.busy() and tracer.current() is None
    if site.blocking:  # made as the caller made it; the whole call is the op's blocked time
        assert _shape(original.calls) == _untraced(site) and not _asks_async(*original.calls[0])
        assert all(r["wait_s"] == pytest.approx(r["t_end"] - r["t_start"]) for r in rec.collectives)


@pytest.mark.parametrize("site", SITES, ids=lambda s: s.name)
def test_a_failing_lookup_is_counted_and_the_call_made_as_the_caller_made_it(site: Site) -> None:
    rec = _recorder()
    original = Original(site.result)
    result = _run(site, _tracer(mesh=ExplodingMesh(), recorder=rec), original)
    assert _shape(original.calls) == _untraced(site)  # once, with the caller's arguments (no async rewrite)
    assert not _asks_async(*original.calls[0]) or not site.blocking
    assert _same_result(result, site.result(*original.calls[0]))
    assert [w for w, _ in rec.errors] == [f"collectives.{site.where}"] and rec.collectives == []


@pytest.mark.parametrize("site", SITES, ids=lambda s: s.name)
def test_a_failing_recorder_is_counted_not_raised(site: Site) -> None:
    rec = _recorder(FailingRecorder)
    original = Original(site.result)
    result = _run(site, _tracer(recorder=rec), original)
    assert len(original.calls) == 1 and _same_result(result, _expected_result(site, original))
    assert [w for w, _ in rec.errors] == ["collectives.record_collective"] * len(site.records)


@pytest.mark.parametrize("site", SITES, ids=lambda s: s.name)
def test_failing_bookkeeping_after_the_call_is_counted_not_raised(site: Site) -> None:
    rec = _recorder()
    tracer = _tracer(recorder=rec)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("tracer bug")

    for name in ("finish_sync", "track_work", "track_tensor", "emit", "cuda_timer"):
        setattr(tracer, name, broken)

    class BrokenMap(dict):  # the pending maps, which the hottest sites fill inline
        def __setitem__(self, key: Any, value: Any) -> None:
            raise RuntimeError("tracer bug")

    tracer._pending_works, tracer._pending_tensors = BrokenMap(), BrokenMap()
    # What the fast sites read instead (closures over ``tracer.hot``): the hand-over and the pending map.
    tracer.hot = tracer.hot._replace(push=broken, pending=tracer._pending_works)
    original = Original(site.result)
    result = site.call(site.build(tracer, original))
    assert len(original.calls) == 1 and _same_result(result, _expected_result(site, original))
    assert [w for w, _ in rec.errors] == [f"collectives.{site.where}"]
    assert not tracer.busy() and tracer.current() is None


@pytest.mark.parametrize("site", SITES, ids=lambda s: s.name)
def test_the_calls_own_exception_propagates_unchanged(site: Site) -> None:
    rec = _recorder()
    tracer = _tracer(recorder=rec)
    error = UserError("from the real collective")
    with pytest.raises(UserError) as raised:
        site.call(site.build(tracer, Original(site.result, fail=error)))
    assert raised.value is error
    assert rec.errors == [] and rec.collectives == []
    assert not tracer.busy() and tracer.current() is None  # the nesting state is restored


@pytest.mark.parametrize("site", SITES, ids=lambda s: s.name)
def test_the_wrapper_steps_aside_when_detached_or_nested(site: Site) -> None:
    rec = _recorder()
    tracer = _tracer(recorder=rec)
    tracer.enabled = False
    detached = Original(site.result)
    site.call(site.build(tracer, detached))
    tracer.enabled = True
    outer = tracer.begin("all_reduce", "g", 4, "ddp_comm_hook")
    prev = tracer.enter(outer)  # inside a DDP hook / FSDP comm: its dist.* call is that op, not another
    nested = Original(site.result)
    try:
        site.call(site.build(tracer, nested))
    finally:
        tracer.leave(prev)
    assert _shape(detached.calls) == _shape(nested.calls) == _untraced(site)
    assert len(nested.calls) == 1 and not (site.blocking and _asks_async(*nested.calls[0]))
    assert rec.collectives == [] and rec.errors == [] and tracer._pending_works == {}


def test_c10d_steps_aside_inside_a_coalescing_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import distributed_c10d as c10d

    monkeypatch.setitem(c10d._world.pg_coalesce_state, "pg", [])  # the call only queues its op there
    rec = _recorder()
    original = Original(_none)
    SITES[0].call(SITES[0].build(_tracer(recorder=rec), original))
    assert original.calls == [((T,), {"group": "g"})] and rec.collectives == []
