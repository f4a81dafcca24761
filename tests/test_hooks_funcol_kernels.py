"""The functional collectives traced in torch's dispatcher (agent/instrument/funcol_kernels.py,
agent/instrument/_funcol_kernels.cpp), against the sites of comm_funcol they replace: the same cases through a
real telemetry core (tests/workers/hooks_funcol_kernels.py, on the ``fake`` backend), once with the kernels
and once with ``MESHSCOPE_FUNCOL_KERNELS=0``, record the same ops — op, group, dim, bytes, sequence number
(one sequence with the c10d ops of the same group), step — and the same step rows. Where they differ, the
kernels see what the sites could not: an op whose Python call raised after the op completed, and the
functional collectives of ``torch.compile``'d code (no graph break either way). The kernels on real gloo
process groups are the multi-process tests' (tests/test_hooks_gloo.py, the trainer's TP runs): this process
has no CUDA, so every Telemetry here traces its funcol ops with them."""

from __future__ import annotations

import shutil

import pytest

from meshscope.agent.instrument import funcol_kernels
from tests.conftest import sites_worker

TIMES = {"t_start", "t_end", "wait_s"}


def _built() -> None:
    if funcol_kernels.built() is None:
        if shutil.which("c++"):  # make install builds them where a compiler is: a missing build is a defect
            pytest.fail("the funcol kernels are not built for this torch (python -m meshscope.agent.instrument."
                        "funcol_kernels)")
        pytest.skip("no C++ compiler here: the funcol kernels cannot be built, the sites trace the ops")


@pytest.fixture(scope="module")
def forms() -> tuple[dict, dict]:
    _built()
    return sites_worker("hooks_funcol_kernels.py", "kernels"), sites_worker("hooks_funcol_kernels.py", "c")


def _shape(case: dict) -> list[dict]:
    """The records without their clock readings, in sequence order (the kernels' are drained before the
    sites', so the written order of a group's mixed ops differs; what they say does not)."""
    rows = [{k: v for k, v in r.items() if k not in TIMES} for r in case["records"]]
    return sorted(rows, key=lambda r: (r["group"], r["seq"]))


def _steps(case: dict) -> list[dict]:
    return [{k: v for k, v in s.items() if k in ("step", "n_collectives")} for s in case["steps"]]


def test_the_kernels_trace_and_the_functions_stay_torchs(forms: tuple[dict, dict]) -> None:
    kernels, sites = forms
    for name in set(kernels) - {"life"}:
        assert kernels[name]["form"] == {"kernels": True, "patched": False}, name
        assert sites[name]["form"] == {"kernels": False, "patched": True}, name


@pytest.mark.parametrize("name", ["every_op", "coalesced", "mixed_with_c10d", "mesh_dims", "across_steps",
                                  "between_steps"])
def test_both_forms_record_the_same_ops_and_steps(forms: tuple[dict, dict], name: str) -> None:
    kernels, sites = forms[0][name], forms[1][name]
    assert _shape(kernels) == _shape(sites)
    assert _steps(kernels) == _steps(sites)
    assert kernels["stats"] == sites["stats"] == {}
    for r in kernels["records"]:
        # (times in the clock's seconds since the epoch: a float's resolution there is ~0.2 us)
        assert r["t_start"] <= r["t_end"] and 0 <= r["wait_s"] <= r["t_end"] - r["t_start"] + 1e-6


def test_what_each_case_records(forms: tuple[dict, dict]) -> None:
    """The expected records themselves (the comparison above would pass two forms wrong the same way)."""
    kernels = forms[0]
    ops = [(r["op"], r["nbytes"], r["seq"], r["step"]) for r in kernels["every_op"]["records"]]
    # world of 4, a 64-byte tensor: all-gather's bytes are the output's; reduce-scatter's the input's (256)
    one_step = [("all_reduce", 64, 1), ("all_gather", 256, 2), ("all_gather", 256, 3), ("reduce_scatter", 256, 4),
                ("all_to_all", 64, 5), ("broadcast", 64, 6)]
    assert ops == [(op, b, s, 0) for op, b, s in one_step] + [(op, b, s + 6, 1) for op, b, s in one_step]
    assert [(r["op"], r["nbytes"], r["seq"]) for r in kernels["coalesced"]["records"]] == [
        ("all_reduce", 64, 1), ("all_reduce", 16, 2), ("all_gather", 256, 3), ("all_gather", 256, 4),
        ("reduce_scatter", 64, 5)]
    mixed = sorted((r["seq"], r["source"], r["step"]) for r in kernels["mixed_with_c10d"]["records"])
    assert mixed == [(s, "funcol" if s % 2 else "c10d", (s - 1) // 4) for s in range(1, 9)]
    assert [(r["dim"], r["group_size"], r["seq"]) for r in kernels["mesh_dims"]["records"]] == [
        ("tp", 2, 1), ("dp", 2, 1), ("tp", 2, 2), ("world", 4, 1)]
    # issued in step 0, waited in step 1: it completed in step 1, as the sites say (Live.key at the wait)
    assert [(r["seq"], r["step"]) for r in kernels["across_steps"]["records"]] == [(1, 1), (2, 1)]
    assert [s["n_collectives"] for s in kernels["across_steps"]["steps"]] == [0, 2]
    # between the steps: no step's row counts it (its record's step is the telemetry's last step when the
    # flusher builds it, the sites' rule as well: compared above)
    assert [r["seq"] for r in kernels["between_steps"]["records"]] == [1, 2]
    assert [s["n_collectives"] for s in kernels["between_steps"]["steps"]] == [1, 0]


def test_an_op_that_ran_before_its_call_raised_is_recorded(forms: tuple[dict, dict]) -> None:
    # all_gather_single(t, 5): the op ran and was waited inside the call; then torch.cat raised. The sites lose
    # it (their record would be made at the call's return); the kernel saw the op complete.
    kernels, sites = (f["raises_after_inner_wait"] for f in forms)
    assert [(r["op"], r["nbytes"], r["seq"]) for r in kernels["records"]] == [("all_gather", 256, 1),
                                                                             ("all_reduce", 64, 2)]
    assert [(r["op"], r["seq"]) for r in sites["records"]] == [("all_reduce", 2)]


def test_the_ops_of_torchs_autograd_formulas_are_recorded(forms: tuple[dict, dict]) -> None:
    # funcol's all_reduce backward is an all_reduce issued through torch.ops, then funcol's wait_tensor: the
    # sites see only that wait (unmatched); the kernels see the op.
    kernels, sites = (f["autograd_backward"] for f in forms)
    assert [(r["op"], r["nbytes"], r["seq"]) for r in kernels["records"]] == [("all_reduce", 64, 1), ("all_reduce", 64, 2)]
    assert kernels["stats"] == {}
    assert [(r["op"], r["seq"]) for r in sites["records"]] == [("all_reduce", 1)]
    assert sites["stats"]["unmatched_waits"] == 1


def test_compiled_functional_collectives_are_recorded_without_a_graph_break(forms: tuple[dict, dict]) -> None:
    kernels, sites = (f["compiled"] for f in forms)
    assert kernels["dynamo"] == sites["dynamo"] == {"unique_graphs": 1, "graph_breaks": 0}
    assert [(r["op"], r["nbytes"], r["seq"]) for r in kernels["records"]] == [("all_reduce", 16, i) for i in range(1, 7)]
    assert sites["records"] == []
    assert kernels["steps"][0]["n_collectives"] == 6


def test_recorded_while_attached_and_the_ops_left_waiting_counted_at_detach(forms: tuple[dict, dict]) -> None:
    kernels, sites = forms[0]["life"], forms[1]["life"]
    assert kernels["attached"] == [["all_reduce", 1, "funcol"]]
    assert kernels["dropped_pending"] == 1  # issued, its wait after the detach
    assert kernels["detached"] == []
    assert kernels["kernels_again"] is True
    assert kernels["reattached"] == [["all_reduce", 1, "funcol"], ["all_reduce", 2, "c10d"]]
    assert {k: v for k, v in kernels.items() if k != "kernels_again"} == {k: v for k, v in sites.items()
                                                                         if k != "kernels_again"}


def test_usable_only_where_built_switched_on_and_without_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    _built()
    import time as time_module

    class Tracer:  # what usable reads of a tracer: a telemetry core's (deferred, perf_counter)
        now = staticmethod(time_module.perf_counter)
        _live = object()

        def error(self, where: str, exc: BaseException) -> None:
            raise AssertionError(f"{where}: {exc}")

    assert funcol_kernels.usable(Tracer()) is not None
    for env in ({"MESHSCOPE_NATIVE": "0"}, {"MESHSCOPE_FUNCOL_KERNELS": "0"}):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert funcol_kernels.usable(Tracer()) is None, env
    with monkeypatch.context() as m:  # a process with a GPU keeps the sites whose CUDA timing is checked
        m.setattr("torch.cuda.is_available", lambda: True)
        assert funcol_kernels.usable(Tracer()) is None
    with monkeypatch.context() as m:  # a recorder without a flusher (ListRecorder): the sites record at completion
        m.setattr(Tracer, "_live", None)
        assert funcol_kernels.usable(Tracer()) is None
    with monkeypatch.context() as m:  # not built for this torch / source: the sites
        m.setenv("MESHSCOPE_CACHE_DIR", str(tmp_path))
        assert funcol_kernels.built() is None
        m.setattr(funcol_kernels, "_loaded", {})
        assert funcol_kernels.usable(Tracer()) is None


def test_the_build_command_says_what_it_did(tmp_path) -> None:
    _built()
    import subprocess
    import sys

    from tests.support.jobs import ROOT

    check = subprocess.run([sys.executable, "-m", "meshscope.agent.instrument.funcol_kernels", "--check"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and check.stdout.startswith("funcol kernels: built: "), check.stdout
    import os

    env = dict(os.environ, MESHSCOPE_CACHE_DIR=str(tmp_path))
    missing = subprocess.run([sys.executable, "-m", "meshscope.agent.instrument.funcol_kernels", "--check"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and missing.stdout.strip() == "funcol kernels: not built for this torch"
