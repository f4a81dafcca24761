"""The planner over a store: calibrate from named runs (through the injected loader, like every view),
and what the What-if page shows. ``meshscope plan`` (``dashboard/planner/cli.py``) and the page call these."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from meshscope.dashboard import figures
from meshscope.dashboard.planner import calibration, layouts
from meshscope.dashboard.planner import predict as planner
from meshscope.dashboard.config import ConfigError
from meshscope.dashboard.data import parse_config
from meshscope.dashboard.memory_model import spec_from_meta
from meshscope.dashboard.views import Loader, meta_of, run_cleanliness
from meshscope.agent.contract.layout import FLAVORS


def clean_choice(load: Loader, *, runs: list[str], include_unclean: bool = False) -> tuple[list[str], pd.DataFrame]:
    """Of ``runs``, the ones a calibration takes: the clean ones (``dashboard/runs_clean.py``: no fault
    injected, no crash or abort, finished), or every one with ``include_unclean``; and the cleanliness of
    the others (``run``, ``reason``, ...: left out, or included though not clean) and of the runs with CPU
    contention (kept: an oversubscribed host is a regime the planner models; ``cpu_contention`` says so)."""
    clean = run_cleanliness(load, runs=runs)
    named = clean.set_index("run")
    kept = [r for r in runs if include_unclean or r not in named.index or bool(named.loc[r, "clean"])]
    said = clean[~clean["clean"] | clean["cpu_contention"]].reset_index(drop=True)
    return kept, said


def calibrate_from(load: Loader, *, runs: list[str], holdout: bool = True) -> calibration.Calibration:
    """The calibration of ``runs`` (one model), with each run predicted from the others (``holdout``;
    its errors widen the predictions' intervals). ConfigError, naming the value, for a run the store does
    not have, runs of different models, or a run without step records."""
    table = load("runs_table")
    if not runs:
        raise ConfigError("no run to calibrate from: name at least one measured run")
    missing = [r for r in runs if r not in set(table["run"])]
    if missing:
        known = ", ".join(sorted(table["run"])) or "none"
        raise ConfigError(f"no run {missing[0]!r} in the store (runs: {known})")
    metas = [meta_of(table, r) for r in runs]
    for meta in metas:
        absent = [k for k in ("n_params", "n_layers", "d_model", "seq_len", "flops_per_token", "world_size")
                  if not _positive(meta.get(k))]
        if absent:
            raise ConfigError(f"run {meta['run']!r} does not describe its model's shape ({', '.join(absent)} unknown): "
                              "the planner needs the layers, width, sequence length and FLOPs per token that the "
                              "reference trainer and the framework integrations record")
    shapes = {(m.get("model"), int(m["n_params"]), int(m["seq_len"])) for m in metas}
    if len(shapes) > 1:
        raise ConfigError("runs of different models cannot calibrate one planner: "
                          + ", ".join(f"{m['run']} ({m.get('model')}, {int(m['n_params']):,} params, seq {int(m['seq_len'])})"
                                      for m in metas))
    devices = {str(m.get("device") or "").split(":")[0] for m in metas}
    specs = [spec_from_meta(m) for m in metas]
    kinds = {(s.dtype, s.activation_checkpoint) for s in specs}
    if len(devices) > 1 or len(kinds) > 1:
        raise ConfigError("runs on different devices or with different dtypes cannot calibrate one planner: "
                          + ", ".join(f"{m['run']} ({m.get('device') or 'device unknown'}, {s.dtype}"
                                      f"{', activation checkpointing' if s.activation_checkpoint else ''})"
                                      for m, s in zip(metas, specs)))
    model = calibration.model_shape(metas[0], **_flavor(metas[0]))
    measured = []
    for meta in metas:
        try:
            measured.append(calibration.measure(meta, load("planner_data", run=meta["run"]), model=model))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    peaks = [float(m["peak_flops"]) for m in metas if float(m.get("peak_flops") or 0) > 0]
    # An unknown device is not taken for a CPU host: no processor sharing is modelled for it.
    kw = {"model": model, "device": devices.pop(), "cores": host_cores(),
          "peak_flops": sum(peaks) / len(peaks) if peaks else 0.0, "dtype": specs[0].dtype,
          "activation_checkpoint": specs[0].activation_checkpoint}
    cal = planner.settle(calibration.calibrate(measured, **kw))
    return dataclasses.replace(cal, holdout=holdout_errors(measured, **kw)) if holdout else cal


def holdout_errors(measured: list[dict], **calibrate_kw) -> pd.DataFrame:
    """Each run (``calibration.measure``'s) predicted from the others' calibration: ``run``, ``ratio``
    (its measured step / the prediction) and ``kinds`` (the extrapolation the prediction needed). Empty
    with fewer than two runs."""
    rows = []
    for i, m in enumerate(measured if len(measured) > 1 else []):
        cal = planner.settle(calibration.calibrate(measured[:i] + measured[i + 1:], **calibrate_kw))
        lay = layouts.measured_layout({**m["layout"]}, model=cal.model)
        if lay.pp > 1 and lay.schedule not in layouts.SIMULATED:
            continue
        p = planner.predict(cal, lay, ranks_per_host=int(m["ranks_per_host"]))
        rows.append({"run": m["run"], "ratio": m["step_time_s"] / p.step_time_s, "kinds": p.extrapolation_kinds})
    return pd.DataFrame(rows, columns=["run", "ratio", "kinds"])


def _positive(v) -> bool:
    try:
        return float(v) > 0
    except (TypeError, ValueError):
        return False


def flavor_name(meta: dict) -> str:
    """The reference trainer's flavor a runs-table row names (its config's ``model.flavor``, else the
    model's name); '' where neither."""
    model = parse_config(meta.get("config")).get("model")
    name = model.get("flavor") if isinstance(model, dict) else None
    return str(name or meta.get("model") or "")


def _flavor(meta: dict) -> dict:
    """n_heads and vocabulary of a run's model where it is the reference trainer's (a flavor it names)."""
    flavor = FLAVORS.get(flavor_name(meta))
    return {"n_heads": flavor.n_heads, "vocab_size": flavor.vocab_size} if flavor else {}


def host_cores() -> int:
    """Cores this process may use: the CPU host's the calibration assumes its runs shared (docs/formulas.md,
    "What-if planner")."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True, kw_only=True)
class WhatIf:
    calibration: calibration.Calibration
    predictions: list[planner.Prediction]
    table: pd.DataFrame  # one row per candidate layout
    measured: pd.DataFrame  # planner.comparison of the measured runs at this world size
    figure: go.Figure
    verdict: dict  # planner.verdict: the fastest layout only where the intervals decide it
    runs: list[str]  # the runs calibrated from
    # the runs not clean (left out, or included with ``include_unclean``) and those with CPU contention
    # (kept): ``clean_choice``'s frame
    cleanliness: pd.DataFrame


def whatif(load: Loader, *, runs: list[str], world_size: int, global_batch: int | None = None,
           include_unclean: bool = False) -> WhatIf:
    """What the What-if page shows: every candidate layout for ``world_size`` ranks predicted from the
    clean runs of ``runs`` (all of them with ``include_unclean``), and the measured runs of that world size
    (from the store, clean ones likewise) overlaid. ConfigError where no run is left to calibrate from."""
    kept, said = clean_choice(load, runs=runs, include_unclean=include_unclean)
    if not kept:
        raise ConfigError("none of the runs is clean (" + "; ".join(f"{r.run}: {r.reason}" for r in said.itertuples())
                          + "): include the runs that are not clean to calibrate from them")
    cal = calibrate_from(load, runs=kept)
    batch = global_batch or int(cal.measured["global_batch"].iloc[0])
    preds = planner.rank_layouts(cal, world_size=world_size, global_batch=batch)
    table = prediction_table(preds)
    comp = planner.comparison(cal, measured_runs(load, cal=cal, world_size=world_size, global_batch=batch,
                                                 include_unclean=include_unclean))
    comp = comp if len(comp) else pd.DataFrame()
    # The chart: the fastest layouts and every layout a measured run has (the table lists them all).
    shown = table if table.empty else table[
        (table.index < CHART_LAYOUTS) | table["layout"].isin(set(comp["layout"]) if len(comp) else set())]
    return WhatIf(calibration=cal, predictions=preds, table=table, measured=comp,
                  figure=figures.whatif_layouts(shown, measured=comp), verdict=planner.verdict(preds, cal=cal, measured=comp),
                  runs=kept, cleanliness=said)


CHART_LAYOUTS = 24  # the fastest layouts drawn (the table has every one)
MAX_OVERLAID = 12  # the newest measured runs of the world size drawn over the predictions


def measured_runs(load: Loader, *, cal: calibration.Calibration, world_size: int, global_batch: int,
                  include_unclean: bool = False) -> pd.DataFrame:
    """The store's (clean, unless ``include_unclean``) runs of the calibration's model at ``world_size``
    and ``global_batch`` (the newest ``MAX_OVERLAID``), measured as the calibration measures its own:
    layout, step time, peak memory."""
    table = load("runs_table")
    same = table[(table["model"] == cal.model.name) & (table["n_params"] == cal.model.n_params)
                 & (table["world_size"] == world_size) & (table["global_batch"] == global_batch)
                 & (table["seq_len"] == cal.model.seq_len)]
    names = list(same["run"])  # the runs table is newest first
    names = clean_choice(load, runs=names, include_unclean=include_unclean)[0][:MAX_OVERLAID] if names else names
    if not names:
        return pd.DataFrame()
    try:
        return calibrate_from(load, runs=names, holdout=False).measured
    except ConfigError:  # a run without step records: nothing to overlay
        return pd.DataFrame()


def prediction_table(preds: list[planner.Prediction]) -> pd.DataFrame:
    """One row per prediction: the layout label, step time and its parts, tokens/s, MFU, memory."""
    rows = []
    for p in preds:
        b = p.breakdown
        rows.append({"layout": p.layout.label, "family": layouts.family(p.layout), "step_time_s": p.step_time_s,
                     "step_time_low_s": p.step_time_low_s, "step_time_high_s": p.step_time_high_s,
                     "tokens_per_s": p.tokens_per_s, "mfu": p.mfu, "compute_s": b["compute_s"],
                     "optimizer_s": b["optimizer_s"], "bubble_s": b["bubble_s"], "other_s": b["other_s"],
                     **{f"exposed_{k}_s": v for k, v in b["exposed_comm_s"].items()},
                     "peak_memory_bytes": p.peak_memory_bytes, "memory_fits": p.memory_fits,
                     "extrapolated": "; ".join(p.extrapolated)})
    return pd.DataFrame(rows)
