"""How far a prediction may be from the step a run of its layout will measure: an interval from evidence
(docs/formulas.md, "What-if planner"). Pure functions; ``predict`` attaches the interval to each
prediction, ``whatif`` measures the hold-out errors, ``rank`` says which layout is fastest only when the
intervals say so.

The interval is on the ratio measured / predicted, in log terms, from three sources:

- **Noise** (every prediction): the run-to-run drift of a step on one machine (``NOISE``) or, if wider,
  the steady steps' own spread in the calibration runs.
- **Hold-out** (``holdout``): each calibration run predicted from the others (leave one out) with the
  kinds of extrapolation that prediction needed; a kind's bound widens to the worst ratio the user's
  own runs showed for it, and the noise to the worst ratio of a hold-out that needed none.
- **Extrapolation** (``SPREAD``): per kind of thing the calibration did not measure, the ratios measured
  on the grids of ``bench/planner_grid.py`` when it was not (bench/RESULTS.md, "The planner").

Independent errors add in quadrature in log terms, each side separately: low = point × exp(−√Σ lo²),
high = point × exp(√Σ hi²).
"""

from __future__ import annotations

import math

import pandas as pd

NOISE = 0.10  # a 2-rank job on a 2-core VM drifts 5-15 % between runs minutes apart (bench/planner_grid.py)
# kind -> (lowest, highest) measured / predicted seen when the calibration did not measure it. A compute
# rate taken from runs without TP or FSDP misses their per-op cost (DTensor's dispatch; FSDP's copies):
# TP 1.4-1.9 (tiny, batch 16) and 2.0-2.7 (tiny, batch 8), FSDP 1.38-1.45 and 1.3-1.8, calibrated from DDP
# and PP-1F1B; the other way ("rate:-TP": a layout without TP from TP runs) the inverse, 0.59 seen for
# FSDP at 4 ranks from FSDP×TP. A pipeline's host time per action from 1F1B runs, for another schedule:
# 0.89 (GPipe) to 1.49 (interleaved zero-bubble); with no pipeline run at all, 1.28 (1F1B) to 2.12
# (tiny, batch 16, 12 and 20 steps: bench/RESULTS.md).
SPREAD: dict[str, tuple[float, float]] = {
    "rate:TP": (0.9, 3.0),
    "rate:-TP": (0.33, 1.1),
    "rate:FSDP": (0.9, 2.0),
    "rate:-FSDP": (0.5, 1.1),
    "rate:PP": (0.8, 1.3),
    "rate:-PP": (0.77, 1.25),
    "rate:sharing cores": (0.8, 1.3),
    "rate:-sharing cores": (0.77, 1.25),
    "exposure": (0.8, 1.5),  # a kind of traffic's exposure borrowed from another kind
    "links": (0.85, 1.25),  # a link's bandwidth or latency borrowed from another op, size or group
    "tp_count": (0.9, 1.3),  # TP's all-reduces per layer from Megatron's count
    "pipeline": (0.85, 1.2),  # a pipeline's hop or weight-gradient share not measured
    "schedule": (0.85, 1.6),  # host time per action from another schedule's runs
    "pipeline_host": (0.9, 2.2),  # host time per action with no pipeline run measured
    # a CPU host's cores inferred from a calibration run's sharing: a 2-rank DDP run's own threads read as
    # another load (tiny-wide: 1.45 of 2 cores), and 4 ranks then measured 0.40-0.60 of the prediction
    "cores": (0.4, 1.1),
    "model": (0.7, 1.5),  # a scaled model: the measured compute rate assumed
    "world": (0.8, 1.25),  # per doubling of the world size beyond the largest measured
}


def spread(kind: str, *, doublings: float = 1.0) -> tuple[float, float]:
    """``SPREAD[kind]`` as log bounds (lo ≤ 0 ≤ hi); ``world`` per doubling; unknown kinds the widest."""
    low, high = SPREAD.get(kind, (min(v[0] for v in SPREAD.values()), max(v[1] for v in SPREAD.values())))
    scale = doublings if kind == "world" else 1.0
    return math.log(low) * scale, math.log(high) * scale


def bounds(point: float, *, kinds: tuple[str, ...], holdout: pd.DataFrame, noise: float = NOISE,
           doublings: float = 0.0) -> tuple[float, float]:
    """(low, high) seconds around ``point`` for a prediction that needed ``kinds`` of extrapolation
    (module docstring). ``holdout``: ``ratio`` (measured / predicted) and ``kinds`` (a tuple) per hold-out
    prediction; ``doublings``: log2 of the world size over the largest measured (``world``)."""
    if not (math.isfinite(point) and point > 0):
        return math.nan, math.nan
    lo2 = hi2 = math.log1p(noise) ** 2
    rows = holdout.to_dict("records") if len(holdout) else []
    plain = [math.log(r["ratio"]) for r in rows if not r["kinds"] and r["ratio"] > 0]
    if plain:
        lo2, hi2 = max(lo2, min(min(plain), 0.0) ** 2), max(hi2, max(max(plain), 0.0) ** 2)
    for kind in kinds:
        lo, hi = spread(kind, doublings=doublings)
        seen = [math.log(r["ratio"]) for r in rows if kind in r["kinds"] and r["ratio"] > 0]
        if seen:  # the user's own runs missed by more: theirs
            lo, hi = min(lo, min(seen)), max(hi, max(seen))
        lo2, hi2 = lo2 + lo * lo, hi2 + hi * hi
    return point * math.exp(-math.sqrt(lo2)), point * math.exp(math.sqrt(hi2))


def decided(intervals: list[tuple[str, float, float]]) -> tuple[bool, list[str]]:
    """Whether the first of ``intervals`` ((label, low, high), fastest point first) is faster than every
    other for sure (its high below their lows), and the labels it cannot be told from."""
    if not intervals:
        return False, []
    _, _, high = intervals[0]
    overlap = [label for label, low, _ in intervals[1:] if low <= high]
    return not overlap, overlap
