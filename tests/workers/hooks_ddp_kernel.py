"""DDP on 2 gloo ranks through a real telemetry core, its buckets recorded by the dispatcher kernel
(agent/instrument/_ddp_kernel.h) or, with ``MESHSCOPE_DDP_KERNEL=0``, by comm_ddp's comm hook: every record
with its step, the model's comm hooks, an injected late backward, a user's all-reduce inside backward, detach.
Usage: ``python tests/workers/hooks_ddp_kernel.py OUT_DIR``. Used by tests/test_hooks_ddp_kernel.py."""

from __future__ import annotations

import sys
import tempfile
import time

from tests.support import profiler as hc

STEPS, DELAYED, DELAY_S = 4, 2, 0.4
KEEP = ("op", "source", "bytes", "seq", "t_start", "t_end", "wait_s", "step")


def run(rank: int, world_size: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig
    from tests.support.records import capture_records

    hc.init(rank, world_size, port)
    torch.manual_seed(0)
    # 8 × 4 MiB of gradients in 8 MiB buckets (as tests/workers/hooks_ddp.py): several buckets a backward,
    # each taking milliseconds
    net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    model = DDP(net, bucket_cap_mb=8)
    tel = Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(prefix="meshscope-ddp-kernel-"), run="d"),
                    rank=rank, world_size=world_size)
    records = capture_records(tel)
    tel.attach(model_parts=[model])
    tracer = tel._tracers[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 1024)
    # A user's all-reduce made inside backward, on DDP's own group (a tensor hook): the c10d site's op, once
    in_backward = torch.ones(3)

    def user_hook(grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(in_backward)
        return grad

    backward_s: list[float] = []
    for i in range(STEPS + DELAYED):
        with tel.step(i):
            opt.zero_grad()
            out_t = model(x)
            if i == 1:
                out_t.register_hook(user_hook)
            loss = out_t.square().mean()
            if i >= STEPS and rank == 1:  # rank 1 starts its backward late: rank 0 waits for its buckets
                time.sleep(DELAY_S)
            t0 = time.perf_counter()
            loss.backward()
            backward_s.append(time.perf_counter() - t0)
            opt.step()
            dist.all_reduce(loss.detach())  # the user's loss all-reduce, outside backward
    hooks = [type(state).__name__ for _, state in model._comm_hooks]
    tel.detach()
    n_after_detach = len(records()["collective"])
    model(x).square().mean().backward()  # training goes on, untraced
    time.sleep(0.3)
    tel.close()
    got = records()
    colls, steps = got["collective"], got["step"]
    hc.write(out, rank, {
        "records": [{k: c[k] for k in KEEP} for c in colls],
        "steps": [{k: s[k] for k in ("step", "wall_s", "compute_s", "exposed_comm_s", "other_s", "n_collectives")}
                  for s in steps],
        "kernel": tracer._kernels is not None and not hooks,
        "comm_hooks": hooks,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "backward_s": backward_s,
        "records_after_detach": len(colls) - n_after_detach,
        "errors": tel.errors, "stats": {k: v for k, v in tracer.stats.items() if v},
        "steps_n": STEPS, "delay_s": DELAY_S,
    })
    dist.destroy_process_group()


if __name__ == "__main__":
    hc.spawn(run, args=(sys.argv[1],))
