"""Cost of the collective / pipeline hooks, A/B: per call of each hook path, and per training step.

    python bench/hooks_overhead.py [--calls 400] [--blocks 9] [--steps 4]

Per call (one process, a gloo world of one, so an op costs microseconds and the hook's own cost is not
drowned in network time): each path is timed in alternating blocks without and with the tracer attached
(attach / detach between blocks: that the tracer really is reversible is part of the measurement); the
cost is the median over blocks of (median per-call time with − without). P2P needs a peer, so it is
timed on 2 ranks (ping-pong; noisier). Per step (2 gloo ranks): a small DDP / FSDP2 / TP / PP-1F1B model,
alternating blocks of steps without and with tracing, median of the per-block ratios.

Prints one JSON object: µs per call (wall and calling-thread CPU) and % per step (wall, calling-thread CPU,
and the % implied by the per-call CPU costs × ops per step). On a shared machine wall-clock A/B per step is
dominated by preemption (see its spread); the CPU-time figures are the stable ones.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _ab(run: Callable[[], None], on: Callable[[], None], off: Callable[[], None], *, calls: int,
        blocks: int) -> dict[str, Any]:
    """Per call, without / with the tracer, in alternating blocks: the median wall time, and the CPU time
    of the calling thread (``time.thread_time``: what the hook itself costs, immune to the preemption that
    dominates wall-time noise on a shared machine). Overheads are medians over blocks of (with − without)."""
    wall_diffs, cpu_diffs, base, cpu_base = [], [], [], []
    run()  # warm up both paths once
    on()
    run()
    off()
    for _ in range(blocks):
        wall, cpu = [], []
        for enable in (False, True):
            (on if enable else off)()
            samples = []
            c0 = time.thread_time()
            for _ in range(calls):
                t0 = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t0)
            cpu.append((time.thread_time() - c0) / calls * 1e6)
            wall.append(statistics.median(samples) * 1e6)
        off()
        base.append(wall[0])
        cpu_base.append(cpu[0])
        wall_diffs.append(wall[1] - wall[0])
        cpu_diffs.append(cpu[1] - cpu[0])
    return {"without_us": round(statistics.median(base), 2),
            "without_cpu_us": round(statistics.median(cpu_base), 2),
            "overhead_us": round(statistics.median(wall_diffs), 2),
            "overhead_cpu_us": round(statistics.median(cpu_diffs), 2),
            "spread_us": [round(min(wall_diffs), 2), round(max(wall_diffs), 2)]}


def per_call(calls: int, blocks: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.comm_ddp import _HookState, traced_allreduce_hook
    from meshscope.agent.instrument.comm_fsdp import TracedAllGather, TracedReduceScatter
    from meshscope.agent.instrument.pipeline import PipelineTracer

    _init(0, 1, _port())
    world = dist.group.WORLD
    # The real recorder, as a job has it: the telemetry core writing to a throwaway store, a step open (so
    # every op is accounted to it), its flusher thread draining records off the training thread.
    rec = _telemetry()
    rec.begin_step(0)
    rec.push_phase("forward")
    tracer = CollectiveTracer(rec)

    def on() -> None:
        tracer.attach(None)

    def off() -> None:
        tracer.detach()

    t = torch.ones(16)
    out = {}
    out["c10d_all_reduce_blocking"] = _ab(lambda: dist.all_reduce(t), on, off, calls=calls, blocks=blocks)
    out["c10d_all_reduce_async_wait"] = _ab(lambda: dist.all_reduce(t, async_op=True).wait(), on, off,
                                            calls=calls, blocks=blocks)
    # As DTensor does: the AsyncCollectiveTensor's wait() → funcol.wait_tensor(elem).
    out["funcol_all_reduce_wait"] = _ab(lambda: funcol.all_reduce(t, "sum", world).wait(), on, off,
                                        calls=calls, blocks=blocks)
    untracked = dist.all_reduce(t, async_op=True)
    untracked.wait()
    out["work_wait_untracked"] = _ab(lambda: untracked.wait(), on, off, calls=calls, blocks=blocks)

    # FSDP2 custom comms: the traced objects against the defaults they wrap.
    ag_out, ag_in, rs_out = torch.empty(16), torch.ones(16), torch.empty(16)
    comms = {"ag": DefaultAllGather(), "rs": DefaultReduceScatter()}
    traced = {"ag": TracedAllGather(tracer, DefaultAllGather()),
              "rs": TracedReduceScatter(tracer, DefaultReduceScatter())}
    current = dict(comms)

    def fsdp_on() -> None:
        on()
        current.update(traced)

    def fsdp_off() -> None:
        off()
        current.update(comms)

    out["fsdp_all_gather"] = _ab(lambda: current["ag"](ag_out, ag_in, world), fsdp_on, fsdp_off, calls=calls,
                                 blocks=blocks)
    out["fsdp_reduce_scatter"] = _ab(lambda: current["rs"](rs_out, ag_in, world, dist.ReduceOp.SUM), fsdp_on,
                                     fsdp_off, calls=calls, blocks=blocks)

    # DDP comm hook on a stand-in bucket (not the last one: no backward to queue callbacks in), against
    # DDP's own default hook.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    class Bucket:
        def __init__(self) -> None:
            self.t = torch.ones(16)

        def buffer(self) -> torch.Tensor:
            return self.t

        def is_last(self) -> bool:
            return False

    bucket, state = Bucket(), _HookState(world, None)
    hook = {"fn": lambda: allreduce_hook(world, bucket).wait()}

    def ddp_on() -> None:
        on()
        state.tracer = tracer
        hook["fn"] = lambda: traced_allreduce_hook(state, bucket).wait()

    def ddp_off() -> None:
        off()
        state.detach()
        hook["fn"] = lambda: allreduce_hook(world, bucket).wait()

    out["ddp_comm_hook"] = _ab(lambda: hook["fn"](), ddp_on, ddp_off, calls=calls, blocks=blocks)

    # Pipeline span around a stage method that does nothing.
    class Stage:
        stage_index = 0

        def forward_one_chunk(self, i, *a):
            return i

    class Schedule:
        def __init__(self, stage: Stage) -> None:
            self._stage = stage
            self.pipeline_order = None

    stage = Stage()
    ptracer = PipelineTracer(rec, deferred=True)  # as the telemetry core attaches it

    def pp_on() -> None:
        ptracer.attach(Schedule(stage))

    def pp_off() -> None:
        ptracer.detach()
        ptracer.take()

    out["pipeline_span"] = _ab(lambda: stage.forward_one_chunk(0), pp_on, pp_off, calls=calls, blocks=blocks)
    rec.close()
    dist.destroy_process_group()
    return out


def _telemetry() -> Any:
    import tempfile

    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

    return Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(prefix="meshscope-hooks-bench-"), run="bench"),
                     rank=0, world_size=1)


def _step_worker(rank: int, world: int, port: int, steps: int, blocks: int, calls: int, q: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.meshinfo import MeshInfo
    from meshscope.agent.instrument.pipeline import PipelineTracer
    from meshscope.agent.instrument.recorder import ListRecorder

    _init(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh

    results: dict[str, Any] = {}

    def measure(name: str, step_off: Callable[[], None], step_on: Callable[[], None], on: Callable[[], None],
                off: Callable[[], None], n_ops: Callable[[], int]) -> None:
        step_off()
        step_off()
        on()
        step_on()
        step_on()  # DDP rebuilds its buckets after the first step: count a later one
        before = n_ops()
        step_on()
        ops_per_step = n_ops() - before
        off()
        ratios, cpu_ratios, base = [], [], []
        for _ in range(blocks):
            wall, cpu = [], []
            for enable in (False, True):
                (on if enable else off)()
                step = step_on if enable else step_off
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(steps):
                    step()
                wall.append((time.perf_counter() - t0) / steps)
                cpu.append((time.thread_time() - c0) / steps)
            off()
            base.append(wall[0])
            ratios.append(wall[1] / wall[0] - 1)
            cpu_ratios.append(cpu[1] / cpu[0] - 1)
        results[name] = {"step_ms": round(statistics.median(base) * 1e3, 2),
                         "overhead_pct": round(statistics.median(ratios) * 100, 2),
                         "spread_pct": [round(min(ratios) * 100, 2), round(max(ratios) * 100, 2)],
                         "cpu_overhead_pct": round(statistics.median(cpu_ratios) * 100, 2),
                         "ops_per_step": ops_per_step}

    def tracing(model_parts: list, mesh: Any) -> tuple[Callable, Callable, Callable]:
        rec = ListRecorder()
        tracer = CollectiveTracer(rec, mesh_info=MeshInfo(mesh))

        def on() -> None:
            rec.collectives.clear()
            tracer.attach(model_parts)

        def off() -> None:
            tracer.detach()

        return on, off, lambda: len(rec.collectives)

    # DDP: A = DDP's built-in C++ all-reduce (no hook), B = the traced comm hook; two identical models
    # because a comm hook cannot be unregistered. 6 buckets per step plus a loss all-reduce.
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.randn(32, 512)

    def ddp_model() -> DDP:
        torch.manual_seed(0)
        return DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]), bucket_cap_mb=1)

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    plain, python_hook, hooked = ddp_model(), ddp_model(), ddp_model()
    python_hook.register_comm_hook(dist.group.WORLD, allreduce_hook)  # DDP's own Python hook, untimed
    on, off, n = tracing([hooked], None)

    def ddp_step(model: DDP) -> Callable[[], None]:
        def step() -> None:
            loss = model(x).square().mean()
            loss.backward()
            dist.all_reduce(loss.detach())
        return step

    # Against DDP's C++ built-in all-reduce (what a model without any comm hook runs), and against DDP's own
    # Python allreduce_hook (the part of the cost that is the Python hook mechanism, not the timing).
    measure("ddp_vs_builtin", ddp_step(plain), ddp_step(hooked), on, off, n)
    measure("ddp_vs_python_default_hook", ddp_step(python_hook), ddp_step(hooked), on, off, n)

    # FSDP2: 4 layers, 8 all-gathers + 4 reduce-scatters per step.
    from torch.distributed.fsdp import fully_shard

    fmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    fsdp = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    for layer in fsdp:
        fully_shard(layer, mesh=fmesh)
    fully_shard(fsdp, mesh=fmesh)

    def fsdp_step() -> None:
        fsdp(x).square().mean().backward()

    on, off, n = tracing([fsdp], fmesh)
    measure("fsdp2", fsdp_step, fsdp_step, on, off, n)

    # TP: Colwise → Rowwise MLP, 3 functional all-reduces per step.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1024),
                       nn.ReLU(), nn.Linear(1024, 512))
    parallelize_module(tp, tmesh, {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(),
                                   "6": RowwiseParallel()})

    def tp_step() -> None:
        tp(x).square().mean().backward()

    on, off, n = tracing([tp], tmesh)
    measure("tp", tp_step, tp_step, on, off, n)

    # PP 1F1B: 2 stages, 4 microbatches (16 P2P ops and 8 spans per rank and step).
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

    c_on, c_off, n = tracing([stage.submod], pmesh)
    prec = ListRecorder()
    ptracer = PipelineTracer(prec)

    def pp_on() -> None:
        c_on()
        ptracer.attach(schedule, [stage])

    def pp_off() -> None:
        ptracer.detach()
        c_off()

    measure("pp_1f1b", pp_step, pp_step, pp_on, pp_off, n)

    # Per-call P2P cost needs a peer: ping-pong, A/B.
    rec = ListRecorder()
    tracer = CollectiveTracer(rec)
    buf = torch.ones(16)
    peer = 1 - rank

    def ping() -> None:
        if rank == 0:
            dist.isend(buf, peer).wait()
            dist.irecv(buf, peer).wait()
        else:
            dist.irecv(buf, peer).wait()
            dist.isend(buf, peer).wait()

    def p2p_on() -> None:
        tracer.attach(None)

    def p2p_off() -> None:
        tracer.detach()
        rec.collectives.clear()

    ab = _ab(ping, p2p_on, p2p_off, calls=calls, blocks=blocks)
    # Two ops (a send and a receive) per ping-pong.
    results["p2p_isend_irecv_pair_2ranks"] = {**ab, "overhead_us_per_op": round(ab["overhead_us"] / 2, 2),
                                              "overhead_cpu_us_per_op": round(ab["overhead_cpu_us"] / 2, 2)}
    if rank == 0:
        q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def per_step(steps: int, blocks: int, calls: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_step_worker, args=(2, _port(), steps, blocks, calls, q), nprocs=2, join=True,
                       start_method="spawn")
    return q.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per block (per-call part)")
    parser.add_argument("--blocks", type=int, default=9, help="A/B blocks")
    parser.add_argument("--steps", type=int, default=4, help="steps per block (per-step part)")
    args = parser.parse_args()
    import torch

    calls_us = per_call(args.calls, args.blocks)
    steps = per_step(args.steps, args.blocks, max(50, args.calls // 4))
    # The per-step cost implied by the per-call CPU costs: ops per step × cost of that path / step time.
    path = {"ddp_vs_builtin": "ddp_comm_hook", "ddp_vs_python_default_hook": "ddp_comm_hook",
            "fsdp2": "fsdp_all_gather", "tp": "funcol_all_reduce_wait"}
    for name, row in steps.items():
        if name in path:
            row["implied_pct"] = round(row["ops_per_step"] * calls_us[path[name]]["overhead_cpu_us"]
                                       / (row["step_ms"] * 1e3) * 100, 3)
    if "pp_1f1b" in steps:
        row = steps["pp_1f1b"]
        p2p = steps["p2p_isend_irecv_pair_2ranks"]["overhead_cpu_us_per_op"]
        spans = 8 * calls_us["pipeline_span"]["overhead_cpu_us"]  # 4 forward + 4 backward spans
        row["implied_pct"] = round((row["ops_per_step"] * p2p + spans) / (row["step_ms"] * 1e3) * 100, 3)
    result = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_avg_start": os.getloadavg(),
        "per_call_world1_us": calls_us,
        "per_step_2ranks": steps,
        "load_avg_end": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
