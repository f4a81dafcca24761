"""The calling thread's CPU time and run-queue delay, for the step record's ``cpu_s`` / ``cpu_wait_s``.

Linux reports both per thread in ``/proc/thread-self/schedstat`` ("<ns on CPU> <ns runnable, waiting for a
CPU> <timeslices>"); the run-queue delay is what CPU contention costs the thread, which its CPU time alone
cannot tell apart from sleeping or I/O. The file is opened once per thread and re-read with ``pread``
(about 1 µs on the 2-vCPU dev VM, like ``time.thread_time``). Elsewhere: ``time.thread_time`` and no
delay (NaN).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time


class ThreadCPU:
    """``read()`` -> (CPU seconds, run-queue seconds) of the calling thread since it started; the second is
    NaN where the kernel does not report it. Never raises."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._tid: int | None = None

    def read(self) -> tuple[float, float]:
        tid = threading.get_native_id()
        if tid != self._tid:
            self._open(tid)
        if self._fd is not None:
            try:
                on_cpu, delay, _ = os.pread(self._fd, 96, 0).split()
                return int(on_cpu) * 1e-9, int(delay) * 1e-9
            except (OSError, ValueError):
                self.close()
                self._tid = tid  # do not retry on every call
        return time.thread_time(), float("nan")

    def _open(self, tid: int) -> None:
        self.close()
        self._tid = tid
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):  # already gone: nothing to release
                os.close(self._fd)
            self._fd = None
