"""DDP: gradient buckets through a comm hook, exposure from autograd final callbacks.

DDP's C++ reducer calls the ProcessGroup directly, so no patch of ``torch.distributed`` sees its
all-reduces. Two things do. In a process without CUDA, where the dispatcher kernels are built
(``funcol_kernels``), a kernel at ``c10d::allreduce_``'s CPU key (_ddp_kernel.h): DDP keeps its C++
built-in all-reduce (any Python comm hook, DDP's own default one included, cost the 6-bucket toy of
bench/hooks_overhead.py 6-16 % more CPU per step than the built-in), the kernel records each bucket and
the same window as below in C++, and ``window_entries`` turns it into the same records (it also sees the
all-reduce of DDP's used-parameter map, with ``find_unused_parameters``, which no hook sees);
``MESHSCOPE_DDP_KERNEL=0`` keeps the hook. Elsewhere (CUDA: comm_nccl's events; no kernels built)
``DistributedDataParallel.register_comm_hook``: the hook registered here is exactly
``default_hooks.allreduce_hook`` (divide the bucket by the group size, async all-reduce, return the
future), which DDP documents as equivalent to no hook, plus timestamps. Per bucket it sees the bucket
index and bytes, the issue time (when the bucket's all-reduce reaches the ProcessGroup) and the completion
(stamped in the one Python callback the default hook already has, the ``then`` that unwraps the result,
run by the gloo worker thread when the op finishes).

Exposed time (``wait_s``): the reducer blocks the training thread at the end of backward in C++
(``finalize_backward`` waits for every bucket's future), which Python cannot time directly. When the last
bucket's hook runs, the reducer has not yet queued its finalize callback; the hook queues one autograd
final callback (A) there, and A queues a second one (B) when it runs. Final callbacks run in queue order,
so the order is A → reducer finalize → B: ``B − A`` is exactly the time the thread spent in the reducer's
finalize, i.e. waiting for the outstanding buckets, plus copying the buckets back into ``.grad`` where
``gradient_as_bucket_view`` is off (DDP's default), which is DDP's own cost and is counted with it: on the
dev VM's CPU, 2.5 ms a step for 33.6 MB of fp32 gradients on a world of one, where the all-reduces took
none, and 0.04 ms with the views on (bench/gpu_check_ddp.py's model). That window is split across buckets in completion order (each bucket gets the part of the
window between the previous completion and its own; the remainder goes to the last one), so the
per-bucket ``wait_s`` sum to the step's exposed DDP time, and a bucket that finished during backward
compute gets 0. Chosen over ``_get_ddp_logging_data()`` (``avg_backward_comm_time``,
``avg_backward_compute_comm_overlap_time``): those are averages, sampled on iterations 1–10 and then every
100th, not per step, and do not give the blocked time itself. The records are made in B, on the thread
that ran backward (the training thread on CPU).

Cannot see (either way): DDP's own C++ broadcasts (the one-off bucket-rebuild sync at the start of step 2 and
``_sync_module_states`` at construction; the per-forward buffer broadcast is seen by ``comm_c10d``).
Only one comm hook can ever be registered on a DDP model, and never removed: a model that already has
one (user hook, DDP mixed precision) is not traced (``record_error``; the all-reduces its hook makes are
the c10d sites'); ``detach`` turns this hook into the plain default all-reduce (the kernel's group is
disarmed instead). CUDA (NCCL): the future completes at enqueue, so the window A/B and the buckets
are timed with CUDA events instead (``comm_nccl``; checked on a GPU by the GPU kit's section 8).
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist

from meshscope.agent.env import ENV_DDP_KERNEL, switched_off
from meshscope.agent.instrument import native
from meshscope.agent.instrument.ops import stamp_unwrap

_NAN = float("nan")
_default_group = dist.distributed_c10d._get_default_group


class _HookState:
    __slots__ = ("process_group", "tracer", "ops", "make_op")

    def __init__(self, process_group: Any, tracer: Any) -> None:
        self.process_group = process_group
        self.ops: list[tuple[Any, Any]] = []  # (op record, Work on CUDA / None) of the current backward
        self.bind(tracer)

    def bind(self, tracer: Any) -> None:
        """Record the buckets through ``tracer`` (None: not at all). A CPU bucket's op is made by
        ``make_op(nbytes)``, in C (``native.ddp_ops``: the group's entry looked up here, once), or None
        (the Python form)."""
        self.tracer, self.make_op = tracer, None
        if tracer is None:
            return
        try:
            group = self.process_group if self.process_group is not None else _default_group()
            self.make_op = native.ddp_ops(tracer, group)
        except Exception as exc:  # the Python form then: the buckets are still recorded
            tracer.error("ddp_comm_hook", exc)

    def detach(self) -> None:
        self.bind(None)
        self.ops = []


def traced_allreduce_hook(state, bucket):  # no annotations: DDP compares them to dist.GradBucket
    """DDP comm hook: ``default_hooks.allreduce_hook`` with timing (see the module docstring)."""
    group = state.process_group
    if group is None:
        group = _default_group()
    tracer = state.tracer
    if isinstance(bucket, tuple):
        # DDP's Python reducer (compiled autograd) passes (grad, param) and ignores the return value; do
        # what it does without a hook. The functional all-reduce is traced by comm_funcol.
        from torch.distributed import _functional_collectives as funcol

        grad = bucket[0]
        grad.copy_(funcol.all_reduce(grad / group.size(), "sum", group))
        return None
    buffer = bucket.buffer()
    buffer.div_(group.size())  # divide first, as the default hook does (fp16 overflow); compute, not comm
    if tracer is None or not tracer.enabled:
        return _allreduce(buffer, group)[0]
    p = stamp = None
    try:
        if buffer.is_cuda:
            p = tracer.begin("all_reduce", group, buffer.nbytes, "ddp_comm_hook", cuda=True)
        elif state.make_op is not None:  # C (``native``): the op is also its completion callback
            p = stamp = state.make_op(buffer.nbytes)
        else:  # tracer.begin, inline (a frame and a keyword call less per bucket)
            hot = tracer.hot
            hit = hot.groups.get(id(group))
            if hit is None or hit[0] is not group:
                hit = hot.resolve(group)
            p = tracer.Op("all_reduce", hit[1], hit[3], buffer.nbytes, -1, "ddp_comm_hook", next(hit[2]), hot.now())
            stamp = functools.partial(stamp_unwrap, p, hot.now)
    except Exception as exc:
        tracer.error("ddp_comm_hook", exc)
    fut, work = _allreduce(buffer, group, stamp)
    if p is not None:
        try:
            # The work is read by the CUDA timing only (comm_nccl): on CPU it is not kept past the hook.
            state.ops.append((p, work if p.cuda is not None else None))
            if bucket.is_last():
                _arm(state, tracer)
        except Exception as exc:
            tracer.error("ddp_comm_hook", exc)
    return fut


def _allreduce(buffer: Any, group: Any, stamp: Any = None) -> tuple[Any, Any]:
    """``default_hooks._allreduce_fut`` after its division, keeping the work. With ``stamp`` (``ops.stamp_unwrap``
    bound to the bucket's op; in C the op itself, see ``native.ddp_ops``), the one Python
    callback the default hook already has (unwrapping the result list: DDP's Python hook result must be a
    Python object, not the work's list future) also stamps completion. One callback, not two: each one runs
    on the gloo worker thread and has to take the GIL, so a second one is a second wait behind the training
    thread (up to the 5 ms switch interval) before gloo's worker can go on.

    The ProcessGroup is called directly, as DDP's C++ reducer does without a hook: ``dist.all_reduce``'s
    Python layer (argument checks, options, logging wrapper: 5 µs of training-thread CPU per bucket on the
    dev VM) would be paid on every bucket for nothing, the bucket being a dense tensor of the group."""
    work = group.allreduce([buffer])
    return work.get_future().then(_unwrap if stamp is None else stamp), work


def _unwrap(fut: Any) -> Any:
    return fut.value()[0]


def _arm(state: _HookState, tracer: Any) -> None:
    from torch.autograd import Variable

    engine = Variable._execution_engine
    cuda = state.ops[-1][0].cuda is not None

    def after_finalize(t_a: float, ev_a: Any) -> None:
        try:
            ops, state.ops = state.ops, []
            if cuda:
                timer = tracer.cuda_timer()
                timer.on_ddp_backward_end(ops, ev_a, timer.event())
            else:
                _emit_window(tracer, [p for p, _ in ops], t_a, tracer.now())
        except Exception as exc:
            tracer.error("ddp_final_callback", exc)

    def before_finalize() -> None:
        try:
            ev_a = None
            if cuda:
                ev_a = tracer.cuda_timer().event()
            t_a = tracer.now()
            engine.queue_callback(functools.partial(after_finalize, t_a, ev_a))
        except Exception as exc:
            tracer.error("ddp_final_callback", exc)

    try:
        engine.queue_callback(before_finalize)
    except Exception as exc:  # not inside a backward graph task: no window, exposure unknown
        tracer.error("ddp_final_callback", exc)
        ops, state.ops = state.ops, []
        now = tracer.now()
        for p, _ in ops:
            tracer.emit(p, t_end=p.t_done if p.t_done is not None else now, wait_s=_NAN)


def split_window(done: list[float | None], t_a: float, t_b: float) -> list[float]:
    """The blocked window [t_a, t_b] split across ops completing at ``done`` (None: not seen before
    t_b): each gets the part of the window between the previous completion and its own, the last one also
    the tail after it. The shares sum to ``t_b - t_a``; an op done before ``t_a`` gets 0."""
    ends = [min(t if t is not None else t_b, t_b) for t in done]
    shares = [0.0] * len(ends)
    cursor = t_a
    order = sorted(range(len(ends)), key=ends.__getitem__)
    for i in order:
        shares[i] = max(0.0, ends[i] - cursor)
        cursor = max(cursor, ends[i])
    if order:
        shares[order[-1]] += t_b - cursor  # finalize's tail (copy-out) after the last completion
    return shares


def window_entries(ops: list[tuple], t_a: float, t_b: float) -> list[tuple]:
    """The DDP bucket kernel's window (funcol_kernels: ``ops`` as (group, bytes, seq, t_start, t_done), 0.0
    for a time not stamped) as (group, bytes, seq, t_start, t_end, wait_s): the same shares as the hook's
    window; exposure unknown (NaN) where the window was not stamped (its final callbacks did not run)."""
    done = [d if d else None for _, _, _, _, d in ops]
    if t_a and t_b:
        shares = split_window(done, t_a, t_b)
        # No later than t_b: the reducer's finalize returned only once every bucket's work had completed. Its
        # stamp can be later: the future wakes its waiters before it runs its callbacks (the stamp among them).
        ends = [min(d, t_b) if d is not None else t_b for d in done]
    else:
        shares = [_NAN] * len(ops)
        ends = [d if d is not None else t0 for d, (_, _, _, t0, _) in zip(done, ops)]
    return [(name, nbytes, seq, t0, t_end, wait_s)
            for (name, nbytes, seq, t0, _), t_end, wait_s in zip(ops, ends, shares)]


def _emit_window(tracer: Any, ops: list[Any], t_a: float, t_b: float) -> None:
    """Record the buckets in issue order with their share of the reducer's blocked window."""
    for p, wait_s in zip(ops, split_window([p.t_done for p in ops], t_a, t_b)):
        tracer.emit(p, t_end=p.t_done if p.t_done is not None else t_b, wait_s=wait_s)


def attach(tracer: Any, module: Any) -> _HookState | None:
    """Register (or re-enable) the traced hook on a DDP model; ``None`` for any other module."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(module, DistributedDataParallel):
        return None
    for hook, state in module._comm_hooks:
        if hook is traced_allreduce_hook:  # attached before: re-enable, DDP allows one registration only
            state.bind(tracer)
            return state
    if module._comm_hooks:
        raise RuntimeError("DDP model already has a comm hook; its buckets are not traced")
    kernels = getattr(tracer, "_kernels", None)
    if kernels is not None and not switched_off(ENV_DDP_KERNEL):
        # In torch's dispatcher, DDP's built-in all-reduce left in place (funcol_kernels: a process without CUDA)
        armed = kernels.arm_ddp(module.process_group if module.process_group is not None else _default_group())
        if armed is not None:
            return armed
    state = _HookState(module.process_group, tracer)
    module.register_comm_hook(state, traced_allreduce_hook)
    return state
