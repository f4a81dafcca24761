"""DDP's buckets recorded in torch's dispatcher (agent/instrument/_ddp_kernel.h), DDP's built-in all-reduce
left in place, against the truths comm_ddp's comm hook is held to and against the hook itself: the same job
on 2 gloo ranks through a real telemetry core (tests/workers/hooks_ddp_kernel.py), once per form. Every
gradient byte in every step, the same sequence numbers and steps, an injected late backward seen as the
early rank's blocked time, a user's all-reduce inside backward recorded once (by its site), each step's
breakdown summing to its wall time, nothing after detach and no comm hook on the model."""

from __future__ import annotations

import math
import os

import pytest

from tests.test_hooks_gloo import run_worker
from tests.test_zerocode_frameworks import ddp_in_dispatcher

pytestmark = pytest.mark.gloo


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    if not ddp_in_dispatcher():
        pytest.skip("the dispatcher kernels are not built here (tests/test_hooks_funcol_kernels.py says whether "
                    "they must be)")
    out = {"kernel": run_worker("hooks_ddp_kernel", tmp_path_factory.mktemp("kernel"))}
    os.environ["MESHSCOPE_DDP_KERNEL"] = "0"  # read by the worker's process (run_worker copies os.environ)
    try:
        out["hook"] = run_worker("hooks_ddp_kernel", tmp_path_factory.mktemp("hook"))
    finally:
        del os.environ["MESHSCOPE_DDP_KERNEL"]
    return out


def buckets(r: dict) -> list[dict]:
    return [x for x in r["records"] if x["source"] == "ddp_comm_hook"]


def test_each_form_is_the_one_asked_for(forms: dict[str, list[dict]]) -> None:
    for r in forms["kernel"]:
        assert r["kernel"] and r["comm_hooks"] == []  # DDP keeps its built-in all-reduce
    for r in forms["hook"]:
        assert not r["kernel"] and r["comm_hooks"] == ["_HookState"]
    for r in forms["kernel"] + forms["hook"]:
        assert r["errors"] == 0 and not {k for k in r["stats"] if "error" in k or "dropped" in k}, r["stats"]
        assert r["records_after_detach"] == 0


def test_every_gradient_byte_of_every_step_with_the_hooks_numbers(forms: dict[str, list[dict]]) -> None:
    for kernel, hook in zip(forms["kernel"], forms["hook"]):
        steps = kernel["steps_n"] + 2
        for r in (kernel, hook):
            by_step: dict[int, int] = {}
            for x in buckets(r):
                assert x["op"] == "all_reduce" and x["t_start"] <= x["t_end"] and x["wait_s"] >= 0
                by_step[x["step"]] = by_step.get(x["step"], 0) + x["bytes"]
            # step 0: DDP's one-off bucket order; then several 8 MiB buckets: every gradient once per step
            assert by_step == {i: r["param_bytes"] for i in range(steps)}, by_step
        shape = [[(x["step"], x["seq"], x["bytes"]) for x in buckets(r)] for r in (kernel, hook)]
        assert shape[0] == shape[1]
        # the user's all-reduces (the loss after each step, one inside step 1's backward): the site's, once,
        # numbered on the same group counter as the buckets
        for r in (kernel, hook):
            own = [(x["step"], x["bytes"]) for x in r["records"] if x["source"] == "c10d"]
            assert sorted(own) == sorted([(i, 4) for i in range(steps)] + [(1, 12)]), own
            seqs = sorted(x["seq"] for x in r["records"])
            assert seqs == list(range(1, len(seqs) + 1))


def test_a_late_backward_is_the_early_ranks_blocked_time(forms: dict[str, list[dict]]) -> None:
    """Rank 1 starts backward 0.4 s late in the last two steps: rank 0 cannot complete its buckets before
    rank 1 sends them, so it reports at least most of the delay as blocked in the reducer, never more than its
    whole backward; rank 1 finds its peer waiting and reports much less."""
    for form, (early, late) in forms.items():
        first = early["steps_n"]
        for step in (first, first + 1):
            waited = sum(x["wait_s"] for x in buckets(early) if x["step"] == step)
            peer = sum(x["wait_s"] for x in buckets(late) if x["step"] == step)
            assert 0.75 * early["delay_s"] <= waited <= early["backward_s"][step], (form, step, waited)
            assert peer < 0.5 * waited, (form, step, peer, waited)


def test_each_steps_breakdown_sums_to_its_wall_time(forms: dict[str, list[dict]]) -> None:
    for r in forms["kernel"]:
        for s in r["steps"]:
            parts = s["compute_s"] + s["exposed_comm_s"] + s["other_s"]
            assert math.isclose(parts, s["wall_s"], abs_tol=1e-6), s
            assert s["n_collectives"] == len([x for x in r["records"] if x["step"] == s["step"]])
            exposed = sum(x["wait_s"] for x in r["records"] if x["step"] == s["step"])
            assert math.isclose(s["exposed_comm_s"], exposed, abs_tol=1e-6), s
