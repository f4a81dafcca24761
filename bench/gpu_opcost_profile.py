"""Where a traced CUDA collective's training-thread CPU goes: each path of the GPU check's section 7
(bench/gpu_check_opcost.py) run ``--calls`` times with the tracer attached under cProfile, on NCCL world
size 1; prints the functions with the most own time, per path. A diagnostic for the next optimisation,
not a check (cProfile's own cost inflates every Python frame alike).

    python bench/gpu_opcost_profile.py [--calls 2000] [--top 18]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=18)
    ns = ap.parse_args()
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    from bench.gpu_check_sections import world_of_one
    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

    device = world_of_one()
    world = dist.group.WORLD
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
    tel = Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(prefix="meshscope-opcost-profile-"), run="p"),
                    rank=0, world_size=1)
    tel.begin_step(0)
    tracer = CollectiveTracer(tel)
    t = torch.ones(256, device=device)
    paths = {"c10d_blocking": lambda: dist.all_reduce(t),
             "c10d_async_wait": lambda: dist.all_reduce(t, async_op=True).wait(),
             "funcol_pg": lambda: funcol.all_reduce(t, "sum", world).wait(),
             "funcol_mesh_dim": lambda: funcol.all_reduce(t, reduceOp="sum", group=(mesh, 0)).wait()}
    tracer.attach(None)
    try:
        for name, op in paths.items():
            for _ in range(50):
                op()
            torch.cuda.synchronize()
            tracer.flush()
            prof = cProfile.Profile()
            prof.enable()
            for i in range(ns.calls):
                op()
                if i % 10 == 9:
                    tracer.flush()
            prof.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(ns.top)
            print(f"===== {name}: {ns.calls} calls")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-4000:])
    finally:
        tracer.detach()
        tel.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
