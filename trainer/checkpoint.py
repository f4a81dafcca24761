"""Checkpoint and resume with torch.distributed.checkpoint (DCP).

Every rank saves its shards; parameter names are global (pipeline stages keep their layers' global
indices), optimizer states are keyed by stage so that interleaved ranks with several optimizers stay
unambiguous. The data pipeline is a pure function of the step, so the step is the only loader state.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _state(parts: list[nn.Module], optimizers: list[Optimizer], stage_ids: list[int]) -> dict:
    model_sd: dict = {}
    optim_sd: dict = {}
    for part, opt, sid in zip(parts, optimizers, stage_ids, strict=True):
        msd, osd = get_state_dict(part, opt)
        model_sd.update(msd)
        optim_sd[f"stage{sid}"] = osd
    return {"model": model_sd, "optim": optim_sd}


def save(directory: str, *, step: int, parts: list[nn.Module], optimizers: list[Optimizer], stage_ids: list[int]) -> Path:
    """Save after ``step`` optimizer steps have completed; resuming continues with step ``step``."""
    path = Path(directory) / f"step-{step}"
    state = _state(parts, optimizers, stage_ids)
    state["step"] = step
    dcp.save(state, checkpoint_id=str(path))
    return path


def latest(directory: str) -> Path | None:
    root = Path(directory)
    found = [
        (int(m.group(1)), p) for p in root.glob("step-*") if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").exists()
    ] if root.is_dir() else []
    return max(found)[1] if found else None


def load(path: Path, *, parts: list[nn.Module], optimizers: list[Optimizer], stage_ids: list[int]) -> int:
    """Load in place; returns the step to continue from."""
    state = _state(parts, optimizers, stage_ids)
    state["step"] = 0
    dcp.load(state, checkpoint_id=str(path))
    for part, opt, sid in zip(parts, optimizers, stage_ids, strict=True):
        keys = get_state_dict(part, opt)[0].keys()
        set_state_dict(
            part, opt, model_state_dict={k: state["model"][k] for k in keys},
            optim_state_dict=state["optim"][f"stage{sid}"],
        )
    return int(state["step"])
