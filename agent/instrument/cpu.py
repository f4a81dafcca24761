"""The calling thread's CPU time and run-queue delay, for the step record's ``cpu_s`` / ``cpu_wait_s``.

Linux reports both per thread in ``/proc/thread-self/schedstat`` ("<ns on CPU> <ns runnable, waiting for a
CPU> <timeslices>"); the run-queue delay is what CPU contention costs the thread, which its CPU time alone
cannot tell apart from sleeping or I/O. The file is opened once per thread and re-read with ``pread``: in
C (``native.read_fd``: 1.2 µs a read from Python on the 2-vCPU dev VM, the system call itself 0.8), else
libc's through ctypes (2.7 µs). Elsewhere: ``time.thread_time`` and no delay (NaN).

Either ``pread`` keeps the GIL (the ctypes one is called through ``ctypes.PyDLL``), as ``time.thread_time`` does:
``os.pread`` releases it, and the training thread reads this twice per step. Whenever the flusher was
waiting for the GIL (it drains every ``flush_interval_s``), it took the GIL at that release, and the
training thread had to wait for it back and force a switch: on the step boundaries' path of
bench/hooks_overhead.py the boundaries cost it 11.6-16.9 µs of CPU per step with ``os.pread``, 8.9-9.1
with this (3 processes each).
A read of this file does not block, so holding the GIL through it is as cheap as the syscall.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time

from meshscope.agent.instrument import native


def _gil_holding_pread():
    """libc's ``pread(fd, buf, n, offset)`` called with the GIL held, or None where it cannot be loaded."""
    try:
        call = ctypes.PyDLL(None, use_errno=True).pread
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    call.restype = ctypes.c_ssize_t
    return call


_PREAD = _gil_holding_pread()
_READ_FD = native.read_fd()  # the same in C: 0.8 µs a read here, against 2.7 through ctypes


_NAN = float("nan")


def parse(reading: bytes | tuple[float, float]) -> tuple[float, float]:
    """(CPU seconds, run-queue seconds) from a ``ThreadCPU.read``; NaN for what cannot be read from it."""
    if type(reading) is not bytes:
        return reading
    try:
        on_cpu, delay = reading.split()[:2]
        return int(on_cpu) * 1e-9, int(delay) * 1e-9
    except ValueError:
        return _NAN, _NAN


class ThreadCPU:
    """``read()`` -> the calling thread's CPU and run-queue time since it started, raw: the schedstat line
    as bytes, which ``parse`` turns into seconds later (on the flusher: 1 µs less per read on the training
    thread), or where the kernel does not report it (CPU seconds, NaN) from ``time.thread_time``. Never
    raises."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._tid: int | None = None
        self._buf = ctypes.create_string_buffer(96)

    def read(self) -> bytes | tuple[float, float]:
        # The thread's ident (pthread_self: no system call, unlike get_native_id) says whether the open file
        # is this thread's. An ident can be reused by a later thread, whose read of the old file then fails
        # (its task is gone): the file is reopened once for the calling thread before giving up on it.
        tid = threading.get_ident()
        if tid == self._tid and _READ_FD is not None and self._fd is not None:  # the common case, one frame
            try:
                data = _READ_FD(self._fd, 96)
                if data:
                    return data
            except OSError:
                pass  # handled below: reopened once
        for retry in (False, True):
            if tid != self._tid:
                self._open(tid)
            if self._fd is None:
                break
            try:
                return self._read(self._fd)
            except OSError:
                self.close()
                if not retry:
                    self._tid = None
        return time.thread_time(), _NAN

    def _read(self, fd: int) -> bytes:
        if _READ_FD is not None:
            data = _READ_FD(fd, 96)
            if data:
                return data
            raise OSError("empty read of /proc/thread-self/schedstat")
        if _PREAD is None:
            return os.pread(fd, 96, 0)
        n = _PREAD(fd, self._buf, 96, 0)
        if n > 0:
            return self._buf.raw[:n]
        raise OSError(ctypes.get_errno(), "pread of /proc/thread-self/schedstat")

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
