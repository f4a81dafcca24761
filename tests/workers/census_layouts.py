"""Builds each data / tensor parallel layout torch offers on 4 gloo ranks (DDP, composable replicate,
FSDP2, FSDP2 on a replicate × shard mesh of shard 1 — torchtitan's DDP —, HSDP, TP, FSDP2 + TP, FSDP2 over
dp_shard × cp with a cp mesh no parameter lives on — torchtitan's context parallel —) around one
small attention model and prints, from rank 0, one JSON line per layout: what ``census`` reads off it
(strategy, mesh sizes, FLOPs per token) and what the model's shape says. Used by tests/test_census.py."""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from meshscope.agent.zerocode import census

DIM, HIDDEN, VOCAB, SEQ, LAYERS = 32, 64, 64, 16, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, 2, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.w1, self.w2 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        x = x + self.attention(x)
        return x + self.w2(torch.relu(self.w1(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(LAYERS):
        plan.update({f"layers.{i}.attention.wq": ColwiseParallel(), f"layers.{i}.attention.wk": ColwiseParallel(),
                     f"layers.{i}.attention.wv": ColwiseParallel(), f"layers.{i}.attention.wo": RowwiseParallel(),
                     f"layers.{i}.w1": ColwiseParallel(), f"layers.{i}.w2": RowwiseParallel()})
    return plan


def build(name, meshes):
    """The model of layout ``name``; every DeviceMesh built goes to ``meshes`` (what zero-code keeps)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = Model()
    if name == "fsdp+cp":  # torchtitan's ParallelDims: a 1-D world mesh unflattened, FSDP on dp_shard × cp
        world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
        batches = world._unflatten(0, (2, 2), ("batch", "cp"))
        dense = world._unflatten(0, (2, 2), ("dp_shard", "cp"))
        fsdp = dense["dp_shard", "cp"]._flatten("dp_shard_cp")
        meshes += [world, batches, dense, fsdp]
        for layer in model.layers:
            fully_shard(layer, mesh=fsdp)
        return fully_shard(model, mesh=fsdp)
    if name == "ddp":
        return DistributedDataParallel(model)
    if name == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return replicate(model)
    if name == "fsdp":
        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)
    if name in ("replicate-shard1", "hsdp"):
        shape = (4, 1) if name == "replicate-shard1" else (2, 2)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard"))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if name == "tp":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        return parallelize_module(model, mesh, tp_plan())
    if name == "fsdp+tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan())
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        return fully_shard(model, mesh=mesh["dp_shard"])
    raise ValueError(name)


def main():
    dist.init_process_group("gloo")
    for name in sys.argv[1:]:
        meshes = []
        model = build(name, meshes)
        lay = census.layout([model], world_size=4, rank=dist.get_rank(), pipeline={}, meshes=meshes)
        flops = census.flops([model], seq_len=SEQ, layout=lay)
        tp, cp = lay.sizes["tp"], lay.sizes.get("cp", 1)
        # the model's shape: per block 4·D² attention + 2·D·H MLP, the head V·D; the TP plan splits the
        # blocks' matmuls (not the head) over tp; a rank's SEQ tokens are 1/cp of the sequence attended over
        blocks = LAYERS * (4 * DIM * DIM + 2 * DIM * HIDDEN)
        expected = 6 * (blocks / tp + VOCAB * DIM) + 12 * LAYERS * (DIM / tp) * SEQ * cp
        if dist.get_rank() == 0:
            print(json.dumps({"layout": name, "strategy": lay.strategy(world_size=4), "sizes": lay.sizes,
                              "flops_per_token": flops.per_token, "expected": expected, "method": flops.method}),
                  flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
