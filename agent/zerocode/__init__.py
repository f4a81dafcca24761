"""Zero-code observation of a job nobody wrote for meshscope: ``meshscope run -- COMMAND``.

``meshscope run`` (``.cli``) puts ``bootstrap/`` first on the job's PYTHONPATH. Its ``sitecustomize``
runs in every Python process the command starts (torchrun and its ranks, ``accelerate launch``, a plain
``python``), chains the job's own ``sitecustomize``, and calls ``.inject.activate``, which imports no
torch: :func:`observe` waits for the job to import torch (``.imports``) and then installs the driver's
hooks (``.driver``); the framework integrations (``.frameworks``) are added to Hugging Face and Lightning
trainers as they are built. A user who does not launch through ``meshscope run`` calls :func:`observe`
(or adds a framework callback) in the training script instead: the same driver.

The environment variables below are the launcher's word to the bootstrap, read here only."""

from __future__ import annotations

import os
from typing import Any, Mapping

ENV_STORE = "MESHSCOPE_STORE"  # the run store the ranks' spools go to
ENV_RUN = "MESHSCOPE_RUN"  # the run name every process of the job shares
ENV_DISABLE = "MESHSCOPE_DISABLE"  # "1": leave the job untouched (the bootstrap imports nothing of meshscope)
# "analytic" (default): model FLOPs from the modules' parameter shapes at the end of the first step (MFU);
# "off": none counted (MFU n/a, said so). Nothing is ever counted inside the job's forward or backward.
ENV_FLOPS = "MESHSCOPE_FLOPS"
# The launch's first attempt number (``meshscope run --new-attempt``: one past the run's last stored attempt);
# torchrun's restarts of the launch count on from it.
ENV_ATTEMPT = "MESHSCOPE_ATTEMPT"
DEFAULT_STORE = "meshscope-runs"

_driver: Any = None


def flops_mode(environ: Mapping[str, str] = os.environ) -> str:
    """MESHSCOPE_FLOPS, checked: ``ValueError`` naming the bad value (``meshscope run`` says it before any
    rank starts; a rank that meets one anyway counts no FLOPs)."""
    from meshscope.agent.instrument.config import FLOPS_MODES  # the config's one list (imports no torch)

    mode = environ.get(ENV_FLOPS, "").strip().lower() or "analytic"
    if mode not in FLOPS_MODES:
        raise ValueError(f"{ENV_FLOPS}={environ.get(ENV_FLOPS)!r}: not one of {', '.join(FLOPS_MODES)}")
    return mode


def disabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV_DISABLE, "").strip().lower() in ("1", "true", "yes", "on")


def launch_attempt(environ: Mapping[str, str] = os.environ) -> int:
    """This process's attempt of the run: the launch's first attempt (MESHSCOPE_ATTEMPT, 0 unless ``meshscope
    run --new-attempt`` set it) plus torchrun's restart count (TORCHELASTIC_RESTART_COUNT)."""
    return int(environ.get(ENV_ATTEMPT) or 0) + int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def observe(*, store: str | None = None, run: str | None = None) -> Any:
    """Observe this process's training with no other change: steps from the optimizer, phases from the
    model's hooks, collectives, memory, tokens, FLOPs. Call before the first forward. Idempotent: the
    first call's store and run stand. ``run=None``: the launcher's name, else one rank 0 picks.
    ``None`` (nothing observed) when MESHSCOPE_DISABLE is set."""
    global _driver
    if _driver is not None or disabled():
        return _driver
    from meshscope.agent.zerocode.driver import Driver
    from meshscope.agent.zerocode.imports import when_imported

    try:
        flops = flops_mode()
    except ValueError:
        flops = "off"
    _driver = Driver(store=store or os.environ.get(ENV_STORE) or DEFAULT_STORE,
                     run=run or os.environ.get(ENV_RUN) or None, flops=flops)
    when_imported("torch", _driver.install)
    return _driver


def current() -> Any:
    """The driver of this process, or ``None``."""
    return _driver
