"""What each collective / pipeline hook costs the calling thread per call: the measurement that
bench/hooks_overhead.py prints and tests/test_hook_cost.py guards.

    costs = per_call(calls=2000, blocks=15)   # {path: {"without_cpu_us", "overhead_cpu_us", ...}}

Each path is an op made through the real Python API and the real C++ ProcessGroup dispatch of torch's
``fake`` backend (``torch.testing._internal.distributed.fake_pg``: works complete at once, no network,
no worker thread; its works are ``FakeWork``, whose own ``wait`` the tracer patches as it does
``Work.wait``), with the real telemetry core as the recorder (a step open, its flusher thread
draining the records). A backend that really communicates adds its own wait to the calling thread's
CPU time — gloo's ``wait`` spins, so on a world of one the caller's CPU per op follows the op's duration
and was seen to double between two runs of the same script — which buries a 1-2 µs hook under noise;
the per-step arms of the benchmark run on real gloo process groups instead.

Method: alternating blocks without / with the hook (the order flipped every block, ABBA, to cancel
drift), ``time.thread_time`` around each block, the median over blocks of (with − without). The
cyclic garbage collector is run before every block and paused inside it: its pauses, triggered by
whichever allocation crosses a threshold, were the largest noise source (±1 µs on a 30 µs functional
collective). The hooks' own allocations are still made and freed inside the block.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable
from tests.support.harness import free_port  # noqa: E402,F401


def _ab(run: Callable[[], Any], on: Callable[[], None], off: Callable[[], None], *, calls: int,
        blocks: int, settle: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """``settle(result)``: what follows each call untimed; each call is then timed on its own (the two
    clock readings per call, 0.8 µs each here, are in both arms and cancel, but add their noise)."""
    without, diffs = [], []
    for arm in (off, on, off):  # warm both paths
        arm()
        result = run()
        if settle is not None:
            settle(result)
    clock = time.thread_time_ns
    # Untimed calls after each switch: the first call after a patch is installed or removed costs up to
    # a few hundred µs more (the interpreter re-specialises every function reading the patched module's
    # globals, and the tracer resolves its group again), which in a block of 100 calls read as +1-4 µs
    # per call.
    warm = max(3, calls // 20)
    for b in range(blocks):
        cpu = {}
        for enable in ((False, True) if b % 2 == 0 else (True, False)):
            (on if enable else off)()
            gc.collect()
            gc.disable()
            try:
                for _ in range(warm):
                    result = run()
                    if settle is not None:
                        settle(result)
                if settle is None:
                    c0 = clock()
                    for _ in range(calls):
                        run()
                    spent = clock() - c0
                else:
                    spent = 0
                    for _ in range(calls):
                        c0 = clock()
                        result = run()
                        spent += clock() - c0
                        settle(result)
                cpu[enable] = spent / calls / 1e3
            finally:
                gc.enable()
        off()
        without.append(cpu[False])
        diffs.append(cpu[True] - cpu[False])
    q = statistics.quantiles(diffs, n=4) if len(diffs) >= 2 else [diffs[0]] * 3
    return {"without_cpu_us": round(statistics.median(without), 3),
            "overhead_cpu_us": round(statistics.median(diffs), 3),
            "iqr_us": [round(q[0], 3), round(q[2], 3)]}


def per_call(*, calls: int = 2000, blocks: int = 15, paths: tuple[str, ...] | None = None,
             profiled: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{path: {"without_cpu_us", "overhead_cpu_us", "iqr_us"}}`` for every hook path (or ``paths``).
    ``profiled``: paths whose untraced op is also measured under torch.profiler (``light_profiler``), the
    same A/B: ``profiler_us`` (what the profiler costs the same op) and ``profiler_events`` (the events it
    records per op). Initialises (and destroys) a ``fake`` process group in this process: call it where no
    other group exists."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.comm_fsdp import TracedAllGather, TracedReduceScatter
    from meshscope.agent.instrument.pipeline import PipelineTracer
    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    world = dist.group.WORLD
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    # The real recorder, as a job has it: a step open (so every op belongs to it), the flusher draining.
    tel = Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(prefix="meshscope-hookcost-"), run="bench"),
                    rank=0, world_size=2)
    tel.begin_step(0)
    tel.push_phase("forward")
    tracer = CollectiveTracer(tel)
    t = torch.ones(16)
    ag_out = torch.empty(32)
    plain_ag, plain_rs = DefaultAllGather(), DefaultReduceScatter()
    traced_ag, traced_rs = TracedAllGather(tracer, plain_ag), TracedReduceScatter(tracer, plain_rs)

    class Stage:
        stage_index = 0

        def forward_one_chunk(self, i: int, *args: Any) -> int:
            return i

    class Schedule:
        def __init__(self, stage: Stage) -> None:
            self._stage = stage
            self.pipeline_order = None

    stage = Stage()
    ptracer = PipelineTracer(tel, deferred=True)  # as the telemetry core attaches it
    traced = {"on": False}

    def on() -> None:
        tracer.attach(None)
        traced["on"] = True

    def off() -> None:
        tracer.detach()
        traced["on"] = False

    def pp_on() -> None:
        ptracer.attach(Schedule(stage))

    def pp_off() -> None:
        ptracer.detach()
        ptracer.take()

    # One step's boundaries as a loop has them (begin, a phase, end): what telemetry costs per step besides
    # its ops. The off arm makes no call at all. The on arm has the collective tracer registered with the
    # telemetry, as ``Telemetry.attach`` leaves it: a step's end flushes it (0.6 µs a step on the dev VM).
    boundary = {"on": False, "step": 1}

    def step_boundary() -> None:
        if boundary["on"]:
            tel.begin_step(boundary["step"])
            tel.push_phase("compute")
            tel.end_step()
            boundary["step"] += 1

    def steps_on() -> None:
        boundary["on"] = True
        if tracer not in tel._tracers:
            tel._tracers.append(tracer)
            tel._index_tracers()

    def steps_off() -> None:
        boundary["on"] = False
        if tracer in tel._tracers:
            tel._tracers.remove(tracer)
            tel._index_tracers()

    floor_on, floor_off = _floor(tel)
    profiling: dict[str, Any] = {"p": None}

    def profiler_on() -> None:
        profiling["p"] = light_profiler()
        profiling["p"].__enter__()

    def profiler_off() -> None:  # its trace's post-processing happens here, outside the timed blocks
        if profiling["p"] is not None:
            profiling["p"].__exit__(None, None, None)
            profiling["p"] = None
    from tests.support.hookcost_ddp import DDP_KERNEL_BUCKETS, ddp_hook_path, ddp_kernel_path

    funcol_floor_on, funcol_floor_off = _floor_funcol(tel)
    ddp_hook, ddp_on, ddp_off = ddp_hook_path(tracer, world, t)
    ddp_buckets, ddp_kernel_on, ddp_kernel_off = ddp_kernel_path(tracer, world, t, on=on, off=off)
    untracked = dist.all_reduce(t, async_op=True)
    table: dict[str, tuple[Callable[[], Any], Callable[[], None], Callable[[], None]]] = {
        "c10d_all_reduce_blocking": (lambda: dist.all_reduce(t), on, off),
        "c10d_all_reduce_async_wait": (lambda: dist.all_reduce(t, async_op=True).wait(), on, off),
        # As DTensor does: the AsyncCollectiveTensor's wait() → funcol.wait_tensor(elem).
        "funcol_all_reduce_wait": (lambda: funcol.all_reduce(t, "sum", world).wait(), on, off),
        # As DTensor names the group: (mesh, mesh_dim), a new tuple per call (a TP step's ops are these).
        "funcol_mesh_dim_all_reduce_wait": (lambda: funcol.all_reduce(t, reduceOp="sum", group=(mesh, 0)).wait(),
                                            on, off),
        "work_wait_untracked": (lambda: untracked.wait(), on, off),
        "fsdp_all_gather": (lambda: (traced_ag if traced["on"] else plain_ag)(ag_out, t, world), on, off),
        "fsdp_reduce_scatter": (lambda: (traced_rs if traced["on"] else plain_rs)(t[:8], t, world,
                                                                                   dist.ReduceOp.SUM), on, off),
        "p2p_isend_wait": (lambda: dist.isend(t, 1).wait(), on, off),
        "p2p_irecv_wait": (lambda: dist.irecv(t, 1).wait(), on, off),
        # As torch.distributed.pipelining issues every P2P op: a batch of one (the op built in the call, with
        # whichever isend / irecv is installed), then its wait.
        "p2p_batch_isend_wait": (lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1)])[0].wait(), on, off),
        "p2p_batch_irecv_wait": (lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 1)])[0].wait(), on, off),
        "ddp_comm_hook": (ddp_hook, ddp_on, ddp_off),
        # DDP's buckets in the dispatcher (funcol_kernels): a backward of DDP_KERNEL_BUCKETS all-reduces as the
        # reducer makes them (the ProcessGroup's C++ call, inside the autograd graph task), per bucket below
        "ddp_kernel_bucket": (ddp_buckets, ddp_kernel_on, ddp_kernel_off),
        "pipeline_span": (lambda: stage.forward_one_chunk(0), pp_on, pp_off),
        "step_boundary": (step_boundary, steps_on, steps_off),
        # The floor of any Python wrapper here (a reference, not a hook): see _floor.
        "floor_blocking": (lambda: dist.all_reduce(t), floor_on, floor_off),
        "floor_async_wait": (lambda: dist.all_reduce(t, async_op=True).wait(), floor_on, floor_off),
        "floor_funcol": (lambda: funcol.all_reduce(t, "sum", world).wait(), funcol_floor_on, funcol_floor_off),
        # torch.profiler's cost per event it records (one aten op, one event), for the per-step comparison.
        "profiler_aten_op": (lambda: torch.add(t, t), profiler_on, profiler_off),
    }
    out = {}
    if tracer._kernels is None:
        on()  # the kernels are bound on attach, where usable
        off()
    if tracer._kernels is None:  # not built or not usable here: DDP's buckets go through the hook
        del table["ddp_kernel_bucket"]
    try:
        for name, (run, arm_on, arm_off) in table.items():
            if paths is None or name in paths:
                out[name] = _ab(run, arm_on, arm_off, calls=calls if name != "step_boundary" else max(1, calls // 10),
                                blocks=blocks)
                if name in profiled:
                    arm_off()  # the op as torch runs it, under the profiler alone
                    row = _ab(run, profiler_on, profiler_off, calls=calls, blocks=blocks)
                    out[name].update(profiler_us=row["overhead_cpu_us"], profiler_iqr_us=row["iqr_us"],
                                     profiler_events=_events_per_call(run, calls=calls))
        if "ddp_kernel_bucket" in out:  # measured per backward: per bucket
            row = out["ddp_kernel_bucket"]
            row.update(without_cpu_us=round(row["without_cpu_us"] / DDP_KERNEL_BUCKETS, 3),
                       overhead_cpu_us=round(row["overhead_cpu_us"] / DDP_KERNEL_BUCKETS, 3),
                       iqr_us=[round(q / DDP_KERNEL_BUCKETS, 3) for q in row["iqr_us"]])
        tel.begin_step(0)  # the open step the paths ran in, as at the start (step_boundary ends its own)
    finally:
        off()
        tel.close()
        dist.destroy_process_group()
    out["_recorded"] = {"dropped_records": tel.dropped_records, "errors": tel.errors}
    return out


PATHS = ("c10d_all_reduce_blocking", "c10d_all_reduce_async_wait", "funcol_all_reduce_wait",
         "funcol_mesh_dim_all_reduce_wait", "work_wait_untracked",
         "fsdp_all_gather", "fsdp_reduce_scatter", "p2p_isend_wait", "p2p_irecv_wait", "p2p_batch_isend_wait",
         "p2p_batch_irecv_wait", "ddp_comm_hook", "ddp_kernel_bucket",
         "pipeline_span", "step_boundary", "floor_blocking", "floor_async_wait", "floor_funcol", "profiler_aten_op")
# Paths ``per_call_isolated(profiled=True)`` does not measure under torch.profiler: not a traced op's path, or
# (the pipeline span) a stand-in stage whose compute has no torch op for the profiler to record.
UNPROFILED = frozenset({"step_boundary", "work_wait_untracked", "ddp_kernel_bucket", "pipeline_span", "floor_blocking", "floor_async_wait",
                        "floor_funcol", "profiler_aten_op"})


def _events_per_call(run: Callable[[], Any], *, calls: int) -> float:
    """The events torch.profiler (``light_profiler``) records per call of ``run``."""
    profiler = light_profiler()
    with profiler:
        for _ in range(calls):
            run()
    return round(len(profiler.events()) / calls, 2)


def _floor(tel: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """(on, off) of the barest recording wrapper of ``dist.all_reduce`` and ``Work.wait`` (the fake
    backend's ``FakeWork.wait``): two clock readings around the call and one tuple of plain values (a group
    key, the step's key: see ``agent.instrument.ops``) appended to a deque, nothing checked, nothing looked
    up. What a traced op costs above this is the checks and lookups every
    real site needs; below it only code outside the interpreter (C) can go."""
    import collections

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original, work_type = c10d.all_reduce, torch_work_type()
    original_wait = vars(work_type)["wait"]
    done: collections.deque = collections.deque(maxlen=65536)
    pending: dict[int, tuple] = {}
    now, live = time.perf_counter, tel.live

    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        t0 = now()
        result = original(tensor, op, group, async_op)
        if async_op:
            pending[id(result)] = (result, ("all_reduce", 0, tensor.nbytes, t0))
        else:
            t1 = now()
            done.append(("all_reduce", 0, tensor.nbytes, t0, t1, t1 - t0, live.key))
        return result

    def wait(self: Any, timeout: Any = None) -> Any:
        entry = pending.pop(id(self), None)
        t0 = now()
        result = original_wait(self) if timeout is None else original_wait(self, timeout)
        t1 = now()
        if entry is not None:
            done.append((entry[1], t1, t1 - t0, live.key))
        return result

    def on() -> None:
        c10d.all_reduce = dist.all_reduce = all_reduce
        work_type.wait = wait

    def off() -> None:
        c10d.all_reduce = dist.all_reduce = original
        work_type.wait = original_wait
        done.clear()
    return on, off


def light_profiler() -> Any:
    """torch.profiler in its lightest useful configuration: CPU activity only, no shapes, stacks, memory or
    FLOPs (what the benchmark compares meshscope with)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False,
                   profile_memory=False, with_flops=False)


def _floor_funcol(tel: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """(on, off) of the barest recording wrappers of ``funcol.all_reduce`` and ``funcol.wait_tensor``: one
    clock reading and a dict entry by the output's data pointer at the issue, two readings and one tuple
    appended at the wait; no group resolved, no op numbered, nothing checked (not even torch.compile's
    flag or the thread). The funcol path's two patched entry points run between ~30 µs of torch's own
    Python, whose caches they share: what this costs in that loop is the least any Python design of the
    path can cost there."""
    import collections

    import torch.distributed._functional_collectives as funcol

    original, original_wait = funcol.all_reduce, funcol.wait_tensor
    done: collections.deque = collections.deque(maxlen=65536)
    pending: dict[int, tuple] = {}
    now, live = time.perf_counter, tel.live

    def all_reduce(tensor: Any, op: str, group: Any, tag: str = "") -> Any:
        t0 = now()
        result = original(tensor, op, group, tag)
        pending[result.elem.data_ptr()] = ("all_reduce", 0, tensor.nbytes, t0)
        return result

    def wait_tensor(tensor: Any) -> Any:
        entry = pending.pop(tensor.data_ptr(), None)
        t0 = now()
        result = original_wait(tensor)
        t1 = now()
        if entry is not None:
            done.append((entry, t1, t1 - t0, live.key))
        return result

    def on() -> None:
        funcol.all_reduce, funcol.wait_tensor = all_reduce, wait_tensor

    def off() -> None:
        funcol.all_reduce, funcol.wait_tensor = original, original_wait
        done.clear()
    return on, off


def torch_work_type() -> type:
    """The class whose ``wait`` the fake backend's works run (``FakeWork``, or ``Work`` without it)."""
    import torch

    c = torch._C._distributed_c10d
    return getattr(c, "FakeWork", c.Work)


def per_call_isolated(*, calls: int = 2000, blocks: int = 15, paths: tuple[str, ...] = PATHS,
                      timeout_s: float = 240.0, env: dict[str, str] | None = None,
                      yardstick: bool = False, profiled: bool = False) -> dict[str, Any]:
    """``per_call`` with each path in a process of its own: forked, one after another, from one interpreter
    that has imported what ``per_call`` imports and measured nothing (``run_forked``), so every path starts
    from the same state and pays no interpreter start-up of its own. In one process a path's figure depended
    on the paths measured before it (the pipeline span read 0.32 µs alone and 0.48 µs after the other nine in
    the same minute: the heap and caches they leave behind), so a figure would have described the order of
    the table, not the hook.

    ``yardstick``: each path's process also measures torch.profiler's cost per event after it
    (``profiler_aten_op``), given as the path's ``profiler_event_us``: the machine moves between states that
    make every path of a process 1.5-2× slower (2026-11-27 22:00 UTC: the profiler's event 0.51 µs in one
    run, 0.87 and 0.93 in the next two), so a path's cost is compared with the profiler's measured in the same
    process, not in another one that may have landed in another state.

    ``profiled``: each traced path's untraced op is also measured under torch.profiler in the path's process
    (``per_call(profiled=...)``: ``profiler_us``, ``profiler_events``); not the paths of ``UNPROFILED``."""
    codes = []
    for path in paths:
        measured = (path, "profiler_aten_op") if yardstick and path != "profiler_aten_op" else (path,)
        under_profiler = (path,) if profiled and path not in UNPROFILED else ()
        codes.append(f"result = per_call(calls={calls}, blocks={blocks}, paths={measured!r}, "
                     f"profiled={under_profiler!r})")
    results = run_forked(codes, preload="from tests.support.hookcost import per_call, preload; preload()",
                         what="hook cost", timeout_s=timeout_s, env=env)
    out: dict[str, Any] = {}
    recorded = {"dropped_records": 0, "errors": 0}
    for path, got in zip(paths, results, strict=True):
        if path not in got:  # not measurable here (ddp_kernel_bucket where the kernels are not built)
            continue
        out[path] = got[path]
        if yardstick and path != "profiler_aten_op":
            out[path]["profiler_event_us"] = got["profiler_aten_op"]["overhead_cpu_us"]
        for key in recorded:
            recorded[key] += got["_recorded"][key]
    out["_recorded"] = recorded
    return out


def preload() -> None:
    """What ``per_call`` imports, imported once in the parent that ``run_forked`` forks each path from."""
    import torch.distributed._functional_collectives  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401
    import torch.profiler  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    import meshscope.agent.instrument.collectives  # noqa: F401
    import meshscope.agent.instrument.comm_fsdp  # noqa: F401
    import meshscope.agent.instrument.pipeline  # noqa: F401
    import meshscope.agent.instrument.telemetry  # noqa: F401
    import tests.support.hookcost_ddp  # noqa: F401


# The parent: ``preload`` once, then for each code a forked child that runs it and writes its ``result`` as one
# JSON line to a pipe, and exits without the parent's atexit handlers; the parent waits for each in turn, so
# two children never run at once. The parent starts no thread before forking (nothing it imports starts one).
_FORKED = """
import json, os, sys, threading
{preload}
assert threading.active_count() == 1, threading.enumerate()
for code in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        status = 0
        try:
            scope = {{}}
            exec(compile(code, "<forked>", "exec"), globals(), scope)
            line = json.dumps(scope["result"])
        except BaseException:
            import traceback
            line, status = json.dumps({{"_error": traceback.format_exc()}}), 1
        os.write(w, line.encode() + bytes([10]))  # a newline
        os._exit(status)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    print(data.decode().strip(), flush=True)
"""


def run_forked(codes: list[str], *, preload: str, what: str, timeout_s: float,
               env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Each of ``codes`` (which sets ``result``, a JSON-able dict) in a process of its own, forked one after
    another from a fresh interpreter (one BLAS thread, ``env`` added to the environment) that ran ``preload``
    first; their ``result`` in order. ``timeout_s`` per code. A failure raises ``RuntimeError`` naming
    ``what``."""
    import json
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[2])  # ``tests.support`` is importable from the checkout's root
    proc = subprocess.run([sys.executable, "-c", _FORKED.format(preload=preload), json.dumps(codes)],
                          capture_output=True, text=True, timeout=timeout_s * max(1, len(codes)), cwd=root,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    results = [json.loads(line) for line in lines]
    errors = [r["_error"] for r in results if "_error" in r]
    if proc.returncode != 0 or errors or len(results) != len(codes):
        raise RuntimeError(f"{what} failed: {(errors[0] if errors else proc.stderr)[-2000:]}")
    return results


def run_isolated(code: str, *, what: str, timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``code`` (which sets ``result``, a JSON-able dict) in a fresh interpreter, one BLAS thread, with
    ``env`` added to the environment (``MESHSCOPE_NATIVE=0``: the Python form of the sites); its
    ``result``. A failure raises ``RuntimeError`` naming ``what``."""
    import json
    import subprocess
    import sys

    program = f"import json\n{code}\nprint(json.dumps(result))"
    root = str(Path(__file__).resolve().parents[2])  # ``tests.support`` is importable from the checkout's root
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=timeout_s, cwd=root,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def init_gloo(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
