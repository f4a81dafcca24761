"""FSDP2 on 2 gloo ranks with the collective tracer: counts / bytes vs flight recorder and analytic, time
per op per step vs torch.profiler, the async-unshard ``Work.wait`` path, detach.
Usage: ``python tests/workers/hooks_fsdp.py OUT_DIR``."""

from __future__ import annotations

import sys

from tests.support import profiler as hc

WARMUP, STEPS, LAYERS, DIM = 2, 4, 4, 1024


def run(rank: int, world_size: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.comm_fsdp import TracedAllGather
    from meshscope.agent.instrument.meshinfo import MeshInfo
    from meshscope.agent.instrument.recorder import ListRecorder

    hc.init(rank, world_size, port)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comms_before = [(layer._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm,
                     layer._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm) for layer in model]
    originals = hc.patch_targets()
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=MeshInfo(mesh))
    tracer.attach([model])
    traced_comms = [isinstance(layer._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm, TracedAllGather)
                    for layer in model]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, DIM)

    def step() -> float:
        opt.zero_grad()
        model[0].unshard(async_op=True)  # explicit prefetch: an async all-gather, waited by FSDP
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        tracer.flush()
        return loss.item()

    per_step, measured, fr, prof = hc.profiled_steps(step, rec, warmup=WARMUP, steps=STEPS)

    tracer.detach()
    n_after_detach = len(rec.collectives)
    loss_after = step()
    comms_after = [(layer._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm,
                    layer._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm) for layer in model]
    # Each layer's flat shard: numel padded to a multiple of world_size per parameter, fp32.
    padded = []
    for layer in model:
        numel = sum(-(-p.numel() // world_size) * world_size for p in layer.parameters())
        padded.append(numel * 4)
    result = {
        "records": measured,
        "tracer_steps": [hc.tracer_step_totals(s) for s in per_step],
        "profiler_steps": hc.profiler_step_totals(prof, STEPS),
        "fr": fr,
        "tracer_fr": hc.tracer_as_fr(measured),
        "layer_bytes": padded,
        "traced_comms": traced_comms,
        "comms_restored": [a is b for pair, again in zip(comms_before, comms_after) for a, b in zip(pair, again)],
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
