"""When to try again after a failed write: the spool writer's and the agent's one retry rule.

The first retry comes ``first_s`` after a failure, so a short outage (a full disk freed, a directory
recreated) costs little; each further failure doubles the delay up to ``max_s``, so a long outage is not
spun on. A success resets it. Once the cause is gone, a write succeeds at most ``max_s`` later: that is
the bound tests and users can rely on ("nothing is lost once the space has been back for ``max_s``").
"""

from __future__ import annotations


class Backoff:
    """Pure state: the caller passes its clock's ``now`` (no clock of its own, so tests drive it)."""

    __slots__ = ("first_s", "max_s", "_delay", "next_at", "failures")

    def __init__(self, *, first_s: float, max_s: float) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"retry delays must satisfy 0 < first_s ({first_s}) <= max_s ({max_s})")
        self.first_s, self.max_s = float(first_s), float(max_s)
        self._delay = self.first_s
        self.next_at = 0.0  # no retry pending
        self.failures = 0  # consecutive failures

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def failed(self, now: float) -> float:
        """Record a failure at ``now``; returns when to try again."""
        self.failures += 1
        self.next_at = now + self._delay
        self._delay = min(self._delay * 2.0, self.max_s)
        return self.next_at

    def succeeded(self) -> None:
        self._delay, self.next_at, self.failures = self.first_s, 0.0, 0
