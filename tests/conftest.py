"""The suite's session fixtures and hooks; the job runners live in tests/support/jobs.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.jobs import ROOT, ReferenceRuns


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory) -> ReferenceRuns:
    """The session's shared reference runs (tests/support/jobs.py): ``reference_runs["ddp"]``, run once for
    all of the session's pytest-xdist workers (their base folders' parent is the session's), and under
    ``make test`` once for both of its phases (``TESTS_REFERENCE_DIR``, which make empties first)."""
    if os.environ.get("TESTS_REFERENCE_DIR"):  # make test: shared by its parallel and its serial phase
        return ReferenceRuns(Path(os.environ["TESTS_REFERENCE_DIR"]))
    base = tmp_path_factory.getbasetemp()
    return ReferenceRuns((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "reference")


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
