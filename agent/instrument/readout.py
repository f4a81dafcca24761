"""What the flusher reads off the training thread: where it is (the hang watchdog) and a step value
handed over as a tensor or a number."""

from __future__ import annotations

from typing import Any


def where_is(frame: Any) -> str:
    """'in a collective: <function> (<file>:<line>)' or 'not in a collective: ...' from a thread's stack."""
    top = frame
    f = frame
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if "torch/distributed/" in path:
            return f"in a collective: {f.f_code.co_name} ({path.rsplit('/', 1)[-1]}:{f.f_lineno})"
        if "torch/autograd/" in path:  # the C++ engine, where DDP's reducer waits for its all-reduces
            return f"in backward: {f.f_code.co_name} ({path.rsplit('/', 1)[-1]}:{f.f_lineno})"
        f = f.f_back
    if top is None:
        return "not in a collective: training thread not found"
    return f"not in a collective: {top.f_code.co_name} ({top.f_code.co_filename.rsplit('/', 1)[-1]}:{top.f_lineno})"


def as_float(value: Any, default: float = float("nan")) -> float:
    if value is None:
        return default
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return default
