"""Zero-code never changes the job, even when meshscope itself fails: a failure injected into each of its
hooks in turn (tests/faults_zerocode/sitecustomize.py: the step boundary, the collective site, the loss
capture, the memory census, the FLOP count) leaves the job's exit code, stdout and stderr (less
meshscope's own ``meshscope:`` lines) identical to the job run alone, and is counted as a
``telemetry_error`` naming the injected fault (so an injection that never fired fails the test)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshscope.agent.store.reader import read_table
from tests.test_zerocode import ingest, meshscope_run, torchrun

FAULTS = ("step_boundary", "collective_site", "loss_capture", "memory_census", "flop_count")
SHIM = Path(__file__).resolve().parent / "faults_zerocode"


def _job_lines(stderr: str) -> list[str]:
    """The job's stderr: meshscope's lines out (``meshscope:`` and the indented commands its last line
    suggests), and torchrun's per-run values (its rendezvous port and temporary paths) masked."""
    lines = [line for line in stderr.splitlines() if not line.startswith(("meshscope:", "  meshscope "))]
    return [re.sub(r"(/tmp/\S+|:\d{4,5}\b|\d+\.\d+ ?s\b)", "<v>", line) for line in lines]


@pytest.mark.gloo
def test_a_failure_in_any_zero_code_hook_leaves_the_job_as_it_is(tmp_path):
    job = torchrun("attention_lm.py", "--steps", "4")
    # C forms off in both arms: the collective site's injection is in the Python form (the C form calls no
    # Python on the way); MESHSCOPE_* changes nothing of the job itself
    env = {"PYTHONPATH": str(SHIM), "MESHSCOPE_NATIVE": "0"}
    alone = meshscope_run(tmp_path, "--", *job, env={**env, "MESHSCOPE_DISABLE": "1"})
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert alone.stdout.count("step ") == 4
    for fault in FAULTS:
        store = tmp_path / fault
        out = meshscope_run(tmp_path, "--store", str(store), "--run", fault, "--", *job,
                            env={**env, "MESHSCOPE_TEST_FAULT": fault})
        assert out.returncode == alone.returncode, (fault, out.stderr[-3000:])
        assert out.stdout == alone.stdout, fault
        assert _job_lines(out.stderr) == _job_lines(alone.stderr), (fault, out.stderr[-3000:])
        ingest(store)
        events = read_table(store, "event", run=fault)
        errors = events[events["kind"] == "telemetry_error"]["message"]
        assert errors.str.contains(f"injected {fault}").any(), (fault, errors.tolist())
