"""Compare two runs: is B slower than A, by how much with what confidence, which part of the step explains it
and what changed between them (``meshscope diff``, the Compare page). Pure DataFrame-in / dict-out.

The unit is the steady step (warm-up cut as the Overview cuts it, ``views.steady_rank_steps``): per step,
the mean over the ranks that recorded it of ``wall_s`` and of its parts, so the parts of a step sum to its
wall time (``analysis.step_time``'s figures are the means of these):

- ``compute`` (the forward and backward: ``compute_s`` less the optimizer's share),
- ``optimizer`` (``optimizer_s``, the optimizer phase less its waits, at most ``compute_s``),
- ``exposed <op> on <mesh dim>`` per collective kind and the job's own dim (``wait_s`` of the step's
  collective records; a stage's waits for the other stages, P2P and collectives over pp, are the
  pipeline's bubble, as the telemetry counts them: ``agent.contract.is_stage_wait``),
- ``exposed, unattributed`` (``exposed_comm_s`` less the per-op sum: records dropped or not timed, ~0),
- ``bubble`` and ``other``,
- ``unattributed``: the wall time the step record's parts leave (0 for the telemetry's own records).

The difference B − A of the mean step time and of every part comes with a bootstrap interval: steps are
resampled in blocks (a circular block bootstrap: slow drift and periodic steps such as a checkpoint stay
together) from each run independently, the same resample for every part, so each resample's parts sum to
its whole. An interval that covers 0 is "no significant difference"; a gate fails only when the interval's
low end is above its threshold, so noise never fails it.

Runs of a different model or global batch are compared per token (seconds per global token), and the
result says so."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd

from meshscope.agent.contract import P2P_OPS, is_stage_wait

LEVEL = 0.95
RESAMPLES = 4000
MIN_STEPS = 4  # fewer steady steps than this in a run: no interval (the verdict says so)

# the run record's fields that describe what ran and where; a change in any of them is listed
CHANGE_FIELDS = ("world_size", "strategy", "mesh", "schedule", "microbatches", "virtual_stages", "model",
                 "n_params", "n_layers", "d_model", "seq_len", "global_batch", "device", "backend", "dtype",
                 "torch_version", "python_version", "meshscope_version", "peak_source")
# peak_flops is left out: on a CPU it is calibrated at each start (peak_source "calibrated-cpu"), so two runs
# on one machine differ in it; a change of hardware shows in device and peak_source
# the fields of those the runs table holds (dashboard.data.runs_table): what finds a run's repeats
TABLE_CHANGE_FIELDS = tuple(f for f in CHANGE_FIELDS if f not in ("backend", "torch_version", "python_version",
                                                                  "meshscope_version", "peak_source"))
# a difference here makes the step not the same amount of work: compare per token
WORK_FIELDS = ("model", "n_params", "n_layers", "d_model", "seq_len", "global_batch")
# config keys that differ between any two runs without changing the job (names and places)
IGNORED_CONFIG = ("store", "run_name", "telemetry.store", "telemetry.run", "telemetry.run_name", "out",
                  "profile_dir", "profile.dir", "checkpoint.dir", "telemetry.flight_recorder_dir")


def part_name(op: str, mesh_dim: str, dim: str = "") -> str:
    where = mesh_dim or dim
    return f"exposed {op}" + (f" on {where}" if where else "")


def step_parts(rank_steps: pd.DataFrame, exposed: pd.DataFrame, *, dp: int = 1,
               stage_waits: bool = True) -> pd.DataFrame:
    """Per steady step (index ``step``): ``wall_s`` and the parts (columns named as the module says), each
    the mean over the ranks that recorded the step; ``tokens``, the step's global tokens: a rank's record
    holds its replica's (global / dp), so the mean over ranks times ``dp`` (the data-parallel degree).

    ``rank_steps``: ``rank``, ``step``, ``wall_s``, ``compute_s``, ``exposed_comm_s``, ``bubble_s``, ``other_s``,
    ``optimizer_s``; ``exposed``: ``step``, ``op``, ``mesh_dim``, ``dim``, ``wait_s`` (summed over the ranks).
    ``stage_waits``: the records count a stage's waits over pp as bubble (schema 6 on); before, only P2P
    waits were bubble and a collective's over pp was exposed, so its row is an exposed part there."""
    r = rank_steps.copy()
    for c in ("compute_s", "exposed_comm_s", "bubble_s", "other_s", "optimizer_s"):
        r[c] = r[c].fillna(0.0) if c in r else 0.0
    r["optimizer"] = np.minimum(r["optimizer_s"].clip(lower=0.0), r["compute_s"])
    r["compute"] = r["compute_s"] - r["optimizer"]
    g = r.groupby("step")
    ranks = g["rank"].nunique()
    out = pd.DataFrame({"wall_s": g["wall_s"].mean(), "compute": g["compute"].mean(),
                        "optimizer": g["optimizer"].mean()})
    exposed_total = g["exposed_comm_s"].mean()
    attributed = pd.Series(0.0, index=out.index)
    if len(exposed):
        stage = [is_stage_wait(o, d) if stage_waits else o in P2P_OPS
                 for o, d in zip(exposed["op"], exposed["dim"].fillna(""))]
        e = exposed[~np.array(stage, dtype=bool) & exposed["step"].isin(out.index).to_numpy()]
    else:
        e = exposed
    if len(e):
        e = e.assign(part=[part_name(o, m, d) for o, m, d in zip(e["op"], e["mesh_dim"].fillna(""),
                                                                  e["dim"].fillna(""))])
        wide = e.pivot_table(index="step", columns="part", values="wait_s", aggfunc="sum").reindex(out.index)
        wide = wide.fillna(0.0).div(ranks, axis=0)
        for c in sorted(wide.columns):
            out[c] = wide[c]
        attributed = wide.sum(axis=1)
    out["exposed, unattributed"] = exposed_total - attributed
    out["bubble"] = g["bubble_s"].mean()
    out["other"] = g["other_s"].mean()
    # what the four parts of a writer's step records leave of its wall time (0 for the telemetry's own)
    out["unattributed"] = out["wall_s"] - (out["compute"] + out["optimizer"] + exposed_total + out["bubble"]
                                           + out["other"])
    if "tokens" in r:
        out["tokens"] = g["tokens"].mean() * dp
    return out


def parts_of(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if c not in ("wall_s", "tokens")]


def _block_means(values: np.ndarray, *, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """Circular block bootstrap of the column means of ``values`` (steps × columns): ``resamples`` × columns."""
    n = len(values)
    block = max(1, int(round(n ** (1 / 3))))
    blocks = -(-n // block)
    starts = rng.integers(0, n, size=(resamples, blocks))
    idx = (starts[:, :, None] + np.arange(block)[None, None, :]).reshape(resamples, -1)[:, :n] % n
    return values[idx].mean(axis=1)


def bootstrap_diff(a: pd.DataFrame, b: pd.DataFrame, *, columns: list[str], level: float = LEVEL,
                   resamples: int = RESAMPLES, seed: int = 0) -> pd.DataFrame:
    """Per column (``wall_s`` first, then the parts): mean in A, mean in B, ``diff_s`` (B − A) with its
    interval ``lo_s``..``hi_s``, and the same as a share of A's mean step time (``diff_pct``, ``lo_pct``,
    ``hi_pct``: the whole's relative change and each part's points of it). A column one run lacks counts 0
    there. Deterministic (``seed``)."""
    cols = ["wall_s", *columns]
    va = a.reindex(columns=cols, fill_value=0.0).fillna(0.0).to_numpy(dtype=float)
    vb = b.reindex(columns=cols, fill_value=0.0).fillna(0.0).to_numpy(dtype=float)
    rng = np.random.default_rng(seed)
    ma, mb = _block_means(va, rng=rng, resamples=resamples), _block_means(vb, rng=rng, resamples=resamples)
    d = mb - ma
    rel = d / ma[:, [0]] * 100.0  # in points of A's step time, resample by resample
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    base = va[:, 0].mean()
    rows = []
    for j, c in enumerate(cols):
        diff = vb[:, j].mean() - va[:, j].mean()
        lo, hi = np.percentile(d[:, j], q)
        plo, phi = np.percentile(rel[:, j], q)
        rows.append({"part": "step" if c == "wall_s" else c, "a_s": va[:, j].mean(), "b_s": vb[:, j].mean(),
                     "diff_s": diff, "lo_s": lo, "hi_s": hi, "diff_pct": diff / base * 100.0,
                     "lo_pct": plo, "hi_pct": phi,
                     "significant": bool(lo > 0 or hi < 0)})
    return pd.DataFrame(rows)


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def _json(text: Any) -> Any:
    if isinstance(text, str) and text[:1] in "{[":
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _same(x: Any, y: Any) -> bool:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return y is None or (isinstance(y, float) and math.isnan(y))
    return x == y


def changes(meta_a: dict, meta_b: dict, *, fields: tuple[str, ...] = CHANGE_FIELDS) -> list[dict]:
    """What differs between the two runs' records: ``fields``, every key of the run's config (flattened,
    ``config.<key>``) but the ones that differ between any two runs (names, output places), and what the
    run ran on (``env.<key>``: CUDA, NCCL and driver versions, the CPU, ``env.flags.<NAME>``) where both
    records have it (schema 6 on)."""
    flat_a: dict[str, Any] = {}
    flat_b: dict[str, Any] = {}
    envs = [_json(meta_a.get("environment")), _json(meta_b.get("environment"))]
    for meta, flat, env in ((meta_a, flat_a, envs[0]), (meta_b, flat_b, envs[1])):
        for f in fields:
            flat[f] = _json(meta.get(f))
        cfg = _json(meta.get("config"))
        if isinstance(cfg, dict):
            _flat("config", cfg, flat)
        if all(isinstance(e, dict) and e for e in envs):  # "{}": the writer could not read it
            _flat("env", env, flat)
    out = []
    for key in [k for k in flat_a if k in flat_b] + [k for k in flat_b if k not in flat_a] + \
            [k for k in flat_a if k not in flat_b]:
        if key.startswith("config.") and key[len("config."):] in IGNORED_CONFIG:
            continue
        a, b = flat_a.get(key), flat_b.get(key)
        if not _same(a, b) and not any(c["key"] == key for c in out):
            out.append({"key": key, "a": _plain(a), "b": _plain(b)})
    # a config key that says what a record's field already says (config.parallel.microbatches 8 → 4 beside
    # microbatches 8 → 4) is listed once, as the field
    fields_changed = {(c["key"], _val(c["a"]), _val(c["b"])) for c in out if not c["key"].startswith("config.")}
    return [c for c in out if not (c["key"].startswith("config.")
                                   and (c["key"].rsplit(".", 1)[-1], _val(c["a"]), _val(c["b"])) in fields_changed)]


def _plain(v: Any) -> Any:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return None if math.isnan(float(v)) else float(v)
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def comparable(meta_a: dict, meta_b: dict) -> tuple[bool, list[str]]:
    """Whether a step of A is the same work as a step of B (model and global batch), and the fields that
    say it is not."""
    differ = [f for f in WORK_FIELDS if not _same(_json(meta_a.get(f)), _json(meta_b.get(f)))]
    return not differ, differ


def per_token(frame: pd.DataFrame) -> pd.DataFrame:
    """The step frame in seconds per global token (each step's figures over its tokens)."""
    tok = frame["tokens"].where(frame["tokens"] > 0)
    out = frame.drop(columns=["tokens"]).div(tok, axis=0).dropna(how="all")
    out["tokens"] = frame["tokens"]
    return out


def drift_noise(frame: pd.DataFrame) -> float:
    """A run's own estimate of run-to-run noise, where no repeats say it: half the relative difference of its
    second half's mean step time from its first's (how far the machine's speed wandered over the run)."""
    w = frame["wall_s"].to_numpy(dtype=float)
    if len(w) < 2 * MIN_STEPS:
        return math.nan
    h = len(w) // 2
    return abs(w[h:].mean() - w[:h].mean()) / w.mean() / 2


def run_noise(means: list[float]) -> float:
    """The relative standard deviation of repeated runs' mean step times (NaN for fewer than 3)."""
    m = np.asarray(means, dtype=float)
    return float(m.std(ddof=1) / m.mean()) if len(m) >= 3 else math.nan


def compare(a: pd.DataFrame, b: pd.DataFrame, *, meta_a: dict, meta_b: dict, level: float = LEVEL,
            resamples: int = RESAMPLES, noise: dict | None = None) -> dict[str, Any]:
    """The comparison of two runs' step frames (``step_parts``): the whole and the parts with intervals,
    whether per step or per token, the changes, and a verdict line.

    Steps resampled within a run cannot see what differs between two runs of one job on one machine (its
    speed shifts between runs: measured here, 6 % between consecutive identical ``tiny-wide`` runs, 16 %
    for ``tiny``'s 35 ms steps): ``noise`` (``{"rel_sd": s, "source": "..."}``, the relative standard
    deviation of a run's mean step time between runs) widens the whole's interval by it, in quadrature.
    Without it, the runs' own drift (``drift_noise``) stands in, and the result says which was used."""
    same_work, differ = comparable(meta_a, meta_b)
    unit = "step" if same_work else "token"
    if not same_work:
        if "tokens" not in a or "tokens" not in b or not (a["tokens"] > 0).any() or not (b["tokens"] > 0).any():
            return {"unit": unit, "not_comparable": differ, "parts": [], "changes": changes(meta_a, meta_b),
                    "verdict": "not comparable: " + ", ".join(differ) + " differ and the runs record no tokens",
                    "steps": [int(len(a)), int(len(b))], "level": level}
        a, b = per_token(a), per_token(b)
    out: dict[str, Any] = {"unit": unit, "not_comparable": differ, "level": level,
                           "steps": [int(len(a)), int(len(b))], "changes": changes(meta_a, meta_b)}
    if len(a) < MIN_STEPS or len(b) < MIN_STEPS:
        out.update(parts=[], verdict=f"too few steady steps to compare ({len(a)} and {len(b)}; at least "
                                     f"{MIN_STEPS} each)")
        return out
    columns = sorted(set(parts_of(a)) | set(parts_of(b)), key=_part_order)
    table = bootstrap_diff(a, b, columns=columns, level=level, resamples=resamples)
    if noise is None or not noise.get("rel_sd") == noise.get("rel_sd"):
        drift = max((x for x in (drift_noise(a), drift_noise(b)) if x == x), default=0.0)
        noise = {"rel_sd": drift, "source": "the runs' own drift (no repeats of either run in the store)"}
    table = widen(table, rel_sd=float(noise["rel_sd"]), level=level)
    out["run_noise"] = {"rel_sd": _plain(noise["rel_sd"]), "source": noise["source"]}
    out["parts"] = [{k: _plain(v) for k, v in r.items()} for r in table.to_dict("records")]
    out["verdict"] = verdict(out)
    return out


def widen(table: pd.DataFrame, *, rel_sd: float, level: float) -> pd.DataFrame:
    """The whole's interval widened by run-to-run noise: each run's mean off by ``rel_sd`` of itself, so the
    difference's extra half-width is z · rel_sd · sqrt(a² + b²), added in quadrature to each side of the
    bootstrap interval (in seconds and in % of A). The parts keep their within-run intervals."""
    t = table.copy()
    i = t.index[t["part"] == "step"][0]
    a, b = float(t.at[i, "a_s"]), float(t.at[i, "b_s"])
    z = float(_z(level))
    extra = z * rel_sd * math.hypot(a, b)
    for lo, hi, scale in (("lo_s", "hi_s", 1.0), ("lo_pct", "hi_pct", 100.0 / a)):
        d = float(t.at[i, "diff_s"]) * scale
        t.at[i, lo] = d - math.hypot(d - float(t.at[i, lo]), extra * scale)
        t.at[i, hi] = d + math.hypot(float(t.at[i, hi]) - d, extra * scale)
    t.at[i, "significant"] = bool(t.at[i, "lo_s"] > 0 or t.at[i, "hi_s"] < 0)
    return t


def _z(level: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf((1 + level) / 2)


def _part_order(name: str) -> tuple[int, str]:
    order = {"compute": 0, "optimizer": 1, "bubble": 8, "other": 9, "exposed, unattributed": 7, "unattributed": 10}
    return (order.get(name, 5 if name.startswith("exposed ") else 6), name)


def whole(result: dict) -> dict | None:
    return next((p for p in result.get("parts", []) if p["part"] == "step"), None)


def parts_carrying(result: dict) -> list[dict]:
    """The parts, those that carry most of the difference in its direction first."""
    w = whole(result)
    if w is None:
        return []
    sign = 1.0 if w["diff_s"] >= 0 else -1.0
    return sorted((p for p in result["parts"] if p["part"] != "step"), key=lambda p: -sign * p["diff_s"])


def explaining(result: dict) -> dict | None:
    """The part that carries most of the difference, in its direction (None when there is no part)."""
    carried = parts_carrying(result)
    return carried[0] if carried else None


def verdict(result: dict) -> str:
    """One line: "B is 12.4 % ± 1.1 % slower; 9.8 points of it exposed all_gather on dp_shard; changed:
    microbatches 8 → 4" (or "no significant difference")."""
    w = whole(result)
    if w is None:
        return result.get("verdict", "no comparison")
    per = " per token" if result["unit"] == "token" else ""
    half = (w["hi_pct"] - w["lo_pct"]) / 2
    if not w["significant"]:
        head = (f"no significant difference{per}: B − A = {w['diff_pct']:+.1f} % "
                f"({w['lo_pct']:+.1f} … {w['hi_pct']:+.1f} %, {result['level']:.0%} interval)")
    else:
        word = "slower" if w["diff_s"] > 0 else "faster"
        head = f"B is {abs(w['diff_pct']):.1f} % ± {half:.1f} % {word}{per}"
        carried = [p for p in parts_carrying(result) if p["significant"]][:2]
        if carried:
            head += f"; {abs(carried[0]['diff_pct']):.1f} points of it {carried[0]['part']}" + "".join(
                f", {abs(p['diff_pct']):.1f} {p['part']}" for p in carried[1:])
    changed = result.get("changes", [])
    if changed:
        shown = ", ".join(change_line(c) for c in changed[:4])
        head += f"; changed: {shown}" + (f" (+{len(changed) - 4} more)" if len(changed) > 4 else "")
    if result.get("not_comparable"):
        head += f" (compared per token: {', '.join(result['not_comparable'])} differ)"
    return head


def change_line(change: dict) -> str:
    """One change as the verdict says it: ``microbatches 8 → 4``, ``NCCL_ALGO none → Tree``."""
    return f"{_short(change['key'])} {_val(change['a'])} → {_val(change['b'])}"


def _short(key: str) -> str:
    for prefix in ("config.", "env.flags.", "env."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _val(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, separators=(",", ":"))
    return "none" if v is None or v == "" else str(v)  # "schedule 1f1b → none", not "1f1b → "


def gate(result: dict, *, fail_above_pct: float) -> bool:
    """True when B is slower than A by more than ``fail_above_pct`` with confidence: the interval's low end
    above it. Noise (an interval reaching below the threshold) never fails."""
    w = whole(result)
    return w is not None and w["lo_pct"] > fail_above_pct


def new_stragglers(a: list[dict], b: list[dict]) -> list[dict]:
    """The stragglers of B (``report``'s entries) that A did not have."""
    seen = {int(s["rank"]) for s in a}
    return [s for s in b if int(s["rank"]) not in seen]
