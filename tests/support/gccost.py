"""What tracing costs the training thread over a long run, the cyclic garbage collector's share included.

``hookcost.per_call`` pauses the GC inside its blocks (its pauses were the largest noise there), so it
cannot see what the hooks' allocations cost the GC. That cost is real and lands on the training thread:
whatever waits for the flusher (every completed op and ended step, up to ``flush_interval_s``) and is still
tracked by the GC when it is collected gets promoted to the oldest generation, and the full collections
that promotion brings on run in whichever thread allocates next. So this runs one long loop per arm, the GC
on as in any job: ``ops`` blocking all-reduces on the ``fake`` backend, a step (begin, a phase, end) every
``ops_per_step`` ops, the real telemetry core and its flusher, untraced and traced arms alternating
``rounds`` times; the training thread's CPU per op and the time the GC ran on it, per generation.

    sustained(ops=100_000, rounds=3)  # in a process of its own (the fake group is process-wide)
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import threading
import time
from typing import Any


def sustained(*, ops: int = 100_000, rounds: int = 3, ops_per_step: int = 10) -> dict[str, Any]:
    """``{"untraced_cpu_us", "traced_cpu_us"}`` (per op, one figure per round), ``overhead_cpu_us`` (the
    median over rounds of traced − untraced), ``gc_us`` (per op, by generation, median over rounds, per
    arm) and what was recorded (``dropped_records``, ``errors``)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    tel = Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(prefix="meshscope-gccost-"), run="gc"),
                    rank=0, world_size=2)
    tracer = CollectiveTracer(tel)
    t = torch.ones(16)
    main = threading.get_ident()
    in_gc: dict[int, float] = {}
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if threading.get_ident() != main:  # the flusher's own collections are not the training thread's
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gen = info["generation"]
            in_gc[gen] = in_gc.get(gen, 0.0) + time.perf_counter() - started[0]

    def arm(traced: bool) -> tuple[float, dict[int, float]]:
        if traced:
            tracer.attach(None)
        in_gc.clear()
        step = 0
        c0 = time.thread_time()
        for i in range(ops):
            if traced and i % ops_per_step == 0:
                tel.begin_step(step)
                tel.push_phase("compute")
            dist.all_reduce(t)
            if traced and i % ops_per_step == ops_per_step - 1:
                tel.end_step()
                step += 1
        cpu = time.thread_time() - c0
        if traced:
            tracer.detach()
        return 1e6 * cpu / ops, {gen: 1e6 * s / ops for gen, s in in_gc.items()}

    runs: dict[bool, list] = {False: [], True: []}
    gc.callbacks.append(on_gc)
    try:
        arm(False)  # warm-up: the first loop pays for caches and lazy imports
        for _ in range(rounds):
            for traced in (False, True):
                runs[traced].append(arm(traced))
    finally:
        gc.callbacks.remove(on_gc)
        tel.close()
        dist.destroy_process_group()

    def gc_median(arm_runs: list) -> dict[str, float]:
        return {str(gen): round(statistics.median(r[1].get(gen, 0.0) for r in arm_runs), 3) for gen in (0, 1, 2)}

    untraced, traced = [r[0] for r in runs[False]], [r[0] for r in runs[True]]
    return {
        "ops": ops, "rounds": rounds, "ops_per_step": ops_per_step,
        "untraced_cpu_us": [round(x, 2) for x in untraced],
        "traced_cpu_us": [round(x, 2) for x in traced],
        "overhead_cpu_us": round(statistics.median(b - a for a, b in zip(untraced, traced)), 2),
        "gc_us": {"untraced": gc_median(runs[False]), "traced": gc_median(runs[True])},
        "dropped_records": tel.dropped_records, "errors": tel.errors,
    }


def sustained_isolated(*, ops: int = 100_000, rounds: int = 3, timeout_s: float = 300.0) -> dict[str, Any]:
    """``sustained`` in a fresh interpreter."""
    from tests.support.hookcost import run_isolated

    return run_isolated("from tests.support.gccost import sustained; "
                        f"result = sustained(ops={ops}, rounds={rounds})", what="sustained cost", timeout_s=timeout_s)
