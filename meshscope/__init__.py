"""meshscope: observability and profiling for distributed PyTorch training.

The public API a training loop uses::

    import meshscope
    tel = meshscope.Telemetry(meshscope.TelemetryConfig(run="my-run", store="runs"))

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
    "NullTelemetry": "meshscope.agent.instrument.telemetry",
}

__all__ = ["version", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshscope' has no attribute {name!r}")
