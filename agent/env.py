"""Every ``MESHSCOPE_*`` variable meshscope reads, and how, in one place: the launcher's word to the
bootstrap and the ranks (zero-code's store, run, attempt, FLOPs mode, off switch), the hot path's switches
(the C forms, the dispatcher kernels) and the cache directory. Imports nothing of meshscope or torch (the
launcher, the bootstrap's driver and the tracer's first import all read it). The one other reader is the
bootstrap ``sitecustomize`` (``MESHSCOPE_DISABLE``, the same rule as ``disabled`` below), which must import
nothing of meshscope when it is set."""

from __future__ import annotations

import os
from pathlib import Path
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
ENV_NATIVE = "MESHSCOPE_NATIVE"  # "0": the tracer's Python forms instead of its C ones (agent/instrument/native.py)
ENV_FUNCOL_KERNELS = "MESHSCOPE_FUNCOL_KERNELS"  # "0": no dispatcher kernels for functional collectives
ENV_DDP_KERNEL = "MESHSCOPE_DDP_KERNEL"  # "0": DDP's buckets through a comm hook, not the dispatcher kernel
ENV_CACHE_DIR = "MESHSCOPE_CACHE_DIR"  # built kernels, the reader's copies of a bucket and its segments


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


def switched_off(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """An on-by-default switch (``ENV_NATIVE``, ``ENV_FUNCOL_KERNELS``, ``ENV_DDP_KERNEL``) set to ``0``."""
    return environ.get(name, "1") == "0"


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """meshscope's cache directory, absolute: ``$MESHSCOPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/meshscope``,
    else ``~/.cache/meshscope``."""
    root = environ.get(ENV_CACHE_DIR) or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "meshscope")
    return Path(root).expanduser().resolve()
