"""What telemetry costs the training thread: per traced op, and per training step beside torch.profiler.

    python bench/hooks_overhead.py [--calls 2000] [--blocks 15] [--steps 8] [--step-blocks 12] [--part all|calls|steps]

Per call (``tests.support.hookcost``: the method is in its docstring; each path in a process of its
own): each hook path through the real Python API and the real C++ dispatch of torch's ``fake`` backend, the real telemetry core as the
recorder; training-thread CPU time per op, the median over ABBA blocks of (with − without). Goal: ≤ 2 µs
per op on every collective / P2P path and DDP bucket, ≤ 0.3 µs per pipeline span. Beside them, the
floors: the barest Python recording wrappers of the same calls (``floor_*``), what no Python design of the
path can go below. Beside each traced path, torch.profiler on the same op, untraced by meshscope, in the
path's process (``profiler_us``; ``profiler_events``: the events it records per op;
``profiler_over_meshscope``). The DDP comm hook is also timed on a gloo world of one
(``ddp_comm_hook_gloo_world1``: a real future, its callback on gloo's thread; far noisier, a cross-check).
Each traced path is measured in the form of the sites this checkout runs (C, agent/instrument/_hot.c,
where built: ``sites``) and again in the pure-Python form (``per_call_python_us``, ``MESHSCOPE_NATIVE=0``;
the per-step attribution in that form is the ``*_python`` figures). The functional collectives are traced by
kernels in torch's dispatcher where those are built (``funcol``: agent/instrument/funcol_kernels.py), and
measured again with the sites those replace (``per_call_funcol_sites_us``, ``MESHSCOPE_FUNCOL_KERNELS=0``).
The per-call blocks pause the garbage collector, so ``sustained`` (``tests.support.gccost``) adds what
they cannot see: 100,000 traced all-reduces in one loop with the GC on, a step every 10 ops, against the
same loop untraced, with the time the GC ran on the training thread per generation.

Per step (2 gloo ranks, real process groups): a small DDP / FSDP2 / TP / PP-1F1B model, blocks of steps
rotating between three arms on the same steps — untraced, meshscope (``Telemetry`` attached, a step and a
phase per iteration, its flusher thread writing a real spool) and torch.profiler in its lightest useful
configuration (CPU activity only, no shapes, stacks, memory or FLOPs; started before a block and stopped
after it, so its trace post-processing is not counted) — with the training thread's CPU time (stable) and
wall time (preemption on a shared machine makes it noisy: see its spread) per arm. The comparison is made on
what each part costs (``attributed``): each op, span and step boundary at its per-call cost, against the
profiler's events at its per-event cost; ``profiler_over_meshscope_same_process`` counts each part in
profiler events measured in the part's own process (``per_call_isolated(yardstick=True)``), which the
machine's state, 1.5-2x apart between processes some hours, cannot move. Goal: meshscope ≤ 1 %
CPU per step on every arm, and ≥ 10× below torch.profiler. DDP is measured against DDP's C++ built-in
all-reduce (what a model without a comm hook runs, and what meshscope leaves it where the dispatcher kernels
are built: ``ddp_kernel_bucket``; elsewhere its traced Python comm hook replaces it) and against DDP's own
Python default hook (what any Python comm hook costs: the way meshscope sees the buckets elsewhere).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshscope.agent.instrument import funcol_kernels, native  # noqa: E402
from tests.support.gccost import sustained_isolated  # noqa: E402
from tests.support.hookcost import _ab, free_port, init_gloo, light_profiler, per_call_isolated  # noqa: E402


def ddp_hook_per_call(calls: int, blocks: int) -> dict[str, Any]:
    """The traced DDP comm hook, per bucket, on a gloo world of one (run in a child process: the per-call
    part's process group is the fake backend): against the same hook without its timing, and against DDP's
    Python default hook."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.comm_ddp import _HookState, traced_allreduce_hook
    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

    init_gloo(0, 1, free_port())
    world = dist.group.WORLD
    tel = Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(prefix="meshscope-hookcost-"), run="bench"),
                    rank=0, world_size=1)
    tel.begin_step(0)
    tracer = CollectiveTracer(tel)
    t = torch.ones(16)

    class Bucket:
        def buffer(self) -> torch.Tensor:
            return t

        def is_last(self) -> bool:
            return False

    bucket, state = Bucket(), _HookState(world, None)
    hook = {"fn": lambda: allreduce_hook(world, bucket)}

    def on() -> None:
        tracer.attach(None)
        state.bind(tracer)
        hook["fn"] = lambda: traced_allreduce_hook(state, bucket)

    def off() -> None:
        tracer.detach()
        state.bind(None)
        hook["fn"] = lambda: allreduce_hook(world, bucket)

    def settle(fut: Any) -> None:
        # Untimed: the bucket's all-reduce itself, and what the end of backward does with the hook's ops
        # (the bench's bucket is never the last one, so the window that records them never opens here).
        fut.wait()
        state.ops.clear()

    def untimed() -> None:  # the same hook with no tracer: the direct ProcessGroup call, no timestamps
        tracer.detach()
        state.bind(None)
        hook["fn"] = lambda: traced_allreduce_hook(state, bucket)

    try:
        # The hook call alone, timed per call: its future's wait would add gloo's spin (the op's duration
        # on the caller's CPU), which buried the hook's few µs under ±10 µs of noise. Against the same hook
        # without a tracer (what the timing adds per bucket), and against DDP's own Python default hook
        # (what a user who already runs a Python comm hook would see change).
        timing = _ab(lambda: hook["fn"](), on, untimed, calls=calls, blocks=blocks, settle=settle)
        timing["vs_ddp_python_default_hook"] = _ab(lambda: hook["fn"](), on, off, calls=calls, blocks=blocks,
                                                   settle=settle)
        return timing
    finally:
        tel.close()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- per step
def _measure(name: str, results: dict, *, steps: int, blocks: int, step_off: Callable[[], None],
             step_on: Callable[[], None], attach: Callable[[], None], detach: Callable[[], None],
             tel: Any, ops: Callable[[], dict[str, int]]) -> None:
    """Blocks of ``steps`` steps in three arms, the order rotated every block; per arm the median over
    blocks of the per-step training-thread CPU and wall time."""
    import torch.distributed as dist

    counter = {"step": 0}

    def traced_step() -> None:
        tel.begin_step(counter["step"])
        tel.push_phase("compute")
        step_on()
        tel.end_step()
        counter["step"] += 1

    for _ in range(2):  # warm up every path (DDP rebuilds its buckets after the first step)
        step_off()
    attach()
    for _ in range(3):
        traced_step()
    time.sleep(0.3)  # let the flusher drain: the op counts below are of the next step only
    before = dict(ops())
    taken: list[int] = []
    ptracer = tel._ptracer
    if ptracer is not None:  # count the spans the step's end takes
        real_take = ptracer.take
        ptracer.take = lambda: taken.append(len(spans := real_take())) or spans
    traced_step()
    n_spans = sum(taken)
    tel.flush()
    time.sleep(0.3)
    per_step = {k: v - before.get(k, 0) for k, v in ops().items() if v - before.get(k, 0)}
    detach()
    step_off()
    # The events torch.profiler records on the training thread in one untraced step (every aten op and
    # autograd node; not those of gloo's threads), for its attributed cost (``attribute``). The training
    # thread is the one of a marker range around the step (the marker itself not counted).
    import torch

    with light_profiler() as prof:
        with torch.profiler.record_function("meshscope-bench-step"):
            step_off()
    events = prof.events()
    marker = [e for e in events if e.name == "meshscope-bench-step"]
    profiler_events = (sum(1 for e in events if e.thread == marker[0].thread) - 1) if marker else 0
    arms = ("off", "meshscope", "profiler")
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    wall: dict[str, list[float]] = {a: [] for a in arms}
    for b in range(blocks):
        for arm in arms[b % 3:] + arms[:b % 3]:
            prof = None
            if arm == "meshscope":
                attach()
            elif arm == "profiler":
                prof = light_profiler()
                prof.__enter__()
            step = traced_step if arm == "meshscope" else step_off
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                step()
            cpu[arm].append((time.thread_time() - c0) / steps)
            wall[arm].append((time.perf_counter() - t0) / steps)
            if arm == "meshscope":
                detach()
            elif prof is not None:
                prof.__exit__(None, None, None)

    def ratios(arm: str, series: dict[str, list[float]]) -> list[float]:
        return [(a / o - 1) * 100 for a, o in zip(series[arm], series["off"])]

    def pct(arm: str, series: dict[str, list[float]]) -> float:
        return round(statistics.median(ratios(arm, series)), 2)

    def iqr(arm: str, series: dict[str, list[float]]) -> list[float]:
        q = statistics.quantiles(ratios(arm, series), n=4)
        return [round(q[0], 2), round(q[2], 2)]

    ms, pr = pct("meshscope", cpu), pct("profiler", cpu)
    results[name] = {
        "step_ms": round(statistics.median(wall["off"]) * 1e3, 2),
        "step_cpu_ms": round(statistics.median(cpu["off"]) * 1e3, 3),
        "ops_per_step": sum(per_step.values()),
        "profiler_events_per_step": profiler_events,
        "ops_by_source": per_step,
        "spans_per_step": n_spans,
        "cpu_overhead_pct": ms,
        "cpu_overhead_iqr_pct": iqr("meshscope", cpu),
        "profiler_cpu_overhead_pct": pr,
        "profiler_cpu_overhead_iqr_pct": iqr("profiler", cpu),
        "wall_overhead_pct": pct("meshscope", wall),
        "wall_overhead_iqr_pct": iqr("meshscope", wall),
        "profiler_wall_overhead_pct": pct("profiler", wall),
    }


def _step_worker(rank: int, world: int, port: int, steps: int, blocks: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

    init_gloo(rank, world, port)
    if hasattr(os, "sched_setaffinity") and world <= (os.cpu_count() or 1):
        os.sched_setaffinity(0, {rank})  # one core per rank: fewer migrations, less CPU-time noise
    from torch.distributed.device_mesh import init_device_mesh

    store = tempfile.mkdtemp(prefix="meshscope-hooks-bench-")
    results: dict[str, Any] = {}
    x = torch.randn(32, 512)

    def telemetry(run: str) -> Any:
        return Telemetry(config=TelemetryConfig(store=store, run=run), rank=rank, world_size=world)

    def run_arm(name: str, step_off: Callable[[], None], step_on: Callable[[], None], *, parts: list,
                mesh: Any = None, schedule: Any = None, stages: list | None = None) -> None:
        tel = telemetry(name)
        counted: dict[str, int] = {}
        real = tel.record_collective

        def counting(**kw: Any) -> None:  # ops per step by source/op (the flusher calls it)
            key = f"{kw['source']}/{kw['op']}"
            counted[key] = counted.get(key, 0) + 1
            real(**kw)

        tel.record_collective = counting  # type: ignore[method-assign]
        _measure(name, results, steps=steps, blocks=blocks, step_off=step_off, step_on=step_on,
                 attach=lambda: tel.attach(model_parts=parts, mesh=mesh, schedule=schedule, stages=stages),
                 detach=tel.detach, tel=tel, ops=lambda: counted)
        results[name]["errors"] = tel.errors
        results[name]["dropped_records"] = tel.dropped_records
        tel.close()

    # DDP: 6 buckets per step plus a loss all-reduce. A comm hook cannot be unregistered, so each arm has
    # its own identical model: the traced one, DDP's C++ built-in all-reduce, DDP's Python default hook.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    def ddp_model() -> DDP:
        torch.manual_seed(0)
        return DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]), bucket_cap_mb=1)

    plain, python_hook, hooked = ddp_model(), ddp_model(), ddp_model()
    python_hook.register_comm_hook(dist.group.WORLD, allreduce_hook)

    def ddp_step(model: DDP) -> Callable[[], None]:
        def step() -> None:
            loss = model(x).square().mean()
            loss.backward()
            dist.all_reduce(loss.detach())
        return step

    run_arm("ddp_vs_builtin", ddp_step(plain), ddp_step(hooked), parts=[hooked])
    run_arm("ddp_vs_python_default_hook", ddp_step(python_hook), ddp_step(hooked), parts=[hooked])

    # FSDP2: 4 layers, 8 all-gathers + 4 reduce-scatters per step.
    from torch.distributed.fsdp import fully_shard

    fmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    fsdp = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    for layer in fsdp:
        fully_shard(layer, mesh=fmesh)
    fully_shard(fsdp, mesh=fmesh)

    def fsdp_step() -> None:
        fsdp(x).square().mean().backward()

    run_arm("fsdp2", fsdp_step, fsdp_step, parts=[fsdp], mesh=fmesh)

    # TP: Colwise → Rowwise MLP twice, functional all-reduces forward and backward.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1024),
                       nn.ReLU(), nn.Linear(1024, 512))
    parallelize_module(tp, tmesh, {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(),
                                   "6": RowwiseParallel()})

    def tp_step() -> None:
        tp(x).square().mean().backward()

    run_arm("tp", tp_step, tp_step, parts=[tp], mesh=tmesh)

    # PP 1F1B: 2 stages, 4 microbatches (P2P per microbatch and 8 compute spans per rank and step).
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    stage = PipelineStage(nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)), rank, world,
                          torch.device("cpu"), group=pmesh.get_group("pp"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.MSELoss())
    y = torch.randn(32, 512)

    def pp_step() -> None:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)

    run_arm("pp_1f1b", pp_step, pp_step, parts=[stage.submod], mesh=pmesh, schedule=schedule, stages=[stage])
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def per_step(steps: int, blocks: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "steps.json")
        mp.start_processes(_step_worker, args=(2, free_port(), steps, blocks, out), nprocs=2, join=True,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


# Arms whose P2P ops are all issued through ``batch_isend_irecv`` (torch.distributed.pipelining does so):
# their sends and receives are attributed at the batched paths' cost.
BATCHED_P2P_ARMS = frozenset({"pp_1f1b"})


def _path(source_op: str, *, batched: bool = False, ddp: str = "ddp_comm_hook") -> str:
    """The per-call path that times an op of this ``source/op`` (see ``tests.support.hookcost``);
    ``batched``: P2P ops come through ``batch_isend_irecv``; ``ddp``: the path of DDP's buckets (their
    kernel in the dispatcher, ``ddp_kernel_bucket``, where the arms ran it; else the comm hook)."""
    source, op = source_op.split("/")
    if source == "ddp_comm_hook":
        return ddp
    if source == "fsdp_comm":
        return f"fsdp_{op}"
    if source == "funcol":  # the arms' funcol ops are DTensor's: group=(mesh, mesh_dim)
        return "funcol_mesh_dim_all_reduce_wait"
    if op in ("send", "recv"):
        return f"p2p_batch_i{op}_wait" if batched else f"p2p_i{op}_wait"
    return "c10d_all_reduce_blocking"


# The functional collectives measured again with the sites their kernels replace (the C sites where built).
FUNCOL_PATHS = ("funcol_all_reduce_wait", "funcol_mesh_dim_all_reduce_wait")
# The traced paths measured again in the Python form of the sites (floors and the profiler do not change).
PYTHON_FORM_PATHS = ("c10d_all_reduce_blocking", "c10d_all_reduce_async_wait", "funcol_all_reduce_wait",
                     "funcol_mesh_dim_all_reduce_wait",
                     "fsdp_all_gather", "fsdp_reduce_scatter", "p2p_isend_wait", "p2p_irecv_wait",
                     "p2p_batch_isend_wait", "p2p_batch_irecv_wait", "ddp_comm_hook", "pipeline_span",
                     "step_boundary")


def attribute(steps: dict[str, Any], calls_us: dict[str, Any], *, suffix: str = "") -> None:
    """Per arm, the training-thread CPU telemetry adds to a step as its parts cost them: each op at its
    path's per-call cost, each span, the step's boundaries — against the untraced step's CPU. The direct
    A/B on 2 gloo ranks sharing 2 cores varies by ±10 % between blocks (its IQR is printed), far above the
    1 % it would have to resolve; these parts are each measured to a few tens of ns."""
    # DDP's buckets: by their kernel where it was measured (the arms ran it: built, no CUDA), except in the
    # Python form's attribution (the kernels need the C forms: the hook there)
    ddp = "ddp_kernel_bucket" if "ddp_kernel_bucket" in calls_us and not suffix else "ddp_comm_hook"
    for arm, row in steps.items():
        batched = arm in BATCHED_P2P_ARMS
        us = sum(n * calls_us[_path(k, batched=batched, ddp=ddp)]["overhead_cpu_us"]
                 for k, n in row["ops_by_source"].items())
        us += row["spans_per_step"] * calls_us["pipeline_span"]["overhead_cpu_us"]
        us += calls_us["step_boundary"]["overhead_cpu_us"]
        row["attributed_us" + suffix] = round(us, 1)
        row["attributed_pct" + suffix] = round(us / (row["step_cpu_ms"] * 1e3) * 100, 3)
        # torch.profiler the same way: each event it records on the training thread in the step at its
        # per-event cost (an aten op's, the same A/B). Its start and stop (and the trace's post-processing,
        # tens of ms) are not counted: a floor of what it costs a profiled step.
        prof_us = row["profiler_events_per_step"] * calls_us["profiler_aten_op"]["overhead_cpu_us"]
        if not suffix:
            row["profiler_attributed_us"] = round(prof_us, 1)
            row["profiler_attributed_pct"] = round(prof_us / (row["step_cpu_ms"] * 1e3) * 100, 3)
        row["profiler_over_meshscope_attributed" + suffix] = round(prof_us / us, 2) if us > 0 else None
        # The same in torch.profiler events: each part's cost over the profiler's per-event cost measured in
        # the same process (``profiler_event_us``), so that the ratio does not depend on the machine state
        # each path's process landed in (see ``per_call_isolated``).
        events = sum(n * _in_events(calls_us[_path(k, batched=batched, ddp=ddp)])
                     for k, n in row["ops_by_source"].items())
        events += row["spans_per_step"] * _in_events(calls_us["pipeline_span"]) + _in_events(calls_us["step_boundary"])
        row["meshscope_in_profiler_events" + suffix] = round(events, 2)
        row["profiler_over_meshscope_same_process" + suffix] = (
            round(row["profiler_events_per_step"] / events, 2) if events > 0 else None)


def compare_per_op(calls_us: dict[str, Any]) -> None:
    """Each path measured under torch.profiler too: the profiler's cost on the same op over meshscope's."""
    for row in calls_us.values():
        if isinstance(row, dict) and "profiler_us" in row:
            mine = row["overhead_cpu_us"]
            row["profiler_over_meshscope"] = round(row["profiler_us"] / mine, 2) if mine > 0 else None


def _in_events(row: dict[str, Any]) -> float:
    """A path's cost in torch.profiler events measured in its own process."""
    return row["overhead_cpu_us"] / row["profiler_event_us"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per block (per-call part)")
    parser.add_argument("--blocks", type=int, default=15, help="A/B blocks (per-call part)")
    parser.add_argument("--steps", type=int, default=8, help="steps per block (per-step part)")
    parser.add_argument("--step-blocks", type=int, default=12, help="blocks per arm (per-step part)")
    parser.add_argument("--part", choices=("all", "calls", "steps"), default="all", help="what to measure")
    parser.add_argument("--ddp-hook-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag in ("calls", "blocks", "steps", "step_blocks"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    if args.ddp_hook_child:
        print(json.dumps(ddp_hook_per_call(args.calls, args.blocks)))
        return
    import torch

    load_start = os.getloadavg()
    calls_us, calls_python, calls_funcol_sites, steps, sustained = None, None, None, None, None
    if args.part in ("all", "calls"):
        calls_us = per_call_isolated(calls=args.calls, blocks=args.blocks, yardstick=True, profiled=True)
        compare_per_op(calls_us)
        # The same traced paths in the Python form of the sites (agent/instrument/native.py): what C saves.
        if native._USABLE:
            calls_python = per_call_isolated(calls=args.calls, blocks=args.blocks, paths=PYTHON_FORM_PATHS,
                                             env={"MESHSCOPE_NATIVE": "0"}, yardstick=True)
        if funcol_kernels.built() is not None and native.switched_on():
            calls_funcol_sites = per_call_isolated(calls=args.calls, blocks=args.blocks, paths=FUNCOL_PATHS,
                                                   env={"MESHSCOPE_FUNCOL_KERNELS": "0"}, yardstick=True)
        child = subprocess.run([sys.executable, __file__, "--ddp-hook-child", "--calls", str(max(1, args.calls // 4)),
                                "--blocks", str(args.blocks)], capture_output=True, text=True, check=True)
        calls_us["ddp_comm_hook_gloo_world1"] = json.loads(child.stdout.strip().splitlines()[-1])
        sustained = sustained_isolated()
    if args.part in ("all", "steps"):
        steps = per_step(args.steps, args.step_blocks)
    if calls_us is not None and steps is not None:
        attribute(steps, calls_us)
        if calls_python is not None:
            attribute(steps, {**calls_us, **calls_python}, suffix="_python")
    result = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_avg_start": load_start,
        "sites": "C (agent/instrument/_hot.c)" if native._USABLE else "Python (the C sites are not built)",
        "per_call_us": calls_us,
        "funcol": ("kernels in torch's dispatcher (agent/instrument/_funcol_kernels.cpp)"
                   if funcol_kernels.built() is not None and native.switched_on()
                   else "the sites of comm_funcol (the kernels are not built)"),
        "per_call_funcol_sites_us": calls_funcol_sites,
        "per_call_python_us": calls_python,
        "sustained_per_op": sustained,
        "per_step_2ranks": steps,
        "goals": {"per_call_cpu_us": 2.0, "pipeline_span_cpu_us": 0.3, "per_step_cpu_pct": 1.0,
                  "profiler_over_meshscope": 10.0},
        "load_avg_end": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
