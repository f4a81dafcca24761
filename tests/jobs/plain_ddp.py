"""A tutorial-style DDP training script, written the way the PyTorch DDP tutorial writes one, with no
meshscope in it: the third-party code of tests/test_zerocode.py."""

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(256, 512)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(512, 16)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--fail-at", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DDP(ToyModel())
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    for step in range(args.steps):
        optimised = 0.0  # what this rank's step optimises: the sum of its pre-divided micro-batch losses
        for _ in range(args.accumulate):
            outputs = model(torch.randn(32, 256))
            loss = loss_fn(outputs, torch.randn(32, 16)) / args.accumulate
            loss.backward()
            optimised += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step == args.fail_at and rank == 1:
            raise RuntimeError(f"injected failure at step {step}")
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        if rank == 0:
            print(f"step {step} loss {reduced.item() / dist.get_world_size():.4f}", flush=True)
            print(f"rank 0 step {step} optimised {optimised:.6f}", flush=True)
    # torch's gloo teardown race (pytorch/pytorch#179291): a gloo worker thread still holding a finished op's
    # tensors when the interpreter finalizes aborts the rank (-6) after a finished run. Released first, as a
    # careful job does: the group's threads are done with them before finalization.
    dist.barrier()
    model = optimizer = scheduler = outputs = loss = reduced = None
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
