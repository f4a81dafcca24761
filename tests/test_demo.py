"""``meshscope demo`` as a user runs it: SIGTERM (a ``kill``, a container stop) stops every process it
started (agent, stack, Prometheus, Alertmanager, the training job and its ranks), and every file it writes
is under its store."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.support.jobs import trainer_env

pytestmark = [pytest.mark.server, pytest.mark.gloo]


def _wait_for(pred, *, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.mark.skipif(not shutil.which("prometheus"), reason="prometheus not installed (make install-servers)")
def test_sigterm_stops_everything_the_demo_started_and_its_files_stay_in_the_store(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    store = tmp_path / "store"
    demo = subprocess.Popen([sys.executable, "-m", "meshscope", "demo", "--store", str(store), "--steps", "200",
                             "--no-serve"], cwd=cwd, env=trainer_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        me = psutil.Process(demo.pid)
        names = lambda: {" ".join(p.cmdline()[:6]) for p in me.children(recursive=True)}  # noqa: E731

        def started():
            # the agent, the stack with its two servers, and a training job with its ranks
            procs = me.children(recursive=True)
            cmd = " ".join(" ".join(p.cmdline()) for p in procs)
            ranks = sum("meshscope.trainer.train" in " ".join(p.cmdline()) for p in procs)
            ok = all(k in cmd for k in (" agent ", " stack ", "prometheus", "alertmanager")) and ranks >= 2
            return procs if ok else None

        procs = _wait_for(started, timeout_s=120, what="the demo's agent, stack, servers and first job")
        pids = {p.pid for p in procs}
        before = names()
        demo.send_signal(signal.SIGTERM)
        out, _ = demo.communicate(timeout=60)
        alive = lambda: [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]  # noqa: E731
        _wait_for(lambda: not alive(), timeout_s=30, what=f"every child to stop; still running: {alive()} of {before}")
        assert demo.returncode == 0, out
        assert "Traceback" not in out, out
        assert list(cwd.iterdir()) == [], "the demo wrote outside its store"
        assert (store / "stack").is_dir(), sorted(p.name for p in store.iterdir())
    finally:
        if demo.poll() is None:
            demo.kill()
        for p in psutil.Process(os.getpid()).children(recursive=True):
            p.kill()
