"""The time base every record is stamped in, shared by ranks and the node agent.

A rank's records and the agent's GPU samples land on one timeline in the dashboard, so both sides must
read time the same way: seconds since the Unix epoch, anchored once per process on ``time.time()`` (ranks
on NTP-synchronised hosts then agree to NTP precision) and advanced by ``time.perf_counter()`` (monotonic
and fine-grained within a process, so a step's intervals never run backwards when the wall clock is
stepped). Components take a ``Clock`` so tests pass a fake one.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch, monotonic within the process (see ``AnchoredClock``)."""


class AnchoredClock:
    """``time.time()`` read once, advanced by ``perf_counter``: one time base across ranks (NTP-level
    agreement), with the monotonicity and resolution of ``perf_counter`` inside a process."""

    __slots__ = ("_wall0", "_perf0")

    def __init__(self) -> None:
        self._wall0 = time.time()
        self._perf0 = time.perf_counter()

    def now(self) -> float:
        return self._wall0 + (time.perf_counter() - self._perf0)

    def offset(self) -> float:
        """What to add to a ``time.perf_counter()`` reading to get ``now()`` at that reading (hot paths
        take the raw reading and convert later, off the training thread)."""
        return self._wall0 - self._perf0
