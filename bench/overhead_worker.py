"""Worker of bench/telemetry_overhead.py (run under torchrun): one training job that alternates blocks of
steps with telemetry attached and detached, so both arms share the process, the data and the machine's
drift. Rank 0 writes one JSON line per block to --out."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch.distributed as dist

from meshscope.agent.instrument.nulltelemetry import NullTelemetry
from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig
from meshscope.trainer import config
from meshscope.trainer.parallel import build_mesh, schedule_stages
from meshscope.trainer.train import Trainer, _device


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    ns, rest = ap.parse_known_args()
    cfg = config.from_args(config.parser("bench").parse_args(rest))
    total = ns.warmup + 2 * ns.pairs * ns.block
    cfg.steps = total
    cfg = cfg.resolve(int(os.environ["WORLD_SIZE"]))
    device = _device(cfg)
    dist.init_process_group("gloo")
    layout = build_mesh(cfg.parallel, device_type=device.type)
    trainer = Trainer(cfg, device=device, layout=layout, peak_flops=1e12)
    rank = dist.get_rank()
    store = tempfile.mkdtemp(prefix="meshscope-bench-")
    names = [store]
    dist.broadcast_object_list(names, src=0)
    on = Telemetry(config=TelemetryConfig(store=names[0], run="bench"), rank=rank,
                   world_size=dist.get_world_size(), device=device)
    on.start({"strategy": cfg.parallel.strategy})
    off = NullTelemetry()
    stages = schedule_stages(trainer.schedule)
    step = 0
    for _ in range(ns.warmup):
        trainer.train_step(step, off)
        step += 1
    out = open(ns.out, "w") if rank == 0 else None
    for pair in range(ns.pairs):
        order = ("on", "off") if pair % 2 == 0 else ("off", "on")
        for arm in order:
            tel = on if arm == "on" else off
            if arm == "on":
                on.attach(model_parts=trainer.parts, mesh=layout.mesh, schedule=trainer.schedule, stages=stages)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(ns.block):
                trainer.train_step(step, tel)
                step += 1
            dist.barrier()
            dt = time.perf_counter() - t0
            if arm == "on":
                on.detach()
            if out:
                out.write(json.dumps({"pair": pair, "arm": arm, "steps": ns.block, "seconds": dt}) + "\n")
                out.flush()
    on.close()
    if out:
        out.write(json.dumps({"dropped": on.dropped_records, "errors": on.errors}) + "\n")
        out.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
