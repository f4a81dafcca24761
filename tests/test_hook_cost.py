"""The telemetry hot path stays at its floor: each traced op's cost to the calling thread, as a ratio to
the untraced op, must stay under twice the goal's ratio (bench/hooks_overhead.py prints the figures).

A ratio, not microseconds, so the check follows the machine's speed: the goal is ≤ 2 µs of training-
thread CPU per collective / P2P op (≤ 0.3 µs per pipeline span) on the 2-core dev VM, where the untraced
ops below cost ``UNTRACED_US`` (``tests.support.hookcost.per_call``, median of 15 ABBA blocks, load
average < 1, torch 2.13 CPU). With the C sites (agent/instrument/_hot.c) the paths measure 0.9-2.1 µs
there, the span 0.1-0.4 µs; the Python form of the sites (``MESHSCOPE_NATIVE=0``) 1.8-4.5 µs.

The functional collective (issue + ``wait_tensor``: two patched entry points amid tens of µs of torch's
own Python; C sites since 2026-11-27 22:00 UTC, 7.4-9.0 µs against its floor's 5.1-5.3) is above its goal, and its ratio to the untraced op does not follow
the machine: on the same VM it read 2.4 µs on a 33 µs op one evening and 11-13 µs on a 66 µs op the next
morning, its barest recording wrapper (``floor_funcol``) 1.6-2.1 and 4.3-5.8 µs. It is guarded against
that floor, measured in the same run: at most ``FLOOR_LIMIT`` times it (1.2-2.6× in those runs; the
wrappers before the fast sites cost 3.4-5×). The floor is measured in a process of its own, and a process
lands in one of two states that do not follow the traced path's (seen on 2026-11-27: the floor 1.96 µs
twice in one suite run and 4.0-5.2 in three runs right after, the traced path 13.8-14.7 in all): so a path
fails only when it is also above ``UNTRACED_SHARE`` of its own untraced op, measured in its own process
(0.16-0.22 that day; the bug that resolved DTensor's designator per call read 40 / 67 µs = 0.6). A path
that exceeds its limit is measured once more before failing: one noisy block set on a shared CI machine
must not fail the suite, a real regression fails both times.
"""

from __future__ import annotations

import math

import pytest

from tests.support.hookcost import per_call_isolated

# serial: per-op CPU cost against a fixed goal: a neighbour's load would be read as the hook's
pytestmark = pytest.mark.serial

GOAL_US = {"pipeline_span": 0.3}  # every other path: 2 µs
# Paths above their goal, guarded against their floor in the same run instead (see the module docstring).
FLOOR_LIMIT = {"funcol_all_reduce_wait": ("floor_funcol", 4.0),
               # As DTensor calls it, group=(mesh, mesh_dim): 40 µs when each call resolved its new tuple
               "funcol_mesh_dim_all_reduce_wait": ("floor_funcol", 4.0)}
UNTRACED_SHARE = 0.25
# The untraced op on the dev VM (see the module docstring): what a goal in µs is a ratio of.
UNTRACED_US = {
    "c10d_all_reduce_blocking": 3.9,
    "c10d_all_reduce_async_wait": 4.0,
    "fsdp_all_gather": 5.2,
    "fsdp_reduce_scatter": 6.8,
    "p2p_isend_wait": 2.4,
    "p2p_irecv_wait": 2.3,
    # As torch.distributed.pipelining sends: a P2POp built and sent in a batch of one (8.3-9.1 µs on a
    # morning when the blocking all-reduce read 5.1: scaled to its 3.9)
    "p2p_batch_isend_wait": 6.4,
    "p2p_batch_irecv_wait": 6.4,
    "ddp_comm_hook": 9.3,  # the hook on the fake backend behind a proxy with a real future (hookcost_ddp.ddp_hook_path)
    # DDP's bucket in the dispatcher (a backward of 20 all-reduces, per all-reduce: 4.1 µs on a morning when
    # the blocking all-reduce read 3.9); measured where the kernels are built
    "ddp_kernel_bucket": 4.1,
    "pipeline_span": 0.084,
}


def bench_hooks_overhead():
    """bench/hooks_overhead.py as a module (bench/ is a folder of scripts)."""
    import importlib
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("bench.hooks_overhead")


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
        limit = 2 * GOAL_US.get(path, 2.0) / untraced
        ratio = row["overhead_cpu_us"] / row["without_cpu_us"]
        if ratio > limit:
            bad[path] = (f"{row['overhead_cpu_us']:.2f} µs on a {row['without_cpu_us']:.2f} µs op: ratio {ratio:.3f} "
                         f"> limit {limit:.3f}")
    for path, (floor, times) in FLOOR_LIMIT.items():
        row, under = costs.get(path), costs.get(floor)
        if (row is not None and under is not None and row["overhead_cpu_us"] > times * under["overhead_cpu_us"]
                and row["overhead_cpu_us"] > UNTRACED_SHARE * row["without_cpu_us"]):
            bad[path] = (f"{row['overhead_cpu_us']:.2f} µs > {times} × its floor's "
                         f"{under['overhead_cpu_us']:.2f} µs and > {UNTRACED_SHARE} × its "
                         f"{row['without_cpu_us']:.2f} µs op")
    return bad


def paths_of(names) -> list[str]:
    """The paths to measure for ``names``: each, and the floor a floor-guarded one is compared with."""
    out = list(names)
    for path, (floor, _) in FLOOR_LIMIT.items():
        if path in out and floor not in out:
            out.append(floor)
    return out


@pytest.mark.timeout(600)
def test_each_traced_op_costs_at_most_twice_the_goal() -> None:
    costs = measure(paths_of([*UNTRACED_US, *FLOOR_LIMIT]))
    assert costs["_recorded"] == {"dropped_records": 0, "errors": 0}
    bad = over_limit(costs)
    if bad:  # once more, only what failed
        bad = over_limit(measure(paths_of(bad)))
    assert not bad, bad


def test_the_limit_is_relative_to_the_untraced_op() -> None:
    # A machine twice as slow: both costs double, the ratio and the verdict do not move.
    fast = {"c10d_all_reduce_blocking": {"overhead_cpu_us": 1.5, "without_cpu_us": 3.9}}
    slow = {"c10d_all_reduce_blocking": {"overhead_cpu_us": 3.0, "without_cpu_us": 7.8}}
    assert over_limit(fast) == over_limit(slow) == {}
    # A regression to 5 µs on the dev VM's 3.9 µs op is above 2 × (2 / 3.9).
    regressed = {"c10d_all_reduce_blocking": {"overhead_cpu_us": 5.0, "without_cpu_us": 3.9}}
    assert list(over_limit(regressed)) == ["c10d_all_reduce_blocking"]


def test_the_functional_collective_is_held_to_its_floor_in_the_same_run() -> None:
    slow_morning = {"funcol_all_reduce_wait": {"overhead_cpu_us": 13.4, "without_cpu_us": 66.6},
                    "floor_funcol": {"overhead_cpu_us": 5.5, "without_cpu_us": 67.5}}
    assert over_limit(slow_morning) == {}
    regressed = {"funcol_all_reduce_wait": {"overhead_cpu_us": 9.0, "without_cpu_us": 33.0},
                 "floor_funcol": {"overhead_cpu_us": 1.8, "without_cpu_us": 33.0}}
    assert list(over_limit(regressed)) == ["funcol_all_reduce_wait"]
    # The floor's process in its fast state, the path's in its slow one (a suite run of 2026-11-27): passes.
    split = {"funcol_mesh_dim_all_reduce_wait": {"overhead_cpu_us": 13.76, "without_cpu_us": 68.5},
             "floor_funcol": {"overhead_cpu_us": 1.96, "without_cpu_us": 66.0}}
    assert over_limit(split) == {}
    # The designator resolved per call (40 µs a TP op): fails whatever state the floor's process is in.
    per_call = {"funcol_mesh_dim_all_reduce_wait": {"overhead_cpu_us": 40.0, "without_cpu_us": 67.0},
                "floor_funcol": {"overhead_cpu_us": 4.5, "without_cpu_us": 66.0}}
    assert list(over_limit(per_call)) == ["funcol_mesh_dim_all_reduce_wait"]
    assert paths_of(["funcol_all_reduce_wait"]) == ["funcol_all_reduce_wait", "floor_funcol"]


def test_the_profiler_ratio_in_same_process_events_ignores_each_process_state() -> None:
    # bench/hooks_overhead.attribute: a TP step (3 funcol ops, one boundary, 400 profiler events). The
    # profiler's process landing in a state 1.8x slower moves the µs ratio from 10x to 18x; counted in
    # profiler events of each part's own process, it stays 10x, whichever process ran slow.
    attribute = bench_hooks_overhead().attribute

    def run(profiler_state: float, funcol_state: float) -> dict:
        calls = {"funcol_mesh_dim_all_reduce_wait": {"overhead_cpu_us": 10.0 * funcol_state,
                                                     "profiler_event_us": 1.0 * funcol_state},
                 "pipeline_span": {"overhead_cpu_us": 0.1, "profiler_event_us": 1.0},
                 "step_boundary": {"overhead_cpu_us": 10.0, "profiler_event_us": 1.0},
                 "profiler_aten_op": {"overhead_cpu_us": 1.0 * profiler_state}}
        steps = {"tp": {"ops_by_source": {"funcol/all_reduce": 3}, "spans_per_step": 0, "step_cpu_ms": 10.0,
                        "profiler_events_per_step": 400}}
        attribute(steps, calls)
        return steps["tp"]

    base, slow_profiler, slow_funcol = run(1.0, 1.0), run(1.8, 1.0), run(1.0, 1.8)
    assert base["profiler_over_meshscope_attributed"] == 10.0
    assert slow_profiler["profiler_over_meshscope_attributed"] == 18.0  # what the µs ratio read
    assert base["meshscope_in_profiler_events"] == 40.0
    assert (base["profiler_over_meshscope_same_process"] == slow_profiler["profiler_over_meshscope_same_process"]
            == slow_funcol["profiler_over_meshscope_same_process"] == 10.0)


def test_ddp_buckets_are_attributed_at_the_cost_of_the_path_that_recorded_them() -> None:
    # Where the arms ran DDP's bucket kernel (its path measured), a bucket costs that path; in the Python
    # form's attribution (no kernels there) and where it was not measured, the comm hook's.
    attribute = bench_hooks_overhead().attribute
    calls = {"ddp_comm_hook": {"overhead_cpu_us": 2.0, "profiler_event_us": 1.0},
             "c10d_all_reduce_blocking": {"overhead_cpu_us": 1.0, "profiler_event_us": 1.0},
             "step_boundary": {"overhead_cpu_us": 4.0, "profiler_event_us": 1.0},
             "pipeline_span": {"overhead_cpu_us": 0.1, "profiler_event_us": 1.0},
             "profiler_aten_op": {"overhead_cpu_us": 0.5}}

    def run(extra: dict, suffix: str = "") -> float:
        steps = {"ddp": {"ops_by_source": {"ddp_comm_hook/all_reduce": 6, "c10d/all_reduce": 1},
                         "spans_per_step": 0, "step_cpu_ms": 10.0, "profiler_events_per_step": 400}}
        attribute(steps, {**calls, **extra}, suffix=suffix)
        return steps["ddp"]["attributed_us" + suffix]

    kernel = {"ddp_kernel_bucket": {"overhead_cpu_us": 0.5, "profiler_event_us": 1.0}}
    assert run({}) == 6 * 2.0 + 1.0 + 4.0
    assert run(kernel) == 6 * 0.5 + 1.0 + 4.0
    assert run(kernel, suffix="_python") == 6 * 2.0 + 1.0 + 4.0


@pytest.mark.timeout(300)
def test_the_same_op_is_measured_under_the_profiler_beside_meshscope() -> None:
    # What the benchmark prints beside each path: torch.profiler on the same untraced op, in the path's
    # process, and the events it records per op (the fake backend's all-reduce: one, c10d::allreduce_).
    costs = per_call_isolated(calls=400, blocks=3, paths=("c10d_all_reduce_blocking", "step_boundary"), profiled=True)
    row = costs["c10d_all_reduce_blocking"]
    assert row["profiler_events"] == 1.0
    # its cost (0.5-1.2 µs on the dev VM) is a median of 3 short blocks here, which a busy machine can push to
    # either side of zero: measured and finite, its value is the benchmark's to judge
    assert math.isfinite(row["profiler_us"]) and len(row["profiler_iqr_us"]) == 2
    assert "profiler_us" not in costs["step_boundary"]  # the profiler has no step boundary to compare
    bench_hooks_overhead().compare_per_op(costs)
    mine = row["overhead_cpu_us"]  # a median of 3 noisy blocks: may read <= 0 on a busy machine
    assert row["profiler_over_meshscope"] == (round(row["profiler_us"] / mine, 2) if mine > 0 else None)
    assert "profiler_over_meshscope" not in costs["step_boundary"]
