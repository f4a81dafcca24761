"""What the collective tracer keeps of an op between its issue and its record, and the state its fast sites
read (``CollectiveTracer.hot``): the types shared by ``collectives`` and the ``comm_*`` sites."""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple

from meshscope.agent.instrument.meshinfo import GroupInfo
from meshscope.agent.instrument.recorder import DIRECT

# What the training thread keeps of an op, as plain tuples (a tuple measured cheaper to build than a slotted
# object with an ``__init__``, and it is built on every op):
#   Issued = (op, group key, nbytes, peer, source, seq, t_start): an op issued on a fast site and not yet
#           complete (in ``_pending_works`` until its wait); the group key indexes the tracer's GroupInfos;
#   Entry = Issued + (t_end, wait_s, context): a completed op waiting for ``drain`` (context: the
#           recorder's ``live.key`` when it completed, ``DIRECT`` for a recorder without deferral).
# Only plain values in both: an Entry waits up to the flusher's interval for ``drain``, long enough for the
# cyclic GC to promote a tracked tuple to its oldest generation, and the full collections that promotion
# brings on cost the training thread 2.2-3.4 µs per op (a GroupInfo and the open StepState in each Entry,
# 100,000 traced all-reduces on the fake backend); a tuple of plain values the GC stops tracking.
# Sites that need to amend an op after its issue (DDP's completion stamp, funcol's nested waits, CUDA
# events, coalesced batches) keep an ``_Op`` and ``emit`` turns it into an Entry.


class Hot(NamedTuple):
    """The tracer's state as the fast sites read it (once, when they are made: closures over these)."""

    tracer: Any  # .enabled, .error, .track_work, and the slow path for what a fast site does not handle
    main: Any  # the attaching thread's nesting state (``_Nesting``)
    main_tid: int
    local: Any  # other threads' nesting state (``threading.local`` with ``.nesting``)
    get_ident: Callable[[], int]
    groups: dict  # id(designator) → (designator, GroupInfo, counter, group key)
    resolve: Callable[[Any], tuple]  # a designator not in ``groups`` → its entry
    now: Callable[[], float]
    live: Any  # ``.key``: the open step's, the context of an op completing now
    push: Callable[[tuple], None]  # hand over one Entry
    done: Any  # the Entries waiting for drain (bounded by ``max_done``)
    max_done: int
    pending: dict  # ``_pending_works``
    max_pending: int
    stats: Any


class _Direct:
    """The ``live`` of a recorder without deferral: no open step to carry, records made at once."""

    __slots__ = ()
    step = key = DIRECT


class _OpDefaults:
    """What most ops never set, as class attributes: an op's constructor stores only what every op has
    (instances get a ``__dict__`` for these on the first store)."""

    t_done: float | None = None  # completion seen before the record (DDP's callback, funcol's wait)
    wait_s = 0.0  # blocked time already attributed (waits nested inside the issuing call)
    waited = False
    cuda: Any = None  # CUDA events (comm_nccl), None on CPU


class _Op(_OpDefaults):
    """One issued op that a site amends before it completes (see ``Issued`` above for the fast sites'
    tuples); ``emit`` turns it into an Entry."""

    __slots__ = ("op", "info", "key", "nbytes", "peer", "source", "seq", "t_start")

    def __init__(self, op: str, info: GroupInfo, key: int, nbytes: int, peer: int, source: str, seq: int,
                 t_start: float) -> None:
        self.op = op
        self.info = info
        self.key = key  # the group's key (``Issued``)
        self.nbytes = nbytes
        self.peer = peer
        self.source = source
        self.seq = seq
        self.t_start = t_start


class _Nesting:
    """Per-thread nesting state. ``depth`` > 0 while inside a traced issue call: nested dist.* calls are
    not recorded again; ``current``: the op being issued (a wait inside its own issue call belongs to it:
    an ``_Op`` is amended, a fast site's ``Issued`` gets the wait in ``nested_wait`` / ``nested_end``,
    which that site reads and resets after its call)."""

    __slots__ = ("depth", "current", "nested_wait", "nested_end")

    def __init__(self) -> None:
        self.depth = 0
        self.current: Any = None
        self.nested_wait = 0.0
        self.nested_end: float | None = None


class _TLS(threading.local):
    def __init__(self) -> None:
        self.nesting = _Nesting()


def stamp_unwrap(p: Any, now: Any, fut: Any) -> Any:
    """A DDP bucket's completion callback (comm_ddp), bound to its op and the clock: completion stamped on
    the op, the bucket's tensor returned (``native.ddp_stamp``: the same in C)."""
    p.t_done = now()  # runs on the gloo worker thread: one attribute store, atomic under the GIL
    return fut.value()[0]
