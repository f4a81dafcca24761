"""``torch.distributed`` collectives and P2P, patched while a ``CollectiveTracer`` is attached.

What it sees: every call made through the Python API, in ``torch.distributed`` and
``torch.distributed.distributed_c10d`` alike (both names point at one wrapper): FSDP2's
``all_gather_single`` / ``reduce_scatter_single`` when no custom comm is installed, HSDP's ``all_reduce``,
DDP's buffer broadcast (``dist._broadcast_coalesced``, every forward when the model has buffers), pipeline
P2P (``isend`` / ``irecv`` / ``batch_isend_irecv``), user calls such as a loss all-reduce or a barrier.
What it cannot see: calls made from C++ (DDP's reducer: see ``comm_ddp``), ops inside a coalescing manager
other than ``batch_isend_irecv``'s, ``gather`` / ``scatter`` / object collectives' own names (the latter
are seen as the broadcast / all-gather they are built from).

Timing on CPU (gloo):
- blocking call (``async_op=False``, ``send`` / ``recv`` / ``_broadcast_coalesced``): the call returns
  once its op completed (c10d waits for the work inside it), so completion is the return and the whole
  call is ``wait_s`` (no future callback: see ``traced_call``).
- asynchronous collective and P2P: completion is the return of ``Work.wait`` (no callback on the work's
  future: it would run on the gloo worker thread and take the GIL from the training thread, +20-30 µs of
  its CPU per op); ``wait_s`` is the time spent inside ``Work.wait``. For P2P this is the interval of the
  profiler's ``gloo:send`` / ``gloo:recv`` ranges, which also end in ``wait()``. An op waited late (GPipe
  waits its sends after the last forward) therefore reads long; its ``wait_s`` is still exact. The
  record is made at ``Work.wait``, or by ``CollectiveTracer.flush`` when nothing waits in Python.
CUDA tensors: see ``comm_nccl`` (events around the call / the wait; checked on a GPU by ``make gpu-check``).

``P2POp`` identity: ``batch_isend_irecv`` picks the peer keyword with ``op.op is isend``. P2POps built
before ``attach``, or while attached from a name imported before it, hold the original functions (P2POp's
own check accepts both while attached); the wrapper of ``batch_isend_irecv`` swaps them for the
wrappers, and the ``isend`` wrapper accepts ``group_src`` so that ops built while attached still work with
the original ``batch_isend_irecv`` after ``detach``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from meshscope.agent.instrument import native
from meshscope.agent.instrument.traced_call import Issue, traced_call


def _a(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _nbytes_of(tensors: Iterable[Any]) -> int:
    return sum(t.nbytes for t in tensors)


class _Spec(NamedTuple):
    """Where a fast site finds what it records in a call's arguments."""

    tensor: int  # position of the tensor (its bytes; CUDA or not)
    group: int  # position of the group (keyword ``group``)
    async_op: int  # position of ``async_op`` (keyword ``async_op``)
    tensor_kw: str = "tensor"  # keyword of the tensor
    is_async: bool | None = None  # the call's async-ness when fixed by the function (P2P)
    peer: int | None = None  # P2P: position of the peer, and of the group peer after it (``peer + 3``)


# P2P's wrappers call the original with the arguments normalised to (tensor, peer, group, tag, group_peer).
_P2P_ASYNC = _Spec(0, 2, 99, is_async=True, peer=1)
_P2P_BLOCKING = _Spec(0, 2, 99, is_async=False, peer=1)


# name → (op, bind): ``bind(tracer, op)`` gives the site's ``describe`` (see ``traced_call``). Bytes follow
# nccl-tests: all-gather = output, reduce-scatter / all-to-all = input. ``_one``'s describe indexes the
# arguments inline and begins the op in the same frame: it runs on every traced call of the common
# one-tensor collectives. The others go through an ``extract(args, kwargs) -> (nbytes, group, async_op, a
# tensor of the op for its device)``.
def _one(ti: int, gi: int, ai: int, tname: str = "tensor") -> Callable:
    def bind(tracer: Any, op: str) -> Callable[[tuple, dict], Issue]:
        begin = tracer.begin

        def describe(args: tuple, kwargs: dict) -> Issue:
            n = len(args)
            t = args[ti] if n > ti else kwargs[tname]
            if kwargs:
                group = args[gi] if n > gi else kwargs.get("group")
                async_op = bool(args[ai] if n > ai else kwargs.get("async_op", False))
            else:
                group = args[gi] if n > gi else None
                async_op = n > ai and bool(args[ai])
            cuda = t.is_cuda
            # A blocking call returns once its op completed: the whole call is blocked time (on CPU; on
            # CUDA it returns once the op is queued, see comm_nccl).
            return begin(op, group, t.nbytes, "c10d", -1, None, cuda), args, kwargs, not async_op and not cuda, async_op
        return describe
    bind.fast = _Spec(ti, gi, ai, tname)  # type: ignore[attr-defined]  # collective() makes a fast site of it
    return bind


def _via(extract: Callable[[tuple, dict], tuple[int, Any, bool, Any]]) -> Callable:
    def bind(tracer: Any, op: str) -> Callable[[tuple, dict], Issue]:
        def describe(args: tuple, kwargs: dict) -> Issue:
            nbytes, group, async_op, tensor = extract(args, kwargs)
            cuda = tensor is not None and tensor.is_cuda
            return tracer.begin(op, group, nbytes, "c10d", cuda=cuda), args, kwargs, not async_op and not cuda, async_op
        return describe
    return bind


def _many(ti: int, gi: int, ai: int, tname: str) -> Callable:
    def extract(args: tuple, kwargs: dict) -> tuple[int, Any, bool, Any]:
        ts = _a(args, kwargs, ti, tname)
        return _nbytes_of(ts), _a(args, kwargs, gi, "group"), bool(_a(args, kwargs, ai, "async_op", False)), ts[0]
    return _via(extract)


@_via
def _barrier(args: tuple, kwargs: dict) -> tuple[int, Any, bool, Any]:
    return 0, _a(args, kwargs, 0, "group"), bool(_a(args, kwargs, 1, "async_op", False)), None


@_via
def _broadcast_coalesced(args: tuple, kwargs: dict) -> tuple[int, Any, bool, Any]:
    ts = _a(args, kwargs, 1, "tensors")
    return _nbytes_of(ts), _a(args, kwargs, 0, "process_group"), False, ts[0] if ts else None


# name → (op, bind)
_COLLECTIVES: dict[str, tuple[str, Callable]] = {
    "broadcast": ("broadcast", _one(0, 2, 3)),
    "all_reduce": ("all_reduce", _one(0, 2, 3)),
    "reduce": ("reduce", _one(0, 3, 4)),
    "all_gather": ("all_gather", _many(0, 2, 3, "tensor_list")),
    "all_gather_single": ("all_gather", _one(0, 2, 3, "output_tensor")),
    "all_gather_into_tensor": ("all_gather", _one(0, 2, 3, "output_tensor")),
    "_all_gather_base": ("all_gather", _one(0, 2, 3, "output_tensor")),
    "reduce_scatter": ("reduce_scatter", _many(1, 3, 4, "input_list")),
    "reduce_scatter_single": ("reduce_scatter", _one(1, 3, 4, "input")),
    "reduce_scatter_tensor": ("reduce_scatter", _one(1, 3, 4, "input")),
    "_reduce_scatter_base": ("reduce_scatter", _one(1, 3, 4, "input")),
    "all_to_all_single": ("all_to_all", _one(1, 4, 5, "input")),
    "all_to_all": ("all_to_all", _many(1, 2, 3, "input_tensor_list")),
    "barrier": ("barrier", _barrier),
}


# Inside a c10d coalescing manager (``world.pg_coalesce_state`` non-empty) a call only queues its op;
# ``batch_isend_irecv`` is where such ops are seen. torch mutates that dict in place and never replaces it,
# so its bound ``__len__`` answers without a Python frame on every call.
_coalescing = c10d._world.pg_coalesce_state.__len__
_coalesce_state = c10d._world.pg_coalesce_state  # the fast sites test it as they find it (no call)
_NO_TIMEOUT = object()  # Work.wait called without a timeout


def collective(original: Callable, *, tracer: Any, op: str, bind: Callable) -> Callable:
    """``original`` (a ``torch.distributed`` collective; ``_COLLECTIVES`` gives ``bind``) recording ``op``
    through ``tracer``. One-tensor collectives get a fast site (``_fast_one``) in front of this."""
    work_type, illegal_work = c10d.Work, c10d._IllegalWork
    pending, limit = tracer._pending_works, tracer.max_pending

    def finish(p: Any, async_op: bool, result: Any) -> None:
        if not async_op:  # CUDA
            tracer.finish_sync(p)
        elif isinstance(result, work_type) and not isinstance(result, illegal_work):
            if len(pending) < limit:  # tracer.track_work, inline
                pending[id(result)] = (result, [p])
            else:
                tracer.track_work(result, [p])

    slow = traced_call(original, tracer=tracer, where=op, describe=bind(tracer, op), finish=finish,
                       skip=_coalescing)
    fast = getattr(bind, "fast", None)
    return slow if fast is None else _fast_one(original, slow, tracer=tracer, op=op, where=op, spec=fast)


class _WorkTypes(dict):
    """``works.get(type(result)) or works.learn(result)``: whether a call's result is a c10d ``Work`` that
    a wait will complete (not c10d's ``_IllegalWork``), cached per type: a dict hit where two
    ``isinstance`` checks of a pybind11 class would be made on every async op."""

    def learn(self, result: Any) -> bool:
        t = type(result)
        ok = self[t] = issubclass(t, c10d.Work) and not issubclass(t, c10d._IllegalWork)
        return ok


def _fast_one(original: Callable, slow: Callable, *, tracer: Any, op: str, where: str, spec: _Spec) -> Callable:
    """The CPU path of a one-tensor collective or P2P op (``spec``: where its arguments are), everything
    ``traced_call`` does written out in one frame: per op the training thread resolves the group (a dict
    hit), takes its sequence number and two clock readings and appends one tuple (``collectives.Issued`` /
    ``Entry``). CUDA tensors take ``slow``. Made in C where ``native`` says so (this
    wrapper is then its ``slow``)."""
    ti, gi, ai, tname, fixed_async, pi = spec
    (_, main, main_tid, local, get_ident, groups, resolve, now, live, push, done, max_done, pending,
     max_pending, stats) = tracer.hot
    works = _WorkTypes()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tls = main if get_ident() == main_tid else local.nesting
        if not tracer.enabled or tls.depth or _coalesce_state:
            return original(*args, **kwargs)
        try:
            n = len(args)
            t = args[ti] if n > ti else kwargs[tname]
            if kwargs:
                group = args[gi] if n > gi else kwargs.get("group")
                async_op = bool(args[ai] if n > ai else kwargs.get("async_op", False))
            else:
                group = args[gi] if n > gi else None
                async_op = n > ai and bool(args[ai])
            if fixed_async is not None:
                async_op = fixed_async
            cuda = t.is_cuda
            if cuda and async_op:  # its Work's wait is where it is timed: the general path
                issue = None
            else:
                hit = groups.get(id(group))
                if hit is None or hit[0] is not group:
                    hit = resolve(group)
                peer = -1
                if pi is not None:  # P2P: the global rank of the peer, or of the group peer
                    peer = args[pi]
                    if peer is None:
                        peer = -1 if args[pi + 3] is None else hit[1].global_rank(args[pi + 3])
                issue = (op, hit[3], t.nbytes, peer, "c10d", next(hit[2]), now())
        except Exception as exc:
            tracer.error(where, exc)
            return original(*args, **kwargs)
        if issue is None:
            return slow(*args, **kwargs)
        # send / recv call isend / irecv, all_gather_into_tensor all_gather_single: one op. ``tls.current``
        # is left as it is (only a funcol wait inside the call would read it, and no c10d call makes one).
        if cuda:  # blocking on CUDA: two events, the op and the stream's stall between them (comm_nccl)
            try:
                timer = tracer.cuda_timer()
                e0 = timer.event()
            except Exception as exc:
                tracer.error(where, exc)
                return original(*args, **kwargs)
        tls.depth += 1
        try:
            result = original(*args, **kwargs)
        finally:
            tls.depth -= 1
        try:
            if cuda:  # resolved off the training thread (CudaCommTimer.queue_fast); no op object
                timer.queue_fast(issue, e0, timer.event())
            elif not async_op:  # returned once its op completed: the whole call was blocked time
                t1 = now()
                if len(done) < max_done:
                    push(issue + (t1, t1 - issue[6], live.key))
                else:
                    stats["dropped_done"] += 1
            elif works.get(type(result)) or works.learn(result):
                if len(pending) < max_pending:
                    pending[id(result)] = (result, issue)
                else:
                    tracer.track_work(result, issue)
        except Exception as exc:
            tracer.error(where, exc)
        return result

    return native.c10d_site(original, wrapper, tracer=tracer, op=op, where=where, spec=spec, works=works,
                            coalesce=_coalesce_state)


def p2p(original: Callable, *, tracer: Any, op: str, is_async: bool) -> Callable:
    """``original`` (``isend`` / ``irecv`` / ``send`` / ``recv``; ``op`` is "send" or "recv") recording
    each call through ``tracer``, behind the public signature: its CPU path is ``_fast_one``'s, CUDA
    tensors take the ``traced_call`` path."""

    def describe(args: tuple, kwargs: dict) -> Issue:
        tensor, peer, group, _tag, group_peer = args
        cuda = tensor.is_cuda
        p = tracer.begin(op, group, tensor.nbytes, "c10d", -1 if peer is None else peer,
                         group_peer if peer is None else None, cuda)
        return p, args, kwargs, not is_async and not cuda, None

    def finish(p: Any, _: None, result: Any) -> None:
        if not is_async:  # CUDA
            tracer.finish_sync(p)
        elif isinstance(result, c10d.Work):
            tracer.track_work(result, [p])

    # Called with the arguments normalised to (tensor, peer, group, tag, group_peer), positionally: the
    # order of the public signatures below, which are torch's own.
    slow = traced_call(original, tracer=tracer, where=op, describe=describe, finish=finish, skip=_coalescing)
    issue = _fast_one(original, slow, tracer=tracer, op=op, where=op, spec=_P2P_ASYNC if is_async else _P2P_BLOCKING)

    if op == "send":
        def public(tensor: Any, dst: Any = None, group: Any = None, tag: int = 0, group_dst: Any = None,
                   group_src: Any = None) -> Any:
            # group_src: the original batch_isend_irecv's keyword for an op it does not recognise.
            return issue(tensor, dst, group, tag, group_dst if group_dst is not None else group_src)
        peer_kw, group_peer_kw = "dst", "group_dst"
    else:
        def public(tensor: Any, src: Any = None, group: Any = None, tag: int = 0, group_src: Any = None) -> Any:
            return issue(tensor, src, group, tag, group_src)
        peer_kw, group_peer_kw = "src", "group_src"
    # In C, the public signature itself (batch_isend_irecv calls it by keyword on every op: a Python frame
    # less per op); any call outside torch's own signature goes to ``public``.
    return native.c10d_site(original, public, tracer=tracer, op=op, where=op,
                            spec=_P2P_ASYNC if is_async else _P2P_BLOCKING,
                            works=_WorkTypes(), coalesce=_coalesce_state, peer_kw=peer_kw,
                            group_peer_kw=group_peer_kw, known=("tensor", peer_kw, "group", "tag", group_peer_kw))


def _coalesced(p2p_op_list: list) -> bool:
    """Whether the batch's backend coalesces (NCCL); gloo does not."""
    group = p2p_op_list[0].group or c10d._get_default_group()
    device = p2p_op_list[0].tensor.device
    return type(group) is dist.ProcessGroup and group._get_backend(device).supports_coalescing


def batch(original: Callable, *, tracer: Any, isend: Callable, irecv: Callable) -> Callable:
    """``batch_isend_irecv`` recording a coalesced batch through ``tracer``; ``isend`` / ``irecv``: the
    installed P2P wrappers, swapped into P2POps built before ``attach``. On a backend that does not coalesce
    (gloo: every pipeline-parallel P2P op on CPU comes through here) the batch is one call per op, each seen
    by those wrappers, and this one only swaps: whether a group coalesces is asked once per group and device
    kind (a ``_get_backend`` per batch cost 1.7 µs of the training thread's CPU per op)."""
    swap = {isend.__wrapped__: isend, irecv.__wrapped__: irecv}
    coalesces: dict[tuple[int, bool], tuple[Any, bool]] = {}  # (id(group), CUDA) → (group, coalesces)

    def coalesced(p2p_op_list: list) -> bool:
        first = p2p_op_list[0]
        key = (id(first.group), first.tensor.is_cuda)
        hit = coalesces.get(key)
        if hit is None or hit[0] is not first.group:
            hit = coalesces[key] = (first.group, _coalesced(p2p_op_list))
        return hit[1]

    def describe(args: tuple, kwargs: dict) -> Issue | None:
        p2p_op_list = args[0] if args else kwargs["p2p_op_list"]
        for p2p_op in p2p_op_list:
            p2p_op.op = swap.get(p2p_op.op, p2p_op.op)
        if not coalesced(p2p_op_list):  # gloo: one call per op, each seen by the isend / irecv wrappers
            return None
        # NCCL: the per-op calls only queue inside a coalescing manager; one work for the batch.
        ops = [tracer.begin("send" if o.op is isend else "recv", o.group, o.tensor.nbytes, "c10d", peer=o.peer,
                            cuda=o.tensor.is_cuda) for o in p2p_op_list]
        return None, args, kwargs, False, ops

    def finish(_: None, ops: list[Any], works: Any) -> None:
        if works and len(works) == len(ops):
            for work, p in zip(works, ops):
                tracer.track_work(work, [p])
        elif works:
            tracer.track_work(works[-1], ops)

    slow = traced_call(original, tracer=tracer, where="batch_isend_irecv", describe=describe, finish=finish)

    def wrapper(p2p_op_list: list) -> Any:
        # The gloo case in one frame: the swap, the cached answer, the original; anything else (a batch to
        # record as one, a nested call) is traced_call's.
        if not p2p_op_list or not tracer.enabled:
            return original(p2p_op_list)
        try:
            for p2p_op in p2p_op_list:
                op = p2p_op.op
                if op is not isend and op is not irecv:
                    p2p_op.op = swap.get(op, op)
            if not coalesced(p2p_op_list):
                return original(p2p_op_list)
        except Exception as exc:
            tracer.error("batch_isend_irecv", exc)
            return original(p2p_op_list)
        return slow(p2p_op_list)

    return native.batch(original, wrapper, tracer=tracer, swap=swap, isend=isend, irecv=irecv, coalesced=_coalesced)


def check_op(original: Callable, *, isend: Callable, irecv: Callable) -> Callable:
    """``P2POp``'s check of its ``op``, accepting torch's own ``isend`` / ``irecv`` as well as the wrappers:
    a name imported before ``attach`` (``from torch.distributed import isend``) still builds a P2POp while
    attached, as it does untraced; ``batch_isend_irecv``'s wrapper swaps it for ours."""
    known = (isend, irecv, isend.__wrapped__, irecv.__wrapped__)

    def check(op: Any) -> None:
        if op not in known:  # functions compare by identity; the wrappers come first
            original(op)

    return check


def install(tracer: Any) -> None:
    """Patch every traced ``torch.distributed`` function, ``Work.wait`` and the ProcessGroup issue
    methods through ``tracer.patch`` (``CollectiveTracer``: restored by its ``detach``)."""
    owners = (c10d, dist)
    for name, (op, bind) in _COLLECTIVES.items():
        if hasattr(c10d, name):
            tracer.patch(owners, name, functools.partial(collective, tracer=tracer, op=op, bind=bind))
    # DDP's buffer sync; a C++ binding exported only in torch.distributed (no async variant).
    tracer.patch((dist,), "_broadcast_coalesced", functools.partial(
        collective, tracer=tracer, op="broadcast", bind=_broadcast_coalesced))

    isend = tracer.patch(owners, "isend", functools.partial(p2p, tracer=tracer, op="send", is_async=True))
    irecv = tracer.patch(owners, "irecv", functools.partial(p2p, tracer=tracer, op="recv", is_async=True))
    tracer.patch(owners, "send", functools.partial(p2p, tracer=tracer, op="send", is_async=False))
    tracer.patch(owners, "recv", functools.partial(p2p, tracer=tracer, op="recv", is_async=False))
    tracer.patch(owners, "batch_isend_irecv", functools.partial(batch, tracer=tracer, isend=isend, irecv=irecv))
    if hasattr(c10d, "_check_op"):
        tracer.patch((c10d,), "_check_op", functools.partial(check_op, isend=isend, irecv=irecv))

    tracer_wait = functools.partial(wait, tracer=tracer)
    for work_type in _work_classes():
        tracer.patch((work_type,), "wait", tracer_wait)


def wait(original: Callable, *, tracer: Any) -> Callable:
    """``Work.wait`` (``original``) completing the op its work was tracked with: timed, recorded through
    ``tracer``; any other work's wait goes through untouched."""
    # take_work and the Entry's hand-over, inline: every Work.wait of the process comes here.
    (_, _, _, _, _, _, _, now, live, push, done, max_done, pending, _, stats) = tracer.hot

    def traced_wait(self: Any, timeout: Any = _NO_TIMEOUT) -> Any:
        # torch's own signature, ``wait(self, timeout=timedelta(0))``: a ``*args, **kwargs`` pass-through
        # builds a tuple and a dict on every wait of the process.
        entry = pending.pop(id(self), None) if pending else None
        if entry is None or entry[0] is not self:
            if entry is not None:  # another work's entry under a reused id: not ours to take
                pending[id(entry[0])] = entry
            return original(self) if timeout is _NO_TIMEOUT else original(self, timeout)
        ops = entry[1]
        if type(ops) is tuple:  # one CPU op of a fast site (its Issued)
            t0 = now()
            result = original(self) if timeout is _NO_TIMEOUT else original(self, timeout)
            try:
                t1 = now()
                if len(done) < max_done:
                    push(ops + (t1, t1 - t0, live.key))
                else:
                    stats["dropped_done"] += 1
            except Exception as exc:
                tracer.error("wait", exc)
            return result
        args: tuple = () if timeout is _NO_TIMEOUT else (timeout,)
        kwargs: dict = {}
        if ops[0].cuda is not None:
            return tracer.cuda_timer().wait(tracer, ops, original, self, args, kwargs)
        t0 = now()
        result = original(self, *args, **kwargs)
        try:
            t1 = now()
            if len(ops) == 1:  # tracer.waited, inline for the common single-op work
                tracer.emit(ops[0], t1, t1 - t0)
            else:
                tracer.waited(ops, t0, t1)
        except Exception as exc:
            tracer.error("wait", exc)
        return result
    return native.work_wait(original, traced_wait, tracer=tracer)


def _work_classes() -> list[type]:
    """``Work`` and torch's own subclasses of it that define their own ``wait`` (the ``fake`` backend's
    ``FakeWork``): a patch of ``Work.wait`` alone never sees their waits, and their ops would stay pending
    until the step-end flush (recorded with no blocked time)."""
    base = torch._C._distributed_c10d.Work
    found = [base]
    for value in vars(torch._C._distributed_c10d).values():
        if isinstance(value, type) and value is not base and issubclass(value, base) and "wait" in vars(value):
            found.append(value)
    return found
