"""What the flusher reads off the training thread: where it is (the hang watchdog), a step value handed
over as a tensor or a number, and what it queued."""

from __future__ import annotations

import collections
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


def hang_message(frame: Any, *, state: Any, last_step: int, last_coll: tuple | None, stalled_s: float) -> str:
    """The ``hang`` event's message: where the training thread is (``frame``, its top), the open step and
    phase (``state``: a StepState or None) or the last step ended, how long nothing progressed, and the
    last completed collective (op, dim, seq) if any."""
    context = f"step {state.step} phase {state.phase or '-'}" if state else f"between steps after {last_step}"
    done = f"; last completed collective {last_coll[0]} dim={last_coll[1]} seq={last_coll[2]}" if last_coll else ""
    return f"{where_is(frame)} ({context}; no progress for {stalled_s:.0f}s{done})"[:500]


def as_float(value: Any, default: float = float("nan")) -> float:
    if value is None:
        return default
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError, LookupError):
        return default


def read_loss(value: Any) -> float | None:
    """A step's loss as given (a float, a tensor, or an object whose ``item`` raises ``LookupError`` when
    the step has no single loss, e.g. the zero-code driver's ``StepLoss`` of a GAN's two models); None
    when none was given or it has none: absent, which is not a non-finite loss."""
    if value is None:
        return None
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except LookupError:
        return None
    except (TypeError, ValueError, RuntimeError):
        return float("nan")


# The tracers' counts of what they could not record: CollectiveTracer.stats (the done queue full, ops left
# pending at detach or beyond a bound, CUDA ops never resolved) and PipelineTracer.dropped (spans).
LOST_STATS = ("dropped_done", "dropped_pending", "dropped_unresolved")


def tracer_losses(tracers: Any) -> int:
    """Records the tracers could not make so far (each counter only grows): part of a step row's
    ``dropped_records_total``, which /metrics exposes and an alert watches."""
    n = 0
    for tracer in tracers:
        stats = getattr(tracer, "stats", None)
        if stats is not None:
            n += sum(stats.get(key, 0) for key in LOST_STATS)
        n += getattr(tracer, "dropped", 0)
    return n


def take_all(buf: collections.deque) -> list:
    """Everything in ``buf`` now, popped one by one (other threads may append meanwhile)."""
    out = []
    try:
        while buf:
            out.append(buf.popleft())
    except IndexError:  # emptied by another drain meanwhile
        pass
    return out
