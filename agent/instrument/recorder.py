"""The narrow interface between instrumentation hooks and the telemetry core.

Hooks (collective tracing, pipeline spans) only ever call a ``Recorder``; the core (``Telemetry``) owns
buffering, step accounting and transport. Keeping the hooks behind this protocol lets them be tested with
a plain list-backed recorder and keeps the training thread's cost to one call per event.

Every method must be cheap, must never block and must never raise into the training loop: a hook that
fails calls ``record_error`` and carries on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from meshscope.agent.contract import AnchoredClock, Clock


# ``record_collective``'s ``context`` when the caller did not defer the record: the recorder accounts the op
# to its open step itself, now. A deferring caller (CollectiveTracer with a recorder that has ``live``)
# passes the ``live.key`` it read when the op completed instead.
DIRECT = object()


class Recorder(Protocol):
    clock: Clock

    def record_collective(
        self, *, op: str, dim: str, group: str, group_size: int, nbytes: int, t_start: float, t_end: float,
        wait_s: float, peer: int = -1, source: str, seq: int = 0, mesh_dim: str = "",
    ) -> None:
        """One collective or P2P op. ``t_start``..``t_end`` is issue to observed completion;
        ``wait_s`` is the time the training thread was blocked waiting for it (its exposed part);
        ``seq`` the per-group issue order (0: let the recorder number it); ``mesh_dim`` the job's own name
        of the group's mesh dim (``GroupInfo.label``)."""

    def record_span(self, *, stage: int, microbatch: int, kind: str, t_start: float, t_end: float) -> None:
        """One pipeline compute span (forward / backward / weight) of one microbatch on one stage."""

    def record_error(self, where: str, exc: BaseException) -> None:
        """A hook failed; counted and reported, never raised."""


@dataclass
class ListRecorder:
    """A recorder that keeps everything in lists: for tests and for offline use."""

    clock: Clock = field(default_factory=AnchoredClock)
    collectives: list[dict] = field(default_factory=list)
    spans: list[dict] = field(default_factory=list)
    errors: list[tuple[str, BaseException]] = field(default_factory=list)

    def record_collective(self, **kw) -> None:
        self.collectives.append(kw)

    def record_span(self, **kw) -> None:
        self.spans.append(kw)

    def record_error(self, where: str, exc: BaseException) -> None:
        self.errors.append((where, exc))
