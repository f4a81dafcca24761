"""meshscope: observability and profiling for distributed PyTorch training.

The public API a training loop uses::

    import meshscope
    tel = meshscope.Telemetry(meshscope.TelemetryConfig(run="my-run", store="runs"))

or, with no change to the loop (what ``meshscope run -- COMMAND`` does for a whole job)::

    meshscope.observe(store="runs")                       # before the model's first forward
    Trainer(..., callbacks=[meshscope.TransformersCallback()])   # Hugging Face
    Trainer(..., callbacks=[meshscope.LightningCallback()])      # Lightning

The checkout's top-level folders are installed under this namespace only (``meshscope.agent``,
``meshscope.trainer``, ``meshscope.dashboard``, ``meshscope.grafana``), so nothing generic such as
``agent`` lands in a user's environment. Names are imported on first use: ``meshscope agent`` and the CLI
never import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from meshscope.agent import version

# public name -> module that defines it
_LAZY = {
    "Telemetry": "meshscope.agent.instrument.telemetry",
    "TelemetryConfig": "meshscope.agent.instrument.telemetry",
    "NullTelemetry": "meshscope.agent.instrument.nulltelemetry",
    "observe": "meshscope.agent.zerocode",
}
# framework callbacks: built on first use (each imports its framework)
_CALLBACKS = {
    "TransformersCallback": ("transformers_callback", ()),
    "LightningCallback": ("lightning_callback", ("lightning.pytorch",)),
}

__all__ = ["version", *_LAZY, *_CALLBACKS]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _CALLBACKS:
        factory, args = _CALLBACKS[name]
        return getattr(importlib.import_module("meshscope.agent.zerocode.frameworks"), factory)(*args)
    raise AttributeError(f"module 'meshscope' has no attribute {name!r}")
