"""What the zero-code driver reads off a job it did not write: where this process stands (rank, world,
device), the token count of a model call, the pipeline schedule, and the run record's fields (the layout
and the FLOPs come from ``census``).

Each figure is measured or absent: a field the job does not reveal is left empty (0 or ""), never guessed."""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from meshscope.agent.env import launch_attempt



def patch(owner: Any, name: str, make: Callable[[Any], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)`` (keeping the original's name and docstring)."""
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(make(original)))


@dataclass(frozen=True, slots=True)
class Where:
    rank: int
    world_size: int
    local_rank: int
    attempt: int
    device: Any
    backend: str


def process(module: Any) -> Where:
    """This process's place in the job: the default process group's rank and size when one is initialised
    (else torchrun's environment, else a single process), and the device of the model's parameters."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    else:
        rank, world, backend = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), ""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return Where(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                 attempt=launch_attempt(), device=device, backend=backend)


def instrumented_by_api(torch: Any) -> bool:
    """A ``Telemetry`` of the explicit API has attached its collective tracer in this process (the
    tracer marks what it patches): zero-code would record the same job twice."""
    dist = torch.distributed
    return dist.is_available() and getattr(getattr(dist, "all_reduce", None), "__meshscope_tracer__", None) is not None


def default_run_name(command: list[str], *, now: float | None = None) -> str:
    """``<script stem>-<YYYYmmdd-HHMMSS>``: the script is the first ``*.py`` argument, else the module of
    the last ``-m`` (``python -m torch.distributed.run ... -m pkg.train`` trains ``pkg.train``), else the
    program's name; anything outside the run-name rule's characters becomes ``-``."""
    stem = next((os.path.basename(a)[:-3] for a in command if a.endswith(".py")), "")
    if not stem:
        modules = [command[i + 1] for i, a in enumerate(command[:-1]) if a == "-m"]
        stem = modules[-1].rsplit(".", 1)[-1] if modules else (os.path.basename(command[0]) if command else "")
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.") or "job"
    return f"{stem[:80]}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"


def shared_run_name(*, timeout_s: float = 60.0) -> str:
    """A run name every rank agrees on when no launcher chose one (a framework callback added by hand):
    rank 0 picks it and hands it over through the default process group's store, which is no collective,
    so the job's collectives stay as they are."""
    import torch.distributed as dist

    name = default_run_name(sys.argv)
    if not (dist.is_available() and dist.is_initialized()):
        return name
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    key = "meshscope/run_name"
    if dist.get_rank() == 0:
        store.set(key, name)
        return name
    store.wait([key], timedelta(seconds=timeout_s))
    return store.get(key).decode()


class TokenFinder:
    """(tokens, sequence length) of a model call whose input is token ids: ``input_ids``, else the first
    integer (batch, sequence) tensor among the arguments (one level into a tuple, list or dict: a batch);
    (0, 0) when there is none. Where it found them is remembered: a training loop calls its model the same
    way every step, so later calls look there first (a few attribute reads) before searching again."""

    def __init__(self) -> None:
        import torch

        self._tensor, self._bool = torch.Tensor, torch.bool
        self._where: tuple = ()

    def _ids(self, value: Any) -> Any:
        if isinstance(value, self._tensor) and value.dim() == 2 and not value.is_floating_point() \
                and not value.is_complex() and value.dtype != self._bool:
            return value
        return None

    def _at(self, where: tuple, args: tuple, kwargs: dict) -> Any:
        try:
            value = kwargs[where[1]] if where[0] == "kw" else args[where[1]]
            for key in where[2:]:
                if not isinstance(value, (tuple, list, dict)):  # a tensor there now: not the batch it was
                    return None
                value = value[key]
            return self._ids(value)
        except (KeyError, IndexError, TypeError):
            return None

    def _search(self, args: tuple, kwargs: dict) -> tuple:
        places = [("kw", "input_ids")] + [("arg", i) for i in range(len(args))] + [("kw", k) for k in kwargs]
        for place in places:
            value = kwargs.get(place[1]) if place[0] == "kw" else args[place[1]]
            if self._ids(value) is not None:
                return place
            if isinstance(value, (tuple, list)):
                inner = range(len(value))
            elif isinstance(value, dict):
                inner = ["input_ids", *value] if "input_ids" in value else list(value)
            else:
                continue
            for key in inner:
                if self._ids(value[key]) is not None:
                    return (*place, key)
        return ()

    def __call__(self, args: tuple, kwargs: dict) -> tuple[int, int]:
        found = self._at(self._where, args, kwargs) if self._where else None
        if found is None:
            self._where = self._search(args, kwargs)
            found = self._at(self._where, args, kwargs) if self._where else None
        return (int(found.numel()), int(found.shape[1])) if found is not None else (0, 0)


def model_name(root: Any) -> str:
    """The user's class: DDP and Lightning's wrappers keep the model in ``.module``; ``fully_shard`` makes a
    class ``FSDP<Name>`` whose bases are (FSDPModule, the user's class)."""
    from torch.distributed.fsdp import FSDPModule

    model = getattr(root, "module", root)
    cls = type(model)
    if isinstance(model, FSDPModule) and cls.__name__.startswith("FSDP") and len(cls.__bases__) > 1:
        cls = cls.__bases__[-1]
    return cls.__name__


# torch.distributed.pipelining's schedule classes -> the names the reference trainer and the pages use
SCHEDULES = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b", "ScheduleInterleaved1F1B": "interleaved",
             "ScheduleInterleavedZeroBubble": "interleaved-zb", "ScheduleLoopedBFS": "looped-bfs"}


def pipeline(schedules: list[Any]) -> dict:
    """The run record's pipeline fields from the first schedule this rank stepped: its name, microbatches,
    virtual stages per rank, the pipeline degree and this rank's place in it."""
    if not schedules:
        return {}
    sched = schedules[0]
    stages = list(getattr(sched, "_stages", None) or [sched._stage])
    name = type(sched).__name__
    return {"schedule": SCHEDULES.get(name, name.lower()), "microbatches": int(sched._n_microbatches),
            "virtual_stages": len(stages), "pp": int(stages[0].group_size), "pp_rank": int(stages[0].group_rank)}


def pipeline_tokens(schedule: Any, args: tuple, kwargs: dict, find: TokenFinder) -> tuple[int, int]:
    """(tokens, sequence length) of one schedule step on this rank: the token ids the first stage is given,
    else the targets the last stage is given, else (a middle stage) its input's shape as the stage knows it
    (microbatch × sequence, of a 3-D activation) times the microbatches; (0, 0) where none of these is. The roots' own forward is not counted inside a
    schedule (its hooks stand aside there)."""
    tokens, seq = find(args, kwargs)
    if tokens:
        return tokens, seq
    stages = list(getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)])
    meta = getattr(stages[0], "inputs_meta", None) if stages and stages[0] is not None else None
    # (microbatch, sequence, hidden): a language model's activations; a 2-D input is (samples, features)
    first = next((t for t in (meta or ()) if hasattr(t, "shape") and len(t.shape) >= 3), None)
    if first is None:
        return 0, 0
    return int(first.shape[0]) * int(first.shape[1]) * int(schedule._n_microbatches), int(first.shape[1])


def run_info(*, roots: list[Any], where: Where, seq_len: int, tokens: int, flops: Any, layout: Any,
             framework: str, schedules: list[Any]) -> dict:
    """The run record's fields a job reveals (``Telemetry.start`` fills the process's own). ``flops``: a
    ``census.Flops``; ``layout``: a ``census.JobLayout``, or None when it could not be read (then the run is
    described as the default group's data parallel, and says so in its strategy: ``manual``)."""
    import torch

    from meshscope.agent.instrument.flops import device_peak

    n = n_embed = 0
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                n += p.numel()  # a DTensor's numel is the global one
                if isinstance(module, torch.nn.Embedding):
                    n_embed += p.numel()
    peak, source = device_peak(where.device, calibrate_gpu=False)
    pp = pipeline(schedules)
    if layout is not None:
        strat, mesh, coords = layout.strategy(world_size=where.world_size), dict(layout.sizes), dict(layout.coords)
    else:
        strat = "single" if where.world_size == 1 else "manual"
        mesh, coords = {"dp": where.world_size, "tp": 1, "pp": 1}, {"dp": where.rank, "tp": 0, "pp": 0}
    per_rank_batch = tokens // seq_len if seq_len else 0
    model = "+".join(model_name(r) for r in roots)
    return {
        "strategy": strat, "mesh": mesh, "coords": coords, "schedule": pp.get("schedule", ""),
        "microbatches": pp.get("microbatches", 0), "virtual_stages": pp.get("virtual_stages", 1),
        "model": model, "n_params": n, "n_params_nonembedding": n - n_embed, "seq_len": seq_len,
        "global_batch": per_rank_batch * mesh.get("dp", 1), "flops_per_token": flops.per_token,
        "flops_method": flops.method, "peak_flops": peak, "peak_source": source,
        "device": torch.cuda.get_device_name(where.device) if where.device.type == "cuda" else "cpu",
        "backend": where.backend, "dtype": str(next((p.dtype for r in roots for p in r.parameters()), "")).replace("torch.", ""),
        "config": {"zero_code": True, "framework": framework, "argv": sys.argv[:50]},
    }
