"""How much of the direct per-step A/B of bench/hooks_overhead.py's DDP arm is meshscope's tracing: the
same A/B (its ``_measure``: blocks of steps, three arms rotated, training-thread CPU, two gloo ranks pinned
one core each) with three pairs of arms, each twice.

- ``vs_other_instance``: as the bench's ``ddp_vs_builtin``: an untraced DDP model against an identical
  second model traced (DDP's buckets in the dispatcher kernel where built);
- ``same_instance``: the traced model against itself detached (with the kernel, attach adds no comm hook,
  so detached it is the untraced model);
- ``untraced_two_instances``: two identical models, neither traced: the on arm has only the telemetry
  core's step boundaries, its flusher and spool writer.

    python bench/ddp_direct_control.py [--steps 20] [--blocks 15]   # one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.hooks_overhead import _measure, free_port, init_gloo  # noqa: E402

FIELDS = ("step_ms", "step_cpu_ms", "cpu_overhead_pct", "cpu_overhead_iqr_pct", "wall_overhead_pct")


def _worker(rank: int, world: int, port: int, steps: int, blocks: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

    init_gloo(rank, world, port)
    if hasattr(os, "sched_setaffinity") and world <= (os.cpu_count() or 1):
        os.sched_setaffinity(0, {rank})  # as the bench's per-step arms
    store = tempfile.mkdtemp(prefix="meshscope-ddp-control-")
    x = torch.randn(32, 512)
    results: dict = {}

    def model() -> DDP:
        torch.manual_seed(0)
        return DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]), bucket_cap_mb=1)

    plain, plain2, traced = model(), model(), model()

    def step_of(m: DDP):
        def step() -> None:
            loss = m(x).square().mean()
            loss.backward()
            dist.all_reduce(loss.detach())
        return step

    def arm(name: str, off, on, parts: list | None) -> None:
        tel = Telemetry(config=TelemetryConfig(store=store, run=name.replace(" ", "-")), rank=rank, world_size=world)
        attach = (lambda: tel.attach(model_parts=parts)) if parts is not None else (lambda: None)
        _measure(name, results, steps=steps, blocks=blocks, step_off=off, step_on=on, attach=attach,
                 detach=tel.detach if parts is not None else (lambda: None), tel=tel, ops=lambda: {})
        tel.close()

    for rep in range(2):
        arm(f"vs_other_instance_{rep}", step_of(plain), step_of(traced), [traced])
        arm(f"same_instance_{rep}", step_of(traced), step_of(traced), [traced])
        arm(f"untraced_two_instances_{rep}", step_of(plain), step_of(plain2), None)
    if rank == 0:
        Path(out_path).write_text(json.dumps({k: {f: v[f] for f in FIELDS} for k, v in results.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=15)
    ns = ap.parse_args()
    import torch.multiprocessing as mp

    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "control.json")
        mp.start_processes(_worker, args=(2, free_port(), ns.steps, ns.blocks, out), nprocs=2, join=True,
                           start_method="spawn")
        report = {"load_avg_start": load_start, **json.loads(Path(out).read_text())}
    report["load_avg_end"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
