"""AdamW, warmup + cosine learning rate, and gradient clipping on the true global norm."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshscope.trainer.config import OptimConfig


def build_optimizers(parts: list[nn.Module], cfg: OptimConfig) -> list[torch.optim.Optimizer]:
    """One AdamW per model part (a pipeline rank may hold several stages); weight decay on matrices only."""
    opts = []
    for part in parts:
        params = [p for p in part.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # One fused kernel per parameter group on a GPU (fewer launches and passes over the fp32 state than
        # foreach); sharded (DTensor) and CPU parameters keep foreach, the form every backend supports.
        fused = bool(params) and all(p.is_cuda and not isinstance(p, DTensor) for p in params)
        opts.append(torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                                      fused=fused or None, foreach=None if fused else True))
    return opts


def lr_at(step: int, *, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _grads_by_mesh(parts: list[nn.Module]) -> dict[object, list[torch.Tensor]]:
    """Gradients grouped by DeviceMesh (None: plain tensors). Foreach kernels and stacking cannot mix
    DTensors of different meshes (FSDP's 1-D vs FSDP×TP's 2-D) or DTensors with plain tensors."""
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for part in parts:
        for p in part.parameters():
            if p.grad is not None:
                by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p.grad)
    return by_mesh


@torch.no_grad()
def global_grad_norm(parts: list[nn.Module], *, pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model, identical on every rank.

    Sharded (FSDP2) and tensor-parallel gradients are DTensors: their norm is a DTensor with a partial or
    replicated placement, and ``full_tensor()`` reduces it over the right ranks. Each mesh is reduced on
    its own and the squares summed. Each pipeline stage holds different parameters: sum squares over pp.
    """
    device = next(p.device for part in parts for p in part.parameters())
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for grads in _grads_by_mesh(parts).values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = sq + norm.float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()


@torch.no_grad()
def clip_(parts: list[nn.Module], *, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm) (the norm already global)."""
    coef = max_norm / (float(total_norm) + 1e-6)
    if coef >= 1.0:
        return
    for grads in _grads_by_mesh(parts).values():
        torch._foreach_mul_(grads, coef)
