"""The launcher's word to the bootstrap and the ranks: zero-code's ``MESHSCOPE_*`` environment, read here
only (the package, the driver's helpers and ``meshscope run`` import it; it imports none of them)."""

from __future__ import annotations

import os
from typing import Mapping

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
