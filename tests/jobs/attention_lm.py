"""A small causal language model with torch's fused attention, trained with DDP, that prints every
step's loss and gradient norm in full precision: no meshscope in it. tests/test_zerocode.py runs it
observed and untouched and compares the output byte for byte."""

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(LM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        ids = torch.randint(0, 256, (4, 33), generator=g)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item()!r} grad_norm {norm.item()!r}", flush=True)
    # torch's gloo teardown race (trainer/train.py, exit_without_finalization): a gloo worker thread that
    # drops an op's tensors while the interpreter finalizes aborts the rank (-6) after a finished run. The
    # DDP model holds the process group: released here, the group's threads end before finalization.
    dist.barrier()
    model = opt = logits = loss = None  # (defined also when --steps is 0)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
