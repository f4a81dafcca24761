"""Apply a parallel layout to the model: DeviceMesh, tensor parallel, FSDP2 / DDP, pipeline stages.

Order follows torchtitan: split into pipeline stages, then TP on each stage, then FSDP2 (or DDP) on the
data-parallel dimension. Mesh dims are ordered (pp, dp, tp) so that tp is the fastest-varying one (its
ranks are neighbours on a node). The dp dim is named ``fsdp`` when it is sharded, ``dp`` when it is
replicated, so that telemetry reports the collective's real purpose.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    _PipelineSchedule,
)
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from meshscope.trainer.config import ParallelConfig
from meshscope.trainer.model import GPT


@dataclass(kw_only=True)
class Placement:
    """Where this rank sits in the mesh."""

    mesh: DeviceMesh
    parallel: ParallelConfig
    dp_name: str  # "fsdp" or "dp"

    @property
    def dp_rank(self) -> int:
        return self.mesh[self.dp_name].get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    def coords(self) -> dict[str, int]:
        return {"pp": self.pp_rank, self.dp_name: self.dp_rank, "tp": self.tp_rank}

    def sizes(self) -> dict[str, int]:
        p = self.parallel
        return {"pp": p.pp, self.dp_name: p.dp, "tp": p.tp}

    def stage_ids(self) -> list[int]:
        """Stages held by this rank: loop style, rank r holds r, r+pp, r+2pp, ... (interleaved)."""
        p = self.parallel
        return [self.pp_rank + k * p.pp for k in range(p.virtual_stages)]


def build_mesh(parallel: ParallelConfig, *, device_type: str) -> Placement:
    dp_name = "fsdp" if parallel.fsdp else "dp"
    mesh = init_device_mesh(
        device_type, (parallel.pp, parallel.dp, parallel.tp), mesh_dim_names=("pp", dp_name, "tp")
    )
    return Placement(mesh=mesh, parallel=parallel, dp_name=dp_name)


def split_stage(model: GPT, *, stage: int, n_stages: int, in_place: bool) -> GPT:
    """The part of ``model`` that pipeline stage ``stage`` of ``n_stages`` owns (contiguous layers; the
    embedding on the first stage, the final norm and head on the last)."""
    part = model if in_place else copy.deepcopy(model)
    n = model.flavor.n_layers // n_stages
    keep = {str(i) for i in range(stage * n, (stage + 1) * n)}
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_emb = None
    if stage != n_stages - 1:
        part.norm = None
        part.head = None
    return part


def apply_tp(part: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Megatron-style: q/k/v and MLP-up column-parallel, attention-out and MLP-down row-parallel;
    with sequence parallel the norms run on sequence shards and the residual stream stays sharded."""
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    top: dict[str, object] = {}
    if part.tok_emb is not None:
        top["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if part.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if part.head is not None:
        top["head"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)
    if top:
        parallelize_module(part, tp_mesh, top)
    for block in part.layers.values():
        plan: dict[str, object] = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan.update({
                "attn_norm": SequenceParallel(),
                "attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "mlp_norm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)


def apply_fsdp(part: GPT, dp_mesh: DeviceMesh, *, pipelined: bool) -> None:
    # Under PP each microbatch would re-gather a resharded block: keep blocks unsharded between the
    # forward and backward of a step instead (torchtitan does the same).
    for block in part.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=not pipelined)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=not pipelined)


def build_schedule(
    parts: list[nn.Module], *, layout: Placement, device: torch.device, loss_fn
) -> _PipelineSchedule:
    p = layout.parallel
    group = layout.mesh["pp"].get_group()
    stages = [
        PipelineStage(part, sid, p.n_stages, device, group=group)
        for part, sid in zip(parts, layout.stage_ids(), strict=True)
    ]
    # scale_grads=False: loss_fn already divides by the microbatch count, so the losses it returns sum
    # to the step's mean loss and gradient accumulation across schedule.step calls stays correct.
    multi = {"interleaved": ScheduleInterleaved1F1B, "interleaved-zb": ScheduleInterleavedZeroBubble,
             "looped-bfs": ScheduleLoopedBFS}.get(p.schedule)
    if multi is not None:
        return multi(stages, n_microbatches=p.microbatches, loss_fn=loss_fn, scale_grads=False)
    cls = ScheduleGPipe if p.schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=p.microbatches, loss_fn=loss_fn, scale_grads=False)


def schedule_stages(schedule: _PipelineSchedule | None) -> list[PipelineStage] | None:
    """The stages a schedule drives on this rank (single-stage schedules keep one in ``_stage``)."""
    if schedule is None:
        return None
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def parallelize(
    model: GPT, *, layout: Placement, device: torch.device, activation_checkpoint: bool, compile: bool = False
) -> list[nn.Module]:
    """Model parts this rank trains (one, or ``virtual_stages`` under interleaved PP), on ``device``,
    with TP, block compilation and FSDP2/DDP applied (torchtitan's order: compile after TP, before FSDP)."""
    p = layout.parallel
    if p.pp > 1:
        ids = layout.stage_ids()
        parts = [split_stage(model, stage=s, n_stages=p.n_stages, in_place=len(ids) == 1) for s in ids]
    else:
        parts = [model]
    dp_mesh = layout.mesh[layout.dp_name]
    wrapped: list[nn.Module] = []
    for part in parts:
        part.to(device)
        for block in part.layers.values():
            block.activation_checkpoint = activation_checkpoint
        if p.tp > 1:
            apply_tp(part, layout.mesh["tp"], sequence_parallel=p.sequence_parallel)
        if compile:
            for block in part.layers.values():
                block.compile_body()
        if p.fsdp:
            apply_fsdp(part, dp_mesh, pipelined=p.pp > 1)
        elif p.dp > 1:
            # No buffer broadcast: the only buffers (rotary tables) are derived from the shape and equal
            # everywhere; broadcasting them would add a collective to every step for nothing.
            part = DistributedDataParallel(part, process_group=dp_mesh.get_group(), broadcast_buffers=False,
                                           device_ids=None if device.type == "cpu" else [device])
        wrapped.append(part)
    return wrapped


def unwrap(part: nn.Module) -> nn.Module:
    return part.module if isinstance(part, DistributedDataParallel) else part


def world_loss(loss: torch.Tensor | None, *, layout: Placement) -> float:
    """The step's global mean loss on every rank: the last stage's tp-rank-0 of each replica contributes
    loss/dp and one world all-reduce sums it (one scalar, negligible next to a step)."""
    p = layout.parallel
    owner = layout.pp_rank == p.pp - 1 and layout.tp_rank == 0
    value = (loss.detach().float() / p.dp) if (owner and loss is not None) else torch.zeros(())
    value = value.reshape(1).to(layout.mesh.device_type)
    dist.all_reduce(value)
    return float(value.item())
