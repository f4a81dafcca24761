"""The functional collectives traced in torch's dispatcher (agent/instrument/_funcol_kernels.cpp), and DDP's
gradient buckets (agent/instrument/_ddp_kernel.h, armed per DDP model by comm_ddp): built, found, loaded, bound
to a tracer and drained.

    python -m meshscope.agent.instrument.funcol_kernels [--check]     # build (make install runs it)

A torch C++ extension: it must be compiled against the torch it runs with, so it is built where meshscope is
installed (``make install``; a C++ compiler, torch's headers and ninja; ~35 s on the dev VM), into a cache
directory named after the torch version and the source (``cache_dir``), and only *loaded* by a job: a job never
compiles. Where it is not built, or cannot be used, comm_funcol's Python / C sites trace the functional
collectives, as before (``usable`` says which; ``MESHSCOPE_NATIVE=0`` switches it off with the other C forms,
``MESHSCOPE_FUNCOL_KERNELS=0`` alone: the sites' own tests and the benchmark's comparison use it).

Used in a process without CUDA only: the kernels record CPU tensors (they are torch's kernels for the CPU key,
each calling the kernel torch had there), and a job with a GPU keeps the sites whose CUDA timing the GPU kit
checks (comm_nccl). Loading puts the kernels in place for the life of the process (a registration is not
undone): a tracer ``bind``s them on attach and ``unbind``s them on detach, which is when they record at all.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import sys
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("_funcol_kernels.cpp")
HEADERS = (Path(__file__).with_name("_ddp_kernel.h"),)  # included by SOURCE: part of what is built
_loaded: dict[str, Any] = {}  # build key -> module (one per process)
# A Bound's token: the extension restarts its counters for a token other than the last bound (a new tracer's
# groups count from 1). Not id(tracer): a later tracer may get a collected one's id and its counters.
_tokens = itertools.count(1)


def _key() -> str:
    import torch

    digest = hashlib.sha256(b"".join(path.read_bytes() for path in (SOURCE, *HEADERS))).hexdigest()[:12]
    abi = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"torch{torch.__version__.replace('+', '_')}-{abi}-{digest}"


def cache_dir() -> Path:
    """Where the extension of this torch and this source is built: ``$MESHSCOPE_CACHE_DIR`` or
    ``$XDG_CACHE_HOME/meshscope`` (``~/.cache/meshscope``), then ``funcol-kernels/<torch>-<python>-<source hash>``."""
    from meshscope.agent.env import cache_root

    return cache_root() / "funcol-kernels" / _key()


def _name() -> str:
    return "meshscope_funcol_kernels_" + _key().rsplit("-", 1)[1]


def built() -> Path | None:
    """The built library for this torch and source, or None."""
    so = cache_dir() / f"{_name()}.so"
    return so if so.is_file() else None


def build(*, verbose: bool = False) -> Path:
    """Compile the extension into ``cache_dir()`` (raises where it cannot be built)."""
    from torch.utils.cpp_extension import load

    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    load(name=_name(), sources=[str(SOURCE)], build_directory=str(directory), extra_cflags=["-O2"],
         verbose=verbose)
    so = built()
    if so is None:
        raise RuntimeError(f"the build wrote no {_name()}.so in {directory}")
    return so


def load() -> Any | None:
    """The built extension, loaded once per process and its kernels put in place (``install``), or None where
    not built or not installable on this torch."""
    key = _key()
    if key in _loaded:
        return _loaded[key]
    so = built()
    module = None
    if so is not None:
        spec = importlib.util.spec_from_file_location(_name(), so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not module.install():  # this torch's ops are not as the kernels expect: the sites trace them
            module = None
    _loaded[key] = module
    return module


def usable(tracer: Any) -> Any | None:
    """The extension, where ``tracer``'s functional collectives are traced by it: C forms switched on, the tracer
    deferred (a telemetry core's: perf_counter readings, drained on its flusher), no CUDA in this process, and
    the extension built for this torch; not switched off (``MESHSCOPE_FUNCOL_KERNELS=0``). None where
    comm_funcol's sites trace them."""
    import time

    import torch

    from meshscope.agent.instrument import native

    from meshscope.agent.env import ENV_FUNCOL_KERNELS, switched_off

    if (not native.switched_on() or switched_off(ENV_FUNCOL_KERNELS)
            or getattr(tracer, "now", None) is not time.perf_counter or getattr(tracer, "_live", None) is None):
        return None
    if torch.cuda.is_available():
        return None
    try:
        return load()
    except Exception as exc:  # a stale or broken build: the sites trace them
        tracer.error("funcol_kernels.load", exc)
        return None


def bind(tracer: Any, ext: Any) -> bool:
    """Trace ``tracer``'s functional collectives with ``ext``'s kernels instead of comm_funcol's sites: bound to
    it (``tracer._kernels``), its groups numbered by the kernels' counters. False where it cannot be (another
    tracer holds them, or this one numbered ops before with counters of its own)."""
    limits = {"max_pending": tracer.max_pending, "max_done": tracer.hot.max_done}
    if tracer._kernels is not None:  # attached again
        return tracer._kernels.bind(**limits)
    bound = Bound(ext, tracer)
    if tracer.groups._counters or not bound.bind(**limits):
        return False
    tracer._kernels = bound
    tracer.groups.counter_of = bound.counter
    return True


class Bound:
    """The extension bound to one tracer: its groups' counters come from it (shared with the kernels), and
    ``drain`` turns the kernels' completed ops into the tracer's entries (``ops.Entry``)."""

    def __init__(self, ext: Any, tracer: Any) -> None:
        self.ext, self.tracer, self.token = ext, tracer, next(_tokens)
        self._keys: dict[str, int] = {}  # c10d group name -> the tracer's group key

    def bind(self, *, max_pending: int, max_done: int) -> bool:
        return bool(self.ext.bind(self.token, max_pending, max_done))

    def unbind(self) -> None:
        self.ext.unbind(self.token)

    def arm_ddp(self, group: Any) -> "DdpArmed | None":
        """Record the buckets of a DDP model on ``group`` with DDP's built-in all-reduce left in place
        (_ddp_kernel.h); None where they cannot be (not installed on this torch; the C sites cannot count
        themselves out of it): then comm_ddp's hook records them."""
        from meshscope.agent.instrument import native

        if not self.ext.ddp_installed() or not native.set_site_depth(self.ext.site_depth_address()):
            return None
        name = group.group_name
        return DdpArmed(self.ext, name) if self.ext.ddp_arm(name) else None

    def counter(self, name: str) -> Any:
        """The group ``name``'s issue counter, shared with the kernels (``_hot.SharedCount`` over it where
        the C module is built: ``next`` without a Python call)."""
        from meshscope.agent.instrument import native

        return native.shared_count(self.ext.counter(name))

    def _group_key(self, name: str) -> int:
        key = self._keys.get(name)
        if key is None:
            from torch.distributed import distributed_c10d as c10d

            key = self._keys[name] = self.tracer.groups.resolve(c10d._resolve_process_group(name))[3]
        return key

    def drain(self, put: Any) -> int:
        """Hand each completed op to ``put`` as an Entry, with the step open at its completion (the recorder's
        ``step_keys``, where it has them; else None). Returns how many."""
        tracer = self.tracer
        try:
            rows, counts = self.ext.drain()
            keys = getattr(tracer.recorder, "step_keys", None)
            at, epoch = (keys() if keys is not None else None), tracer._epoch
        except Exception as exc:
            tracer.error("funcol_kernels.drain", exc)
            return 0
        for name, n in counts.items():
            if n:
                tracer.stats[name] += n
        for op, group, nbytes, seq, t0, t1, wait_s in rows:
            try:
                step = at(t1 + epoch) if at is not None else None
                put((op, self._group_key(group), nbytes, -1, "funcol", seq, t0, t1, wait_s, step))
            except Exception as exc:
                tracer.error("funcol_kernels.drain", exc)
        return len(rows) + self._drain_ddp(put, at, epoch)

    def _drain_ddp(self, put: Any, at: Any, epoch: float) -> int:
        """DDP's buckets, a backward window at a time: each bucket's share of the window as comm_ddp's hook
        gives it (``window_entries``), with the step open at the window's end."""
        from meshscope.agent.instrument.comm_ddp import window_entries

        n = 0
        try:
            windows = self.ext.ddp_drain()
        except Exception as exc:
            self.tracer.error("funcol_kernels.drain", exc)
            return 0
        for t_a, t_b, ops in windows:
            try:
                for name, nbytes, seq, t0, t_end, wait_s in window_entries(ops, t_a, t_b):
                    step = at((t_b or t_end) + epoch) if at is not None else None
                    put(("all_reduce", self._group_key(name), nbytes, -1, "ddp_comm_hook", seq, t0, t_end, wait_s,
                         step))
                    n += 1
            except Exception as exc:
                self.tracer.error("funcol_kernels.drain", exc)
        return n


class DdpArmed:
    """A DDP model's group armed in the DDP bucket kernel (the handle comm_ddp.attach returns)."""

    def __init__(self, ext: Any, name: str) -> None:
        self.ext, self.name = ext, name

    def detach(self) -> None:
        self.ext.ddp_disarm(self.name)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m meshscope.agent.instrument.funcol_kernels",
                                     description="Build meshscope's functional-collective kernels for this torch.")
    parser.add_argument("--check", action="store_true", help="only say whether they are built")
    args = parser.parse_args(argv)
    if args.check:
        so = built()
        print(f"funcol kernels: {'built: ' + str(so) if so else 'not built for this torch'}")
        return 0 if so else 1
    try:
        so = build()
    except Exception as exc:  # no compiler, no headers: meshscope runs its Python / C sites
        print(f"funcol kernels: not built ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}); "
              "the functional collectives are traced by the Python / C sites")
        return 0
    print(f"funcol kernels: built {so}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
