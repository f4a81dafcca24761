"""Section 7 of the GPU check: what a traced collective on CUDA tensors costs the training thread.

bench/hooks_overhead.py measures the per-op cost on CPU tensors (gloo's path, where the C sites run). On a
GPU every op takes the Python sites and the CUDA-event timing of ``agent/instrument/comm_nccl.py`` instead:
two or more events recorded per op (``torch.Event``), resolved on the telemetry's flusher thread
(``drain``). This section measures that path the same way (``tests.support.hookcost``'s A/B:
alternating blocks with and without the tracer attached, the calling thread's CPU time, the garbage
collector paused in the blocks, the median over blocks of the difference), on NCCL world size 1 with a
small tensor so that the GPU's own work is negligible. The recorder is the real telemetry core, a step
open; the traced arm flushes the tracer every ``FLUSH_EVERY`` ops, as a step's end does. On CUDA it also
times the calls the path is made of (``primitives``). The check: every path at most ``GOAL_US`` (the
per-op goal of bench/hooks_overhead.py).

``measure`` takes an initialised process group of one and a device, so that tests run it on CPU / gloo.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

from bench.gpu_check_analysis import Rendered, _fmt, md_table

GOAL_US = 2.0
FLUSH_EVERY = 10  # ops per step end (a TP layer's forward issues a few; a step, hundreds)
CALLS, BLOCKS = 400, 9
TENSOR_VALUES = 256  # 1 KiB of fp32: the op's own GPU work is negligible next to its issue
PATHS = {
    "c10d_all_reduce_blocking": "c10d all-reduce, blocking",
    "c10d_all_reduce_async_wait": "c10d all-reduce, async + wait",
    "funcol_all_reduce_wait": "functional all-reduce + wait_tensor, on a ProcessGroup",
    "funcol_mesh_dim_all_reduce_wait": "functional all-reduce + wait_tensor as DTensor calls it, (mesh, 0)",
}


def measure(*, device: Any, calls: int = CALLS, blocks: int = BLOCKS) -> dict:
    """``{"paths": {path: hookcost A/B figures}, "errors", "dropped_records", "stats"}`` for ``PATHS`` on
    ``device``, in the process group of one already initialised (NCCL on CUDA, gloo in tests)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig
    from tests.support.hookcost import _ab

    cuda = device.type == "cuda"
    world = dist.group.WORLD
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
    tel = Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(prefix="meshscope-gpu-opcost-"), run="opcost"),
                    rank=0, world_size=1)
    tel.begin_step(0)
    tel.push_phase("forward")
    tracer = CollectiveTracer(tel)
    t = torch.ones(TENSOR_VALUES, device=device)
    state = {"on": False, "n": 0}

    def drain() -> None:  # untimed: every event complete, then recorded (detach resolves what is left)
        if cuda:
            torch.cuda.synchronize()
        tracer.flush()

    def on() -> None:
        tracer.attach(None)
        state["on"] = True

    def off() -> None:
        if state["on"]:
            drain()
        tracer.detach()
        state["on"] = False

    def traced(op: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            op()
            if state["on"]:  # (read in both arms: its cost cancels)
                state["n"] += 1
                if state["n"] % FLUSH_EVERY == 0:
                    tracer.flush()  # a step's end (the events are resolved by the flusher's drain)
        return run

    ops: dict[str, Callable[[], Any]] = {
        "c10d_all_reduce_blocking": lambda: dist.all_reduce(t),
        "c10d_all_reduce_async_wait": lambda: dist.all_reduce(t, async_op=True).wait(),
        "funcol_all_reduce_wait": lambda: funcol.all_reduce(t, "sum", world).wait(),
        "funcol_mesh_dim_all_reduce_wait": lambda: funcol.all_reduce(t, reduceOp="sum", group=(mesh, 0)).wait(),
    }
    out: dict[str, Any] = {}
    try:
        for name, op in ops.items():
            out[name] = _ab(traced(op), on, off, calls=calls, blocks=blocks)
    finally:
        off()
        tel.close()
    return {"paths": out, "errors": tel.errors, "dropped_records": tel.dropped_records,
            "stats": {k: v for k, v in tracer.stats.items() if v}, "calls": calls, "blocks": blocks,
            "device": str(device), "primitives": primitives(calls=calls * blocks) if cuda else {},
            "nccl_timing_env": os.environ.get("TORCH_NCCL_ENABLE_TIMING", "")}


PRIMITIVES = {
    "cuda_event_new_record": "`torch.cuda.Event(enable_timing=True)` + `.record()` (meshscope before)",
    "event_new_record": "`torch.Event(\"cuda\", enable_timing=True)` + `.record()`",
    "timer_event": "meshscope's `CudaCommTimer.event()`",
    "current_stream": "`torch.cuda.current_stream()`",
    "query": "`event.query()` (complete)",
    "elapsed_time": "`start.elapsed_time(end)`",
}


def primitives(*, calls: int) -> dict[str, float]:
    """Training-thread CPU µs per call of what the CUDA path is made of (median of 5 runs of ``calls``)."""
    import statistics
    import time

    import torch

    from meshscope.agent.instrument.comm_nccl import CudaCommTimer

    timer = CudaCommTimer()
    a, b = torch.Event("cuda", enable_timing=True), torch.Event("cuda", enable_timing=True)
    a.record()
    b.record()
    torch.cuda.synchronize()

    fns = {"cuda_event_new_record": lambda: torch.cuda.Event(enable_timing=True).record(),
           "event_new_record": lambda: torch.Event("cuda", enable_timing=True).record(),
           "timer_event": timer.event, "current_stream": torch.cuda.current_stream, "query": a.query,
           "elapsed_time": lambda: a.elapsed_time(b)}
    out = {}
    for name, fn in fns.items():
        runs = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.thread_time_ns()
            for _ in range(calls):
                fn()
            runs.append((time.thread_time_ns() - t0) / calls / 1e3)
        out[name] = statistics.median(runs)
    torch.cuda.synchronize()
    return out


def render_opcost(data: dict) -> Rendered:
    paths = data["paths"]
    over = {name: row for name, row in paths.items() if not row["overhead_cpu_us"] <= GOAL_US}
    clean = not data.get("errors") and not data.get("dropped_records")
    verdict = "PASS" if paths and not over and clean else "FAIL"
    worst = max(paths.items(), key=lambda kv: kv[1]["overhead_cpu_us"]) if paths else None
    if not paths:
        line = "nothing measured"
    elif not clean:
        line = f"{data.get('errors', 0)} telemetry errors, {data.get('dropped_records', 0)} dropped records"
    elif over:
        line = (f"{len(over)} of {len(paths)} paths over {GOAL_US:g} µs per op (worst: {PATHS.get(worst[0], worst[0])}, "
                f"{worst[1]['overhead_cpu_us']:.1f} µs)")
    else:
        line = f"every path at most {GOAL_US:g} µs per op (worst {worst[1]['overhead_cpu_us']:.2f} µs)"
    rows = [[PATHS.get(name, name), _fmt(row["without_cpu_us"], ".2f"), _fmt(row["overhead_cpu_us"], ".2f"),
             f"{row['iqr_us'][0]:.2f} … {row['iqr_us'][1]:.2f}", f"≤ {GOAL_US:g}",
             "yes" if row["overhead_cpu_us"] <= GOAL_US else "no"] for name, row in paths.items()]
    md = [
        f"Each path on {data.get('device', 'cuda')} (NCCL world size 1, a 1 KiB tensor), traced by meshscope's "
        "Python sites and CUDA events (`agent/instrument/comm_nccl.py`) with the telemetry core as recorder, "
        f"against the same op untraced (`TORCH_NCCL_ENABLE_TIMING={data.get('nccl_timing_env') or 'unset'}`: "
        "with it, NCCL records its own start event per op, and each op's duration is NCCL's): "
        f"{data.get('blocks')} alternating blocks of {data.get('calls')} ops, the "
        "training thread's CPU time, the median of the per-block difference (`tests.support.hookcost`). "
        f"The traced arm flushes the tracer every {FLUSH_EVERY} ops, as a step's end does; the events are "
        "resolved where the tracer is drained, on the telemetry's flusher thread.",
        "",
        md_table(["path", "untraced op (µs)", "meshscope (µs per op)", "IQR (µs)", "goal (µs)", "within"], rows),
    ]
    if data.get("primitives"):
        md += ["", "What the CUDA path is made of, training-thread CPU per call (µs):", "",
               md_table(["call", "µs"], [[PRIMITIVES.get(k, k), _fmt(v, ".2f")]
                                         for k, v in data["primitives"].items()])]
    if data.get("stats"):
        md += ["", f"Tracer counters: {data['stats']}"]
    md += ["", f"**{verdict}**: {line}."]
    return Rendered(verdict, line, "\n".join(md))
