"""Shared helpers for the test tiers: launching real torchrun jobs of the reference trainer."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^step=(\d+) loss=(\S+)")


def trainer_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torchrun(nproc: int, *args: str, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node=nproc -m meshscope.trainer.train *args`` from the repo root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "meshscope.trainer.train", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def single(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """The same trainer as one plain process (a world of one)."""
    cmd = [sys.executable, "-m", "meshscope.trainer.train", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def losses(stdout: str) -> dict[int, float]:
    out = {}
    for line in stdout.splitlines():
        m = STEP_LINE.match(line)
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out


@pytest.fixture
def root() -> Path:
    return ROOT


@functools.lru_cache(maxsize=None)
def sites_worker(script: str, form: str) -> dict:
    """The JSON object printed last by ``tests/workers/<script>``, run in its own process with the collective
    tracer's C sites (``form`` "c") or its Python ones (``MESHSCOPE_NATIVE=0``), the functional collectives'
    kernels off (``MESHSCOPE_FUNCOL_KERNELS=0``) unless ``form`` is "kernels" (with the C sites). Cached: copy
    to change it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MESHSCOPE_NATIVE="0" if form == "python" else "1",
               MESHSCOPE_FUNCOL_KERNELS="1" if form == "kernels" else "0")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sites_cases(script: str, form: str) -> dict:
    """``sites_worker``'s cases in ``form`` (a copy, without its ``_form`` entry, checked to be that form);
    skipped where the C sites are not built and ``form`` is "c"."""
    from meshscope.agent.instrument import native

    if form == "c" and not native._USABLE:
        pytest.skip("the C sites are not built here (tests/test_hooks_native.py says whether they must be)")
    got = dict(sites_worker(script, form))
    assert got.pop("_form")["active"] == (form == "c")
    return got


_CPU_AT_START = pytest.StashKey[float]()


def _cpu_s() -> float:
    """CPU seconds of this process and of every child it (or they) waited for: a torchrun job's ranks count
    once torchrun has reaped them and the test has reaped torchrun."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_CPU_AT_START] = _cpu_s()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # junit takes a test's properties from its teardown report: the CPU its setup, call and teardown used
    # (bench/suite_durations.py sets it beside the wall time: where a second core would be idle).
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        item.user_properties.append(("cpu_s", round(_cpu_s() - item.stash[_CPU_AT_START], 3)))
    yield

