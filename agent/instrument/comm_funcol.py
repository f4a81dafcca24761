"""Functional collectives (``torch.distributed._functional_collectives``): the path of TP / DTensor.

DTensor's redistributions (``Partial → Replicate`` after a ``RowwiseParallel`` linear, the gradient
all-reduce of a ``ColwiseParallel`` input, FSDP×TP's DTensor ops, loss parallel) call the funcol
functions through the module (``funcol.all_reduce(...)``), which return an ``AsyncCollectiveTensor``
whose first use calls the module-level ``wait_tensor``. Both are patched while attached:

- issue: ``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``,
  ``broadcast`` and the ``*_coalesced`` variants (one record per tensor). The deprecated
  ``all_gather_tensor`` / ``reduce_scatter_tensor`` (and the ``*_autograd`` aliases) call these and are
  therefore seen once.
- wait: ``wait_tensor``; the op is found by the storage of the tensor waited on (views of the output share
  it). On gloo a funcol wait blocks, so ``t_end`` is the wait's return and ``wait_s`` its blocked time.
  DTensor waits right after issuing unless ``async_op`` is requested, so ``t_end`` is then the completion.

Not seen: functional collectives inside ``torch.compile``'d code (graph nodes there; the wrappers step
aside while Dynamo traces), and ``torch.ops._c10d_functional.*`` called directly (funcol's own autograd
formulas do so for the backward of a funcol op on a tensor that requires grad, e.g. loss parallel). Their
waits still pass through ``wait_tensor`` and are counted in ``tracer.stats["unmatched_waits"]`` /
``["unmatched_wait_us"]``.
CUDA: ``wait_tensor`` only makes the current stream wait; the wait is timed with CUDA events
(``comm_nccl``, UNTESTED).
"""

from __future__ import annotations

from typing import Any, Callable

from meshscope.agent.instrument.collectives import CollectiveTracer


def _storage_key(t: Any) -> int:
    return t.untyped_storage().data_ptr()


def install(tracer: CollectiveTracer) -> None:
    import torch
    import torch.distributed._functional_collectives as funcol

    # Inside torch.compile'd code the functional collectives become graph nodes; a Python timestamp there
    # would only cause a graph break, so the wrappers step aside while Dynamo traces.
    compiling = torch.compiler.is_compiling

    act_type = funcol.AsyncCollectiveTensor
    owners = (funcol,)

    def register(p: Any, out: Any) -> None:
        if p.waited or not isinstance(out, act_type):  # already complete (waited inside the call)
            if p.cuda is not None:
                tracer.cuda_timer().queue(p)
            else:
                # Completion is the inner wait's return, not the call's: all_gather_single with
                # gather_dim != 0 still concatenates the chunks after its wait (compute, not comm).
                tracer.emit(p, t_end=p.t_done if p.t_done is not None else tracer.now(), wait_s=p.wait_s)
        else:
            tracer.track_tensor(_storage_key(out.elem), p)

    def single(op: str, group_index: int, nbytes: Callable[[Any, Any], int]) -> Callable:
        def make(original: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if not tracer.enabled or tracer.busy() or compiling():
                    return original(*args, **kwargs)
                try:
                    t = args[0] if args else kwargs["self"]
                    group = args[group_index] if len(args) > group_index else kwargs["group"]
                    info = tracer.mesh_info.lookup(group)
                    p = tracer.begin(op, group, nbytes(t, info), "funcol", cuda=t.is_cuda)
                except Exception as exc:
                    tracer.error(op, exc)
                    return original(*args, **kwargs)
                prev = tracer.enter(p)
                try:
                    out = original(*args, **kwargs)
                finally:
                    tracer.leave(prev)
                try:
                    register(p, out)
                except Exception as exc:
                    tracer.error(op, exc)
                return out
            return wrapper
        return make

    def coalesced(op: str, group_index: int, output_bytes: bool) -> Callable:
        def make(original: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if not tracer.enabled or tracer.busy() or compiling():
                    return original(*args, **kwargs)
                try:
                    ts = args[0] if args else kwargs.get("self", kwargs.get("inputs"))
                    group = args[group_index] if len(args) > group_index else kwargs["group"]
                    n = tracer.mesh_info.lookup(group).size if output_bytes else 1
                    ops = [tracer.begin(op, group, t.nbytes * n, "funcol", cuda=t.is_cuda) for t in ts]
                except Exception as exc:
                    tracer.error(op, exc)
                    return original(*args, **kwargs)
                prev = tracer.enter(None)
                try:
                    outs = original(*args, **kwargs)
                finally:
                    tracer.leave(prev)
                try:
                    for p, out in zip(ops, outs):
                        register(p, out)
                except Exception as exc:
                    tracer.error(op, exc)
                return outs
            return wrapper
        return make

    input_bytes: Callable[[Any, Any], int] = lambda t, info: t.nbytes
    tracer.patch(owners, "all_reduce", single("all_reduce", 2, input_bytes))
    tracer.patch(owners, "all_gather_single", single("all_gather", 2, lambda t, info: t.nbytes * info.size))
    tracer.patch(owners, "reduce_scatter_single", single("reduce_scatter", 3, input_bytes))
    tracer.patch(owners, "all_to_all_single", single("all_to_all", 3, input_bytes))
    tracer.patch(owners, "broadcast", single("broadcast", 2, input_bytes))
    tracer.patch(owners, "all_reduce_coalesced", coalesced("all_reduce", 2, False))
    tracer.patch(owners, "all_gather_single_coalesced", coalesced("all_gather", 1, True))
    tracer.patch(owners, "reduce_scatter_single_coalesced", coalesced("reduce_scatter", 3, False))

    def wait(original: Callable) -> Callable:
        def wait_tensor(tensor: Any) -> Any:
            # An AsyncCollectiveTensor passed in directly: its dispatch calls this function again with the
            # plain tensor inside, which is where the wait is timed.
            if not tracer.enabled or type(tensor) is act_type or compiling():
                return original(tensor)
            try:
                cur = tracer.current()
                p = tracer.take_tensor(_storage_key(tensor)) if cur is None else None
                if tensor.is_cuda:
                    return tracer.cuda_timer().wait_tensor(tracer, cur or p, original, tensor)
            except Exception as exc:
                tracer.error("wait_tensor", exc)
                return original(tensor)
            t0 = tracer.now()
            out = original(tensor)
            try:
                t1 = tracer.now()
                if cur is not None:  # a wait inside the issuing call (e.g. all_gather_single, dim != 0)
                    cur.wait_s += t1 - t0
                    cur.waited = True
                    cur.t_done = t1
                elif p is not None:
                    tracer.emit(p, t_end=t1, wait_s=t1 - t0 + p.wait_s)
                else:
                    tracer.stats["unmatched_waits"] += 1
                    tracer.stats["unmatched_wait_us"] += int((t1 - t0) * 1e6)
            except Exception as exc:
                tracer.error("wait_tensor", exc)
            return out
        return wait_tensor

    tracer.patch(owners, "wait_tensor", wait)
