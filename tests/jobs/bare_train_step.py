"""``Trainer.train_step`` in a bare loop, as the benchmarks call it (no ``Trainer.run``, so no
``Faults.before_step``), printing the command's step lines (``step=<n> loss=<x> skipped=<bool>``). Plain
process or torchrun; takes the trainer's own flags."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from meshscope.agent.instrument.nulltelemetry import NullTelemetry
from meshscope.trainer import config
from meshscope.trainer.parallel import build_mesh
from meshscope.trainer.train import Trainer, _device, _single_process_env, exit_without_finalization


def main(argv: list[str]) -> int:
    cfg = config.from_args(config.parser("bare_train_step").parse_args(argv))
    _single_process_env()
    cfg = cfg.resolve(int(os.environ["WORLD_SIZE"]))
    device = _device(cfg)
    dist.init_process_group("gloo")
    try:
        trainer = Trainer(cfg, device=device, layout=build_mesh(cfg.parallel, device_type=device.type),
                          peak_flops=1e12)
        tel = NullTelemetry()
        for step in range(cfg.steps):
            r = trainer.train_step(step, tel)
            if dist.get_rank() == 0:
                print(f"step={step} loss={r['loss']:.8f} skipped={r['skipped']}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # As the trainer's command leaves (trainer/train.py): torch's gloo teardown race aborted rank 0 of the
    # 2-rank PP case (-6, "terminate called without an active exception") after its last step in a suite run.
    exit_without_finalization(main(sys.argv[1:]))
