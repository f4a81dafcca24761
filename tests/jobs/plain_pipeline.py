"""A plain pipeline-parallel loop with torch.distributed.pipelining (2 stages, one per rank), with no
meshscope in it: third-party code for tests/test_zerocode.py."""

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


def stage_module(rank, dim=256, layers=2):
    blocks = [nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers)]
    if rank == 1:
        blocks.append(nn.Linear(dim, 8))
    return nn.Sequential(*blocks)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    module = stage_module(rank)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = cls(stage, n_microbatches=args.microbatches, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        x, y = torch.randn(32, 256, generator=g), torch.randn(32, 8, generator=g)
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 1:
            print(f"step {step} loss {sum(l.item() for l in losses) / len(losses):.4f}", flush=True)
    # torch's gloo teardown race (pytorch/pytorch#179291): a gloo worker thread still holding a finished op's
    # tensors when the interpreter finalizes aborts the rank (-6) after a finished run. Released first, as a
    # careful job does: the group's threads are done with them before finalization.
    dist.barrier()
    stage = schedule = module = optimizer = losses = None
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
