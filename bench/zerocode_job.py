"""Job of bench/zerocode_overhead.py (under torchrun): one small DDP language-model loop, run as it is
(``--mode off``, also what ``meshscope run`` observes), or written around the explicit API (``--mode
explicit``: ``Telemetry.step`` / ``phase`` / ``attach``). Rank 0 writes its training thread's CPU time per
measured step to --out."""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class TinyLM(nn.Module):
    def __init__(self, vocab=128, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.mlp(self.embed(ids)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("off", "explicit"), default="off")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--store", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(TinyLM())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tel = None
    if args.mode == "explicit":
        from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

        tel = Telemetry(config=TelemetryConfig(store=args.store, run="explicit"), rank=rank,
                        world_size=dist.get_world_size())
        tel.start({"strategy": "ddp"})
        tel.attach(model_parts=[model])
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 128, (4, 17), generator=g) for _ in range(8)]
    cpu = []
    for step in range(args.steps):
        ids = batches[step % len(batches)]
        t0 = time.thread_time()
        if tel is None:
            loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            with tel.step(step) as s:
                with tel.phase("forward"):
                    loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
                with tel.phase("backward"):
                    loss.backward()
                with tel.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
                s.update(loss=loss, tokens=ids[:, :-1].numel())
        if step >= args.warmup:
            cpu.append(time.thread_time() - t0)
    if tel is not None:
        tel.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"cpu_s": cpu}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
