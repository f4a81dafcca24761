"""Per-step memory sample: process RSS and peak everywhere, the caching allocator's stats on CUDA.

Costs: ru_maxrss ~1 µs, reading /proc/self/statm ~1 µs (one pread), torch.cuda.memory_stats
tens of µs, on the flusher thread, once per drain (``readings``).
"""

from __future__ import annotations

import os
import resource
import weakref

import torch

from meshscope.agent.contract import memory_record

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_statm: list = [None, -1]  # [fd of /proc/self/statm, the pid that opened it]


def rss_bytes() -> int:
    """The process's resident set. ``/proc/self/statm`` is opened once per process and re-read with one
    ``pread`` (an open/read/close cost the flusher 18.7 µs, this 7). Reopened in a forked child: the
    descriptor would still read the parent."""
    try:
        fd, pid = _statm
        if pid != os.getpid():
            # No lock (a child forked while another thread held one would wait forever): two threads
            # opening at once leave one descriptor unused, nothing worse. The parent's, in a child, is
            # left open: closing it there changes nothing for the parent.
            fd = os.open("/proc/self/statm", os.O_RDONLY)  # not inherited by exec'd children (PEP 446)
            _statm[0], _statm[1] = fd, os.getpid()
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):  # not Linux: fall back to the peak (an upper bound)
        _statm[1] = -1  # a descriptor closed or reused under us: opened again next time
        return rss_peak_bytes()


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


NOT_MEASURED = (-1, -1, -1)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard (FSDP2, TP), else the tensor."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _nbytes(tensors, seen: set) -> int:
    """Bytes of the tensors' storages, each storage once (tied weights, views of one flat buffer)."""
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage.data_ptr())
        if storage.data_ptr() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def tensor_bytes(*, modules, optimizers) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes this rank holds, read from the tensors: what the
    analytic model describes (RSS also holds the runtime; the allocator also holds activations).

    Parameters: the modules' and the optimizers' parameters. Gradients: each trainable parameter's
    ``.grad``, or as many bytes as the parameter where it is None at this moment (``zero_grad`` sets it
    to None between steps; backward re-creates it at the parameter's size). Optimizer state: every
    tensor in ``optimizer.state``."""
    params: dict[int, torch.Tensor] = {}
    for m in modules:
        params.update((id(p), p) for p in m.parameters())
    for opt in optimizers:
        params.update((id(p), p) for g in opt.param_groups for p in g["params"])
    seen: set = set()
    param_b = _nbytes(params.values(), seen)
    grads = [p.grad for p in params.values() if p.grad is not None]
    grad_b = _nbytes(grads, seen)
    grad_b += sum(_local(p).numel() * _local(p).element_size() for p in params.values()
                  if p.requires_grad and p.grad is None)
    state = [v for opt in optimizers for st in opt.state.values() for v in st.values()]
    return param_b, grad_b, _nbytes(state, seen)


class TensorCensus:
    """The bytes of parameters, gradients and optimizer state, taken once, at the end of the first step
    after which an optimizer holds state. Optimizers are found by torch's global step hook, so a loop need
    not name them; modules come from ``add_modules``. ``on_error(where, exc)`` counts failures: the
    census never raises into training."""

    def __init__(self, *, on_error) -> None:
        self._on_error = on_error
        self._modules: weakref.WeakSet = weakref.WeakSet()
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        self._taken = False
        self._stepped = False  # an optimizer stepped: a plain flag, read at every step's end before any WeakSet
        self._hook = None
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._hook = register_optimizer_step_post_hook(self._saw)
        except Exception as exc:  # an old torch: no tensor bytes, nothing else lost
            on_error("optimizer_hook", exc)

    def _saw(self, opt, *_) -> None:
        if self._taken:
            return
        self._optimizers.add(opt)
        self._stepped = True

    def add_modules(self, modules) -> None:
        self._modules.update(modules)

    def take(self) -> tuple[int, int, int]:
        """The bytes once, when due; ``NOT_MEASURED`` before and after."""
        # Plain flags first: even len() of a WeakSet costs ~0.3 µs, and this runs at every step's end.
        if self._taken or not self._stepped or not any(opt.state for opt in self._optimizers):
            return NOT_MEASURED
        # The hook stays until close(): take() may run inside torch's loop over its global step hooks (the
        # zero-code driver ends a step in its own post hook), where removing one raises "OrderedDict mutated
        # during iteration" into the user's optimizer.step(). Once taken, _saw returns at its first test.
        self._taken = True
        try:
            return tensor_bytes(modules=list(self._modules), optimizers=list(self._optimizers))
        except Exception as exc:
            self._on_error("tensor_bytes", exc)
            return NOT_MEASURED

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def readings(device: torch.device) -> dict[str, int]:
    """The process's and the device's memory now: the fields of a ``memory`` row that are not the step's.
    The flusher reads them once per drain and gives them to every step it drains then. Read per step, each
    ``pread`` let the training thread take the GIL and made it hand it back (a forced switch): 8 µs of the
    training thread's CPU per step on the step boundaries' path of bench/hooks_overhead.py. A drain runs a
    few ms to ``flush_interval_s`` after its steps ended, so per-step readings were as late and nearly
    equal anyway. -1 marks what this device lacks (the allocator's and the device's figures off CUDA)."""
    common = dict(rss_bytes=rss_bytes(), rss_peak_bytes=rss_peak_bytes())
    if device.type != "cuda":
        return dict(common, allocated_bytes=-1, allocated_peak_bytes=-1, reserved_bytes=-1, reserved_peak_bytes=-1,
                    active_bytes=-1, active_peak_bytes=-1, alloc_retries=-1, ooms=-1, device_free_bytes=-1,
                    device_total_bytes=-1)
    s = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    return dict(
        common,
        allocated_bytes=s.get("allocated_bytes.all.current", 0),
        allocated_peak_bytes=s.get("allocated_bytes.all.peak", 0),
        reserved_bytes=s.get("reserved_bytes.all.current", 0), reserved_peak_bytes=s.get("reserved_bytes.all.peak", 0),
        active_bytes=s.get("active_bytes.all.current", 0), active_peak_bytes=s.get("active_bytes.all.peak", 0),
        alloc_retries=s.get("num_alloc_retries", 0), ooms=s.get("num_ooms", 0),
        device_free_bytes=free, device_total_bytes=total,
    )


def sample(step: int, t: float, now: dict[str, int], tensors: tuple[int, int, int] = NOT_MEASURED) -> tuple:
    """A ``memory`` row (``agent.contract.memory_record``) of step ``step`` from ``readings`` taken at or
    after its end; the tensor bytes are -1 when they were not measured with this sample."""
    param, grad, optimizer = tensors
    return memory_record(step=step, t=t, param_bytes=param, grad_bytes=grad, optimizer_bytes=optimizer, **now)
