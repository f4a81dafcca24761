"""Tensor parallel (ColwiseParallel / RowwiseParallel MLP) on 2 gloo ranks with the collective tracer:
counts / bytes vs flight recorder and analytic, time per op per step vs torch.profiler, detach.
Usage: ``python tests/workers/hooks_tp.py OUT_DIR``."""

from __future__ import annotations

import sys

from tests.support import profiler as hc

WARMUP, STEPS, BATCH, DIM, HIDDEN = 2, 4, 256, 512, 2048


def run(rank: int, world_size: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.meshinfo import MeshInfo
    from meshscope.agent.instrument.recorder import ListRecorder

    hc.init(rank, world_size, port)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    # Two Megatron MLP blocks: each is Colwise → Rowwise, one all-reduce forward (Rowwise output) and one
    # backward (the gradient of the Colwise input), except that the first block's input needs no grad.
    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM), nn.ReLU(),
                          nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                     "4": ColwiseParallel(), "6": RowwiseParallel()})
    originals = hc.patch_targets()
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=MeshInfo(mesh))
    tracer.attach([model])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(BATCH, DIM)

    def step() -> float:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        tracer.flush()
        return loss.item()

    per_step, measured, fr, prof = hc.profiled_steps(step, rec, warmup=WARMUP, steps=STEPS)

    tracer.detach()
    n_after_detach = len(rec.collectives)
    loss_after = step()
    result = {
        "records": measured,
        "tracer_steps": [hc.tracer_step_totals(s) for s in per_step],
        "profiler_steps": hc.profiler_step_totals(prof, STEPS),
        "fr": fr,
        "tracer_fr": hc.tracer_as_fr(measured),
        "activation_bytes": BATCH * DIM * 4,
        "errors": [f"{w}: {e!r}" for w, e in rec.errors],
        "stats": dict(tracer.stats),
        "changed_after_detach": hc.changed_targets(originals),
        "records_after_detach": len(rec.collectives) - n_after_detach,
        "loss_after_detach": loss_after,
    }
    hc.write(out, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    hc.spawn(run, args=(sys.argv[1],))
