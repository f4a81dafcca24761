"""The step record's ``cpu_s`` / ``cpu_wait_s`` source: the calling thread's schedstat, read raw on the
training thread and parsed on the flusher (``agent.instrument.cpu``)."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest

from meshscope.agent.instrument.cpu import ThreadCPU, parse

# serial: a thread's CPU + wait against its wall time, to 10 %
pytestmark = pytest.mark.serial


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_reading_parses_to_this_threads_cpu_time_against_thread_time() -> None:
    reader = ThreadCPU()
    r0, t0 = reader.read(), time.thread_time()
    _spin(0.05)
    r1, t1 = reader.read(), time.thread_time()
    (c0, w0), (c1, w1) = parse(r0), parse(r1)
    assert abs((c1 - c0) - (t1 - t0)) < 0.005  # the kernel's two counters of the same thread
    if os.path.exists("/proc/thread-self/schedstat"):
        assert type(r0) is bytes and w1 >= w0 >= 0  # raw on the training thread; delays never go back
    reader.close()


def test_another_thread_reads_its_own_time_not_the_first_ones() -> None:
    reader = ThreadCPU()
    main0 = parse(reader.read())[0]
    _spin(0.1)  # this thread now has at least 0.1 s more than a new thread
    got = {}

    def other() -> None:
        got["cpu"] = parse(reader.read())[0]

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert got["cpu"] < main0 + 0.1 - 0.02
    reader.close()


def test_what_cannot_be_read_parses_to_nan_and_a_fallback_passes_through() -> None:
    assert all(math.isnan(x) for x in parse(b"garbage"))
    assert all(math.isnan(x) for x in parse(b""))
    assert parse((1.5, float("nan")))[0] == 1.5
    assert parse(b"1000000000 2000000000 7\n") == (1.0, 2.0)


def test_the_run_queue_delay_is_the_time_a_competitor_on_the_same_cpu_held_it() -> None:
    """The independent truth: a busy process pinned to this thread's CPU takes about half of it, so over a
    wall-clock window this thread's CPU + run-queue delay add up to the window and the delay is a large
    share of it (what the CPU-contention verdict reads from ``cpu_wait_s``)."""
    import subprocess
    import sys

    if not os.path.exists("/proc/thread-self/schedstat") or not hasattr(os, "sched_setaffinity"):
        import pytest

        pytest.skip("no per-thread schedstat here")
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    reader = ThreadCPU()
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only
        time.sleep(0.3)  # the hog is running
        (c0, w0), t0 = parse(reader.read()), time.monotonic()
        while time.monotonic() - t0 < 1.0:
            pass
        (c1, w1), wall = parse(reader.read()), time.monotonic() - t0
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait(timeout=10)
        reader.close()
    cpu_s, wait_s = c1 - c0, w1 - w0
    assert abs(cpu_s + wait_s - wall) < 0.1 * wall, (cpu_s, wait_s, wall)
    assert wait_s > 0.25 * wall, (cpu_s, wait_s, wall)
