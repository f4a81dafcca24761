"""The C form of the fast sites (agent/instrument/_hot.c, chosen by agent/instrument/native.py): built
wherever a C compiler is (a silent fall back to Python would pass every other test and lose the cost
figures), switched off by ``MESHSCOPE_NATIVE=0``, its schedstat read the kernel's line, and no reference
leaked or stolen over many calls (what C can get wrong and Python cannot). What each site records, in both
forms, is tested by tests/test_hooks_wrappers.py and tests/test_hooks_fastpaths.py."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import sysconfig
import time

import pytest
import torch
import torch.distributed as dist

from meshscope.agent.instrument import comm_c10d, comm_fsdp, native
from meshscope.agent.instrument.collectives import CollectiveTracer
from meshscope.agent.instrument.cpu import ThreadCPU, parse
from meshscope.agent.instrument.meshinfo import GroupInfo, MeshInfo
from meshscope.agent.instrument.recorder import ListRecorder


class PerfClock:
    now = staticmethod(time.perf_counter)


class OneMesh(MeshInfo):
    def lookup(self, group):
        return GroupInfo(dim="dp", size=2, name="g", ranks=(0, 1))


class Work(dist.Work):
    def wait(self, timeout=None) -> bool:
        return True


def _tracer(monkeypatch: pytest.MonkeyPatch, form: str) -> tuple[CollectiveTracer, ListRecorder]:
    monkeypatch.setenv("MESHSCOPE_NATIVE", "1" if form == "c" else "0")
    rec = ListRecorder(clock=PerfClock())
    tracer = CollectiveTracer(rec, mesh_info=OneMesh())
    tracer.enabled = True
    return tracer, rec


def test_built_wherever_a_c_compiler_is() -> None:
    if not (shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc")
            or shutil.which("cc")):
        pytest.skip("no C compiler here: the Python sites are the whole path")
    assert native._hot is not None, "agent/instrument/_hot.c is not built: run `make install`"
    assert native._USABLE, "the C module's clock is not time.perf_counter's"


def test_the_switch_and_the_clock_choose_the_form(monkeypatch: pytest.MonkeyPatch) -> None:
    if not native._USABLE:
        pytest.skip("the C sites are not built here")
    tracer, _ = _tracer(monkeypatch, "c")
    assert native.active(tracer)
    monkeypatch.setenv("MESHSCOPE_NATIVE", "0")
    assert not native.active(tracer) and native.read_fd() is None
    # A recorder on another clock (a test's fake, an AnchoredClock) keeps the tracer on the Python sites.
    monkeypatch.setenv("MESHSCOPE_NATIVE", "1")
    assert not native.active(CollectiveTracer(ListRecorder(), mesh_info=OneMesh()))


def test_the_schedstat_read_is_the_kernels_line() -> None:
    if native.read_fd() is None or not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("no C read or no schedstat here")
    cpu = ThreadCPU()
    try:
        first = cpu.read()
        assert type(first) is bytes and len(first.split()) == 3
        sum(i * i for i in range(200_000))  # some CPU time
        on_cpu, delay = (b - a for a, b in zip(parse(first), parse(cpu.read())))
        assert on_cpu > 0 and delay >= 0
    finally:
        cpu.close()
    with pytest.raises(OSError):
        native.read_fd()(-1, 96)


@pytest.mark.parametrize("form", ["c", "python"])
def test_no_reference_is_leaked_or_stolen(monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """Thousands of blocking, async (+ wait) and FSDP calls: the tensor, group and work references are where
    they were, and the objects of the process do not grow with the calls."""
    if form == "c" and not native._USABLE:
        pytest.skip("the C sites are not built here")
    tracer, rec = _tracer(monkeypatch, form)
    works: list[Work] = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        if async_op:
            works.append(Work())
            return works[-1]
        return None

    def fsdp_call(output_tensor, input_tensor, group, async_op=False):
        return None

    bind = comm_c10d._COLLECTIVES["all_reduce"][1]
    site = comm_c10d.collective(all_reduce, tracer=tracer, op="all_reduce", bind=bind)
    fsdp = comm_fsdp._traced(fsdp_call, tracer=tracer, op="all_gather", buffer=0)
    waited = comm_c10d.wait(Work.wait, tracer=tracer)
    assert (type(site).__name__ == "Site") == (form == "c")
    t, group = torch.ones(4), object()

    def burst(n: int) -> None:
        for _ in range(n):
            site(t, group=group)
            work = site(t, None, group, True)
            waited(work)
            fsdp(t, t, group, False)
        works.clear()
        tracer.drain()
        rec.collectives.clear()

    burst(200)  # warm: the group resolved, caches filled
    gc.collect()
    refs = (sys.getrefcount(t), sys.getrefcount(group), sys.getrefcount(None))
    objects = len(gc.get_objects())
    burst(3000)
    gc.collect()
    assert (sys.getrefcount(t), sys.getrefcount(group)) == refs[:2]
    assert abs(sys.getrefcount(None) - refs[2]) < 100  # None is everyone's: only a steady count matters
    assert len(gc.get_objects()) - objects < 100
    assert rec.errors == [] and not tracer._pending_works


@pytest.mark.parametrize("form", ["c", "python"])
def test_a_pipeline_span_is_the_same_in_both_forms(monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """The deferred span around a stage's compute: the microbatch positional or by keyword, the method's
    result and exception passed through, a span recorded either way, spans beyond the limit counted as
    dropped, and no reference kept by the calls."""
    from meshscope.agent.instrument import pipeline

    if form == "c" and not native._USABLE:
        pytest.skip("the C sites are not built here")
    monkeypatch.setenv("MESHSCOPE_NATIVE", "1" if form == "c" else "0")
    monkeypatch.setattr(pipeline, "_MAX_SPANS", 4)

    class Stage:
        stage_index = 1

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            if fwd_chunk_id == 7:
                raise ValueError("the user's own error")
            return fwd_chunk_id * 2

    class Schedule:
        def __init__(self, stage):
            self._stage, self.pipeline_order = stage, None

    stage = Stage()
    tracer = pipeline.PipelineTracer(ListRecorder(clock=PerfClock()), deferred=True)
    tracer.attach(Schedule(stage))
    try:
        wrapped = stage.forward_one_chunk
        assert (type(wrapped).__name__ == "Span") == (form == "c")
        assert wrapped.__wrapped__ == stage.__class__.forward_one_chunk.__get__(stage)
        assert wrapped(3) == 6 and wrapped(fwd_chunk_id=4) == 8
        with pytest.raises(ValueError, match="the user's own error"):
            wrapped(7)
        t0 = time.perf_counter()
        wrapped(5), wrapped(6)  # the 5th span is beyond the limit of 4
        spans = tracer.take()
        assert [s[:3] for s in spans] == [(1, 3, "forward"), (1, 4, "forward"), (1, 7, "forward"), (1, 5, "forward")]
        assert all(a <= b for *_, a, b in spans) and spans[-1][3] >= t0 and tracer.dropped == 1
        arg = object()
        before = sys.getrefcount(arg)
        for _ in range(1000):
            wrapped(0, arg)
            tracer.take()
        assert sys.getrefcount(arg) == before
    finally:
        tracer.detach()
    assert "forward_one_chunk" not in vars(stage)


def test_a_site_refuses_keyword_names_that_are_not_str() -> None:
    """The C sites compare keyword names by identity where both are interned; a name that is no str is
    refused when the site is made, never read as one on the hot path."""
    if not native._USABLE:
        pytest.skip("the C sites are not built here")
    tracer = CollectiveTracer(ListRecorder(clock=PerfClock()), mesh_info=OneMesh())
    with pytest.raises(TypeError, match="known must be a tuple of str"):
        native._hot.Site(native._hot.KIND_C10D, print, print, tracer.hot, "send", "c10d", "send", tensor=0,
                         works={}, learn=print, known=("tensor", 3))


@pytest.mark.parametrize("form", ["c", "python"])
def test_a_ddp_models_bucket_ops_are_made_with_its_group_looked_up_once(monkeypatch: pytest.MonkeyPatch,
                                                                         form: str) -> None:
    """The hook state binds the tracer once (``_HookState.bind``): in C a ``DdpOps`` holding the group's
    entry makes each bucket's op, with the fields the tracer's own ``begin`` gives the same group, numbered
    on the group's counter; called as the future's callback it stamps completion and unwraps the bucket.
    Detached, it holds nothing; and thousands of ops leak no reference."""
    from meshscope.agent.instrument.comm_ddp import _HookState

    if form == "c" and not native._USABLE:
        pytest.skip("the C sites are not built here")
    tracer, _ = _tracer(monkeypatch, form)
    group, t = object(), torch.ones(4)
    state = _HookState(group, tracer)
    assert (type(state.make_op).__name__ == "DdpOps") == (form == "c") and (state.make_op is None) == (form != "c")
    if form != "c":
        return  # the hook's Python form makes its ops inline (tests/test_hooks_gloo.py runs it on DDP)
    reference = tracer.begin("all_reduce", group, 64, "ddp_comm_hook")
    t0 = time.perf_counter()
    p = state.make_op(64)
    assert (p.op, p.info, p.key, p.nbytes, p.peer, p.source, p.cuda, p.t_done) == (
        "all_reduce", reference.info, reference.key, 64, -1, "ddp_comm_hook", None, None)
    assert p.seq == reference.seq + 1 and t0 <= p.t_start <= time.perf_counter()
    fut = torch.futures.Future()
    fut.set_result([t])
    assert fut.then(p).wait() is t and p.t_start <= p.t_done <= time.perf_counter()
    with pytest.raises(TypeError):
        state.make_op(64, 1)

    def burst(n: int) -> None:
        for _ in range(n):
            op = state.make_op(t.nbytes)
            op(fut)

    burst(200)
    gc.collect()
    refs, objects = (sys.getrefcount(t), sys.getrefcount(group)), len(gc.get_objects())
    burst(3000)
    gc.collect()
    assert (sys.getrefcount(t), sys.getrefcount(group)) == refs and len(gc.get_objects()) - objects < 100
    state.bind(None)
    assert state.tracer is None and state.make_op is None
