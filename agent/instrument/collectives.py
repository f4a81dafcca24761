"""In-process tracing of every collective and P2P op of a training step, without a profiler.

    tracer = CollectiveTracer(recorder, mesh_info=MeshInfo(mesh))
    tracer.attach(model_parts)   # after DDP / fully_shard / parallelize_module wrapping, before step 1
    ...                          # each op → recorder.record_collective(...) on the thread that waited
    tracer.flush()               # at step end: ops that completed without a Python-visible wait
    tracer.drain()               # any thread (the recorder's flusher): build and hand over the records
    tracer.detach()

One record per op: op (nccl-tests name), mesh dim / group / group size (``MeshInfo``), bytes (the full
buffer, see ``agent.contract.bandwidth``), ``t_start`` (issue: where the Python API calls the
ProcessGroup, or the functional collective's call), ``t_end`` (observed completion),
``wait_s`` (time the calling thread was blocked on it: its exposed part), peer (P2P) and ``source``, the
path that saw it. Paths, and what each sees (measured on torch 2.13 / gloo, see the docstrings of the
``comm_*`` modules for details):

- ``ddp_comm_hook`` (``comm_ddp``): DDP's C++ reducer talks to the ProcessGroup directly, so no Python
  patch sees it; in a process without CUDA a kernel in torch's dispatcher sees every gradient bucket with
  DDP's built-in all-reduce left in place (``funcol_kernels``, _ddp_kernel.h), elsewhere a comm hook does.
  Exposed time is the reducer's blocking wait at the end of backward, measured between two autograd final
  callbacks.
- ``fsdp_comm`` (``comm_fsdp``): FSDP2's official ``set_custom_all_gather`` / ``set_custom_reduce_scatter``.
- ``funcol`` (``comm_funcol``): TP / DTensor functional collectives; issue in the funcol function, wait in
  ``wait_tensor``.
- ``c10d`` (``comm_c10d``): ``torch.distributed.*`` collectives and P2P (isend / irecv /
  batch_isend_irecv / send / recv: pipeline parallelism), DDP's buffer broadcast, any user call such as a
  loss all-reduce; async ones complete at ``Work.wait`` (patched on the class while attached).

Not seen: collectives issued from C++ with no Python frame other than DDP buckets (DDP's one-off bucket
rebuild broadcast on step 2, ``torch.ops._c10d_functional`` calls made directly by autograd formulas
(their waits are counted in ``stats["unmatched_waits"]``), ``torch.ops._dtensor.shard_dim_alltoall`` on
GPU), and ``gather`` / ``scatter`` (no op name in the schema). Ops issued inside a c10d coalescing manager
are seen only through ``batch_isend_irecv``.

Nesting is handled with a per-thread depth counter: a DDP hook or FSDP comm that calls ``dist.*`` records
the op once, under its own source. Every hook wraps its own work in ``try/except`` →
``recorder.record_error`` and always performs the real collective; an exception raised by the real
collective itself propagates unchanged. The c10d, P2P, funcol and FSDP issue wrappers share one skeleton
for this (``traced_call``); their CPU paths (every op on gloo) are that skeleton written out in the
site's own frame (``comm_c10d._fast_one``, ``comm_c10d.p2p``, ``comm_funcol.single``, ``comm_fsdp._traced``:
a Python frame and a tuple less per op are measurable at this scale), reading the tracer's state from
``hot``. The plug-ins get this tracer as an argument and never import this module.

The training thread pays only for what cannot be deferred (the goal is ≤ 2 µs of its CPU per op, measured
by bench/hooks_overhead.py): per op it resolves the group (a cached dict hit), numbers the op, takes two
``perf_counter`` readings and appends one tuple (``Issued`` + completion: an ``Entry``) to a bounded
deque. Everything
else — the epoch time base, the record's fields, bandwidths, the row itself, and the op's share of its
step's accounting — is done by ``drain()`` and the recorder on the recorder's flusher thread (a recorder
with a ``live`` view of its open step and an ``epoch``: Telemetry). No future callback is added to a
work: completion of an async op is the return of its ``Work.wait`` (a callback runs on the backend's
thread and has to take the GIL from the training thread: +20-30 µs of training-thread CPU per op,
measured). Any other recorder (``ListRecorder``, tests) gets each record synchronously, at completion.

CUDA tensors (NCCL) take the ``comm_nccl`` path: futures complete at enqueue there, so CPU timestamps say
nothing about completion; CUDA events give duration and exposure, resolved at ``drain()`` (the flusher).
``make gpu-check`` checks its c10d and funcol parts against torch.profiler on a GPU, and its DDP part
against DDP's own buckets; FSDP2's has not run on one (``comm_nccl``).
"""

from __future__ import annotations

import collections
import functools
import inspect
import threading
import time
from typing import Any, Callable

from meshscope.agent.instrument import native
from meshscope.agent.instrument.grouptable import GroupTable
from meshscope.agent.instrument.meshinfo import GroupInfo, MeshInfo
from meshscope.agent.instrument.ops import Hot, _Direct, _Nesting, _Op, _TLS
from meshscope.agent.instrument.recorder import DIRECT

_MAX_PENDING = 4096  # async ops waiting for their wait(); beyond this the oldest are dropped (and counted)
_MAX_DONE = 65536  # completed ops waiting for drain(); beyond this new ones are dropped (and counted)
_CUDA_SETTLE_S = 2.0  # at detach, how long the last CUDA ops may take to complete on the GPU


class _Patch:
    __slots__ = ("owner", "name", "original", "wrapper", "release")

    def __init__(self, owner: Any, name: str, original: Any, wrapper: Any) -> None:
        self.owner, self.name, self.original, self.wrapper = owner, name, original, wrapper
        self.release: Callable[[], None] | None = None  # what unpatching also does (a C funcol site: unbind)


class CollectiveTracer:
    """Records every collective / P2P op through ``recorder.record_collective``.

    ``attach(model)`` installs the Python patches (c10d, P2P, ``Work.wait``, functional collectives) and,
    for each module in ``model`` (a module, a list of modules — e.g. pipeline stage parts — or ``None``),
    DDP's buckets (comm_ddp: their kernel in torch's dispatcher, else a comm hook) and FSDP2 custom comms.
    Call it after wrapping and before the first backward (DDP accepts a comm hook only then). ``attach`` is
    idempotent; ``detach`` restores every patched attribute and FSDP comm; a DDP comm hook cannot be
    unregistered: it stays as a plain pass-through (DDP's default all-reduce) until a later ``attach``.
    Only one tracer may patch the process at a time (``RuntimeError`` on a second one).
    ``ddp_comm_hook=False`` (``TelemetryConfig.ddp_comm_hook``, which says what each way costs) leaves DDP
    models alone: their buckets are not recorded.
    """

    Op = _Op  # what a site that amends its op after the issue builds (comm_funcol), without importing this

    def __init__(self, recorder: Any, *, mesh_info: MeshInfo | None = None, ddp_comm_hook: bool = True) -> None:
        self.recorder = recorder
        self.ddp_comm_hook = ddp_comm_hook
        self.mesh_info = mesh_info if mesh_info is not None else MeshInfo()
        # A recorder with a ``live`` view of its open step (Telemetry) takes records deferred: the hot path
        # stores raw perf_counter readings and the open step's context, and drain() builds the records
        # on the recorder's flusher thread (adding ``recorder.epoch`` to the times). Any other recorder
        # (ListRecorder, tests) gets each record at completion, stamped by its own clock.
        self._live: Any = getattr(recorder, "live", None)
        if self._live is not None:
            self.now: Callable[[], float] = time.perf_counter
            self._epoch = float(recorder.epoch)
        else:
            self.now = recorder.clock.now
            self._epoch = 0.0
        self._done: collections.deque[_Op] = collections.deque()  # completed, waiting for drain()
        self.enabled = False
        self.stats: collections.Counter[str] = collections.Counter()
        # The thread that attaches (the training thread) has its nesting state in a plain object: an
        # attribute of a threading.local costs 4-5× a plain one, and each traced call touches it 6 times.
        # Other threads (autograd's device threads, a checkpoint thread) get theirs from a threading.local.
        self._main_tid = threading.get_ident()
        self._main = _Nesting()
        self._tls = _TLS()
        # Group designators → (designator, GroupInfo, issue counter, key): one dict hit per op (``grouptable``).
        self.groups = GroupTable(self.mesh_info, limit=_MAX_PENDING)
        self._groups, self._infos, self._group = self.groups.entries, self.groups.infos, self.groups.resolve
        # id(Work) → (the Work, kept alive so that its id stays unique; its ops: an ``Issued`` tuple for the
        # one CPU op of a fast site, else a list of ``_Op``)
        self._pending_works: dict[int, tuple[Any, Any]] = {}
        # What flush() works on, where a flusher makes the CUDA records (Telemetry skips flush while it is empty)
        self.flush_pending: Any = self._pending_works if self._live is not None else None
        self._pending_tensors: dict[int, _Op] = {}  # funcol: output data pointer → op
        self.max_pending = _MAX_PENDING  # bound of either pending map (read by sites that inline their adds)
        self._patches: list[_Patch] = []
        self._model_hooks: dict[int, Any] = {}  # id(module) → handle with .detach()
        self._cuda: Any = None  # comm_nccl.CudaCommTimer, created on the first CUDA op
        self._no_future: set[tuple[str, str]] = set()  # (op, group) whose works have no future
        # The Recorder protocol has no ``seq`` yet; pass the issue-order sequence number where accepted.
        self._pass_seq = _accepts_kw(recorder.record_collective, "seq")
        self._pass_label = _accepts_kw(recorder.record_collective, "mesh_dim")
        self._kernels: Any = None  # funcol_kernels.Bound, where the functional collectives' kernels trace them
        self._hot_paths()

    # ------------------------------------------------------------------------------------ lifecycle
    def attach(self, model: Any = None) -> None:
        # Imported on attach, not at the top: this module imports no torch itself, while the plug-ins import
        # torch.distributed, FSDP2 and the functional collectives at theirs. They never import this module:
        # the tracer is passed to them.
        from meshscope.agent.instrument import comm_c10d, comm_ddp, comm_fsdp, comm_funcol

        if not self._patches:
            try:
                comm_c10d.install(self)
                comm_funcol.install(self)
            except Exception:
                self._unpatch()
                raise
        self.enabled = True
        for module in _modules(model):
            key = id(module)
            if key in self._model_hooks:
                continue
            try:
                handle = (comm_ddp.attach(self, module) if self.ddp_comm_hook else None) or comm_fsdp.attach(
                    self, module)
            except Exception as exc:  # an unsupported wrapper must not stop the rest from attaching
                self.error(f"attach:{type(module).__name__}", exc)
                continue
            if handle is not None:
                self._model_hooks[key] = handle

    def detach(self) -> None:
        """Restore every original; emit what already completed (CUDA ops: what completes within
        ``_CUDA_SETTLE_S``). Safe to call twice."""
        self.flush()
        if self._cuda is not None:
            try:
                self._cuda.settle(self, timeout_s=_CUDA_SETTLE_S, clock=time.monotonic, sleep=time.sleep)
            except Exception as exc:
                self.error("cuda_resolve", exc)
        if self._kernels is not None:  # off; the ops still waiting for their wait are dropped (counted)
            self._kernels.unbind()
        self.drain()
        self.enabled = False
        for handle in self._model_hooks.values():
            try:
                handle.detach()
            except Exception as exc:
                self.error("detach", exc)
        self._model_hooks.clear()
        self._unpatch()
        self._main.nested_end, self._main.nested_wait = None, 0.0
        self.stats["dropped_pending"] += len(self._pending_works) + len(self._pending_tensors)
        self._pending_works.clear()
        self._pending_tensors.clear()
        if self._cuda is not None:  # CUDA ops whose events did not complete within the settle above
            self.stats["dropped_pending"] += self._cuda.clear()

    def flush(self) -> int:
        """Complete async ops that finished without a Python-visible wait (``wait_s`` 0); CUDA ops among
        them are queued for ``drain`` (which resolves CUDA timings whose events have completed; here too
        for a recorder without a flusher). Call at step end on the training thread (their step is the one
        ending). Returns how many ops it completed."""
        emitted = 0
        try:
            if self._pending_works:
                now = self.now()
                for key, (work, ops) in list(self._pending_works.items()):
                    issued = type(ops) is tuple  # a fast site's Issued, else a list of _Op
                    op, info = (ops[0], self._infos[ops[1]]) if issued else (ops[0].op, ops[0].info)
                    if not self._finished(work, op, info):
                        continue
                    if self._pending_works.pop(key, None) is None:  # taken by its wait meanwhile
                        continue
                    if issued:  # completion is first observed here
                        self.put(ops + (now, 0.0, self.hot.live.key))
                        emitted += 1
                        continue
                    for p in ops:
                        if p.cuda is not None:  # never waited in Python: CUDA timing without a stall
                            p.cuda.work = work
                            self.cuda_timer().queue(p)
                        else:  # completion is first observed here
                            self.emit(p, t_end=p.t_done if p.t_done is not None else now, wait_s=0.0)
                            emitted += 1
            if self._cuda is not None and self._live is None:  # no flusher: the CUDA records are made here
                emitted += self._cuda.resolve(self)
        except Exception as exc:
            self.error("flush", exc)
        return emitted

    def _finished(self, work: Any, op: str, info: GroupInfo) -> bool:
        """Whether an async op is over. gloo completes a work's future before the work itself, so the
        future is asked too (here at step end, not on the hot path); works with no future (P2P, gloo's
        emulated reduce_scatter) answer with a C++ exception (~30-50 µs), asked once per op and group."""
        if _completed(work):
            return True
        key = (op, info.name)
        if key in self._no_future:
            return False
        try:
            return bool(work.get_future().done())
        except RuntimeError:
            self._no_future.add(key)
            return False

    def drain(self) -> int:
        """Resolve the CUDA ops whose events completed (``comm_nccl``) and hand every completed op to the
        recorder as a record (``record_collective``). Safe on any thread (Telemetry calls it from its
        flusher). Returns how many records it handed over from the queue (a recorder that records
        synchronously has none there: its records were made at completion)."""
        done = self._done
        n = 0
        if self._cuda is not None:  # CUDA ops whose events completed (comm_nccl), off the training thread
            try:
                self._cuda.resolve(self)
            except Exception as exc:
                self.error("cuda_resolve", exc)
        if self._kernels is not None:
            n += self._kernels.drain(self._record_entry)
        while True:
            try:
                entry = done.popleft()
            except IndexError:
                return n
            self._record_entry(entry)
            n += 1

    # ----------------------------------------------------------------- used by the comm_* modules
    def nesting(self) -> _Nesting:
        """The calling thread's nesting state."""
        return self._main if threading.get_ident() == self._main_tid else self._tls.nesting

    def busy(self) -> bool:
        return self.nesting().depth > 0

    def begin(self, op: str, group: Any, nbytes: int, source: str, peer: int = -1,
              group_peer: int | None = None, cuda: bool = False) -> _Op:
        """Resolve the group, number the op, stamp its issue time (last, so lookup cost is not comm).
        Positional parameters (unlike the rest of the code base): hot sites call it positionally. The
        instance attribute ``begin`` is this, as a closure over the tracer's state (``_hot_paths``)."""
        return self._begin(op, group, nbytes, source, peer, group_peer, cuda)

    def group_info(self, group: Any) -> GroupInfo:
        """The group's ``GroupInfo`` (``GroupTable.info``: resolved once per designator)."""
        return self.groups.info(group)

    def enter(self, p: _Op | None) -> _Op | None:
        tls = self.nesting()
        tls.depth += 1
        prev, tls.current = tls.current, p
        return prev

    def leave(self, prev: _Op | None) -> None:
        tls = self.nesting()
        tls.depth -= 1
        tls.current = prev

    def current(self) -> _Op | None:
        return self.nesting().current

    def finish_sync(self, p: _Op) -> None:
        """A call that returned only once its op completed: the whole call was blocked time."""
        if p.cuda is not None:
            self._cuda.on_sync_return(p)
            return
        t_end = self.now()
        self.emit(p, t_end=t_end, wait_s=t_end - p.t_start)

    def track_work(self, work: Any, ops: list[_Op]) -> None:
        """Remember an async op until ``Work.wait`` (or ``flush``)."""
        pending = self._pending_works
        if len(pending) >= _MAX_PENDING:
            del pending[next(iter(pending))]
            self.stats["dropped_pending"] += 1
        pending[id(work)] = (work, ops)

    def take_work(self, work: Any) -> Any:
        """The ops tracked for ``work`` (an ``Issued`` or a list of ``_Op``), no longer tracked; ``None``
        when it is not tracked."""
        if not self._pending_works:  # the common case for a wait() nobody asked us to time
            return None
        entry = self._pending_works.pop(id(work), None)
        if entry is None or entry[0] is not work:
            return None
        return entry[1]

    def track_tensor(self, key: int, p: _Op) -> None:
        pending = self._pending_tensors
        if len(pending) >= _MAX_PENDING:
            del pending[next(iter(pending))]
            self.stats["dropped_pending"] += 1
        pending[key] = p

    def take_tensor(self, key: int) -> _Op | None:
        return self._pending_tensors.pop(key, None)

    def waited(self, ops: list[_Op], t0: float, t1: float) -> None:
        """The calling thread was blocked from ``t0`` to ``t1`` waiting for ``ops`` (one work, or one
        coalesced work for several ops: the blocked time is split evenly). Completion is the wait's return
        (an op that finished before its wait reads as ending there: an upper bound; its ``wait_s`` is
        still exact)."""
        if type(ops) is tuple:  # one op of a fast site (its Issued)
            self.put(ops + (t1, t1 - t0, self.hot.live.key))
            return
        share = (t1 - t0) / len(ops)
        for p in ops:
            self.emit(p, t_end=min(p.t_done, t1) if p.t_done is not None else t1, wait_s=share)

    def emit(self, p: _Op, t_end: float, wait_s: float) -> None:
        """``p`` completed at ``t_end`` (the tracer's clock) after blocking the thread for ``wait_s``.
        Deferred recorders: ``p`` is queued with the open step's context; ``drain`` makes the record and
        the recorder accounts it to that step when it builds the step's record. The instance attribute
        ``emit`` is this, as a closure (``_hot_paths``)."""
        self._emit(p, t_end, wait_s)

    def _hot_paths(self) -> None:
        """``begin`` and ``emit`` as closures over the tracer's state, set as instance attributes, and
        ``hot``, what the fast sites read (``Hot``): they run on every op, and a closure reads its state
        from cells where a method looks up ``self.<name>``."""
        groups, resolve, now, done, stats = self._groups, self._group, self.now, self._done, self.stats
        if self._live is None:  # a recorder without deferral: each entry recorded at once, no open step
            live: Any = _Direct()
            push: Callable[[tuple], None] = self._record_entry
        else:
            live, push = self._live, done.append

        def begin(op: str, group: Any, nbytes: int, source: str, peer: int = -1,
                  group_peer: int | None = None, cuda: bool = False) -> _Op:
            hit = groups.get(id(group))
            if hit is None or hit[0] is not group:
                hit = resolve(group)
            info, seq = hit[1], next(hit[2])
            if group_peer is not None:
                peer = info.global_rank(group_peer)
            if cuda:
                p = _Op(op, info, hit[3], nbytes, peer, source, seq, 0.0)
                self.cuda_timer().on_issue(p)
                p.t_start = now()
                return p
            return _Op(op, info, hit[3], nbytes, peer, source, seq, now())

        def emit(p: _Op, t_end: float, wait_s: float) -> None:
            if len(done) < _MAX_DONE:
                push((p.op, p.key, p.nbytes, p.peer, p.source, p.seq, p.t_start, t_end, wait_s, live.key))
            else:
                stats["dropped_done"] += 1

        def put(entry: tuple) -> None:  # an Entry, bounded as every site bounds it
            if len(done) < _MAX_DONE:
                push(entry)
            else:
                stats["dropped_done"] += 1

        self._begin = self.begin = begin
        self._emit = self.emit = emit
        self.put = put
        self.hot = Hot(tracer=self, main=self._main, main_tid=self._main_tid, local=self._tls,
                       get_ident=threading.get_ident, groups=groups, resolve=resolve, now=now, live=live,
                       push=push, done=done, max_done=_MAX_DONE, pending=self._pending_works,
                       max_pending=_MAX_PENDING, stats=stats)

    def _record_entry(self, entry: tuple) -> None:
        """Hand one completed op (an ``Entry``) to the recorder as a record."""
        try:
            op, key, nbytes, peer, source, seq, t_start, t_end, wait_s, context = entry
            info, epoch = self._infos[key], self._epoch
            kw = dict(op=op, dim=info.dim, group=info.name, group_size=info.size, nbytes=nbytes,
                      t_start=t_start + epoch, t_end=t_end + epoch, wait_s=wait_s, peer=peer, source=source)
            if self._pass_seq:
                kw["seq"] = seq
            if self._pass_label:
                kw["mesh_dim"] = info.label
            if context is not DIRECT:
                kw["context"] = context
            self.recorder.record_collective(**kw)
        except Exception as exc:
            self.error("record_collective", exc)

    def error(self, where: str, exc: BaseException) -> None:
        self.stats["errors"] += 1
        try:
            self.recorder.record_error(f"collectives.{where}", exc)
        except Exception:  # a broken recorder must not take training down either
            pass

    def unresolved_steps(self) -> frozenset:  # steps (live.key) with CUDA ops not complete at the last drain
        return self._cuda.unresolved if self._cuda is not None else frozenset()

    def cuda_timer(self) -> Any:
        if self._cuda is None:
            from meshscope.agent.instrument.comm_nccl import CudaCommTimer

            self._cuda = CudaCommTimer(live=self.hot.live, stats=self.stats)
        return self._cuda

    def patch(self, owners: tuple[Any, ...], name: str, make: Callable[[Any], Callable]) -> Any:
        """Replace ``name`` by ``make(original)`` in every owner that holds the same original object
        (``torch.distributed`` re-exports ``distributed_c10d``'s functions and code compares their
        identity, e.g. ``P2POp.op is isend``, so both names must point at one wrapper).

        A name the first owner lacks (this torch release has no such function) is left absent and
        ``None`` returned: a wrapper put there would call ``None``, and would tell code that tests for
        the function (``getattr(funcol, "all_gather_single", None)``) that it exists."""
        if (original := _raw(owners[0], name)) is None:
            return None
        if getattr(original, "__meshscope_tracer__", None) is not None or native.funcol_bound(original):
            raise RuntimeError(f"{name} is already patched by another CollectiveTracer")
        wrapper = functools.wraps(original)(make(original))
        wrapper.__meshscope_tracer__ = self
        for owner in owners:
            if _raw(owner, name) is original:
                setattr(owner, name, wrapper)
                self._patches.append(_Patch(owner, name, original, wrapper))
        return wrapper

    def _unpatch(self) -> None:
        for patch in reversed(self._patches):
            if getattr(patch.owner, patch.name, None) is patch.wrapper:
                setattr(patch.owner, patch.name, patch.original)
            else:  # someone patched on top of us: leave theirs; ours is a pass-through now (enabled=False)
                self.stats["detach_conflicts"] += 1
            if patch.release is not None:
                patch.release()
        self._patches.clear()


def _raw(owner: Any, name: str) -> Any:
    """The attribute as stored: on a class, its own ``__dict__`` entry (a pybind11 method is stored as an
    ``instancemethod`` descriptor but ``getattr`` on the class returns the bare builtin, which would not
    bind ``self`` if put back)."""
    if isinstance(owner, type) and name in vars(owner):
        return vars(owner)[name]
    return getattr(owner, name, None)


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:
        return False


def _accepts_kw(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _modules(model: Any) -> list[Any]:
    if model is None:
        return []
    if hasattr(model, "modules"):  # one nn.Module
        return list(model.modules())
    out: list[Any] = []
    for part in model:
        out.extend(part.modules())
    return out

