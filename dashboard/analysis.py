"""Per-step, per-rank and per-collective analyses: DataFrame in, DataFrame out, no plotting, no I/O.

The formulas are docs/formulas.md's, the reference; each function states the one it computes.
Inputs are either raw store rows or the per-rank/per-step aggregates the data layer computes in SQL
(documented per function), so the same function serves a unit test on a hand-computed table and the
dashboard on 1,024 ranks.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from meshscope.agent.contract import busbw_factor as contract_busbw_factor
from meshscope.agent.contract import bubble_theory, normalize_schedule  # noqa: F401 (the pages' names for them)

# ------------------------------------------------------------------------------------------ busbw
def busbw_factor(op: str, n: int) -> float:
    """The contract's nccl-tests factor (``agent.contract.bandwidth``, what the ranks record busbw with),
    NaN where a bus bandwidth means nothing: a barrier (no payload) and an op the contract does not know
    (a page must draw the other ops rather than fail)."""
    if op == "barrier":
        return math.nan
    try:
        return contract_busbw_factor(op, max(int(n), 1))
    except ValueError:
        return math.nan


# -------------------------------------------------------------------------------------- breakdown
BREAKDOWN = ("compute_s", "exposed_comm_s", "bubble_s", "other_s")


def breakdown(rows: pd.DataFrame) -> pd.DataFrame:
    """Per-rank temporal breakdown: mean seconds per step of compute / exposed comm / bubble / other,
    their fractions of wall time, and the unattributed residual wall - sum (should be ~0).

    ``rows``: step rows (or per-rank means) with ``rank``, ``wall_s`` and the four components."""
    g = rows.groupby("rank", sort=True)[["wall_s", *BREAKDOWN]].mean()
    g = g.fillna({c: 0.0 for c in BREAKDOWN})
    g["unattributed_s"] = g["wall_s"] - g[list(BREAKDOWN)].sum(axis=1)
    for c in BREAKDOWN:
        g[c.replace("_s", "_frac")] = np.where(g["wall_s"] > 0, g[c] / g["wall_s"], np.nan)
    return g.reset_index()


def step_time(rank_steps: pd.DataFrame) -> dict[str, float]:
    """The step-time figures ``report``, the Overview and the Communication page state, all over one set of
    rank-steps (a rank's step: its ``wall_s``, split into the four parts of ``BREAKDOWN``), so they agree:

    - ``step_time_s_median``, ``step_time_s_mean``: median and mean ``wall_s`` over the rank-steps;
    - ``compute_s``, ``exposed_comm_s``, ``bubble_s``, ``other_s``: each part's mean over the same rank-steps
      (a missing part counts 0), so they sum to ``step_time_s_mean`` up to ``unattributed_s`` (wall - parts,
      ~0 for every writer's records);
    - ``rank_steps``, ``steps``, ``ranks``, ``first_step``, ``last_step``: what they are over.

    ``rank_steps``: ``rank``, ``step``, ``wall_s`` and the parts (``dashboard.data``'s ``rank_steps``, cut to
    the steady steps by the caller). Every figure NaN when there are no rows."""
    r = rank_steps
    out = {"step_time_s_median": float(r["wall_s"].median()) if len(r) else math.nan,
           "step_time_s_mean": float(r["wall_s"].mean()) if len(r) else math.nan}
    for c in BREAKDOWN:
        out[c] = float(r[c].fillna(0.0).mean()) if len(r) else math.nan
    out["unattributed_s"] = out["step_time_s_mean"] - sum(out[c] for c in BREAKDOWN)
    out.update(rank_steps=int(len(r)), steps=int(r["step"].nunique()), ranks=int(r["rank"].nunique()),
               first_step=int(r["step"].min()) if len(r) else None, last_step=int(r["step"].max()) if len(r) else None)
    return out


def nonfinite_loss(series: pd.DataFrame) -> dict | None:
    """Where a run's loss was NaN or infinite, from the per-step counts of ``dashboard.data``'s Overview series
    (``step``, ``ranks``, ``loss_nonfinite``: rank-steps with ``step.loss_nonfinite``, ``loss_nan``: of them
    NaN): ``rank_steps`` non-finite of ``of_rank_steps``, the ``first_step``, ``steps`` (the steps that had
    one), ``nan`` (whether a NaN was among them) and ``last`` (the last step with a loss was non-finite on
    some rank). None when every recorded loss was finite."""
    bad = series[series["loss_nonfinite"].fillna(0) > 0]
    if bad.empty:
        return None
    known = series[(series["loss_nonfinite"].fillna(0) > 0) | series["loss"].notna()]
    return {"rank_steps": int(bad["loss_nonfinite"].sum()), "of_rank_steps": int(series["ranks"].sum()),
            "first_step": int(bad["step"].min()), "steps": [int(s) for s in bad["step"]],
            "nan": bool(bad["loss_nan"].fillna(0).sum() > 0),
            "last": bool(known["step"].max() == bad["step"].max())}


def nonfinite_loss_warning(found: dict) -> str:
    """The one line ``report`` and the Overview say for ``nonfinite_loss``'s result."""
    return (f"Loss non-finite ({'NaN' if found['nan'] else 'infinite'}) on {found['rank_steps']} of "
            f"{found['of_rank_steps']} rank-steps from step {found['first_step']}.")


def mfu_reason(meta: dict, *, tokens: bool = True) -> str:
    """Why a run has no MFU: the run record's own reason where the writer gave one (``mfu_reason``, or a
    ``flops_method`` of "off" or "absent: <why>"), else what its record lacks (MFU = FLOPs / wall / peak: a
    peak for the device, and the model's FLOPs: per token, with the steps' tokens, or per step). ``tokens``:
    whether the run's steps recorded tokens."""
    if meta.get("mfu_reason"):
        return str(meta["mfu_reason"])
    method = str(meta.get("flops_method") or "")
    if method == "off":
        return "FLOP counting is off (MESHSCOPE_FLOPS=off, or TelemetryConfig flops='off')"
    if method.startswith("absent"):
        return method.partition(":")[2].strip() or "the model's FLOPs were not counted"
    if not _positive(meta.get("peak_flops")):
        return f"no peak FLOP/s known for the device ({meta.get('device') or 'not recorded'})"
    if not _positive(meta.get("flops_per_token")):
        return "the model's FLOPs were not counted"
    if not tokens:
        return "the FLOPs per token are known, but no step recorded its tokens (the model's input is not token ids)"
    return "no step recorded its FLOPs"


def no_series_reason(name: str, *, meta: dict, tokens: bool = True) -> str:
    """The one line an Overview chart (``tokens``, ``mfu``, ``loss``) shows instead of empty axes."""
    if name == "mfu":
        return f"MFU n/a: {mfu_reason(meta, tokens=tokens)}."
    if name == "loss":
        zero_code = bool(_json_object(meta.get("config")).get("zero_code"))
        return "Loss n/a: no step recorded a loss" + (
            " (zero-code reads the loss a job hands to backward: one backward per step, on CPU)." if zero_code else ".")
    return "Throughput n/a: no step recorded its tokens (the model's input is not token ids)."


def _json_object(text) -> dict:
    try:
        value = json.loads(text) if isinstance(text, str) else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _positive(v) -> bool:
    try:
        return float(v) > 0
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------- robust scores, GPU slowdowns
# (The straggler and warm-up verdicts are in dashboard.stragglers.)
MAD_SCALE = 1.4826  # makes MAD a consistent estimator of the standard deviation for normal data


def robust_z(values: pd.Series) -> pd.Series:
    """(x - median) / (1.4826 * MAD). If MAD is 0 (more than half the values identical), fall back to
    the mean absolute deviation * 1.2533 (also sigma-consistent) so one outlier among equal values still
    scores; if that is 0 too, every score is 0."""
    x = values.astype(float)
    med = x.median()
    scale = MAD_SCALE * (x - med).abs().median()
    if not scale > 0:
        scale = 1.2533 * (x - med).abs().mean()
    if not scale > 0:
        return pd.Series(0.0, index=x.index)
    return (x - med) / scale


# NVML clocks-event ("throttle") reason bits. Idle, application-clock setting, sync boost and display
# clock are not slowdowns, so only the others count as throttling.
THROTTLE_REASONS = {
    0x1: "idle", 0x2: "app clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x10: "sync boost",
    0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake", 0x100: "display clocks",
}
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def decode_throttle(bits: int) -> list[str]:
    """Names of the slowdown reasons set in an NVML clocks-event bitmask (non-slowdown bits dropped)."""
    return [name for bit, name in THROTTLE_REASONS.items() if bits & bit & THROTTLE_MASK]


def gpu_ranks(devices: pd.DataFrame, *, hosts: pd.DataFrame) -> pd.DataFrame:
    """Per-GPU figures given to the ranks that ran on them (host and GPU index = local rank), as
    ``dashboard.data.gpu_by_rank`` computes in SQL. ``devices``: ``host``, ``gpu`` and figures;
    ``hosts``: ``rank``, ``host``, ``local_rank``. Ranks without a matching GPU are left out."""
    d = devices.dropna(subset=["host", "gpu"])
    m = hosts.merge(d, how="inner", left_on=["host", "local_rank"], right_on=["host", "gpu"])
    return m.drop(columns=["host", "local_rank", "gpu"]).sort_values("rank", kind="stable").reset_index(drop=True)


# -------------------------------------------------------------------------------------- pipeline
def measured_bubble(spans: pd.DataFrame, *, windows: pd.DataFrame | None = None) -> pd.DataFrame:
    """Measured bubble per (step, rank): 1 - (sum of the rank's F/B/W span durations) / window.

    ``spans``: ``step``, ``rank``, ``stage``, ``t_start``, ``t_end``. ``windows``: ``step``, ``rank``,
    ``wall_s`` (the rank's step wall time, as the formula defines the window). Without windows, the
    window is the pipeline's extent in that step (first span start to last span end, all ranks).
    Returns ``step``, ``rank``, ``stage`` (the rank's lowest stage: its position in the pipeline),
    ``busy_s``, ``window_s``, ``bubble``, and its split into

    - ``imbalance``: (the step's largest busy time over ranks - the rank's own) / window: idle that comes
      from this stage being lighter than the slowest one, not from the schedule;
    - ``schedule_bubble`` = ``bubble`` - ``imbalance``: the fill-and-drain idle that (p-1)/(m+p-1)
      describes, which the theory derives for balanced stages. With the extent window it is the same
      for every rank of a step, 1 - max busy / extent; on the slowest stage it equals ``bubble``."""
    s = spans.assign(d=spans["t_end"] - spans["t_start"])
    g = s.groupby(["step", "rank"]).agg(stage=("stage", "min"), busy_s=("d", "sum")).reset_index()
    if windows is not None and len(windows):
        g = g.merge(windows[["step", "rank", "wall_s"]].rename(columns={"wall_s": "window_s"}),
                    how="left", on=["step", "rank"])
    else:
        g["window_s"] = np.nan
    extent = s.groupby("step").agg(a=("t_start", "min"), b=("t_end", "max"))
    g["window_s"] = g["window_s"].fillna(g["step"].map(extent["b"] - extent["a"]))
    g["bubble"] = 1.0 - g["busy_s"] / g["window_s"]
    g["imbalance"] = (g.groupby("step")["busy_s"].transform("max") - g["busy_s"]) / g["window_s"]
    g["schedule_bubble"] = g["bubble"] - g["imbalance"]
    return g


def pipeline_stages(per: pd.DataFrame, replayed: pd.DataFrame) -> pd.DataFrame:
    """Per stage, means over steps: ``bubble`` (its idle over the pipeline's extent), split into
    ``imbalance`` (lighter than the slowest stage), ``schedule_share`` (the rest: what the closed form
    describes, with the transfers in it), and of that ``schedule_idle`` (fill and drain the schedule
    implies for the measured op times, ``pipeline_sim.replay``), ``p2p_share`` (replayed transfer time and
    host gaps between ops) and ``unexplained`` (schedule share beyond the replay). The replay's columns
    are means over the replayed steps (NaN when none)."""
    t = per.groupby("stage", as_index=False)[["bubble", "imbalance", "schedule_bubble"]].mean()
    t = t.rename(columns={"schedule_bubble": "schedule_share"})
    if len(replayed):
        r = per[per["step"].isin(replayed["step"])].groupby("step")["schedule_bubble"].first().rename("share")
        rp = replayed.set_index("step").join(r, how="inner")
        t["schedule_idle"] = float(rp["schedule_idle"].mean())
        t["p2p_share"] = float((rp["replay_bubble"] - rp["schedule_idle"]).mean())
        t["unexplained"] = float((rp["share"] - rp["replay_bubble"]).mean())
    else:
        t["schedule_idle"] = t["p2p_share"] = t["unexplained"] = np.nan
    return t


def idle_gaps(spans: pd.DataFrame, *, t0: float, t1: float) -> pd.DataFrame:
    """Idle intervals of each rank inside [t0, t1]: the complement of its spans (for shading bubbles).
    ``spans``: ``rank``, ``t_start``, ``t_end``. Returns ``rank``, ``t_start``, ``t_end``."""
    out = []
    for rank, grp in spans.sort_values("t_start").groupby("rank"):
        cursor = t0
        for a, b in zip(grp["t_start"], grp["t_end"]):
            if a > cursor:
                out.append((rank, cursor, min(a, t1)))
            cursor = max(cursor, b)
        if cursor < t1:
            out.append((rank, cursor, t1))
    return pd.DataFrame(out, columns=["rank", "t_start", "t_end"])


# -------------------------------------------------------------------------------- communication
def comm_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Time per op and parallel dimension, split into exposed (the training thread waited: wait_s) and
    overlapped (duration - wait, hidden behind compute), per rank and step (averaged over the distinct
    (rank, step) pairs in ``rows``).

    ``rows``: collective and P2P records with ``rank``, ``step``, ``op``, ``dim``, ``bytes``,
    ``duration_s``, ``wait_s``, and where the records carry it ``mesh_dim`` (the job's own name of the
    dim: a row per name, so ``dp_shard`` and ``dp_replicate`` stay apart; "" in records from before it)."""
    rank_steps = max(int(rows.groupby("rank")["step"].nunique().sum()), 1)
    keys = ["op", "dim", "mesh_dim"] if "mesh_dim" in rows.columns else ["op", "dim"]
    t = (rows.groupby(keys, as_index=False)
         .agg(count=("bytes", "size"), duration_s=("duration_s", "sum"), wait_s=("wait_s", "sum"),
              total_bytes=("bytes", "sum")))
    t["exposed_s"] = t["wait_s"] / rank_steps
    t["overlapped_s"] = (t["duration_s"] - t["wait_s"]).clip(lower=0.0) / rank_steps
    t["ops_per_step"] = t["count"] / rank_steps
    t["bytes_per_step"] = t["total_bytes"] / rank_steps
    t["exposed_share"] = np.where(t["duration_s"] > 0, t["wait_s"] / t["duration_s"], np.nan)
    return t.sort_values(["exposed_s", "overlapped_s"], ascending=False).reset_index(drop=True)


def collective_instances(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per collective instance (group, seq) with its network-side bus bandwidth.

    ``net_s`` = earliest t_end - latest t_start over the members: the transfer once the last member
    arrived. Per-rank durations include waiting for late peers (arrival skew), so a fast rank that
    waited would look like a slow link; ``net_s`` does not, while a slow link lengthens it for the whole
    group. ``busbw`` = bytes x factor / net_s (bytes/s; NaN when net_s <= 0). P2P ops are left out.

    ``rows``: ``rank``, ``op``, ``dim``, ``group``, ``group_size``, ``bytes``, ``seq``, ``t_start``,
    ``t_end`` (``peer`` optional)."""
    r = rows if "peer" not in rows else rows[rows["peer"] < 0]
    key = _instance_key(r)
    by = r.groupby(key, sort=False)
    first = r.loc[~key.duplicated(), ["group", "seq", "op", "dim"]].set_index(key[~key.duplicated()])
    g = by.agg(group_size=("group_size", "max"), bytes=("bytes", "max"), members=("rank", "size"),
               t_last=("t_start", "max"), t_end=("t_end", "min"))
    return instance_busbw(first.join(g).reset_index(drop=True))


def instance_busbw(g: pd.DataFrame) -> pd.DataFrame:
    """Adds ``net_s`` and ``busbw`` (see ``collective_instances``) to per-instance aggregates with ``op``,
    ``group_size``, ``bytes``, ``t_last`` (latest member start) and ``t_end`` (earliest member end), e.g.
    ``dashboard.data.collective_links``' instances, computed in SQL."""
    g = g.copy()
    g["net_s"] = g["t_end"] - g["t_last"]
    # One factor per distinct (op, size): a few, where instances number in the thousands.
    factors = {k: busbw_factor(k[0], int(k[1])) for k in set(zip(g["op"], g["group_size"]))}
    factor = np.array([factors[k] for k in zip(g["op"], g["group_size"])], dtype=float)
    g["busbw"] = np.where(g["net_s"] > 0, g["bytes"] * factor / g["net_s"].where(g["net_s"] > 0), np.nan)
    return g


def busbw_spread(instances: pd.DataFrame) -> pd.DataFrame:
    """Per op, dim and message size: median, p10 and p90 busbw over collective instances, and their
    count. ``instances``: from ``collective_instances``."""
    c = instances[(instances["bytes"] > 0) & instances["busbw"].notna()]
    g = c.groupby(["op", "dim", "bytes"])["busbw"]
    out = g.agg(count="size", busbw="median")
    out["busbw_p10"] = g.quantile(0.1)
    out["busbw_p90"] = g.quantile(0.9)
    return out.reset_index()


def link_ratios(instances: pd.DataFrame, *, members: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """How each group's network-side busbw compares with groups doing the same op on the same dim with
    the same size, and each rank's worst group.

    A group's ratio is the median over its instances of busbw / (median busbw of that op, dim, size). A
    rank's ratio is the lowest over its groups (a slow NIC shows on the dims that cross hosts, not on
    the others). ``members``: ``rank``, ``dim``, ``group``. Returns (``rank``, ``busbw_ratio``,
    ``link_group``) and (``dim``, ``group``, ``group_size``, ``busbw_ratio``, ``busbw``)."""
    c = instances[(instances["bytes"] > 0) & instances["busbw"].notna()].copy()
    ref = c.groupby(["op", "dim", "bytes"])["busbw"].transform("median")
    c["ratio"] = c["busbw"] / ref.where(ref > 0)
    groups = (c.groupby(["dim", "group"], as_index=False)
              .agg(group_size=("group_size", "max"), busbw_ratio=("ratio", "median"), busbw=("busbw", "median"))
              .sort_values("busbw_ratio").reset_index(drop=True))
    # A group without a ratio (one member: its bus bandwidth is 0 by the nccl-tests factor) names no link.
    m = members[["rank", "dim", "group"]].drop_duplicates().merge(
        groups.dropna(subset=["busbw_ratio"])[["dim", "group", "busbw_ratio"]], on=["dim", "group"])
    worst = m.loc[m.groupby("rank")["busbw_ratio"].idxmin()] if len(m) else m
    ranks = worst.rename(columns={"group": "link_group"})[["rank", "busbw_ratio", "link_group"]]
    return ranks.sort_values("rank").reset_index(drop=True), groups


def _instance_key(r: pd.DataFrame) -> pd.Series:
    """One integer per (group, seq): grouping on it is several times faster than on a string column."""
    seq = r["seq"].to_numpy(dtype=np.int64)
    lo, span = (int(seq.min()), int(seq.max() - seq.min()) + 1) if len(seq) else (0, 1)
    return pd.Series(pd.factorize(r["group"])[0].astype(np.int64) * span + (seq - lo), index=r.index)


def arrival_skew(rows: pd.DataFrame) -> pd.DataFrame:
    """Arrival skew of collectives: for every (group, seq) collective, each rank's t_start minus the
    earliest t_start in that collective. The last to arrive made the others wait; ``caused_wait_s`` on
    its row is the sum over the others of (its t_start - their t_start). P2P ops (peer >= 0) are left
    out: their sequence numbers do not pair up across ranks.

    ``rows``: ``rank``, ``group``, ``seq``, ``t_start`` (``peer`` optional)."""
    r = rows if "peer" not in rows else rows[rows["peer"] < 0]
    r = r[["rank", "group", "seq", "t_start"]].reset_index(drop=True)
    by = r.groupby(_instance_key(r), sort=False)["t_start"]
    r["skew_s"] = r["t_start"] - by.transform("min")
    # idxmax takes the first row on ties, so each collective blames exactly one rank.
    r["is_last"] = r.index.isin(by.idxmax())
    owed = by.transform("max") * by.transform("size") - by.transform("sum")
    r["caused_wait_s"] = np.where(r["is_last"], owed, 0.0)
    return r


def skew_by_rank(skew: pd.DataFrame) -> pd.DataFrame:
    """Per rank: mean, p95 and max arrival skew, how often it arrived last, and the wait it caused."""
    by = skew.groupby("rank")
    g = by.agg(mean_skew_s=("skew_s", "mean"), max_skew_s=("skew_s", "max"), last_count=("is_last", "sum"),
               collectives=("seq", "size"), caused_wait_s=("caused_wait_s", "sum"))
    g.insert(1, "p95_skew_s", by["skew_s"].quantile(0.95))
    g["last_share"] = g["last_count"] / g["collectives"]
    return g.reset_index().sort_values("caused_wait_s", ascending=False, kind="stable").reset_index(drop=True)


def slow_groups(groups: pd.DataFrame, *, threshold: float = 3.5, min_drop: float = 0.10) -> pd.DataFrame:
    """Communication groups whose bus bandwidth is low against the other groups of the same dim: a
    slow link slows every member of its groups alike, so it shows per group rather than per rank.

    ``groups``: ``dim``, ``group``, ``busbw_ratio`` (median of busbw / peers' busbw, same op and size).
    Adds ``robust_z`` (within the dim) and keeps groups with z < -threshold whose ratio is also at
    least ``min_drop`` below 1 (so near-identical groups with a tiny MAD are not flagged)."""
    if groups.empty:
        return groups.assign(robust_z=pd.Series(dtype=float))
    z = groups.groupby("dim", group_keys=False)["busbw_ratio"].apply(robust_z)
    out = groups.assign(robust_z=z.reindex(groups.index))
    keep = (out["robust_z"] < -threshold) & (out["busbw_ratio"] <= 1 - min_drop)
    return out[keep].sort_values("robust_z").reset_index(drop=True)


# ---------------------------------------------------------------------------------- throughput
def parallel_degrees(mesh: dict[str, int] | None, *, world_size: int) -> dict[str, int]:
    """Degrees of dp (data replicas: dp * fsdp), tp and pp. Without a mesh, all ranks are replicas."""
    mesh = mesh or {}
    tp, pp = int(mesh.get("tp", 1) or 1), int(mesh.get("pp", 1) or 1)
    if mesh:
        dp = int(mesh.get("dp", 1) or 1) * int(mesh.get("fsdp", 1) or 1)
    else:
        dp = max(world_size, 1)
    return {"dp": dp, "tp": tp, "pp": pp}


def step_throughput(per_step: pd.DataFrame, *, dp: int) -> pd.DataFrame:
    """Tokens/s per step: each rank reports its replica's tokens (global / dp), so global tokens =
    mean over ranks * dp; the step takes the slowest rank's wall time (synchronous training).

    ``per_step``: ``step``, ``tokens_mean``, ``step_time_s`` (max wall over ranks)."""
    t = per_step.copy()
    # no tokens recorded (a zero-code job whose model does not take token ids): not known, not 0 tokens/s
    t["tokens_per_s"] = np.where((t["step_time_s"] > 0) & (t["tokens_mean"] > 0),
                                 t["tokens_mean"] * dp / t["step_time_s"], np.nan)
    return t


# -------------------------------------------------------------------------------------------- events
FAILURE_KINDS = ("crash", "hang", "aborted_step", "restart", "nonfinite_loss")


def event_summary(ev: pd.DataFrame, *, kinds: tuple[str, ...] | None = None) -> dict:
    """Events (``data.events``: newest first; ``kind``, ``rank``, ``step``, ``message``), those of ``kinds``
    if given: ``counts`` per kind and the ``key_event`` (kind, rank, step, message): the newest crash or
    hang before anything else, since the other ranks' aborted steps follow from it — of the hangs, one whose
    training thread was not in a collective (the rank the others wait for: ``dashboard.hang``); else the
    newest."""
    if kinds is not None:
        ev = ev[ev["kind"].isin(kinds)]
    out = {"counts": {str(k): int(n) for k, n in ev["kind"].value_counts().sort_index().items()}, "key_event": None}
    if len(ev):
        causes = ev[ev["kind"].isin(["crash", "hang"])]
        held = causes[(causes["kind"] == "hang") & causes["message"].astype(str).str.startswith("not in a collective")]
        r = (held if len(held) and not (causes["kind"] == "crash").any() else causes if len(causes) else ev).iloc[0]
        out["key_event"] = {"kind": str(r["kind"]), "rank": None if pd.isna(r["rank"]) else int(r["rank"]),
                            "step": None if pd.isna(r["step"]) else int(r["step"]), "message": str(r["message"])[:300]}
    return out
