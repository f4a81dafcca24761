"""The functional collectives' C sites (agent/instrument/_hot_funcol.h, ``native.funcol_site``) over a tracer's
life, in a process of their own (tests/workers/hooks_funcol_cform.py): what they record is checked against
the Python sites op for op by tests/test_hooks_fastpaths.py, and torch.compile'd code through them is one
graph there too."""

from __future__ import annotations

import pytest

from tests.conftest import sites_worker


C, PY = "builtin_function_or_method/builtin_function_or_method", "function/function"


@pytest.fixture(scope="module")
def life() -> dict:
    from meshscope.agent.instrument import native

    if not native._USABLE:
        pytest.skip("the C sites are not built here")
    return sites_worker("hooks_funcol_cform.py", "c")


def test_the_c_sites_come_in_once_torch_compile_is_imported(life: dict) -> None:
    # Nothing imports torch._dynamo before the first funcol op: the Python sites until then, the C sites from
    # the call after it, and every op recorded once, in order, across the change.
    assert life["dynamo_at_attach"] is False
    assert life["forms"] == [PY, PY, C, C]
    assert life["a"] == {"records": [["all_reduce", n, 64] for n in (1, 2, 3)], "errors": [], "pending": 0}


def test_a_second_tracer_is_refused_while_the_first_is_attached(life: dict) -> None:
    assert "already patched by another CollectiveTracer" in life["second_tracer"]


def test_detach_restores_torch_and_unbinds_and_a_kept_reference_calls_through(life: dict) -> None:
    assert life["restored"] is True and life["bound_after_detach"] == []
    assert life["kept_call"] == [1.0, 1.0]  # torch's all-reduce on the fake backend (which leaves the data)
    assert life["a_after_detach"] == 3  # nothing recorded for the first tracer after its detach


def test_the_next_tracer_binds_them_again(life: dict) -> None:
    # One site per name per process (torch.compile's registration is for good), bound to the new tracer at its
    # attach; disabled, it records nothing.
    assert life["b_form"] == C
    assert life["b"] == {"records": [["all_reduce", 1, 64]], "errors": [], "pending": 0}
    assert life["sites"] == ["all_gather_single", "all_reduce", "all_to_all_single", "broadcast",
                             "reduce_scatter_single", "wait_tensor"]
