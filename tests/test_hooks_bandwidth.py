"""nccl-tests bandwidth definitions on hand-computed cases."""

from __future__ import annotations

import math

import pytest

from meshscope.agent.contract import algbw, busbw, busbw_factor


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("all_reduce", 8, 1.75),  # 2·7/8
        ("all_reduce", 2, 1.0),  # 2·1/2
        ("all_reduce", 1, 0.0),  # nothing moves
        ("all_gather", 4, 0.75),  # 3/4
        ("reduce_scatter", 8, 0.875),  # 7/8
        ("all_to_all", 2, 0.5),  # 1/2
        ("broadcast", 8, 1.0),
        ("reduce", 8, 1.0),
        ("send", 2, 1.0),
        ("recv", 2, 1.0),
        ("barrier", 8, 0.0),
    ],
)
def test_busbw_factor(op: str, n: int, factor: float) -> None:
    assert busbw_factor(op, n) == pytest.approx(factor)


def test_unknown_op_and_bad_group_size_raise() -> None:
    with pytest.raises(ValueError, match="unknown collective"):
        busbw_factor("allreduce", 8)  # c10d spelling, not the nccl-tests one
    with pytest.raises(ValueError, match="group size"):
        busbw_factor("all_reduce", 0)


def test_algbw() -> None:
    assert algbw(1_000_000_000, 0.5) == 2e9
    assert algbw(4096, 0.001) == pytest.approx(4_096_000.0)
    assert math.isnan(algbw(1024, 0.0))  # no duration: no bandwidth, never inf
    assert math.isnan(algbw(1024, -1e-6))
    assert math.isnan(algbw(1024, math.nan))


def test_busbw_hand_computed() -> None:
    # nccl-tests style line: 128 MiB all-reduce on 8 ranks in 2.5 ms.
    nbytes, seconds = 134_217_728, 0.0025
    assert algbw(nbytes, seconds) == pytest.approx(53.687e9, rel=1e-4)
    assert busbw("all_reduce", nbytes, seconds, 8) == pytest.approx(93.952e9, rel=1e-4)  # × 1.75
    # All-gather of a 1 GB output on 4 ranks in 0.1 s: 10 GB/s algbw, 7.5 GB/s busbw.
    assert busbw("all_gather", 1_000_000_000, 0.1, 4) == pytest.approx(7.5e9)
    # P2P: busbw = algbw.
    assert busbw("send", 32_768, 1e-4, 2) == pytest.approx(327.68e6)
