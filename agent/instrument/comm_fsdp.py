"""FSDP2: parameter all-gathers and gradient reduce-scatters through FSDP's official custom-comm hooks.

``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` take an ``AllGather`` /
``ReduceScatter`` object that FSDP calls for every unshard / gradient reduction of that module's
parameter group. The objects installed here subclass the default implementations (so FSDP's own
``isinstance`` checks — ``set_symm_mem_for_comm``, ``set_allocate_memory_from_process_group_for_comm`` —
keep accepting them) and delegate to whatever comm was installed before, timing the call.

What they see, per call: the group, the bytes (all-gather output, reduce-scatter input: FSDP's flat
padded buffers), issue time. On CPU/gloo FSDP calls both blocking (``async_op=False``): the call returns
once the op completed, so completion is the return and the whole call is ``wait_s``. With ``async_op=True``
(explicit ``unshard(async_op=True)``) the work is tracked and the wait FSDP makes in
``foreach_all_gather_copy_out`` is timed by the ``Work.wait`` patch (``comm_c10d``).

Not seen here: HSDP's replicate-dim ``dist.all_reduce`` (seen by ``comm_c10d``, source ``c10d``), and
modules with several parameter groups (per-parameter meshes), for which FSDP refuses a custom comm: their
collectives are still seen by ``comm_c10d``. On CUDA FSDP issues on its own streams and the compute stream
waits on an event, not a ``Work``: durations come from CUDA events around the call on the all-gather /
reduce-scatter stream, the exposed part is not observable here (``wait_s`` = NaN) (``comm_nccl``; not yet run on a GPU).
"""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from meshscope.agent.instrument import native
from meshscope.agent.instrument.comm_nccl import SIDE_STREAM
from meshscope.agent.instrument.traced_call import Issue, traced_call


def _traced(call: Callable, *, tracer: Any, op: str, buffer: int) -> Callable:
    """``call(output_tensor, input_tensor, group, [op,] async_op)`` (the FSDP comm being replaced, behind
    positional arguments: cheaper to pass on than keywords) recording ``op`` through ``tracer``; its bytes
    are the size of the tensor at position ``buffer`` (nccl-tests: all-gather output, reduce-scatter
    input). A blocking call on CPU returns once its op completed: the whole call is blocked time. The CPU
    path is written out in one frame (as ``comm_c10d._fast_one``; in C where ``native`` says so); on CUDA
    the same frame records two events on FSDP's stream (``comm_nccl``), an async call takes ``traced_call``."""
    where = f"fsdp_{op}"

    def describe(args: tuple, kwargs: dict) -> Issue:
        tensor, async_op = args[buffer], args[-1]
        p = tracer.begin(op, args[2], tensor.nbytes, "fsdp_comm", cuda=tensor.is_cuda)
        return p, args, kwargs, not async_op and p.cuda is None, async_op

    def finish(p: Any, async_op: bool, work: Any) -> None:
        if async_op and work is not None:
            tracer.track_work(work, [p])
        elif p.cuda is not None:
            tracer.cuda_timer().on_side_stream_return(p)
        else:
            tracer.finish_sync(p)

    slow = traced_call(call, tracer=tracer, where=where, describe=describe, finish=finish)
    (_, main, main_tid, local, get_ident, groups, resolve, now, live, push, done, max_done, pending,
     max_pending, stats) = tracer.hot

    def fast(output_tensor: Any, input_tensor: Any, group: Any, *rest: Any) -> Any:
        tls = main if get_ident() == main_tid else local.nesting
        if not tracer.enabled or tls.depth:
            return call(output_tensor, input_tensor, group, *rest)
        try:
            tensor = input_tensor if buffer else output_tensor
            cuda = tensor.is_cuda
            if cuda and rest[-1]:  # async on CUDA (explicit unshard(async_op=True)): the general path
                issued = None
            else:
                hit = groups.get(id(group))
                if hit is None or hit[0] is not group:
                    hit = resolve(group)
                issued = (op, hit[3], tensor.nbytes, -1, "fsdp_comm", next(hit[2]), now())
        except Exception as exc:
            tracer.error(where, exc)
            return call(output_tensor, input_tensor, group, *rest)
        if issued is None:
            return slow(output_tensor, input_tensor, group, *rest)
        if cuda:  # on FSDP's all-gather / reduce-scatter stream: two events bound it, its stall unknown
            try:
                timer = tracer.cuda_timer()
                e0 = timer.event()
            except Exception as exc:
                tracer.error(where, exc)
                return call(output_tensor, input_tensor, group, *rest)
        tls.depth += 1  # FSDP's own dist.* call inside is this op, not another
        try:
            work = call(output_tensor, input_tensor, group, *rest)
        finally:
            tls.depth -= 1
        try:
            if cuda:  # resolved off the training thread (comm_nccl: CudaCommTimer.queue_fast); no op object
                timer.queue_fast(issued, e0, timer.event(), SIDE_STREAM)
            elif rest[-1] and work is not None:  # async_op: completed by its Work.wait
                if len(pending) < max_pending:
                    pending[id(work)] = (work, issued)
                else:
                    tracer.track_work(work, issued)
            else:
                t1 = now()
                if len(done) < max_done:
                    push(issued + (t1, t1 - issued[6], live.key))
                else:
                    stats["dropped_done"] += 1
        except Exception as exc:
            tracer.error(where, exc)
        return work

    return native.fsdp_site(call, fast, tracer=tracer, op=op, where=where, buffer=buffer)


class TracedAllGather(DefaultAllGather):
    """FSDP2 all-gather that records each call; delegates to ``inner`` (the comm it replaces)."""

    def __init__(self, tracer: Any, inner: Any) -> None:
        self.tracer = tracer
        self.inner = inner

        # ``inner`` is called positionally, in the AllGather protocol's parameter order.
        self._call = _traced(inner, tracer=tracer, op="all_gather", buffer=0)

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
        return self._call(output_tensor, input_tensor, group, async_op)


class TracedReduceScatter(DefaultReduceScatter):
    """FSDP2 reduce-scatter that records each call; delegates to ``inner`` (the comm it replaces)."""

    def __init__(self, tracer: Any, inner: Any) -> None:
        self.tracer = tracer
        self.inner = inner

        # ``inner`` is called positionally, in the ReduceScatter protocol's parameter order.
        self._call = _traced(inner, tracer=tracer, op="reduce_scatter", buffer=1)

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        return self._call(output_tensor, input_tensor, group, op, async_op)


class _FsdpHandle:
    def __init__(self, module: Any, all_gather: Any, reduce_scatter: Any) -> None:
        self.module, self.all_gather, self.reduce_scatter = module, all_gather, reduce_scatter

    def detach(self) -> None:
        self.module.set_custom_all_gather(self.all_gather)
        self.module.set_custom_reduce_scatter(self.reduce_scatter)


def attach(tracer: Any, module: Any) -> _FsdpHandle | None:
    """Install the traced comms on one ``fully_shard``-ed module; ``None`` when it is not one or has no
    single parameter group (a root without own parameters; per-parameter meshes)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) != 1:
        return None
    all_gather, reduce_scatter = groups[0]._all_gather_comm, groups[0]._reduce_scatter_comm
    # Installed by an earlier tracer that did not detach: wrap what it wrapped.
    if isinstance(all_gather, TracedAllGather):
        all_gather = all_gather.inner
    if isinstance(reduce_scatter, TracedReduceScatter):
        reduce_scatter = reduce_scatter.inner
    module.set_custom_all_gather(TracedAllGather(tracer, all_gather))
    module.set_custom_reduce_scatter(TracedReduceScatter(tracer, reduce_scatter))
    return _FsdpHandle(module, all_gather, reduce_scatter)
