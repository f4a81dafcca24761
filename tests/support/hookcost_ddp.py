"""The per-call paths of DDP's buckets for ``tests.support.hookcost.per_call`` (the method is in its
docstring): through the traced comm hook (``ddp_comm_hook``) and through the bucket kernel in torch's
dispatcher (``ddp_kernel_bucket``; agent/instrument/_ddp_kernel.h)."""

from __future__ import annotations

from typing import Any, Callable


def ddp_hook_path(tracer: Any, group: Any, t: Any) -> tuple[Callable[[], Any], Callable[[], None], Callable[[], None]]:
    """(run, on, off) of the traced DDP comm hook on one bucket (never the last: the window that records
    the step's buckets at the end of backward is per step, not per bucket), against the same hook with no
    tracer (the direct ProcessGroup call and its one callback, as DDP runs it untraced).

    The hook's group is ``group`` (the fake backend) behind a thin proxy: its ``allreduce`` is the real
    C++ call, whose work's future holds ``None`` where a real backend's holds the reduced tensors, so the
    proxy hands the hook a completed future holding them (one more object per call, in both arms). Being
    complete, the future runs the hook's callback at once on this thread (a real backend runs it on its
    own thread when the op ends): the figure includes the completion stamp, an upper bound of what the
    training thread pays."""
    import torch

    from meshscope.agent.instrument.comm_ddp import _HookState, traced_allreduce_hook

    class Work:
        __slots__ = ("work", "tensors")

        def __init__(self, work: Any, tensors: list) -> None:
            self.work, self.tensors = work, tensors

        def get_future(self) -> Any:
            fut = torch.futures.Future()
            fut.set_result(self.tensors)
            return fut

    class Group:
        def size(self) -> int:
            return group.size()

        def allreduce(self, tensors: list) -> Work:
            return Work(group.allreduce(tensors), tensors)

    proxy = Group()
    # The tracer resolves a group through MeshInfo; the proxy stands for ``group`` there (a benchmark's
    # shortcut into its cache: no public way to alias a designator).
    tracer.mesh_info._cache[id(proxy)] = (proxy, tracer.mesh_info.lookup(group))

    class Bucket:
        def buffer(self) -> Any:
            return t

        def is_last(self) -> bool:
            return False

    bucket, state = Bucket(), _HookState(proxy, None)

    def on() -> None:
        tracer.attach(None)
        state.bind(tracer)

    def off() -> None:
        tracer.detach()
        state.bind(None)

    def run() -> None:
        traced_allreduce_hook(state, bucket)
        state.ops.clear()  # what the end of backward does with the bucket's op (both arms: empty untraced)

    return run, on, off


DDP_KERNEL_BUCKETS = 20  # all-reduces per backward of the ddp_kernel_bucket path


def ddp_kernel_path(tracer: Any, world: Any, t: Any, *, on: Callable[[], None], off: Callable[[], None]
                ) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """(run, on, off) of DDP's buckets recorded by the dispatcher kernel: ``run`` a backward whose node
    all-reduces ``DDP_KERNEL_BUCKETS`` times through the ProcessGroup's C++ call, as DDP's reducer does from
    its autograd hooks; ``on`` the tracer attached and the group armed as ``comm_ddp.attach`` arms a DDP
    model's (the untraced arm: neither). The backward's own cost is in both arms."""
    import torch

    class Buckets(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x * 1

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            for _ in range(DDP_KERNEL_BUCKETS):
                world.allreduce([t])
            return grad

    leaf = torch.ones(4, requires_grad=True)
    armed: dict[str, Any] = {"handle": None}

    def run() -> None:
        Buckets.apply(leaf).sum().backward()

    def arm() -> None:
        on()
        if tracer._kernels is not None:
            armed["handle"] = tracer._kernels.arm_ddp(world)

    def disarm() -> None:
        if armed["handle"] is not None:
            armed["handle"].detach()
            armed["handle"] = None
        off()
    return run, arm, disarm
