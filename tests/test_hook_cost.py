"""The telemetry hot path stays at its floor: each traced op's cost to the calling thread, as a ratio to
the untraced op, must stay under twice the goal's ratio (bench/hooks_overhead.py prints the figures).

A ratio, not microseconds, so the check follows the machine's speed: the goal is ≤ 2 µs of training-
thread CPU per collective / P2P op (≤ 0.3 µs per pipeline span) on the 2-core dev VM, where the untraced
ops below cost ``UNTRACED_US`` (``meshscope.testing.hookcost.per_call``, median of 15 ABBA blocks, load
average < 1, torch 2.13 CPU). The functional collective (issue + ``wait_tensor``: two patched entry
points around 32 µs of torch's own Python) measures 3.6-6.5 µs between runs, above its goal, where the
barest Python recording wrappers of the same two calls (``floor_funcol``) already cost 1.2-1.8 µs: it is
guarded at 1.5× its cost before the fast sites (4.05 µs) instead, so that it cannot get worse unnoticed. A path that exceeds its limit is measured once
more before failing: one noisy block set on a shared CI machine must not fail the suite, a real
regression fails both times.
"""

from __future__ import annotations

import pytest

from meshscope.testing.hookcost import per_call_isolated

GOAL_US = {"pipeline_span": 0.3}  # every other path: 2 µs
# Paths measured above their goal on the dev VM (µs): guarded at 1.5× this rather than 2× the goal.
ABOVE_GOAL_US = {"funcol_all_reduce_wait": 4.05}
# The untraced op on the dev VM (see the module docstring): what a goal in µs is a ratio of.
UNTRACED_US = {
    "c10d_all_reduce_blocking": 3.9,
    "c10d_all_reduce_async_wait": 4.0,
    "funcol_all_reduce_wait": 32.0,
    "fsdp_all_gather": 5.2,
    "fsdp_reduce_scatter": 6.8,
    "p2p_isend_wait": 2.4,
    "p2p_irecv_wait": 2.3,
    "ddp_comm_hook": 9.3,  # the hook on the fake backend behind a proxy with a real future (hookcost._ddp_hook)
    "pipeline_span": 0.084,
}


def measure(paths: list[str]) -> dict:
    # Each path in its own process (per_call initialises a fake process group, and no other may exist
    # here; and a path's figure must not depend on the paths measured before it).
    return per_call_isolated(calls=1000, blocks=9, paths=tuple(paths))


def over_limit(costs: dict) -> dict[str, str]:
    bad = {}
    for path, untraced in UNTRACED_US.items():
        row = costs.get(path)
        if row is None:
            continue
        limit = max(2 * GOAL_US.get(path, 2.0), 1.5 * ABOVE_GOAL_US.get(path, 0.0)) / untraced
        ratio = row["overhead_cpu_us"] / row["without_cpu_us"]
        if ratio > limit:
            bad[path] = (f"{row['overhead_cpu_us']:.2f} µs on a {row['without_cpu_us']:.2f} µs op: ratio {ratio:.3f} "
                         f"> limit {limit:.3f}")
    return bad


@pytest.mark.timeout(600)
def test_each_traced_op_costs_at_most_twice_the_goal() -> None:
    costs = measure(list(UNTRACED_US))
    assert costs["_recorded"] == {"dropped_records": 0, "errors": 0}
    bad = over_limit(costs)
    if bad:  # once more, only what failed
        bad = over_limit(measure(list(bad)))
    assert not bad, bad


def test_the_limit_is_relative_to_the_untraced_op() -> None:
    # A machine twice as slow: both costs double, the ratio and the verdict do not move.
    fast = {"c10d_all_reduce_blocking": {"overhead_cpu_us": 1.5, "without_cpu_us": 3.9}}
    slow = {"c10d_all_reduce_blocking": {"overhead_cpu_us": 3.0, "without_cpu_us": 7.8}}
    assert over_limit(fast) == over_limit(slow) == {}
    # A regression to 5 µs on the dev VM's 3.9 µs op is above 2 × (2 / 3.9).
    regressed = {"c10d_all_reduce_blocking": {"overhead_cpu_us": 5.0, "without_cpu_us": 3.9}}
    assert list(over_limit(regressed)) == ["c10d_all_reduce_blocking"]
