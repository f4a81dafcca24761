"""Functional collectives (``torch.distributed._functional_collectives``): the path of TP / DTensor.

Where their kernels in torch's dispatcher are built and usable (``funcol_kernels``: a process without CUDA,
a telemetry core's tracer), those trace the functional collectives and nothing here is installed; these
sites are the rest: a GPU job's, a build without a C++ compiler, ``MESHSCOPE_FUNCOL_KERNELS=0``.

DTensor's redistributions (``Partial → Replicate`` after a ``RowwiseParallel`` linear, the gradient
all-reduce of a ``ColwiseParallel`` input, FSDP×TP's DTensor ops, loss parallel) call the funcol
functions through the module (``funcol.all_reduce(...)``), which return an ``AsyncCollectiveTensor``
whose first use calls the module-level ``wait_tensor``. Both are patched while attached:

- issue: ``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``,
  ``broadcast`` and the ``*_coalesced`` variants (one record per tensor). The deprecated
  ``all_gather_tensor`` / ``reduce_scatter_tensor`` (and the ``*_autograd`` aliases) call these and are
  therefore seen once. A torch before 2.13 (2.11 on the GPU check's machine) has only those older names,
  which issue the op themselves (and DTensor calls them): they are patched instead.
- wait: ``wait_tensor``; the op is found by the data pointer of the tensor waited on (the tensor the call
  returned inside its AsyncCollectiveTensor). On gloo a funcol wait blocks, so ``t_end`` is the wait's
  return and ``wait_s`` its blocked time. DTensor waits right after issuing unless ``async_op`` is
  requested, so ``t_end`` is then the completion.

Not seen: functional collectives inside ``torch.compile``'d code (graph nodes there; the wrappers step
aside while Dynamo traces), and ``torch.ops._c10d_functional.*`` called directly (funcol's own autograd
formulas do so for the backward of a funcol op on a tensor that requires grad, e.g. loss parallel). Their
waits still pass through ``wait_tensor`` and are counted in ``tracer.stats["unmatched_waits"]`` /
``["unmatched_wait_us"]``.
C form (``_CForm``, ``native.funcol_site``): the one-tensor sites and ``wait_tensor`` become builtins of
agent/instrument/_hot_funcol.h, doing what the CPU path here does, once ``torch._dynamo`` is imported (torch.compile
must be told to trace torch's function in their place; the first funcol op imports it); everything else they
hand to the Python sites here.
CUDA: ``wait_tensor`` only makes the current stream wait; the wait is timed with CUDA events
(``comm_nccl``; checked on a GPU by the GPU kit's section 2).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch
import torch.distributed._functional_collectives as funcol

from meshscope.agent.instrument import native
from meshscope.agent.instrument.traced_call import Issue, traced_call

# Inside torch.compile'd code the functional collectives become graph nodes; a Python timestamp there would
# only cause a graph break, so the wrappers step aside while Dynamo traces.
_compiling = torch.compiler.is_compiling
_ACT = funcol.AsyncCollectiveTensor  # what a funcol call returns while its op is in flight


def _storage_key(t: Any) -> int:
    # The data pointer, not the storage's: ``untyped_storage()`` builds a Python storage object the first
    # time it is asked of a tensor (0.9 µs per call on the dev VM, twice per op). The wait is made on the
    # very tensor the call returned (the AsyncCollectiveTensor's ``elem``), so the pointers agree.
    return t.data_ptr()


class _CudaIssued:
    """A fast site's funcol op on CUDA tensors in flight: its ``Issued`` and the event recorded before its
    issue; its ``wait_tensor`` records the two around the wait (``CudaCommTimer.queue_fast``)."""

    __slots__ = ("issued", "e0")

    def __init__(self, issued: tuple, e0: Any) -> None:
        self.issued, self.e0 = issued, e0


def _registrar(*, tracer: Any) -> Callable[[Any, Any, Any], None]:
    """``register(p, _, out)``: record ``p`` now if its call already completed it, else keep it until its
    ``wait_tensor``. Shaped as ``traced_call``'s ``finish`` so that a one-tensor site uses it directly."""
    pending, limit = tracer._pending_tensors, tracer.max_pending

    def register(p: Any, _: None, out: Any) -> None:
        if p.waited or not isinstance(out, _ACT):  # already complete (waited inside the call)
            if p.cuda is not None:
                tracer.cuda_timer().queue(p)
            else:
                # Completion is the inner wait's return, not the call's: all_gather_single with
                # gather_dim != 0 still concatenates the chunks after its wait (compute, not comm).
                tracer.emit(p, p.t_done if p.t_done is not None else tracer.now(), p.wait_s)
        elif len(pending) < limit:  # track_tensor, inline (every funcol call comes here)
            pending[out.elem.data_ptr()] = p
        else:
            tracer.track_tensor(_storage_key(out.elem), p)

    return register


def single(original: Callable, *, tracer: Any, op: str, group_index: int,
           nbytes: Callable[[Any, Any], int], cform: Any = None) -> Callable:
    """``original`` (a one-tensor funcol function; its group at ``group_index``) recording ``op`` through
    ``tracer``; ``nbytes(tensor, group info)`` gives the op's bytes. The CPU path is written out in one
    frame with an ``Issued`` tuple (as ``comm_c10d._fast_one``); on CUDA tensors the same tuple goes with
    its events to ``comm_nccl.CudaCommTimer.queue_fast`` (no op object). ``cform``: the ``_CForm`` that puts the
    C site in this one's place once it can."""

    def _cuda(args: tuple, kwargs: dict, issued: tuple, tls: Any) -> Any:
        # On CUDA: an event before the issue; its wait, in wait_tensor after the call or inside it, is timed
        # with two more; complete at its return without a wait, the call's two events bound it.
        try:
            timer = tracer.cuda_timer()
            e0 = timer.event()
        except Exception as exc:
            tracer.error(op, exc)
            return original(*args, **kwargs)
        prev = tls.current
        tls.depth += 1
        tls.current = inflight = _CudaIssued(issued, e0)  # a wait inside the call is this op's (tls.nested_end)
        try:
            out = original(*args, **kwargs)
        finally:
            tls.depth -= 1
            tls.current = prev
            waited, tls.nested_end, tls.nested_wait = tls.nested_end, None, 0.0
        try:
            if waited is not None:  # complete at the wait inside the call (not at its return: see register)
                timer.queue_fast(issued, e0, waited[1], waited[0])
            elif type(out) is _ACT:
                if len(pending) < limit:
                    pending[out.elem.data_ptr()] = inflight
                else:
                    tracer.track_tensor(_storage_key(out.elem), inflight)
            else:
                timer.queue_fast(issued, e0, timer.event())
        except Exception as exc:
            tracer.error(op, exc)
        return out

    (_, main, main_tid, local, get_ident, groups, resolve, now, live, push, done, max_done, _, _,
     stats) = tracer.hot
    pending, limit, output = tracer._pending_tensors, tracer.max_pending, nbytes is _output_bytes

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _compiling():  # first: Dynamo folds it, and traces nothing of ours (no graph break)
            return original(*args, **kwargs)
        tls = main if get_ident() == main_tid else local.nesting
        if not tracer.enabled or tls.depth:
            return original(*args, **kwargs)
        if cform is not None and cform.pending:  # (the C site takes the next call)
            cform()
        try:
            t = args[0] if args else kwargs["self"]
            group = args[group_index] if len(args) > group_index else kwargs["group"]
            hit = groups.get(id(group))
            if hit is None or hit[0] is not group:
                hit = resolve(group)
            info = hit[1]
            issued = (op, hit[3], t.nbytes * info.size if output else t.nbytes, -1, "funcol", next(hit[2]), now())
            cuda = t.is_cuda
        except Exception as exc:
            tracer.error(op, exc)
            return original(*args, **kwargs)
        if cuda:
            return _cuda(args, kwargs, issued, tls)
        prev = tls.current
        tls.depth += 1
        tls.current = issued  # a wait inside the call is this op's (wait_tensor: tls.nested_*)
        try:
            out = original(*args, **kwargs)
        finally:  # also when the call raises after its inner wait: the next op must not inherit it
            tls.depth -= 1
            tls.current = prev
            end, blocked = tls.nested_end, tls.nested_wait
            tls.nested_end, tls.nested_wait = None, 0.0
        try:
            if end is None and type(out) is _ACT:  # in flight: its wait_tensor completes it
                if len(pending) < limit:
                    pending[out.elem.data_ptr()] = issued
                else:
                    tracer.track_tensor(_storage_key(out.elem), issued)
            else:  # complete already: at the wait inside the call (not the call's return), or now
                if len(done) < max_done:
                    push(issued + ((now(), 0.0) if end is None else (end, blocked)) + (live.key,))
                else:
                    stats["dropped_done"] += 1
        except Exception as exc:
            tracer.error(op, exc)
        return out

    return wrapper


def coalesced(original: Callable, *, tracer: Any, op: str, group_index: int, output_bytes: bool) -> Callable:
    """``original`` (a ``*_coalesced`` funcol function) recording one ``op`` per tensor through ``tracer``;
    ``output_bytes``: the op's bytes are the output's (all-gather: input × group size)."""

    def describe(args: tuple, kwargs: dict) -> Issue:
        ts = args[0] if args else kwargs.get("self", kwargs.get("inputs"))
        group = args[group_index] if len(args) > group_index else kwargs["group"]
        n = tracer.group_info(group).size if output_bytes else 1
        ops = [tracer.begin(op, group, t.nbytes * n, "funcol", cuda=t.is_cuda) for t in ts]
        return None, args, kwargs, False, ops

    register = _registrar(tracer=tracer)

    def finish(_: None, ops: list[Any], outs: Any) -> None:
        for p, out in zip(ops, outs):
            register(p, None, out)

    return traced_call(original, tracer=tracer, where=op, describe=describe, finish=finish, skip=_compiling)


def _input_bytes(t: Any, info: Any) -> int:
    return t.nbytes


def _output_bytes(t: Any, info: Any) -> int:
    return t.nbytes * info.size


# names → (op, position of the group argument, bytes(tensor, group info)); bytes follow nccl-tests. The
# first name this torch has is patched: ``all_gather_single`` & co. are torch 2.13's names, and the older
# ``all_gather_tensor`` & co. call them there; releases before (torch 2.11, a GPU machine's) have only the
# older names, which DTensor calls and which issue the op themselves.
_SINGLE: dict[tuple[str, ...], tuple[str, int, Callable[[Any, Any], int]]] = {
    ("all_reduce",): ("all_reduce", 2, _input_bytes),
    ("all_gather_single", "all_gather_tensor"): ("all_gather", 2, _output_bytes),
    ("reduce_scatter_single", "reduce_scatter_tensor"): ("reduce_scatter", 3, _input_bytes),
    ("all_to_all_single",): ("all_to_all", 3, _input_bytes),
    ("broadcast",): ("broadcast", 2, _input_bytes),
}
# names → (op, position of the group argument, bytes are the output's); one record per tensor.
_COALESCED: dict[tuple[str, ...], tuple[str, int, bool]] = {
    ("all_reduce_coalesced",): ("all_reduce", 2, False),
    ("all_gather_single_coalesced", "all_gather_into_tensor_coalesced"): ("all_gather", 1, True),
    ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"): ("reduce_scatter", 3, False),
}


def _present(owner: Any, names: tuple[str, ...]) -> str | None:
    return next((name for name in names if getattr(owner, name, None) is not None), None)


class _CForm:
    """Puts the C sites (``native.funcol_site``) in the one-tensor sites' and ``wait_tensor``'s place, once they
    can be: when ``torch._dynamo`` is imported (DTensor and FSDP2 import it, by the first funcol op at the
    latest), at install or at the first eager call of a Python site after. ``pending`` until it has tried."""

    __slots__ = ("tracer", "specs", "pending")

    def __init__(self, tracer: Any) -> None:
        self.tracer, self.specs = tracer, {}
        self.pending = native.active(tracer)

    def __call__(self) -> None:
        if "torch._dynamo" not in sys.modules:
            return
        self.pending = False
        for patch in self.tracer._patches:
            spec = self.specs.get(patch.name) if patch.owner is funcol else None
            if spec is None or getattr(funcol, patch.name, None) is not patch.wrapper:
                continue
            try:
                fn = native.funcol_site(patch.name, patch.original, patch.wrapper, tracer=self.tracer, **spec)
            except Exception as exc:  # the Python site stays
                self.tracer.error(patch.name, exc)
                continue
            if fn is not None:
                setattr(funcol, patch.name, fn)
                patch.wrapper, patch.release = fn, functools.partial(native.release_funcol, fn)


def install(tracer: Any) -> None:
    """Patch the funcol issue functions and ``wait_tensor`` through ``tracer.patch``
    (``CollectiveTracer``: restored by its ``detach``); their C form where it can be (``_CForm``)."""
    from meshscope.agent.instrument import funcol_kernels

    ext = funcol_kernels.usable(tracer)
    if ext is not None and funcol_kernels.bind(tracer, ext):  # traced in torch's dispatcher: nothing patched here
        return
    owners = (funcol,)
    cform = _CForm(tracer)

    for names, (op, group_index, nbytes) in _SINGLE.items():
        if (name := _present(funcol, names)) is None:
            continue
        tracer.patch(owners, name, functools.partial(single, tracer=tracer, op=op, group_index=group_index,
                                                     nbytes=nbytes, cform=cform))
        cform.specs[name] = {"op": op, "group_index": group_index, "output_bytes": nbytes is _output_bytes}
    for names, (op, group_index, output_bytes) in _COALESCED.items():
        if (name := _present(funcol, names)) is None:
            continue
        tracer.patch(owners, name, functools.partial(coalesced, tracer=tracer, op=op, group_index=group_index,
                                                     output_bytes=output_bytes))

    def wait(original: Callable) -> Callable:
        # The tracer's nesting state and take_tensor, inline: every funcol wait of the process comes here.
        (_, main, main_tid, local, get_ident, _, _, now, live, push, done, max_done, _, _, stats) = tracer.hot
        pending = tracer._pending_tensors

        def wait_tensor(tensor: Any) -> Any:
            # An AsyncCollectiveTensor passed in directly: its dispatch calls this function again with the
            # plain tensor inside, which is where the wait is timed.
            if _compiling() or not tracer.enabled or type(tensor) is _ACT:  # compile's first: see single
                return original(tensor)
            if pending:
                # The common case first: the wait of a fast site's op (a CPU tensor), in flight since its
                # issue. Taken before the nesting state is read: a pending op waited inside another op's
                # issuing call is still its own op's wait, not that call's.
                try:
                    p = pending.pop(tensor.data_ptr(), None)
                except Exception as exc:
                    tracer.error("wait_tensor", exc)
                    return original(tensor)
                if type(p) is tuple:
                    t0 = now()
                    out = original(tensor)
                    try:
                        t1 = now()
                        if len(done) < max_done:
                            push(p + (t1, t1 - t0, live.key))
                        else:
                            stats["dropped_done"] += 1
                    except Exception as exc:
                        tracer.error("wait_tensor", exc)
                    return out
                if type(p) is _CudaIssued:  # (its issue made the timer)
                    return tracer.cuda_timer().wait_fast(tracer, p.issued, p.e0, original, tensor)
                if p is not None:  # an op object of traced_call's sites: back, for the general path below
                    pending[tensor.data_ptr()] = p
            try:
                tls = main if get_ident() == main_tid else local.nesting
                cur = tls.current
                p = pending.pop(tensor.data_ptr(), None) if cur is None and pending else None
                w0 = cuda = None
                if type(cur) is _CudaIssued:  # a wait inside a fast site's issuing call on CUDA: that op's
                    timer = tracer.cuda_timer()
                    w0 = timer.event()
                elif tensor.is_cuda:  # (a fast site's Issued, CPU only, is no CUDA op's owner)
                    cuda = tracer.cuda_timer()
            except Exception as exc:
                tracer.error("wait_tensor", exc)
                return original(tensor)
            if cuda is not None:  # outside the try above: a wait that raises is not made twice
                return cuda.wait_tensor(tracer, p if type(cur) is tuple else (cur or p), original, tensor)
            if w0 is not None:  # (its issuing call queues it: tls.nested_end)
                out = original(tensor)
                try:
                    tls.nested_end = (w0, timer.event())
                except Exception as exc:
                    tracer.error("wait_tensor", exc)
                return out
            t0 = now()
            out = original(tensor)
            try:
                t1 = now()
                if p is not None:  # an op object (traced_call's sites)
                    tracer.emit(p, t1, t1 - t0 + p.wait_s)
                elif type(cur) is tuple:  # a wait inside a fast site's issuing call (all_gather_single, dim != 0)
                    tls.nested_wait += t1 - t0
                    tls.nested_end = t1
                elif cur is not None:  # the same inside traced_call's
                    cur.wait_s += t1 - t0
                    cur.waited = True
                    cur.t_done = t1
                else:
                    stats["unmatched_waits"] += 1
                    stats["unmatched_wait_us"] += int((t1 - t0) * 1e6)
            except Exception as exc:
                tracer.error("wait_tensor", exc)
            return out
        return wait_tensor

    tracer.patch(owners, "wait_tensor", wait)
    cform.specs["wait_tensor"] = {"op": "wait_tensor", "wait": True}
    if cform.pending:
        cform()
