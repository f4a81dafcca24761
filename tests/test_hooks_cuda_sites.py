"""The fast sites on CUDA tensors, without a GPU (tests/workers/hooks_cuda_sites.py, its own process: tensors
that answer ``is_cuda`` True on the ``fake`` backend, CUDA events that each read 1 ms after the one made
before): one ``Issued`` tuple and its events per op, no op object, and the records the general path made
before (comm_nccl's rules): a blocking call's two events are its duration and its stall; a funcol op
waited after its call or inside it is timed from the event before its issue to the one after its wait,
its stall being the wait's two events. On a GPU the same paths are timed by the GPU check's section 7."""

from __future__ import annotations


import pytest

from meshscope.agent.instrument import native
from tests.conftest import sites_cases, sites_worker

def _worker(form: str) -> dict:
    return sites_worker("hooks_cuda_sites.py", form)


@pytest.fixture(scope="module", params=["c", "python"])
def cases(request: pytest.FixtureRequest) -> dict:
    return sites_cases("hooks_cuda_sites.py", request.param)


def _timed(case: dict) -> list[tuple[str, int, float, float, int]]:
    """(op, bytes, duration ms, stall ms, seq) of each record; nothing went wrong."""
    assert case["errors"] == [] and case["stats"] == {}
    return [(r["op"], r["nbytes"], round((r["t_end"] - r["t_start"]) * 1e3, 6), round(r["wait_s"] * 1e3, 6),
             r["seq"]) for r in case["records"]]


def test_a_blocking_call_is_its_two_events(cases: dict) -> None:
    assert _timed(cases["c10d_blocking"]) == [("all_reduce", 64, 1.0, 1.0, seq) for seq in (1, 2, 3)]
    assert cases["c10d_blocking"]["events"] == 6
    assert _timed(cases["c10d_blocking_keywords"]) == [("all_reduce", 64, 1.0, 1.0, 1)]


def test_a_funcol_op_is_timed_from_its_issue_to_its_wait_and_stalls_for_the_wait(cases: dict) -> None:
    assert _timed(cases["funcol_issue_then_wait"]) == [("all_reduce", 64, 2.0, 1.0, seq) for seq in (1, 2, 3)]
    assert cases["funcol_issue_then_wait"]["events"] == 9
    # waited inside its own call (gather_dim 1: torch concatenates after the wait): the inner wait's
    # events, not the call's return; bytes the output's (4 ranks)
    assert _timed(cases["funcol_nested_wait"]) == [("all_gather", 256, 2.0, 1.0, 1)]
    assert cases["funcol_nested_wait"]["events"] == 3


def test_fsdp2s_blocking_comms_are_their_two_events_with_the_stall_unknown(cases: dict) -> None:
    # FSDP2 issues on its own stream: the events bound the op; what the compute stream lost is not seen
    case = cases["fsdp_blocking"]
    assert case["errors"] == [] and case["stats"] == {} and case["events"] == 4
    assert [(r["op"], r["nbytes"], round((r["t_end"] - r["t_start"]) * 1e3, 6), r["wait_s"], r["source"])
            for r in case["records"]] == [("all_gather", 256, 1.0, None, "fsdp_comm"),
                                          ("reduce_scatter", 256, 1.0, None, "fsdp_comm")]
    # async (unshard(async_op=True)): the general path, timed to its Work's wait (issued both, then waited)
    assert _timed(cases["fsdp_async"]) == [("all_gather", 256, 3.0, 1.0, 1), ("reduce_scatter", 256, 4.0, 1.0, 2)]


def test_the_general_path_and_a_failed_call_are_unchanged(cases: dict) -> None:
    # async c10d on CUDA still takes the general path (its Work's wait): the same rules
    assert _timed(cases["c10d_async_wait"]) == [("all_reduce", 64, 2.0, 1.0, 1)]
    # a call that raises records nothing and leaves nothing behind for the next op
    assert _timed(cases["c10d_blocking_raises_then_one"]) == [("all_reduce", 64, 1.0, 1.0, 2)]


def test_an_event_that_cannot_be_made_costs_the_op_its_record_never_the_call(cases: dict) -> None:
    case = cases["events_fail"]
    assert case["records"] == [] and case["events"] == 0
    assert len(case["errors"]) == 3 and all("an event could not be made" in e for e in case["errors"])


def test_both_forms_record_the_same() -> None:
    if not native._USABLE:
        pytest.skip("the C sites are not built here")
    c, py = _worker("c"), _worker("python")
    assert c["fsdp_blocking"]["records"][0]["wait_s"] is None is py["fsdp_blocking"]["records"][0]["wait_s"]
    skip = {"_form", "events_fail", "fsdp_blocking"}
    assert {k: _timed(v) for k, v in c.items() if k not in skip} == {k: _timed(v) for k, v in py.items() if k not in skip}
