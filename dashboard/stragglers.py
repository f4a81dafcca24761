"""Warm-up and straggler verdicts: DataFrame in, DataFrame out, no plotting, no I/O.

The rules, in the words the pages use:

- **Warm-up**: the run's step 0 (allocations, DDP's bucket rebuild, FSDP2's lazy init, first-call
  kernels) and the steps after it until the first one whose step time is within ``WARMUP_FACTOR`` x the
  range's median step time; at most a quarter of the range. Verdicts use the steps after it.
- **Straggler**: a rank whose compute exceeds the median of its peers' compute *in the same step* by at
  least ``STRAGGLER_REL`` of it (and ``STRAGGLER_ABS_S``), in at least ``STRAGGLER_PERSISTENCE`` of the
  steps, and in those steps is among the last to arrive at the collectives: its exposed communication is
  within ``STRAGGLER_REL`` of its compute of the least any rank of its group waited (the last arriver
  waits for nobody). Peers are the other ranks doing the same work (the same pipeline stage), so the
  rule holds at any world size >= 2: at 2 the peers' median is the other rank. (Median/MAD z-scores
  across ranks cannot flag one rank of two, and a pipeline's stages differ by design.) The arrival
  condition keeps noise out: with 4 ranks on 2 cores a fast rank's 11-24 ms compute varies by 50 % from
  step to step, yet it still waits ~90 ms for the real straggler's 110 ms (tests/test_verdicts_e2e.py).
- **Cost**: what the other ranks lose waiting for it. In synchronous training a rank that arrives late
  at a collective makes its peers wait there, so per step the cost of rank r is the median of its
  peers' exposed communication minus its own (clipped at 0); the job's cost per step is the largest
  over ranks.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from meshscope.dashboard.analysis import decode_throttle, robust_z

WARMUP_FACTOR = 1.5
WARMUP_MAX_SHARE = 0.25
STRAGGLER_REL = 0.20
STRAGGLER_ABS_S = 0.002
STRAGGLER_PERSISTENCE = 0.5
RULE = (f"A rank is a straggler when its compute exceeds its peers' median (same pipeline stage, same "
        f"step) by ≥ {STRAGGLER_REL:.0%} and it is among the last to arrive at the collectives, in ≥ "
        f"{STRAGGLER_PERSISTENCE:.0%} of the steps after warm-up; its cost is what its peers lose waiting for it "
        f"(their exposed communication beyond its own).")


def first_steady_step(series: pd.DataFrame, *, run_first_step: int = 0) -> int | None:
    """The first step after warm-up (see the module docstring). ``series``: ``step``, ``step_time_s`` for
    one run over the selected range; ``run_first_step``: the run's first recorded step (warm-up is at
    the start of a run: a range that starts later has none). None when there are no steps."""
    s = series.dropna(subset=["step_time_s"]).sort_values("step")
    if s.empty:
        return None
    steps, times = s["step"].to_numpy(), s["step_time_s"].to_numpy()
    cap = int(len(s) * WARMUP_MAX_SHARE)
    if steps[0] > run_first_step or cap < 1:
        return int(steps[0])
    limit = WARMUP_FACTOR * float(np.median(times))
    i = 1
    while i < cap and times[i] > limit:
        i += 1
    return int(steps[i])


def _others_median(values: np.ndarray) -> np.ndarray:
    """For each element, the median of the other elements (NaN when it has none)."""
    n = len(values)
    if n < 2:
        return np.full(n, np.nan)
    order = np.argsort(values, kind="stable")
    s = values[order]
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)

    def kth_of_others(k: int) -> np.ndarray:  # the k-th smallest once the element itself is left out
        return np.where(k < pos, s[k], s[min(k + 1, n - 1)])

    m = n - 1
    if m % 2:
        return kth_of_others(m // 2)
    return (kth_of_others(m // 2 - 1) + kth_of_others(m // 2)) / 2


def rank_step_verdicts(rank_steps: pd.DataFrame, *, peers: pd.DataFrame | None = None,
                       rel: float = STRAGGLER_REL, abs_s: float = STRAGGLER_ABS_S) -> pd.DataFrame:
    """Per (rank, step): the peers' median compute, the excess over it, whether the rank was slow (the
    excess rule and among the last to arrive, see the module docstring), and the wait cost (peers' median
    exposed communication - its own, >= 0).

    ``rank_steps``: ``rank``, ``step``, ``compute_s``, ``exposed_comm_s``, optionally ``cpu_wait_s`` (steady
    steps). ``peers``: ``rank``, ``peer_group`` (ranks doing the same work); absent: every rank is a peer
    of every other."""
    t = rank_steps[["rank", "step", "compute_s", "exposed_comm_s"]].copy()
    # What of a rank's excess was waiting for a CPU (straggler_table's cause); NaN without the column.
    t["cpu_wait_s"] = rank_steps["cpu_wait_s"].to_numpy(dtype=float) if "cpu_wait_s" in rank_steps else np.nan
    t["peer_group"] = 0
    if peers is not None and len(peers):
        t["peer_group"] = t["rank"].map(peers.set_index("rank")["peer_group"]).fillna(-1)
    by = t.groupby(["step", "peer_group"], sort=False)

    def others(col: str) -> pd.Series:
        return by[col].transform(lambda x: _others_median(x.to_numpy(dtype=float)))

    t["peers_compute_s"] = others("compute_s")
    peers_exposed = others("exposed_comm_s")
    t["excess_s"] = t["compute_s"] - t["peers_compute_s"]
    last_to_arrive = t["exposed_comm_s"] - by["exposed_comm_s"].transform("min") <= rel * t["compute_s"]
    t["slow"] = (t["excess_s"] >= np.maximum(rel * t["peers_compute_s"], abs_s)) & last_to_arrive
    t["cost_s"] = (peers_exposed - t["exposed_comm_s"]).clip(lower=0.0)
    t["cpu_wait_excess_s"] = t["cpu_wait_s"] - others("cpu_wait_s")
    return t


def step_cost(verdicts: pd.DataFrame) -> pd.DataFrame:
    """Per step, the largest wait cost over ranks (``rank_step_verdicts``' ``cost_s``) and whose it was:
    ``step``, ``cost_s``, ``rank``."""
    v = verdicts.dropna(subset=["cost_s"])
    if v.empty:
        return pd.DataFrame({"step": pd.Series(dtype="int64"), "cost_s": pd.Series(dtype=float),
                             "rank": pd.Series(dtype="int64")})
    idx = v.groupby("step")["cost_s"].idxmax()
    return v.loc[idx, ["step", "cost_s", "rank"]].sort_values("step").reset_index(drop=True)


def straggler_table(verdicts: pd.DataFrame, *, gpu: pd.DataFrame | None = None, link: pd.DataFrame | None = None,
                    persistence: float = STRAGGLER_PERSISTENCE, link_threshold: float = 3.5,
                    min_drop: float = 0.10) -> pd.DataFrame:
    """The flagged ranks with their figures and a cause hint.

    - ``verdicts``: ``rank_step_verdicts`` over the steady steps.
    - ``gpu`` (optional): ``rank``, ``clock_ratio`` (SM clock / max clock), ``throttle_share`` (share of
      samples with a slowdown reason), ``reasons`` (OR of reason bits).
    - ``link`` (optional): ``rank``, ``busbw_ratio`` (its worst group's busbw against peer groups, see
      ``analysis.link_ratios``), optionally ``link_group``.

    Compute stragglers follow the module's rule. A rank is also listed when its bus bandwidth is a robust
    outlier below its peers' (z < -``link_threshold`` and at least ``min_drop`` below). Columns: ``rank``,
    ``compute_s`` and ``peers_compute_s`` (means over the steps), ``excess_s`` (median per step),
    ``slow_share`` (share of steps slow), ``cost_s_per_step`` (mean wait cost it caused), ``busbw_ratio``,
    ``clock_ratio``, ``throttle_share``, ``cause``. Cause hint, relative to peers (busy GPUs often show a
    power cap now and then): GPU throttling when its GPU reports slowdown reasons in at least a quarter
    more of its samples than the median GPU, or runs its SM clock below 92 % of the median; link when its
    busbw is low; CPU contention when at least half its excess compute is time it waited for a CPU beyond
    what its peers waited (``cpu_wait_excess_s``, from the step records' run-queue delay: the machine,
    not the job); else compute."""
    g = verdicts.groupby("rank", sort=True)
    t = pd.DataFrame({"compute_s": g["compute_s"].mean(), "peers_compute_s": g["peers_compute_s"].mean(),
                      "excess_s": g["excess_s"].median(), "slow_share": g["slow"].mean(),
                      "cost_s_per_step": g["cost_s"].mean(),
                      "cpu_wait_excess_s": g["cpu_wait_excess_s"].median()}).reset_index()
    for frame, cols in ((gpu, ["clock_ratio", "throttle_share", "reasons"]), (link, ["busbw_ratio", "link_group"])):
        if frame is not None and len(frame):
            t = t.merge(frame[["rank", *[c for c in cols if c in frame]]], how="left", on="rank")
        for c in cols:
            if c not in t:
                t[c] = np.nan
    t["link_z"] = robust_z(t["busbw_ratio"]) if t["busbw_ratio"].notna().sum() >= 3 else np.nan
    peers = {"clock": t["clock_ratio"].median(), "share": t["throttle_share"].median()}
    slow_link = (t["link_z"] < -link_threshold) & (t["busbw_ratio"] <= 1 - min_drop)
    t = t[(t["slow_share"] >= persistence) | slow_link].copy()
    t["cause"] = [_cause(r, peers=peers, threshold=link_threshold, min_drop=min_drop) for r in t.itertuples()]
    return t.sort_values(["cost_s_per_step", "excess_s"], ascending=False).reset_index(drop=True)


def _cause(r, *, peers: dict, threshold: float, min_drop: float) -> str:
    throttled = not pd.isna(r.throttle_share) and r.throttle_share - peers["share"] >= 0.25
    slow_clock = not pd.isna(r.clock_ratio) and not pd.isna(peers["clock"]) and r.clock_ratio < 0.92 * peers["clock"]
    if throttled or slow_clock:
        names = decode_throttle(int(r.reasons)) if not pd.isna(r.reasons) else []
        detail = ", ".join(names) if names else "no reason bits"
        return f"GPU throttling ({detail}; SM clock {r.clock_ratio:.0%} of max)"
    if not pd.isna(r.link_z) and r.link_z < -threshold and r.busbw_ratio <= 1 - min_drop:
        where = f"group {r.link_group} " if isinstance(r.link_group, str) else ""
        return f"link ({where}busbw {r.busbw_ratio:.0%} of peer groups)"
    if not pd.isna(r.cpu_wait_excess_s) and r.excess_s > 0 and r.cpu_wait_excess_s >= 0.5 * r.excess_s:
        return (f"CPU contention (it waited {r.cpu_wait_excess_s * 1e3:.0f} ms per step longer than its peers for "
                f"a CPU, of {r.excess_s * 1e3:.0f} ms extra compute)")
    return "compute (no throttling or link signal: kernels, host, data or imbalance)"
