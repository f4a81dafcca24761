"""Shared harness for the hook workers (``tests/workers/hooks_*.py``): spawn gloo ranks, read the flight
recorder, reduce a ``torch.profiler`` trace to per-step totals per op, and check that ``detach`` restored
every original.

Profiler ↔ tracer mapping on gloo (measured on torch 2.13): every gloo collective / P2P op shows up as
  - an issue event on the calling thread, named after the c10d op (``c10d::allreduce_``,
    ``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``, ``c10d::send``, ``c10d::recv_``,
    ``c10d::broadcast_``, ``c10d::barrier``; functional collectives add an outer ``_c10d_functional::*``
    that contains the ``c10d::`` one), and
  - a ``gloo:<op>`` range: on a gloo worker thread from the start of execution to completion for
    collectives; on the calling thread from issue to the return of ``Work.wait`` for ``gloo:send`` /
    ``gloo:recv`` (gloo P2P completes in ``wait``).
gloo runs ``reduce_scatter_single`` as an all-reduce of the whole input, so FSDP's reduce-scatters appear
as ``gloo:all_reduce`` (in the flight recorder as well).

The tracer records issue → observed completion. The profiler's equivalent is issue-event start →
``gloo:*`` end (Σ over a step does not depend on how issues and ranges pair up; gloo's queue is FIFO);
``gloo:*`` durations alone ("exec") leave out the time an op queued behind earlier ones. For functional
collectives (TP) completion is observed when ``wait_tensor`` returns, which on a loaded machine is up to
tens of ms after gloo's range ends (the waiter's wake-up): the equivalent there is
``_c10d_functional::<op>`` start → ``_c10d_functional::wait_tensor`` end. All of them are reported.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable
from tests.support.harness import free_port  # noqa: E402,F401

# gloo range name → (issue event names, the tracer op(s) it corresponds to)
GLOO_TO_ISSUE = {
    "gloo:all_reduce": ("c10d::allreduce_", "c10d::_reduce_scatter_base_"),
    "gloo:all_gather": ("c10d::_allgather_base_", "c10d::allgather_", "c10d::allgather_into_tensor_coalesced_"),
    "gloo:broadcast": ("c10d::broadcast_", "c10d::_broadcast_coalesced"),
    "gloo:barrier": ("c10d::barrier",),
    "gloo:send": ("c10d::send",),
    "gloo:recv": ("c10d::recv_",),
}
# tracer op → gloo range name (reduce_scatter is emulated by an all-reduce on gloo)
OP_TO_GLOO = {"all_reduce": "gloo:all_reduce", "reduce_scatter": "gloo:all_reduce",
              "all_gather": "gloo:all_gather", "broadcast": "gloo:broadcast", "barrier": "gloo:barrier",
              "send": "gloo:send", "recv": "gloo:recv"}
_FUNCOL_NOT_ISSUE = frozenset({"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd"})
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Byte": 1, "Char": 1}


def spawn(fn: Callable, *, world_size: int = 2, args: tuple = ()) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_run_then_exit, args=(fn, world_size, free_port(), *args), nprocs=world_size, join=True)


def _run_then_exit(rank: int, fn: Callable, *args: Any) -> None:
    """Run one rank, then leave without interpreter finalization, as the trainer's ranks do: torch's gloo
    teardown race (``trainer.train.exit_without_finalization``) aborted hooks_c10d with SIGABRT after
    every result was written (3 of 8 runs here, and in CI). An exception still propagates to mp.spawn."""
    from meshscope.trainer.train import exit_without_finalization

    fn(rank, *args)
    exit_without_finalization(0)


def init(rank: int, world_size: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 ranks share a small machine: no intra-op oversubscription
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def write(out: str, rank: int, result: dict) -> None:
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, indent=1, sort_keys=True, default=str))


# ------------------------------------------------------------------------------------ flight recorder
def fr_entries() -> list[dict]:
    import torch

    return json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False)).get("entries", [])


def fr_last_id() -> int:
    entries = fr_entries()
    return max((e["record_id"] for e in entries), default=-1)


def fr_summary(after_id: int) -> dict[str, dict[str, int]]:
    """Per profiling name: count and bytes (output buffer) of the entries recorded after ``after_id``."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for e in fr_entries():
        if e["record_id"] <= after_id:
            continue
        row = out[e["profiling_name"]]
        row["count"] += 1
        for size, dtype in zip(e.get("output_sizes", []), e.get("output_dtypes", [])):
            n = 1
            for d in size:
                n *= d
            row["bytes"] += n * _DTYPE_BYTES.get(dtype, 4)
    return dict(out)


def tracer_as_fr(records: list[dict]) -> dict[str, dict[str, int]]:
    """The tracer's records in flight-recorder terms (P2P is not in gloo's flight recorder)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for r in records:
        name = OP_TO_GLOO.get(r["op"])
        if name is None or r["op"] in ("send", "recv"):
            continue
        out[name]["count"] += 1
        out[name]["bytes"] += r["nbytes"]
    return dict(out)


# ---------------------------------------------------------------------------------------- profiler
def profiled_steps(step: Callable[[], Any], rec: Any, *, warmup: int, steps: int) -> tuple:
    """Run ``warmup`` steps, then ``steps`` steps under the profiler, each in a ``hooks_step_<i>`` window.
    Returns (per-step tracer records, all measured records, flight-recorder summary, the profiler)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        step()
    fr_before = fr_last_id()
    n_before = len(rec.collectives)
    per_step: list[list[dict]] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            n0 = len(rec.collectives)
            with record_function(f"hooks_step_{i}"):
                step()
            per_step.append(rec.collectives[n0:])
    return per_step, rec.collectives[n_before:], fr_summary(fr_before), prof


def profiler_step_totals(prof: Any, n_steps: int, *, window_prefix: str = "hooks_step_",
                         events: list | None = None, first_step: int = 0) -> list[dict[str, dict[str, float]]]:
    """Per step (``record_function(f"{window_prefix}<i>")`` windows): per gloo range name, count,
    ``exec_s`` (Σ range durations) and ``issue_to_done_s`` (Σ issue start → range end, paired in order).
    ``events`` (objects with ``name`` and ``time_range``) replaces ``prof.events()``, e.g. events loaded
    from an exported Chrome trace (see ``chrome_trace_events``)."""
    events = list(prof.events()) if events is None else events
    windows = {}
    for e in events:
        if e.name.startswith(window_prefix):
            windows[int(e.name.rsplit("_", 1)[1])] = (e.time_range.start, e.time_range.end)
    result = []
    for i in range(first_step, first_step + n_steps):
        lo, hi = windows[i]
        inside = [e for e in events if lo <= e.time_range.start <= hi]
        step: dict[str, dict[str, float]] = {}
        for gloo_name, issue_names in GLOO_TO_ISSUE.items():
            ranges = sorted((e for e in inside if e.name == gloo_name), key=lambda e: e.time_range.start)
            if not ranges:
                continue
            issues = sorted((e for e in inside if e.name in issue_names), key=lambda e: e.time_range.start)
            paired = len(issues) == len(ranges)
            step[gloo_name] = {
                "count": len(ranges),
                "issue_count": len(issues),
                "exec_s": sum(e.time_range.elapsed_us() for e in ranges) / 1e6,
                "issue_to_done_s": (
                    sum(r.time_range.end - s.time_range.start for s, r in zip(issues, ranges)) / 1e6
                    if paired else float("nan")),
            }
        # Functional collectives: issue = the outer ``_c10d_functional::<op>`` range, observed completion =
        # the end of the ``_c10d_functional::wait_tensor`` range that waited for it (paired in order).
        f_issues = sorted((e for e in inside if e.name.startswith("_c10d_functional::")
                           and e.name not in _FUNCOL_NOT_ISSUE), key=lambda e: e.time_range.start)
        f_waits = sorted((e for e in inside if e.name == "_c10d_functional::wait_tensor"),
                         key=lambda e: e.time_range.start)
        if f_issues and "gloo:all_reduce" in step:
            step["gloo:all_reduce"]["funcol_issue_to_wait_s"] = (
                sum(w.time_range.end - s.time_range.start for s, w in zip(f_issues, f_waits)) / 1e6
                if len(f_issues) == len(f_waits) else float("nan"))
        result.append(step)
    return result


class _Range:
    __slots__ = ("start", "end")

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end

    def elapsed_us(self) -> float:
        return self.end - self.start


class _Event:
    __slots__ = ("name", "time_range")

    def __init__(self, name: str, start: float, end: float) -> None:
        self.name, self.time_range = name, _Range(start, end)


def chrome_trace_events(path: str | Path) -> list[_Event]:
    """Complete ("X") events of an exported torch.profiler Chrome trace, times in µs as in the profiler."""
    trace = json.loads(Path(path).read_text())
    return [_Event(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
            for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "name" in e]


def tracer_step_totals(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per gloo range name: count and Σ(t_end − t_start) of one step's records."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "duration_s": 0.0, "wait_s": 0.0})
    for r in records:
        name = OP_TO_GLOO[r["op"]]
        out[name]["count"] += 1
        out[name]["duration_s"] += r["t_end"] - r["t_start"]
        out[name]["wait_s"] += r["wait_s"]
    return dict(out)


# Functional collective (issue event) → the gloo range it runs as.
FUNCOL_TO_GLOO = {"_c10d_functional::all_reduce": "gloo:all_reduce",
                  "_c10d_functional::reduce_scatter_tensor": "gloo:all_reduce",
                  "_c10d_functional::all_gather_into_tensor": "gloo:all_gather",
                  "_c10d_functional::broadcast": "gloo:broadcast"}


def op_path(source: str) -> str:
    """The tracer's record source → the profiler path it is compared on: ``funcol`` (completion observed at
    ``wait_tensor``) or ``c10d`` (every other path: hooks, FSDP comms, ``torch.distributed`` calls)."""
    return "funcol" if source == "funcol" else "c10d"


def profiler_op_refs(events: list, *, window_prefix: str, first_step: int,
                     n_steps: int) -> list[dict[tuple[str, str], dict[str, float]]]:
    """Per step (``record_function(f"{window_prefix}<i>")`` windows), per (gloo range name, path): count and
    ``issue_to_done_s``, Σ over the step's ops of issue → observed completion as the profiler sees it:
      - path ``c10d``: c10d issue event start → its ``gloo:*`` range end (issues and ranges of one name
        paired in order: gloo's queue is FIFO), for every issue not made inside a functional collective;
      - path ``funcol``: ``_c10d_functional::<op>`` start → the end of the ``wait_tensor`` that waited for
        it (paired in order), the op's lifetime as the program sees it: a functional collective has no
        completion callback, so the return of its wait is the earliest a Python observer (the tracer) can
        see completion. The gloo range it contains ends 35 µs earlier in the median on this VM, more where
        the program waits late (see bench/profiler_agreement.py).
    NaN where a step's events do not pair one-to-one (an op issued in one step window, completed in the
    next)."""
    windows = {int(e.name.rsplit("_", 1)[1]): (e.time_range.start, e.time_range.end)
               for e in events if e.name.startswith(window_prefix)}
    result = []
    for i in range(first_step, first_step + n_steps):
        lo, hi = windows[i]
        inside = sorted((e for e in events if lo <= e.time_range.start <= hi), key=lambda e: e.time_range.start)
        f_issues = [e for e in inside if e.name in FUNCOL_TO_GLOO]
        f_waits = [e for e in inside if e.name == "_c10d_functional::wait_tensor"]
        step: dict[tuple[str, str], dict[str, float]] = {}

        def add(key: tuple[str, str], seconds: float) -> None:
            row = step.setdefault(key, {"count": 0, "issue_to_done_s": 0.0})
            row["count"] += 1
            row["issue_to_done_s"] += seconds

        def within_funcol(e: Any) -> bool:
            return any(f.time_range.start <= e.time_range.start and e.time_range.end <= f.time_range.end
                       for f in f_issues)

        for gloo_name, issue_names in GLOO_TO_ISSUE.items():
            ranges = [e for e in inside if e.name == gloo_name]
            issues = [e for e in inside if e.name in issue_names]
            if not ranges:
                continue
            if len(issues) != len(ranges):
                step[(gloo_name, "c10d")] = {"count": sum(not within_funcol(e) for e in issues),
                                             "issue_to_done_s": float("nan")}
                continue
            for issue, rng in zip(issues, ranges):
                if not within_funcol(issue):
                    add((gloo_name, "c10d"), (rng.time_range.end - issue.time_range.start) / 1e6)
        if len(f_issues) == len(f_waits):
            for issue, wait in zip(f_issues, f_waits):
                add((FUNCOL_TO_GLOO[issue.name], "funcol"), (wait.time_range.end - issue.time_range.start) / 1e6)
        else:
            for issue in f_issues:
                step.setdefault((FUNCOL_TO_GLOO[issue.name], "funcol"), {"count": 0, "issue_to_done_s": float("nan")})
                step[(FUNCOL_TO_GLOO[issue.name], "funcol")]["count"] += 1
        result.append(step)
    return result


def tracer_op_refs(records: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """The tracer's records of one step keyed as ``profiler_op_refs``: count and Σ(t_end − t_start)."""
    out: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: {"count": 0, "duration_s": 0.0})
    for r in records:
        row = out[(OP_TO_GLOO[r["op"]], op_path(r["source"]))]
        row["count"] += 1
        row["duration_s"] += r["t_end"] - r["t_start"]
    return dict(out)


# ------------------------------------------------------------------------------------ detach check
def patch_targets() -> dict[str, Any]:
    """Every attribute the collective tracer patches, by name → current object."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

    names = ["broadcast", "all_reduce", "reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
             "_all_gather_base", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
             "_reduce_scatter_base", "all_to_all_single", "all_to_all", "barrier", "send", "recv", "isend",
             "irecv", "batch_isend_irecv"]
    out = {}
    for n in names:
        out[f"c10d.{n}"] = getattr(c10d, n)
        out[f"dist.{n}"] = getattr(dist, n)
    out["dist._broadcast_coalesced"] = dist._broadcast_coalesced
    for n in ["all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single", "broadcast",
              "all_reduce_coalesced", "all_gather_single_coalesced", "reduce_scatter_single_coalesced",
              "wait_tensor"]:
        out[f"funcol.{n}"] = getattr(funcol, n)
    out["Work.wait"] = torch._C._distributed_c10d.Work.__dict__["wait"]
    for n, value in vars(dist.ProcessGroup).items():  # the tracer patches none of them: any change is a leak
        out[f"ProcessGroup.{n}"] = value
    return out


def changed_targets(before: dict[str, Any]) -> list[str]:
    """Names whose object differs from ``before`` (by identity)."""
    now = patch_targets()
    return sorted(k for k, v in before.items() if now[k] is not v)
