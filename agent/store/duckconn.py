"""Every DuckDB connection the process opens, so that its exit can stop them first.

    with duckconn.connect(config={...}) as con:   # instead of duckdb.connect
        ...

A thread still inside DuckDB when the interpreter finalizes (a dashboard page's load thread, the
compaction worker: daemon threads) is unwound by force when it next takes the GIL, through DuckDB's C++
frames, and the process aborts (SIGABRT, "FATAL: exception not rethrown"; seen on SIGTERM to a dashboard
loading or compacting a 16,384-rank store). At exit (``atexit``, before finalization) ``stop`` refuses new
connections and waits until no thread can enter DuckDB code again: none is opening or closing a
connection, each open one is interrupted (again every 0.1 s: an interrupt reaches only the statement
running) until its thread has closed it, and each closed one is held here until no thread holds it any
more, 1 s at most once none is open (its destructor is DuckDB code too: held here, it runs at module
teardown, on the main thread). The interrupted calls raise in their threads
(``duckdb.InterruptException``, or ``InterruptedError`` for a new connection), which end as every failed
load does. Nothing here runs outside exit: ``stop`` is for the process's end only.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

EXIT_WAIT_S = 30.0  # at most this long at exit, all of stop's callers together (see ``stop``)
# Once none is open: how long to wait more for the threads still holding a closed connection (normally
# microseconds: the rest of the function that used it). A failed load's exception kept for its page holds
# its frames, and with them the connection, for as long as the page keeps it: that one is left to be
# freed by whoever drops it last (module teardown at exit, on the main thread).
_HELD_GRACE_S = 1.0
_REINTERRUPT_S = 0.1  # an interrupt reaches only the statement running: a thread between two gets another

_guard = threading.Condition()
_active: set = set()  # open: interrupted by ``stop``
_closed: list = []  # closed, kept until no thread refers to them any more (``_held``)
_busy = [0]  # threads inside duckdb.connect or close (DuckDB code too: ``stop`` waits for them as well)
_stopping = threading.Event()
_deadline: list[float] = []  # set by the first ``stop``: later calls share it


def stopping() -> bool:
    """The process is exiting: long work between DuckDB calls should stop (the compaction's batches)."""
    return _stopping.is_set()


def _held(i: int) -> bool:
    """``_closed[i]`` is still referred to by something other than the list (a thread's variable, a
    relation): the list and getrefcount's own argument make 2."""
    return sys.getrefcount(_closed[i]) > 2


@contextlib.contextmanager
def connect(**kwargs) -> Iterator[Any]:
    """``duckdb.connect(**kwargs)``, registered until it is closed; ``InterruptedError`` once the process is
    exiting. DuckDB is imported here, not with the module: the agent imports the store's layout rules
    (``compact``) and never reads through DuckDB."""
    import duckdb

    with _guard:
        if _stopping.is_set():
            raise InterruptedError("the process is exiting")
        _busy[0] += 1
        # Connections closed earlier that no thread holds any more: released here, on a thread that is
        # about to use DuckDB anyway.
        keep, drop = [], []
        for i in range(len(_closed)):
            (keep if _held(i) else drop).append(_closed[i])
        _closed[:] = keep[-256:]  # past that, the oldest are left to whoever holds them
    # Freed here, outside the lock (a connection's destructor is DuckDB code); ``keep`` let go too, or
    # this frame would hold the kept ones (``_held``) for as long as its connection is open.
    del keep, drop
    try:
        con = duckdb.connect(**kwargs)
    except BaseException:
        with _guard:
            _busy[0] -= 1
            _guard.notify_all()
        raise
    with _guard:
        _busy[0] -= 1
        _active.add(con)
        _guard.notify_all()
    try:
        if _stopping.is_set():  # ``stop`` began while it was opening
            raise InterruptedError("the process is exiting")
        yield con
    finally:
        # Out of ``_active`` before it is closed: ``stop`` must never interrupt a connection being freed.
        with _guard:
            _active.discard(con)
            _busy[0] += 1
        try:
            con.close()
        finally:
            with _guard:
                _busy[0] -= 1
                _closed.append(con)
                _guard.notify_all()


def stop(timeout_s: float = EXIT_WAIT_S) -> bool:
    """Interrupt every open connection and wait until no thread can enter DuckDB again (True; a closed
    connection still held elsewhere 1 s after the last one closed is left), or until the deadline
    (False). The first call sets the deadline, ``timeout_s`` from then; later calls (the compaction's exit
    hook, then this module's) share it, so an exit waits ``timeout_s`` at most in all. New connections are
    refused from the first call on."""
    with _guard:
        _stopping.set()
        if not _deadline:
            _deadline.append(time.monotonic() + timeout_s)
        deadline, grace = _deadline[0], None
        while True:
            if not (_active or _busy[0]):
                if not any(_held(i) for i in range(len(_closed))):
                    break
                grace = grace or time.monotonic() + _HELD_GRACE_S
                if time.monotonic() >= grace:
                    break
            for con in list(_active):
                try:
                    con.interrupt()
                except Exception:  # noqa: BLE001 - closed meanwhile
                    pass
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _guard.wait(min(left, _REINTERRUPT_S))
    return True


def time_left() -> float:
    """Seconds left before the exit deadline (``EXIT_WAIT_S`` before ``stop`` was first called)."""
    return max(0.0, _deadline[0] - time.monotonic()) if _deadline else EXIT_WAIT_S


atexit.register(stop)
