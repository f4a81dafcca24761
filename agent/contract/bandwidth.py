"""Collective bandwidth, nccl-tests definitions (the numbers people compare against).

    algbw = bytes / seconds
    busbw = algbw × factor(op, n)

with ``n`` the group size and ``bytes`` the op's full buffer: the output of an all-gather, the input of a
reduce-scatter, the (per-rank) buffer of an all-reduce / all-to-all / broadcast / reduce / send / recv.

Factors (nccl-tests ``doc/PERFORMANCE.md``): all_reduce 2(n−1)/n (a ring moves each byte out and back);
all_gather, reduce_scatter, all_to_all (n−1)/n; broadcast, reduce, send, recv 1. busbw is then comparable
with the link bandwidth whatever the op and group size. Units are bytes per second; divide by 1e9 for GB/s.
"""

from __future__ import annotations

import math

_RING_FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
_UNIT_OPS = frozenset({"broadcast", "reduce", "send", "recv"})


def busbw_factor(op: str, n: int) -> float:
    """The nccl-tests bus-bandwidth factor of ``op`` on a group of ``n`` ranks.

    ``barrier`` moves no payload and has factor 0. Unknown ops raise ``ValueError`` (a typo must not
    silently report algbw as busbw)."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    ring = _RING_FACTORS.get(op)
    if ring is not None:
        return ring(n)
    if op in _UNIT_OPS:
        return 1.0
    if op == "barrier":
        return 0.0
    raise ValueError(f"unknown collective op {op!r}")


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s; NaN when the duration is not positive or not known."""
    if not seconds > 0 or math.isinf(seconds):  # `not >` also catches NaN
        return math.nan
    return nbytes / seconds


def busbw(op: str, nbytes: int, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes/s: ``algbw(nbytes, seconds) * busbw_factor(op, n)``."""
    return algbw(nbytes, seconds) * busbw_factor(op, n)
