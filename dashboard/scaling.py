"""Scaling across runs of one model (formulas brief, "Scaling").

- Speedup relative to the smallest run (world size n0): S(n) = n0 · throughput(n) / throughput(n0), so
  the baseline sits on the ideal line S = n. Efficiency = S(n) / n.
- Strong scaling (same global batch): efficiency = T(n0)/T(n) · n0/n with T the step time; shown only
  for runs whose global batch equals the baseline's.
- Weak scaling (same batch per device): efficiency = throughput(n) / (n/n0 · throughput(n0)); shown
  only for runs whose per-device batch equals the baseline's.
- Amdahl: time per unit of work T(n) = T1 · (c + (1 - c)/n), i.e. T = a + b/n with a = T1·c,
  b = T1·(1 - c): a linear least-squares fit in 1/n, so c = a / (a + b). Speedup bound 1/(c + (1-c)/n).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True, slots=True, kw_only=True)
class AmdahlFit:
    c: float  # serial (non-scaling) fraction of time at n = 1
    t1: float  # fitted time per unit of work on one device
    rmse: float  # of the fitted time per unit of work

    def time(self, n: np.ndarray | float) -> np.ndarray | float:
        return self.t1 * (self.c + (1 - self.c) / np.asarray(n, dtype=float))

    def speedup(self, n: np.ndarray | float) -> np.ndarray | float:
        """Speedup over one device: 1 / (c + (1 - c)/n)."""
        return 1.0 / (self.c + (1 - self.c) / np.asarray(n, dtype=float))


def amdahl_fit(*, n: np.ndarray, throughput: np.ndarray) -> AmdahlFit | None:
    """Fit c from throughputs at several world sizes (None with fewer than two distinct sizes).

    Least squares of T = 1/throughput on x = 1/n, with a, b >= 0 (c within [0, 1])."""
    n = np.asarray(n, dtype=float)
    thr = np.asarray(throughput, dtype=float)
    ok = (n > 0) & (thr > 0) & np.isfinite(thr)
    n, t = n[ok], 1.0 / thr[ok]
    if len(np.unique(n)) < 2:
        return None
    x = 1.0 / n
    b, a = np.polyfit(x, t, 1)
    if a < 0:  # no serial part fits better than a negative one: refit through the origin
        a, b = 0.0, float(np.dot(x, t) / np.dot(x, x))
    elif b < 0:  # time does not fall with n at all: everything is serial
        a, b = float(t.mean()), 0.0
    t1 = a + b
    fit = AmdahlFit(c=a / t1, t1=t1, rmse=0.0)
    rmse = float(np.sqrt(np.mean((fit.time(n) - t) ** 2)))
    return AmdahlFit(c=fit.c, t1=t1, rmse=rmse)


def scaling_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run: speedup, efficiencies, and which is best.

    ``runs``: ``run``, ``world_size``, ``tokens_per_s``, ``step_time_s``, ``global_batch`` (optional
    ``comm_fraction`` passes through). Adds ``speedup``, ``efficiency``, ``strong_efficiency``,
    ``weak_efficiency``, ``tokens_per_s_per_device``, ``best`` (highest throughput)."""
    t = runs.sort_values(["world_size", "tokens_per_s"], ascending=[True, False]).reset_index(drop=True)
    if t.empty:
        return t.assign(speedup=[], efficiency=[], strong_efficiency=[], weak_efficiency=[],
                        tokens_per_s_per_device=[], best=[])
    base = t.iloc[0]
    n0, n = float(base["world_size"]), t["world_size"].astype(float)
    t["speedup"] = n0 * t["tokens_per_s"] / base["tokens_per_s"]
    t["efficiency"] = t["speedup"] / n
    same_batch = t["global_batch"] == base["global_batch"]
    same_per_device = np.isclose(t["global_batch"] / n, base["global_batch"] / n0)
    t["strong_efficiency"] = np.where(same_batch, base["step_time_s"] / t["step_time_s"] * n0 / n, np.nan)
    t["weak_efficiency"] = np.where(same_per_device, t["tokens_per_s"] / (n / n0 * base["tokens_per_s"]),
                                    np.nan)
    t["tokens_per_s_per_device"] = t["tokens_per_s"] / n
    t["best"] = t.index == t["tokens_per_s"].idxmax()
    return t
