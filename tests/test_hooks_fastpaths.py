"""The fast CPU sites (one frame per traced call, ``Issued`` / ``Entry`` tuples) through the real torch API
on the ``fake`` backend (tests/workers/hooks_fastpaths.py, its own process): what each records in the cases
the generic path used to handle — a funcol wait inside its own issuing call, a pending funcol op waited
inside another op's issuing call, keyword calls and ``Work.wait(timeout=...)``, P2P group peers, an async
op nobody waits in Python, a call that raises after the wait torch makes inside it, a funcol op inside
``torch.compile`` (one graph: the wrappers step aside before Dynamo traces anything of theirs) — and that
the ``fake`` backend's own ``FakeWork.wait`` is timed (a patch of ``Work.wait`` alone never saw it: the
per-op cost benchmark then timed the issue without its wait). Each in both forms of the sites, C
(agent/instrument/_hot.c) and Python (``MESHSCOPE_NATIVE=0``), and the two forms record the same ops."""

from __future__ import annotations


import pytest

from meshscope.agent.instrument import native
from tests.conftest import sites_cases, sites_worker

def _worker(form: str) -> dict:
    return sites_worker("hooks_fastpaths.py", form)


@pytest.fixture(scope="module", params=["c", "python"])
def cases(request: pytest.FixtureRequest) -> dict:
    return sites_cases("hooks_fastpaths.py", request.param)


def test_both_forms_record_the_same_ops() -> None:
    """Everything but the clock readings is the same, op for op, in C and in Python; and the C form is the
    one patched in (its objects, not Python functions) when active."""
    if not native._USABLE:
        pytest.skip("the C sites are not built here")
    c, py = _worker("c"), _worker("python")
    assert c["_form"] == {"c10d": "Site", "wait": "Wait", "active": True}
    assert py["_form"] == {"c10d": "function", "wait": "function", "active": False}
    # funcol's sites are C builtins from the case after the first (whose funcol op imports torch._dynamo,
    # which they wait for: tests/test_hooks_funcol_cform.py), Python functions in the Python form.
    forms = [tuple(case["funcol_form"]) for name, case in c.items() if name != "_form"]
    assert set(forms[1:]) == {("builtin_function_or_method",) * 2}, forms
    assert {tuple(case["funcol_form"]) for name, case in py.items() if name != "_form"} == {("function",) * 2}
    timing = {"t_start", "t_end", "wait_s"}

    def shape(case: dict) -> tuple:
        return ([{k: v for k, v in r.items() if k not in timing} | {"waited": r["wait_s"] > 0}
                 for r in case["records"]], case["errors"], case["pending"], case["stats"])

    assert set(c) == set(py)
    for name in c:
        if name != "_form":
            assert shape(c[name]) == shape(py[name]), name


def _clean(case: dict) -> None:
    assert case["errors"] == [] and case["pending"] == 0
    assert case["stats"].get("unmatched_waits", 0) == 0 and case["stats"].get("dropped_pending", 0) == 0
    for r in case["records"]:
        assert r["t_start"] <= r["t_end"] and 0 <= r["wait_s"] <= r["t_end"] - r["t_start"] + 1e-9


def test_a_funcol_wait_inside_its_own_call_completes_that_op(cases: dict) -> None:
    case = cases["funcol_nested_wait"]
    _clean(case)
    [r] = case["records"]
    # all_gather_single's bytes are the output's: 64 × 4 ranks; the wait torch makes inside the call is
    # the op's blocked time, and the op completes there, not at the call's return (the cat after it).
    assert (r["op"], r["nbytes"], r["source"], r["group_size"]) == ("all_gather", 256, "funcol", 4)
    assert r["wait_s"] > 0


def test_a_pending_funcol_op_waited_inside_another_issue_keeps_its_own_wait(cases: dict) -> None:
    case = cases["funcol_wait_inside_another_issue"]
    _clean(case)
    first, second = sorted(case["records"], key=lambda r: r["seq"])
    assert (first["op"], first["nbytes"], second["op"], second["nbytes"]) == ("all_reduce", 64, "all_gather", 256)
    assert first["wait_s"] > 0 and second["wait_s"] > 0
    # The first op was waited during the second's issuing call: it completes inside that call.
    assert second["t_start"] <= first["t_end"] <= second["t_end"]


def test_issue_then_wait_is_one_record_with_its_blocked_time(cases: dict) -> None:
    case = cases["funcol_issue_then_wait"]
    _clean(case)
    [r] = case["records"]
    assert (r["op"], r["nbytes"], r["seq"]) == ("all_reduce", 64, 1) and r["wait_s"] > 0


@pytest.mark.parametrize("name", ["c10d_positional", "c10d_keywords"])
def test_c10d_calls_record_the_same_however_the_arguments_are_passed(cases: dict, name: str) -> None:
    case = cases[name]
    _clean(case)
    blocking, waited = case["records"]
    assert [(r["op"], r["nbytes"], r["seq"], r["source"]) for r in case["records"]] == [
        ("all_reduce", 64, 1, "c10d"), ("all_reduce", 64, 2, "c10d")]
    assert blocking["wait_s"] == pytest.approx(blocking["t_end"] - blocking["t_start"])  # the whole call
    assert waited["wait_s"] > 0  # timed by the patched FakeWork.wait, not completed by the flush


def test_p2p_peers_are_global_ranks_and_every_op_is_timed(cases: dict) -> None:
    case = cases["p2p"]
    _clean(case)
    assert [(r["op"], r["peer"], r["nbytes"]) for r in case["records"]] == [("send", 3, 64), ("send", 1, 64),
                                                                            ("recv", 2, 64), ("send", 3, 64),
                                                                            ("recv", 3, 64)]
    assert all(r["wait_s"] > 0 for r in case["records"])


def test_a_batch_is_one_record_per_op_each_timed_by_its_wait(cases: dict) -> None:
    case = cases["p2p_batch"]
    _clean(case)
    assert [(r["op"], r["peer"], r["nbytes"]) for r in case["records"]] == [("send", 1, 64), ("recv", 2, 64),
                                                                            ("send", 3, 64), ("recv", 3, 64),
                                                                            ("send", 2, 64)]
    assert all(r["wait_s"] > 0 for r in case["records"])


def test_an_async_op_never_waited_is_completed_by_the_flush(cases: dict) -> None:
    case = cases["async_never_waited"]
    _clean(case)
    [r] = case["records"]
    assert r["op"] == "all_reduce" and r["wait_s"] == 0.0


def test_compiled_funcol_is_one_graph_and_not_recorded(cases: dict) -> None:
    case = cases["compiled_funcol"]
    assert case["errors"] == [] and case["records"] == [] and case["pending"] == 0
    assert case["dynamo"] == {"unique_graphs": 1, "graph_breaks": 0, "recompiles": 0}


def test_a_call_that_raises_after_its_inner_wait_leaves_nothing_to_the_next_op(cases: dict) -> None:
    case = cases["funcol_raises_after_inner_wait"]
    _clean(case)
    [r] = case["records"]  # the failed call is not recorded; the next op carries only its own wait
    assert (r["op"], r["nbytes"]) == ("all_reduce", 64) and r["wait_s"] > 0


def test_dtensors_mesh_dim_designator_is_resolved_once_per_mesh_and_dim(cases: dict) -> None:
    """DTensor calls funcol with ``group=(mesh, mesh_dim)``, a new tuple each time: each op is still
    numbered in its own group and named by its mesh dim, and the designator is resolved from scratch once
    per (mesh, dim) — not per op, which cost 40 µs a funcol op where a ProcessGroup's cost 11.5."""
    case = cases["funcol_mesh_dim"]
    _clean(case)
    assert [(r["op"], r["group_size"], r["seq"], r["nbytes"]) for r in case["records"]] == [
        ("all_reduce", 2, 1, 64), ("all_reduce", 2, 2, 64), ("all_reduce", 2, 3, 64), ("all_reduce", 2, 1, 64),
        ("all_reduce", 2, 4, 64), ("all_reduce", 2, 5, 64), ("all_gather", 2, 6, 128), ("all_gather", 2, 7, 128)]
    dims = [d for d, _ in case["groups"]]
    assert dims == ["tp", "tp", "tp", "dp", "tp", "tp", "tp", "tp"], dims
    assert len({g for _, g in case["groups"]}) == 2
    assert case["lookups"] == 2  # (mesh, 1) and (mesh, 0)


def test_a_rank_list_designator_is_resolved_once_per_set_of_ranks(cases: dict) -> None:
    """A list of ranks, funcol's other designator and a new list per call in a user's loop, is resolved
    once per set of ranks, and each op is numbered in its own group."""
    case = cases["funcol_rank_list"]
    _clean(case)
    assert [(r["op"], r["group_size"], r["seq"]) for r in case["records"]] == [
        ("all_reduce", 4, 1), ("all_reduce", 4, 2), ("all_reduce", 2, 1), ("all_reduce", 4, 3), ("all_reduce", 2, 2)]
    assert len({g for _, g in case["groups"]}) == 2
    assert case["lookups"] == 2


def test_a_torch_without_the_single_names_is_traced_under_its_older_ones(cases: dict) -> None:
    """torch before 2.13 (the GPU machine's 2.11) has no ``all_gather_single`` & co.: DTensor calls
    ``all_gather_tensor`` / ``reduce_scatter_tensor``, which issue the op themselves there. Those are traced
    (one record each, its bytes), no missing name is created while attached (a wrapper of ``None`` there
    broke ``getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor`` on the GPU check), and
    detach puts the older functions back."""
    case = cases["funcol_older_torch"]
    assert case["created"] == []
    assert case["restored"]
    _clean(case)
    assert [(r["op"], r["nbytes"], r["source"]) for r in case["records"]] == [
        ("all_gather", 256, "funcol"), ("reduce_scatter", 128, "funcol"),
        ("all_gather", 256, "funcol"), ("all_gather", 256, "funcol"), ("reduce_scatter", 128, "funcol")]
    assert all(r["wait_s"] >= 0 and r["t_end"] >= r["t_start"] for r in case["records"])
