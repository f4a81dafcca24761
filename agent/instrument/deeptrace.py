"""A rank's side of ``meshscope trace``: torch.profiler armed on a running job for N steps, nothing to
restart (the protocol: ``agent.contract.deeptrace``).

Who does what, so that a job that is never traced pays nothing but one attribute check per step boundary:

- the flusher thread (``DeepTrace.poll``, every flush) stats the run's ``request.json`` at most once per
  ``POLL_S`` and reads it only when it changed; a request for this rank arms a :class:`TraceSession`, which
  the telemetry holds in an attribute the training thread checks at each step's start and end;
- the training thread, at the start of the first step to trace, starts torch's Kineto profiler (CPU
  activities, CUDA too on a GPU; no shapes, no stacks, no memory) and marks each traced step ``ProfilerStep#<step>`` over exactly the
  span telemetry records for it; at the end of the N-th step it stops the profiler (on this thread: Kineto
  is enabled and disabled per thread) and hands it to a short-lived thread;
- that thread exports the Chrome-trace JSON (``rank<k>.json``: Kineto writes it in C++), adds the
  ``distributedInfo`` HTA needs (rank, world size, backend and the process groups' config), and writes
  ``rank<k>.done.json`` with the steps traced and what the profiler cost.

A failure anywhere is an answer with an ``error``, never an exception into the training loop.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from meshscope.agent.contract.deeptrace import POLL_S, REQUEST, TraceDone, TraceRequest, done_name, trace_name, write_atomic

HEAD_BYTES = 4 << 20  # the part of an exported trace where Kineto writes its metadata, before "traceEvents"


class TraceSession:
    """One armed request on one rank. Made by the flusher; ``begin_step`` / ``end_step`` run on the training
    thread and return the session while it goes on, None once it is over (the telemetry drops it then)."""

    def __init__(self, request: TraceRequest, *, directory: Path, rank: int, world_size: int,
                 device: Any = None) -> None:
        self.request, self.dir, self.rank, self.world_size = request, directory, rank, world_size
        self.device = device
        self.cancelled = False  # set by the flusher when the request is withdrawn before the trace began
        self.prof: Any = None
        self.region: Any = None  # the open step's ProfilerStep#<step> annotation
        self.first = self.last = -1
        self.traced = 0
        self.start_s = 0.0
        self.error = ""
        self.exporter: threading.Thread | None = None

    # ------------------------------------------------------------------------------ training thread
    def begin_step(self, step: int) -> TraceSession | None:
        try:
            return self._begin(step)
        except Exception as exc:  # never into the training loop
            return self._fail(exc)

    def end_step(self, step: int) -> TraceSession | None:
        try:
            return self._end(step)
        except Exception as exc:
            return self._fail(exc)

    def _begin(self, step: int) -> TraceSession | None:
        if self.prof is None:
            if self.cancelled:
                return None
            start = self.request.start_step
            if start is not None and step < start:
                return self
            try:
                self._start()
            except Exception as exc:  # e.g. another profiler already runs in this process
                self.error = f"profiler did not start: {type(exc).__name__}: {exc}"[:500]
                self.prof = None
                self._answer_async(None)
                return None
            self.first = step
        elif self.region is not None:  # the last step did not end (aborted, discarded): not a traced step
            self._close_region()
        from torch.profiler import record_function

        self.region = record_function(f"ProfilerStep#{step}")
        self.region.__enter__()
        return self

    def _end(self, step: int) -> TraceSession | None:
        if self.region is None:  # armed, or began between this step's start and end: nothing traced yet
            return self if self.prof is not None or not self.cancelled else None
        self._close_region()
        self.last, self.traced = step, self.traced + 1
        if self.traced < self.request.steps:
            return self
        self.finish()
        return None

    def _fail(self, exc: BaseException) -> None:
        self.error = self.error or f"{type(exc).__name__}: {exc}"[:500]
        if self.prof is not None:
            self.finish()
        elif self.exporter is None:
            self._answer_async(None)
        return None

    def finish(self, error: str = "") -> None:
        """Stop the profiler (this thread: it started it) and export on another thread. ``close`` of a
        telemetry mid-trace calls it with why the trace is short."""
        if self.prof is None:
            return
        if self.region is not None:
            self._close_region()
        self.error = self.error or error
        prof, self.prof = self.prof, None
        t0 = time.perf_counter()
        try:
            prof.__exit__(None, None, None)  # on a GPU, after a device sync: the kernels of the last step
        except Exception as exc:
            self.error = f"profiler did not stop: {type(exc).__name__}: {exc}"[:500]
            prof = None
        stop_s = time.perf_counter() - t0
        self._answer_async(prof, stop_s=stop_s)

    def _start(self) -> None:
        # torch.autograd.profiler's Kineto session, not torch.profiler.profile: the latter's start imports
        # torch._inductor (``prepare_trace``), 2-3 s on the training thread of a process that had not, and
        # adds nothing here but the distributedInfo written after the export anyway (``distributed_info``).
        import torch
        from torch.autograd.profiler import profile

        kind = getattr(self.device, "type", None)
        cuda = kind == "cuda" or (kind is None and torch.cuda.is_available() and torch.cuda.is_initialized())
        t0 = time.perf_counter()
        prof = profile(use_kineto=True, use_device="cuda" if cuda else None, record_shapes=False,
                       with_stack=False, profile_memory=False)
        prof.__enter__()
        self.prof, self.start_s = prof, time.perf_counter() - t0

    def _close_region(self) -> None:
        region, self.region = self.region, None
        try:
            region.__exit__(None, None, None)
        except Exception as exc:
            self.error = self.error or f"step annotation: {type(exc).__name__}: {exc}"[:500]

    def _answer_async(self, prof: Any, *, stop_s: float = 0.0) -> None:
        self.exporter = threading.Thread(target=self._answer, args=(prof, stop_s), name="meshscope-deeptrace",
                                         daemon=True)
        self.exporter.start()

    # ------------------------------------------------------------------------------- export thread
    def _answer(self, prof: Any, stop_s: float) -> None:
        out = self.dir / self.request.id
        trace, export_s = "", 0.0
        try:
            out.mkdir(parents=True, exist_ok=True)
            if prof is not None:
                t0 = time.perf_counter()
                path = out / trace_name(self.rank)
                tmp = path.with_name(f".{path.name}.tmp")
                prof.export_chrome_trace(str(tmp))
                add_distributed_info(tmp, self.distributed_info())
                os.replace(tmp, path)
                trace, export_s = path.name, time.perf_counter() - t0
            short = self.traced < self.request.steps and not self.error
            error = self.error or (f"traced {self.traced} of {self.request.steps} steps" if short else "")
            done = TraceDone(rank=self.rank, world_size=self.world_size, host=socket.gethostname(), pid=os.getpid(),
                             first_step=self.first if self.traced else -1, last_step=self.last if self.traced else -1,
                             steps=self.traced, trace=trace, error=error, start_s=self.start_s, stop_s=stop_s,
                             export_s=export_s)
            write_atomic(out / done_name(self.rank), done.dumps())
        except Exception:  # a store that cannot be written: the CLI times out and says which rank
            pass

    def distributed_info(self) -> dict:
        """What HTA reads to tell the ranks' traces apart: the keys torch.profiler.profile writes when a
        process group is up (backend, rank, world_size, pg_count, pg_config, nccl_version), else this rank's
        place in the telemetry's world."""
        info: dict[str, Any] = {"rank": self.rank, "world_size": self.world_size, "backend": ""}
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                info.update(backend=str(dist.get_backend()), rank=dist.get_rank(), world_size=dist.get_world_size(),
                            pg_count=dist.get_pg_count(), pg_config=dist.distributed_c10d._get_all_pg_configs())
                if info["backend"] == "nccl":
                    import torch

                    info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
        return info


def add_distributed_info(path: str | Path, info: dict) -> bool:
    """Give an exported Kineto trace a top-level ``distributedInfo`` when it has none (torch writes one only
    when a process group is up). Kineto writes its metadata before ``"traceEvents"``, so only the head is
    read; the object is spliced in as the first key, written with ``": "`` after each key as torch does
    (HTA finds a file's rank with the pattern ``"rank":\\s+(\\d+)``). True when it added one."""
    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(HEAD_BYTES)
    meta = head.split(b'"traceEvents"', 1)[0]
    if b'"distributedInfo"' in meta:
        return False
    brace = head.find(b"{")
    if brace < 0:
        raise ValueError(f"{path} is not a JSON object")
    tmp = path.with_name(f".{path.name}.dist.tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        src.seek(brace + 1)
        dst.write(b'{\n  "distributedInfo": ' + json.dumps(info, sort_keys=True).encode() + b",")
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    os.replace(tmp, path)
    return True


class DeepTrace:
    """The flusher's side: looks for this rank's requests and arms a session through ``arm`` (a callable
    that hands the session to the training thread; the telemetry's attribute)."""

    def __init__(self, directory: str | Path, *, rank: int, world_size: int, device: Any = None,
                 arm: Callable[[TraceSession], None], armed: Callable[[], TraceSession | None],
                 wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.dir = Path(directory)
        self.rank, self.world_size, self.device = rank, world_size, device
        self._arm, self._armed, self._wall, self._mono = arm, armed, wall, monotonic
        self._next = 0.0
        self._seen: tuple | None = None  # (mtime_ns, size, inode) of the request last read
        self._answered: set[str] = set()
        self.session: TraceSession | None = None  # the last one armed (also after it ended)

    def poll(self) -> None:
        """Flusher thread: at most one stat per POLL_S; a read only when the request file changed."""
        now = self._mono()
        if now < self._next:
            return
        self._next = now + POLL_S
        try:
            st = os.stat(self.dir / REQUEST)
        except OSError:
            self._withdrawn(None)
            return
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key == self._seen:
            return
        self._seen = key
        try:
            request = TraceRequest.loads((self.dir / REQUEST).read_text())
        except (OSError, ValueError):
            return  # replaced meanwhile, or not a request: looked at again when it changes
        self._withdrawn(request.id)
        if request.id in self._answered or not request.wants(self.rank) or request.expired(self._wall()):
            return
        if self._armed() is not None:  # one trace at a time on a rank (the CLI refuses a second one too)
            return
        self._answered.add(request.id)
        self.session = TraceSession(request, directory=self.dir, rank=self.rank, world_size=self.world_size,
                                    device=self.device)
        self._arm(self.session)

    def _withdrawn(self, current: str | None) -> None:
        """The request this rank armed is gone (the CLI gave up) before its trace began: do not begin it."""
        s = self.session
        if s is not None and s.request.id != current and s.prof is None and s.traced == 0:
            s.cancelled = True

    def close(self) -> None:
        """The telemetry closes (training thread): a trace still running stops with what it has; one armed
        and not begun answers that it never began."""
        s = self._armed()
        if s is not None and s.prof is not None:
            s.finish(f"the job ended after {s.traced} of {s.request.steps} steps")
        elif s is not None and not s.cancelled and s.exporter is None:
            s.error = "the job ended before the trace began"
            s._answer_async(None)
        if s is not None and s.exporter is not None:
            s.exporter.join(timeout=30)


def for_telemetry(tel: Any) -> DeepTrace:
    """The poller of a ``Telemetry``: its run's request directory, and its ``_tracing`` attribute as the
    hand-over (the flusher sets it from None to an armed session; the training thread sets it back)."""
    from meshscope.agent.contract.storelayout import StoreLayout

    return DeepTrace(StoreLayout.of(tel.config.store).deeptrace(tel.config.run), rank=tel.rank,
                     world_size=tel.world_size, device=tel._device, arm=lambda s: setattr(tel, "_tracing", s),
                     armed=lambda: getattr(tel, "_tracing", None))
