"""Zero-code observation of a job nobody wrote for meshscope: ``meshscope run -- COMMAND``.

``meshscope run`` (``.cli``) puts ``bootstrap/`` first on the job's PYTHONPATH. Its ``sitecustomize``
runs in every Python process the command starts (torchrun and its ranks, ``accelerate launch``, a plain
``python``), chains the job's own ``sitecustomize``, and calls ``.inject.activate``, which imports no
torch: :func:`observe` waits for the job to import torch (``.imports``) and then installs the driver's
hooks (``.driver``); the framework integrations (``.frameworks``) are added to Hugging Face and Lightning
trainers as they are built. A user who does not launch through ``meshscope run`` calls :func:`observe`
(or adds a framework callback) in the training script instead: the same driver.

The environment variables are the launcher's word to the bootstrap, read in ``.env`` only."""

from __future__ import annotations

import os
from typing import Any

from meshscope.agent.env import (  # noqa: F401  (re-exported: the package's word)
    DEFAULT_STORE, ENV_ATTEMPT, ENV_DISABLE, ENV_FLOPS, ENV_RUN, ENV_STORE, disabled, flops_mode, launch_attempt,
)

_driver: Any = None


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
