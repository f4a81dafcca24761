"""DDP on 2 gloo ranks with the collective tracer: counts / bytes vs flight recorder and analytic, time
per op per step vs torch.profiler, detach. Usage: ``python tests/workers/hooks_ddp.py OUT_DIR``."""

from __future__ import annotations

import sys
import time

from tests.support import profiler as hc

WARMUP, STEPS, DELAY_S = 3, 4, 0.4


def run(rank: int, world_size: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.comm_ddp import traced_allreduce_hook
    from meshscope.agent.instrument.meshinfo import MeshInfo
    from meshscope.agent.instrument.recorder import ListRecorder

    hc.init(rank, world_size, port)
    torch.manual_seed(0)
    # 8 × 4 MiB of gradients in 8 MiB buckets: each all-reduce takes milliseconds, well above the
    # scheduling noise of a shared 2-core machine.
    net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    # A buffer makes DDP broadcast it from rank 0 before every forward (dist._broadcast_coalesced).
    net.register_buffer("scale", torch.ones(1024))
    model = DDP(net, bucket_cap_mb=8)
    originals = hc.patch_targets()
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=MeshInfo(None))
    tracer.attach([model])
    tracer.attach([model])  # idempotent
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 1024)

    def step() -> float:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)  # a user collective (loss averaging): seen by the c10d path
        tracer.flush()
        return avg.item() / world_size

    per_step, measured, fr, prof = hc.profiled_steps(step, rec, warmup=WARMUP, steps=STEPS)
    logging = model._get_ddp_logging_data()

    # Ground truth for the exposed time: rank 1 starts its backward DELAY_S late, so rank 0's buckets cannot
    # complete before then and rank 0 sits in the reducer's finalize for about DELAY_S; rank 1 finds its
    # peer already waiting and is exposed only for the last bucket's transfer.
    delayed_waits, backward_s = [], []
    for _ in range(2):
        n0 = len(rec.collectives)
        opt.zero_grad()
        loss = model(x).square().mean()
        if rank == 1:
            time.sleep(DELAY_S)
        t0 = time.perf_counter()
        loss.backward()
        backward_s.append(time.perf_counter() - t0)
        delayed_waits.append(sum(r["wait_s"] for r in rec.collectives[n0:] if r["source"] == "ddp_comm_hook"))

    tracer.detach()
    n_after_detach = len(rec.collectives)
    loss_after = step()  # training still works, through the (now pass-through) hook
    result = {
        "records": measured,
        "tracer_steps": [hc.tracer_step_totals(s) for s in per_step],
        "profiler_steps": hc.profiler_step_totals(prof, STEPS),
        "fr": fr,
        "tracer_fr": hc.tracer_as_fr(measured),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "bucket_sizes": [int(s) for s in str(logging["bucket_sizes"]).split(",") if s.strip()],
        "errors": [f"{w}: {e!r}" for w, e in rec.errors],
        "stats": dict(tracer.stats),
        "changed_after_detach": hc.changed_targets(originals),
        "records_after_detach": len(rec.collectives) - n_after_detach,
        "hook_still_registered": [h is traced_allreduce_hook for h, _ in model._comm_hooks],
        "hook_tracer_after_detach": [s.tracer is None for _, s in model._comm_hooks],
        "loss_after_detach": loss_after,
        "delay_s": DELAY_S,
        "delayed_waits": delayed_waits,
        "delayed_backward_s": backward_s,
    }
    hc.write(out, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    hc.spawn(run, args=(sys.argv[1],))
