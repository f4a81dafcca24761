"""One step's accumulators on the training thread, and the handle ``Telemetry.step`` hands out."""

from __future__ import annotations

import collections
import time
from typing import Any


class StepState:
    __slots__ = (
        "step", "t_start", "phases", "phase", "waits_in_phase", "exposed", "pp_wait", "span_time",
        "span_depth", "nonpp_wait_outside_spans", "span_kind_time", "n_collectives", "values", "cpu0",
        "phase_t0", "outer", "segments", "colls",
    )

    def __init__(self, step: int, t_start: float, cpu0: tuple[float, float]) -> None:
        self.step = step
        self.t_start = t_start
        self.cpu0 = cpu0
        self.phases: dict[str, float] = collections.defaultdict(float)
        self.phase: str | None = None
        self.phase_t0 = 0.0  # perf_counter when the current phase (re)started
        self.outer: list[str] = []  # phases paused by a nested one (push_phase)
        self.waits_in_phase: dict[str, float] = collections.defaultdict(float)
        self.exposed = 0.0
        self.pp_wait = 0.0
        self.span_time = 0.0
        self.span_depth = 0
        self.nonpp_wait_outside_spans = 0.0
        self.span_kind_time: dict[str, float] = collections.defaultdict(float)
        self.n_collectives = 0
        self.values: dict[str, Any] = {}
        # (phase, t0, t1) for every stretch of time a phase was the innermost open one, in order (raw
        # perf_counter times): the flusher finds the phase a collective completed in from these.
        self.segments: list[tuple[str, float, float]] = []
        # Collectives of this step as (op, t_end, wait_s), gathered by the flusher until the step is built.
        self.colls: list[tuple[str, float, float]] = []


class StepContext:
    """Handed out by ``Telemetry.step``; ``update`` attaches the step's results."""

    __slots__ = ("_state",)

    def __init__(self, state: StepState) -> None:
        self._state = state

    def update(self, **values: Any) -> None:
        """Known keys: loss, tokens, flops, grad_norm, lr, skipped. Values may be tensors (read at step end)."""
        self._state.values.update(values)


def pop_phase(state: StepState) -> None:
    if state.phase is None:
        return
    now = time.perf_counter()
    state.phases[state.phase] += now - state.phase_t0
    state.segments.append((state.phase, state.phase_t0, now))
    state.phase = state.outer.pop() if state.outer else None
    state.phase_t0 = now
