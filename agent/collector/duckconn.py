"""Every DuckDB connection the process opens, so that its exit can stop them first.

    with duckconn.connect(config={...}) as con:   # instead of duckdb.connect
        ...

A thread still inside DuckDB when the interpreter finalizes (a dashboard page's load thread, the
compaction worker: daemon threads) is unwound by force when it next takes the GIL, through DuckDB's C++
frames, and the process aborts (SIGABRT, "FATAL: exception not rethrown"; seen on SIGTERM to a dashboard
loading or compacting a 16,384-rank store). At exit (``atexit``, before finalization) ``stop`` interrupts
every open connection, refuses new ones and waits until each has been closed; the interrupted calls raise
in their threads (``duckdb.InterruptException``, or ``InterruptedError`` for a new connection), which end
as every failed load does.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

EXIT_WAIT_S = 30.0  # at most this long at exit for the connections to close
_REINTERRUPT_S = 0.1  # an interrupt reaches only the statement running: a thread between two gets another

_guard = threading.Condition()
_active: set = set()
_opening = [0]  # threads inside duckdb.connect (DuckDB code too: stop waits for them as well)
_stopping = threading.Event()


def stopping() -> bool:
    """The process is exiting: long work between DuckDB calls should stop (the compaction's batches)."""
    return _stopping.is_set()


@contextlib.contextmanager
def connect(**kwargs) -> Iterator[Any]:
    """``duckdb.connect(**kwargs)``, registered until it is closed; ``InterruptedError`` once the process is
    exiting. DuckDB is imported here, not with the module: the agent imports the store's layout rules
    (``compact``) and never reads through DuckDB."""
    import duckdb

    with _guard:
        if _stopping.is_set():
            raise InterruptedError("the process is exiting")
        _opening[0] += 1
    try:
        con = duckdb.connect(**kwargs)
    except BaseException:
        with _guard:
            _opening[0] -= 1
            _guard.notify_all()
        raise
    with _guard:
        _opening[0] -= 1
        _active.add(con)
        _guard.notify_all()
    try:
        if _stopping.is_set():  # ``stop`` began while it was opening
            raise InterruptedError("the process is exiting")
        yield con
    finally:
        try:
            con.close()
        finally:
            with _guard:
                _active.discard(con)
                _guard.notify_all()


def stop(timeout_s: float = EXIT_WAIT_S) -> bool:
    """Interrupt every open connection and wait until all are closed (True), or ``timeout_s`` (False).
    New connections are refused from here on."""
    _stopping.set()
    deadline = time.monotonic() + timeout_s
    with _guard:
        while _active or _opening[0]:
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


atexit.register(stop)
