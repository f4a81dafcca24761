"""What a loop runs when telemetry is off: ``Telemetry``'s step API, doing nothing."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from meshscope.agent.instrument.stepstate import StepContext, StepState


class NullTelemetry:
    """Stands in when telemetry is off: the same API, doing nothing (no branches in the user's loop)."""

    dropped_records = 0

    def start(self, info: dict[str, Any]) -> None:
        pass

    def attach(self, **_: Any) -> None:
        pass

    def detach(self) -> None:
        pass

    @contextmanager
    def step(self, step: int) -> Iterator[StepContext]:
        yield StepContext(StepState(step, 0.0, (0.0, 0.0)))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def event(self, kind: str, message: str = "", *, step: int | None = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, timeout_s: float = 5.0) -> None:
        pass
