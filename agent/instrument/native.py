"""Which form of the collective tracer's per-op sites a process runs: the C one (``_hot``, built from
agent/instrument/_hot.c by ``pip install``) or the pure-Python one of the ``comm_*`` modules.

The Python sites are the reference: each C site does what its Python site does on the case it handles and
hands every other case to it (``slow``). The C form is used where it was built, where its clock is the
tracer's (``time.perf_counter``, CLOCK_MONOTONIC on Linux: the entries of both forms are compared and
accounted together), and unless ``MESHSCOPE_NATIVE=0`` is set (the off switch, read when a tracer
attaches). What a C site saves is the interpreter's share of the path — a frame, ``*args`` / ``**kwargs``
packing, a call per clock reading: bench/hooks_overhead.py measures both forms (``_python`` paths).
"""

from __future__ import annotations

import time
from typing import Any, Callable

try:
    from meshscope.agent.instrument import _hot
except ImportError:  # not built (no C compiler where meshscope was installed): the Python sites
    _hot = None


def _same_clock() -> bool:
    if _hot is None or time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        return False
    before = time.perf_counter()
    mine = _hot.perf_counter()
    return before <= mine <= time.perf_counter()


_USABLE = _same_clock()


def _switched_on() -> bool:
    from meshscope.agent.env import ENV_NATIVE, switched_off

    return not switched_off(ENV_NATIVE)


def switched_on() -> bool:
    """Whether the C forms are switched on (``MESHSCOPE_NATIVE`` is not ``0``): the C sites and the
    functional-collective kernels (``funcol_kernels``) alike."""
    return _switched_on()


# SharedCount (by id) → (itself, the address of the int64 it counts in): what ``issued`` reads
_SHARED: dict[int, tuple[Any, int]] = {}


def shared_count(counter: Any) -> Any:
    """A functional-collective kernels' group counter (``funcol_kernels.Bound.counter``) as the sites take it:
    ``_hot.SharedCount`` over the int64 it counts in where the C module is built, else the counter itself."""
    if _hot is None:
        return counter
    shared = _hot.SharedCount(counter.address, counter)
    _SHARED[id(shared)] = (shared, counter.address)  # one per group and process: never grows past them
    return shared


def issued(counter: Any) -> int | None:
    """The last number a group's issue counter gave (its last op's sequence number; 0: none yet), read
    without taking one: an ``itertools.count``, a kernels' counter, or a ``SharedCount`` over one. None
    for a counter of another kind. Read by the hang watchdog on its own thread while the training thread
    is blocked; never on a hot path."""
    import ctypes
    import itertools
    import re

    hit = _SHARED.get(id(counter))
    address = hit[1] if hit is not None and hit[0] is counter else getattr(counter, "address", None)
    if isinstance(address, int) and address:
        return int(ctypes.c_int64.from_address(address).value)
    if type(counter) is itertools.count:  # its repr is the next number it gives: count(N)
        m = re.fullmatch(r"count\((-?\d+)\)", repr(counter))
        return int(m[1]) - 1 if m else None
    return None


def set_site_depth(address: int) -> bool:
    """Have the C sites count themselves in the dispatcher kernels' site depth (``address``: their
    ``site_depth(int)``; funcol_kernels), so that the DDP bucket kernel leaves a site's own all-reduce to the
    site. False where the C module does not have it (then the kernels must not record DDP's buckets)."""
    setter = getattr(_hot, "set_site_depth", None)
    if setter is None:
        return False
    setter(address)
    return True


def active(tracer: Any) -> bool:
    """Whether ``tracer``'s sites are made in C."""
    return _USABLE and _switched_on() and getattr(tracer, "now", None) is time.perf_counter


def c10d_site(original: Callable, python: Callable, *, tracer: Any, op: str, where: str, spec: Any,
              works: Any, coalesce: dict, peer_kw: str | None = None, group_peer_kw: str | None = None,
              known: tuple[str, ...] | None = None) -> Callable:
    """``comm_c10d._fast_one``'s wrapper (``python``) in C, or ``python`` itself. For P2P called as torch's
    API is (``known``: its parameters, in order; ``peer_kw`` / ``group_peer_kw``: the peer's keywords),
    ``python`` is the public-signature wrapper, which takes any other call."""
    if not active(tracer):
        return python
    ti, gi, ai, tname, fixed_async, pi = spec
    return _hot.Site(_hot.KIND_C10D, original, python, tracer.hot, op, "c10d", where, tensor=ti, group=gi,
                     async_op=ai, tensor_kw=tname, fixed_async=-1 if fixed_async is None else int(fixed_async),
                     peer=-1 if pi is None else pi, coalesce=coalesce, works=works, learn=works.learn,
                     peer_kw=peer_kw, group_peer_kw=group_peer_kw, known=known)


def fsdp_site(original: Callable, python: Callable, *, tracer: Any, op: str, where: str, buffer: int) -> Callable:
    """``comm_fsdp._traced``'s ``fast`` (``python``) in C, or ``python`` itself."""
    if not active(tracer):
        return python
    return _hot.Site(_hot.KIND_FSDP, original, python, tracer.hot, op, "fsdp_comm", where, buffer=buffer)


def batch(original: Callable, python: Callable, *, tracer: Any, swap: dict, isend: Callable, irecv: Callable,
          coalesced: Callable[[list], bool]) -> Callable:
    """``comm_c10d.batch``'s ``wrapper`` (``python``) in C, or ``python`` itself; ``coalesced(list)``: whether
    the list's group coalesces (asked once per group and device kind); a coalescing batch goes to ``python``."""
    if not active(tracer):
        return python
    return _hot.Batch(original, python, tracer, swap, isend, irecv, coalesced)


def span(method: Callable, python: Callable, *, spans: list, index: Any, kind: str, chunk_kw: str, tracer: Any,
         limit: int) -> Callable:
    """``pipeline.PipelineTracer``'s deferred ``span`` (``python``) in C, or ``python`` itself. Both read
    ``time.perf_counter`` whatever the recorder's clock (the telemetry core adds its epoch), so only the
    build and the switch decide."""
    if not (_USABLE and _switched_on()):
        return python
    return _hot.Span(method, spans, index, kind, chunk_kw, tracer, limit)


def work_wait(original: Callable, python: Callable, *, tracer: Any) -> Callable:
    """``comm_c10d``'s ``traced_wait`` (``python``) in C (bound as a method on the Work class), or ``python``."""
    if not active(tracer):
        return python
    return _hot.Wait(original, python, tracer.hot, "wait")


def ddp_ops(tracer: Any, group: Any) -> Callable[[int], Any] | None:
    """What comm_ddp makes a CPU bucket's op with, in C: ``_hot.DdpOps(hot, group)(nbytes)``, the op record
    (``ops._Op``'s fields) that is also its future's completion callback (``ops.stamp_unwrap``), the group's
    entry looked up once per model, not per bucket; None where the Python form runs."""
    return _hot.DdpOps(tracer.hot, group) if active(tracer) else None


def read_fd() -> Callable[[int, int], bytes] | None:
    """``pread(fd, n, 0)`` keeping the GIL, in C (``cpu.ThreadCPU``); None where not built or switched off."""
    if _hot is None or not _switched_on():
        return None
    return _hot.read_fd


# One C functional-collective site per name per process: torch.compile's registration below cannot be undone, and
# an id it knows must never be reused by another object (see funcol_site).
_FUNCOL: dict[str, Any] = {}


def funcol_site(name: str, original: Callable, python: Callable, *, tracer: Any, op: str, group_index: int = 0,
                output_bytes: bool = False, wait: bool = False) -> Callable | None:
    """comm_funcol's ``single`` wrapper / ``wait_tensor`` (``python``) in C, bound to ``tracer``: the builtin to
    put in ``original``'s place, or None where the Python site stays (not built, switched off, torch.compile
    not imported yet or not able to take it, or the C site of ``name`` bound to another tracer).

    The site is a builtin that torch.compile is told (``torch._dynamo.substitute_in_graph``) to trace as
    ``original``, so that compiled TP code has no graph break, as with the Python site, which Dynamo inlines
    until its ``is_compiling`` check. That needs ``torch._dynamo``, which DTensor and FSDP2 import anyway
    (1.2 s and 73 MB on the dev VM for a job that does not): only taken once it is imported."""
    import sys

    if not active(tracer) or "torch._dynamo" not in sys.modules:
        return None
    import torch

    if not isinstance(vars(torch.compiler).get("_is_compiling_flag"), bool):  # what the C site reads for it
        return None
    site = _FUNCOL.get(name)
    if site is None:  # (a failure here raises: the caller counts it, and keeps the Python site)
        import torch.distributed._functional_collectives as funcol

        site = _hot.FuncolSlot(original, funcol.AsyncCollectiveTensor, vars(torch.compiler), wait)

        def traced(*args: Any, **kwargs: Any) -> Any:  # what torch.compile traces in its place
            return original(*args, **kwargs)

        sys.modules["torch._dynamo"].substitute_in_graph(site.fn, skip_signature_check=True)(traced)
        _FUNCOL[name] = site
    if site.bound or site.original is not original:  # another tracer's, or not torch's function under it
        return None
    site.bind(python, tracer.hot._replace(pending=tracer._pending_tensors), op, name, group_index, output_bytes)
    return site.fn


def release_funcol(fn: Any) -> None:
    """Unbind the C site whose builtin is ``fn`` (its tracer detached)."""
    for site in _FUNCOL.values():
        if site.fn is fn:
            site.unbind()


def funcol_bound(fn: Any) -> bool:
    """Whether ``fn`` is a C functional-collective site bound to a tracer."""
    return any(site.fn is fn and site.bound for site in _FUNCOL.values())
