"""Pipeline parallel on 2 gloo ranks (GPipe, 1F1B or Interleaved1F1B) with the collective tracer and the
pipeline tracer: P2P counts / bytes vs analytic, time per op per step vs torch.profiler, span coverage,
planned order, detach. Usage: ``python tests/workers/hooks_pp.py OUT_DIR SCHEDULE``."""

from __future__ import annotations

import sys

from tests.support import profiler as hc

WARMUP, STEPS, MICROBATCHES, BATCH, DIM = 1, 3, 4, 64, 512


def run(rank: int, world_size: int, port: int, out: str, schedule_name: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.profiler import ProfilerActivity, profile, record_function

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.meshinfo import MeshInfo
    from meshscope.agent.instrument.pipeline import PipelineTracer
    from meshscope.agent.instrument.recorder import ListRecorder

    hc.init(rank, world_size, port)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    group = mesh.get_group("pp")
    virtual = 2 if schedule_name == "interleaved1f1b" else 1
    n_stages = world_size * virtual
    torch.manual_seed(0)
    stage_ids = [rank + v * world_size for v in range(virtual)]  # interleaved: rank r holds r, r + world
    stages = [PipelineStage(nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM)), sid, n_stages,
                            torch.device("cpu"), group=group) for sid in stage_ids]
    loss_fn = nn.MSELoss()
    if schedule_name == "gpipe":
        schedule = ScheduleGPipe(stages[0], n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    elif schedule_name == "1f1b":
        schedule = Schedule1F1B(stages[0], n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    originals = hc.patch_targets()
    methods_before = [sorted(k for k in vars(s) if k.endswith("_one_chunk")) for s in stages]
    rec = ListRecorder()
    span_events: list[str] = []
    tracer = CollectiveTracer(rec, mesh_info=MeshInfo(mesh))
    tracer.attach([s.submod for s in stages])
    ptracer = PipelineTracer(rec, on_span_enter=lambda: span_events.append("enter"),
                             on_span_exit=lambda: span_events.append("exit"))
    ptracer.attach(schedule, stages)
    ptracer.attach(schedule, stages)  # idempotent
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)

    def step() -> None:
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()
        tracer.flush()

    for _ in range(WARMUP):
        step()
    n_before = len(rec.collectives)
    per_step: list[list[dict]] = []
    spans_per_step: list[list[dict]] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(STEPS):
            n0, s0 = len(rec.collectives), len(rec.spans)
            with record_function(f"hooks_step_{i}"):
                step()
            per_step.append(rec.collectives[n0:])
            spans_per_step.append(rec.spans[s0:])
    measured = rec.collectives[n_before:]
    planned = ptracer.planned_order()

    ptracer.detach()
    tracer.detach()
    n_after, s_after = len(rec.collectives), len(rec.spans)
    step()
    result = {
        "records": measured,
        "spans": spans_per_step,
        "stage_ids": stage_ids,
        "planned": planned,
        "span_events": span_events[:8],
        "span_events_balanced": span_events.count("enter") == span_events.count("exit"),
        "tracer_steps": [hc.tracer_step_totals(s) for s in per_step],
        "profiler_steps": hc.profiler_step_totals(prof, STEPS),
        "microbatch_bytes": BATCH // MICROBATCHES * DIM * 4,
        "errors": [f"{w}: {e!r}" for w, e in rec.errors],
        "stats": dict(tracer.stats),
        "changed_after_detach": hc.changed_targets(originals),
        "stage_methods_after_detach": [sorted(k for k in vars(s) if k.endswith("_one_chunk")) for s in stages],
        "stage_methods_before": methods_before,
        "records_after_detach": len(rec.collectives) - n_after,
        "spans_after_detach": len(rec.spans) - s_after,
    }
    hc.write(out, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    hc.spawn(run, args=(sys.argv[1], sys.argv[2]))
