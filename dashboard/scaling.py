"""Scaling across runs (docs/formulas.md, Scaling): DataFrame in, DataFrame out, no plotting, no I/O.
The Scaling page (``views.scaling``) and ``meshscope sweep``'s table both call these functions on the same
loads (``views.scaling_runs``), so the two show the same numbers.

- **Throughput** of a run: global tokens per step / step time, over its steady steps
  (``stragglers.first_steady_step``: warm-up left out). Step time: the slowest rank's wall time
  (synchronous training), median over the steady steps; global tokens: the ranks' mean replica tokens × dp.
- **Families**: runs are compared only within one: the same model, sequence length and strategy (for a
  pipeline also its schedule, microbatches and virtual stages), and either
  *strong* (the same global batch: fixed total work per step) or *weak* (the same batch per rank, global
  batch / world size: the work grows with the world). A 1-rank run joins every family of its model whose
  batch it matches (at one rank every strategy computes the same thing, and strong and weak coincide).
  A family needs two or more world sizes.
- **Baseline**: the family's smallest world size n0 (the median throughput of its runs there, if several).
  speedup(n) = tput(n) / tput(n0); efficiency = speedup · n0 / n. Strong: the classic strong efficiency.
  Weak: the speedup is the scaled speedup (n/n0 times the work) and the efficiency is the per-rank
  throughput ratio (tput(n)/n) / (tput(n0)/n0).
- **Amdahl** (strong families with ``MIN_FIT_SIZES`` or more world sizes): time per token
  T(n) = T1 · (c + (1 − c)/n) = a + b/n, a linear least-squares fit in 1/n, c = a / (a + b); its quality
  is R² and the RMS residual of the fitted time per token. Two points always fit a two-parameter curve,
  so they test nothing; weak scaling keeps the time per rank, not the work, fixed, so Amdahl's law does
  not describe it. Amdahl's throughput rises with n towards a plateau and never falls: where the measured
  throughput falls after some world size by more than ``FALL_TOL`` (4 ranks on a 2-core machine), or the
  time per token does not fall with n at all (fitted b ≤ 0), there is no fit, and the verdict says so (a
  c clipped to 1 with R² 0 would read like a measurement).
- **Clean runs** (``runs_clean``): families are built from clean runs only (no injected fault, no failure
  event, finished) unless the caller includes the others (``family_runs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from meshscope.dashboard.analysis import parallel_degrees
from meshscope.dashboard.data import parse_mesh
from meshscope.dashboard.stragglers import first_steady_step

MIN_FIT_SIZES = 3
FALL_TOL = 0.05  # a throughput this far below the family's best at a smaller world size is a fall, not noise
# What makes two runs the same configuration apart from the world size (and the batch, by kind).
CONFIG_KEYS = ("model", "seq_len", "strategy", "schedule", "microbatches", "virtual_stages")
_KEY_FILL = {"model": "", "seq_len": 0, "strategy": "", "schedule": "", "microbatches": 0, "virtual_stages": 1}
KINDS = {"strong": "global_batch", "weak": "batch_per_rank"}
RULE = ("Runs are compared within a family: the same model and strategy with a fixed global batch (strong "
        "scaling) or a fixed batch per rank (weak scaling); a 1-rank run belongs to every family whose batch it "
        "matches. Baseline: the family's smallest world size n0. Speedup = throughput / throughput(n0), "
        "efficiency = speedup · n0 / n (weak: the per-rank throughput ratio). Throughput: global tokens per step / "
        "median step time (slowest rank) over the steps after warm-up. Amdahl fit: strong families with ≥ "
        f"{MIN_FIT_SIZES} world sizes, time per token = T1 · (c + (1 − c)/n) by least squares in 1/n.")


@dataclass(frozen=True, slots=True, kw_only=True)
class AmdahlFit:
    c: float  # serial (non-scaling) fraction of time at n = 1
    t1: float  # fitted time per unit of work on one device
    rmse: float  # RMS residual of the fitted time per unit of work
    r2: float  # 1 − SS_res / SS_tot of the fitted time per unit of work

    def time(self, n: np.ndarray | float) -> np.ndarray | float:
        return self.t1 * (self.c + (1 - self.c) / np.asarray(n, dtype=float))

    def speedup(self, n: np.ndarray | float) -> np.ndarray | float:
        """Speedup over one device: 1 / (c + (1 - c)/n)."""
        return 1.0 / (self.c + (1 - self.c) / np.asarray(n, dtype=float))


def amdahl_fit(*, n: np.ndarray, throughput: np.ndarray) -> AmdahlFit | None:
    """Fit c from throughputs at ``MIN_FIT_SIZES`` or more distinct world sizes (None with fewer).

    Least squares of T = 1/throughput on x = 1/n, with a >= 0 (c >= 0). None when the time per token does
    not fall as n grows (b <= 0): Amdahl's law then describes nothing measured (c would be clipped to 1)."""
    n = np.asarray(n, dtype=float)
    thr = np.asarray(throughput, dtype=float)
    ok = (n > 0) & (thr > 0) & np.isfinite(thr)
    n, t = n[ok], 1.0 / thr[ok]
    if len(np.unique(n)) < MIN_FIT_SIZES:
        return None
    x = 1.0 / n
    b, a = np.polyfit(x, t, 1)
    if b <= 0:  # time does not fall with n at all: no parallel part to fit
        return None
    if a < 0:  # no serial part fits better than a negative one: refit through the origin
        a, b = 0.0, float(np.dot(x, t) / np.dot(x, x))
    t1 = a + b
    resid = t - (a + b * x)
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / ss_tot if ss_tot > 0 else 1.0
    return AmdahlFit(c=a / t1, t1=t1, rmse=float(np.sqrt(np.mean(resid**2))), r2=r2)


def run_throughput(series: pd.DataFrame, *, runs: pd.DataFrame) -> pd.DataFrame:
    """Per run with step records: ``runs`` (the runs table: ``run``, ``world_size``, ``mesh`` JSON, other
    columns pass through) plus ``steady_from``, ``steps_used``, ``step_time_s``, ``tokens_per_step``,
    ``tokens_per_s``, ``tokens_per_s_per_device``.

    ``series``: per run and step, ``step_time_s`` (max wall over ranks) and ``tokens_mean`` (mean replica
    tokens over ranks), as ``data.overview_data`` returns it."""
    stats = []
    for run, g in series.dropna(subset=["step_time_s"]).groupby("run", sort=False):
        # The series holds all of the run's steps, so its first step is the run's first.
        first = first_steady_step(g, run_first_step=int(g["step"].min()))
        steady = g[g["step"] >= first]
        stats.append({"run": run, "steady_from": first, "steps_used": len(steady),
                      "step_time_s": float(steady["step_time_s"].median()),
                      "tokens_mean": float(steady["tokens_mean"].median())})
    cols = ["run", "steady_from", "steps_used", "step_time_s", "tokens_mean"]
    t = runs.drop(columns=[c for c in cols[1:] if c in runs], errors="ignore").dropna(subset=["world_size"])
    t = t.merge(pd.DataFrame(stats, columns=cols), on="run", how="inner")
    t = t[t["step_time_s"] > 0].copy()
    t["world_size"] = t["world_size"].astype(int)
    dp = [parallel_degrees(parse_mesh(m if isinstance(m, str) else None), world_size=w)["dp"]
          for m, w in zip(t["mesh"] if "mesh" in t else [None] * len(t), t["world_size"])]
    # Each rank reports its replica's tokens (global / dp): the mean over ranks × dp is the global count.
    t["tokens_per_step"] = t.pop("tokens_mean") * np.asarray(dp, dtype=float)
    t["tokens_per_s"] = t["tokens_per_step"] / t["step_time_s"]
    t["tokens_per_s_per_device"] = t["tokens_per_s"] / t["world_size"]
    t["best"] = t.index == t["tokens_per_s"].idxmax() if len(t) else []
    return t.reset_index(drop=True)


def _label(kind: str, key: dict, batch: float) -> str:
    parts = [kind, str(key["strategy"])]
    if key["schedule"]:
        parts[-1] += f" {key['schedule']} m{int(key['microbatches'])}"
        if int(key["virtual_stages"]) > 1:
            parts[-1] += f" v{int(key['virtual_stages'])}"
    parts.append(f"global batch {batch:g}" if kind == "strong" else f"batch/rank {batch:g}")
    return " · ".join(parts)


def families(per_run: pd.DataFrame) -> pd.DataFrame:
    """One row per (family, member run): ``family`` (a label), ``kind`` (strong/weak), ``batch`` (global
    or per rank), and the run's columns. Only families with two or more world sizes."""
    t = per_run.copy()
    for k, fill in _KEY_FILL.items():
        t[k] = t[k].fillna(fill) if k in t else fill
    t["batch_per_rank"] = (t["global_batch"] / t["world_size"]).round(9)
    alone = t["world_size"] == 1
    rows = []
    for kind, col in KINDS.items():
        for values, g in t[~alone].groupby([*CONFIG_KEYS, col], sort=True):
            key = dict(zip(CONFIG_KEYS, values[:-1]))
            # A 1-rank run is every strategy's baseline (the same model, sequence length and batch).
            ones = t[alone & (t["model"] == key["model"]) & (t["seq_len"] == key["seq_len"]) & (t[col] == values[-1])]
            members = pd.concat([ones, g])
            if members["world_size"].nunique() < 2:
                continue
            rows.append(members.assign(family=_label(kind, key, values[-1]), kind=kind, batch=values[-1]))
    if not rows:
        return t.iloc[:0].assign(family=[], kind=[], batch=[])
    return pd.concat(rows, ignore_index=True)


def scaling_table(per_run: pd.DataFrame) -> pd.DataFrame:
    """Per (family, run): ``n0`` and ``baseline`` (the runs at the family's smallest world size), ``speedup``
    and ``efficiency`` relative to it (module docstring), sorted by family and world size. ``per_run``:
    ``run_throughput``'s frame."""
    fam = families(per_run)
    if fam.empty:
        return fam.assign(n0=[], baseline=[], speedup=[], efficiency=[])
    parts = []
    for _, g in fam.groupby("family", sort=True):
        g = g.sort_values(["world_size", "run"])
        n0 = int(g["world_size"].iloc[0])
        at_n0 = g[g["world_size"] == n0]
        g = g.assign(n0=n0, baseline=", ".join(at_n0["run"]))
        g["speedup"] = g["tokens_per_s"] / float(at_n0["tokens_per_s"].median())
        g["efficiency"] = g["speedup"] * n0 / g["world_size"]
        parts.append(g)
    return pd.concat(parts, ignore_index=True)


def _medians(n: np.ndarray, throughput: np.ndarray) -> pd.Series:
    """Median throughput per world size, by world size."""
    return pd.Series(np.asarray(throughput, dtype=float)).groupby(np.asarray(n, dtype=int)).median().sort_index()


def throughput_fall(n: np.ndarray, throughput: np.ndarray, *, tol: float = FALL_TOL) -> int | None:
    """The world size where throughput stops rising (its highest median throughput), when a larger world
    size falls more than ``tol`` below it or it is the smallest world size; else None (it rises, or levels
    off within ``tol``): Amdahl's law has no fall."""
    med = _medians(n, throughput)
    if len(med) < 2:
        return None
    peak = int(med.idxmax())
    if peak == int(med.index[0]) or (med[med.index > peak] < (1 - tol) * med[peak]).any():
        return peak
    return None


def _fall_note(n: np.ndarray, throughput: np.ndarray, *, peak: int | None) -> str:
    med = _medians(n, throughput)
    n0 = int(med.index[0])
    speedups = ", ".join(f"{v / med.iloc[0]:.2f} at n={k}" for k, v in med.iloc[1:].items())
    where = f" beyond n={peak}" if peak is not None and peak > n0 else ""
    return (f"No Amdahl fit: throughput does not rise with the world size{where} (speedup {speedups} against "
            f"n={n0}); Amdahl's law has it rise towards a plateau, so a fit would describe nothing measured.")


def amdahl_fits(table: pd.DataFrame, *, clean: bool = False) -> pd.DataFrame:
    """Per family of ``scaling_table``: ``fit`` (an ``AmdahlFit`` or None), ``c``, ``r2``, ``rmse_rel``
    (RMS residual / mean time per token) and ``note``: the verdict, or why there is no fit. ``clean``: the
    table holds clean runs only (``family_runs``), as the notes then say."""
    rows = []
    sized = "clean world sizes" if clean else "world sizes"
    for family, g in table.groupby("family", sort=True):
        kind, sizes = g["kind"].iloc[0], sorted(g["world_size"].unique())
        shown = ", ".join(str(int(s)) for s in sizes)
        n, thr = g["world_size"].to_numpy(), g["tokens_per_s"].to_numpy()
        fall = throughput_fall(n, thr) if kind == "strong" and len(sizes) >= MIN_FIT_SIZES else None
        fit = amdahl_fit(n=n, throughput=thr) if kind == "strong" and fall is None else None
        if kind == "weak":
            note = ("No Amdahl fit: Amdahl's law is for a fixed global batch (strong scaling); weak scaling is "
                    "judged by its efficiency, the per-rank throughput against the baseline's.")
        elif len(sizes) < MIN_FIT_SIZES:
            note = (f"No Amdahl fit: {len(sizes)} {sized} ({shown}); a two-parameter curve passes through "
                    f"any two points, so a fit needs ≥ {MIN_FIT_SIZES} to say anything.")
        elif fit is None:  # a fall, or a time per token that does not fall with n
            note = _fall_note(n, thr, peak=fall)
        else:
            rel = fit.rmse / float((1.0 / g["tokens_per_s"]).mean())
            note = (f"Amdahl c = {fit.c:.3f} from {sized} {shown} (R² {fit.r2:.3f}, RMS residual {rel:.1%} "
                    f"of the time per token).")
        rows.append({"family": family, "kind": kind, "world_sizes": shown, "fit": fit,
                     "c": fit.c if fit else np.nan, "r2": fit.r2 if fit else np.nan,
                     "rmse_rel": fit.rmse / float((1.0 / g["tokens_per_s"]).mean()) if fit else np.nan,
                     "note": note})
    return pd.DataFrame(rows, columns=["family", "kind", "world_sizes", "fit", "c", "r2", "rmse_rel", "note"])


def family_runs(per_run: pd.DataFrame, *, include_unclean: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the runs families are built from, the runs left out) of ``per_run`` (``run_throughput``'s frame with
    ``runs_clean.clean_runs``' ``clean`` and ``reason``): the clean runs and the others, or every run and
    none with ``include_unclean``. Without a ``clean`` column every run is used."""
    if include_unclean or "clean" not in per_run:
        return per_run.reset_index(drop=True), per_run.iloc[:0]
    keep = per_run["clean"].fillna(False).astype(bool)
    return per_run[keep].reset_index(drop=True), per_run[~keep].reset_index(drop=True)


def no_family_reason(per_run: pd.DataFrame) -> str:
    """Why ``scaling_table`` found no family in ``per_run`` (a sentence for the page and the sweep)."""
    if per_run.empty:
        return "No scaling verdict: no run has step records."
    return ("No scaling verdict: no two world sizes share a configuration (the same model and strategy with the "
            "same global batch, or the same batch per rank), so no speedup can be stated; the table lists each "
            "run's throughput only. Run one configuration at several world sizes, e.g. `meshscope sweep`.")
