"""The what-if planner against real runs: a grid of gloo jobs of one model on this machine (DDP, FSDP2,
TP, PP GPipe / 1F1B / interleaved at 2 ranks; DDP, FSDP2, TP, PP 1F1B, FSDP2+TP, PP+FSDP2 at 4), a
calibration from one or two of them, and every other run's measured step time against the calibrated
prediction and the uncalibrated textbook model (``dashboard.planner.predict.textbook``), with peak memory.

    python bench/planner_grid.py [--store DIR] [--reuse] [--calibrate ddp2,fsdptp4] [--repeats 3] [--json]

Each layout runs ``--repeats`` times (``ddp2``, ``ddp2-r2``, ...): this 2-vCPU VM's speed drifts by 5-15 %
between runs minutes apart (once 48 % for one run), so a layout's measured step time is the median over its
repeats of ``meshscope report``'s step time (the median over the steps after warm-up of the slowest rank's
wall time), and so is its peak memory. The calibration uses every repeat of each calibration layout (as a
user who ran a layout three times would; ``--calibration-repeats 1``: its first run only, also printed).
Errors are predicted / measured - 1; the summary leaves the calibration layouts out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from meshscope.agent.store.reader import Store
from meshscope.dashboard import report, views
from meshscope.dashboard.planner import calibration, whatif
from meshscope.dashboard.planner.layouts import measured_layout
from meshscope.dashboard.planner import predict as planner

# name -> (ranks, trainer arguments)
GRID: dict[str, tuple[int, list[str]]] = {
    "ddp2": (2, []),
    "fsdp2": (2, ["--fsdp"]),
    "tp2": (2, ["--tp", "2"]),
    "gpipe2": (2, ["--pp", "2", "--schedule", "gpipe", "--microbatches", "4"]),
    "1f1b2": (2, ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"]),
    "interleaved2": (2, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4"]),
    "zb2": (2, ["--pp", "2", "--schedule", "interleaved-zb", "--virtual-stages", "2", "--microbatches", "4"]),
    "bfs2": (2, ["--pp", "2", "--schedule", "looped-bfs", "--virtual-stages", "2", "--microbatches", "4"]),
    "ddp4": (4, []),
    "fsdp4": (4, ["--fsdp"]),
    "tp4": (4, ["--tp", "4"]),
    "1f1b4": (4, ["--pp", "4", "--schedule", "1f1b", "--microbatches", "4"]),
    "fsdptp4": (4, ["--fsdp", "--tp", "2"]),
    "ppfsdp4": (4, ["--fsdp", "--pp", "2", "--schedule", "1f1b", "--microbatches", "4"]),
}


def run_name(name: str, repeat: int) -> str:
    return name if repeat == 1 else f"{name}-r{repeat}"


def run_grid(store: Path, *, model: str, steps: int, batch: int, reuse: bool, names: list[str],
             repeats: int) -> dict[str, float]:
    """Run every grid job not already in the store (with ``reuse``), each layout ``repeats`` times, the
    layouts interleaved (a slow spell of the machine hits different layouts); seconds per job."""
    have = set(Store.open(store).runs()) if reuse and store.exists() else set()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    took = {}
    for name, repeat in ((n, r) for r in range(1, repeats + 1) for n in names):
        run = run_name(name, repeat)
        if run in have:
            continue
        ranks, args = GRID[name]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               "-m", "meshscope.trainer.train", "--model", model, "--steps", str(steps), "--log-every", str(steps),
               "--batch-size", str(batch), "--store", str(store), "--run-name", run, *args]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        took[run] = time.monotonic() - t0
        if proc.returncode != 0:
            sys.exit(f"planner_grid: {run} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        print(f"  {run}: {ranks} ranks, {took[run]:.0f} s", flush=True)
    subprocess.run([sys.executable, "-m", "meshscope.cli", "ingest", "--store", str(store)], env=env, check=True,
                   capture_output=True, timeout=600)
    return took


def compare(store: Path, *, calibrate: list[str], names: list[str], repeats: int,
            calibration_repeats: int) -> tuple[pd.DataFrame, str]:
    """Every grid layout's step time (the median of its repeats' report step times) and peak memory
    against the calibrated and textbook predictions (calibrated from the first ``calibration_repeats`` runs
    of each calibration layout)."""
    load = views.direct_loader(Store.open(store))
    cal = whatif.calibrate_from(load, runs=[run_name(n, r) for n in calibrate for r in range(1, calibration_repeats + 1)])
    runs = [run_name(n, r) for n in names for r in range(1, repeats + 1)]
    every = whatif.calibrate_from(load, runs=runs).measured  # each run's layout and peak memory
    every["step_time_s"] = [report.build(load, run=r)["step_time_s"] for r in every["run"]]
    every["run"] = every["run"].str.replace(r"-r\d+$", "", regex=True)
    spread = every.groupby("run")["step_time_s"].agg(lambda t: t.max() / t.min() - 1)
    layouts = every.groupby("run", as_index=False, sort=False).agg(
        {**{c: "first" for c in every.columns if c not in ("run", "step_time_s", "peak_memory_bytes")},
         "step_time_s": "median", "peak_memory_bytes": "median"})
    comp = planner.comparison(cal, layouts)
    return comp.assign(repeat_spread=comp["run"].map(spread)), cal.memory_measure


def every_pair(store: Path, *, names: list[str], repeats: int, calibration_repeats: int) -> pd.DataFrame:
    """Each pair of layouts as the calibration (their first ``calibration_repeats`` runs), the others
    predicted: how much the figures depend on which two layouts a user measured first. Per pair: median
    and worst |error|, and whether the calibrated model beats the textbook in every family."""
    load = views.direct_loader(Store.open(store))
    table = load("runs_table")
    first = whatif.calibrate_from(load, runs=names[:1])
    cores = whatif.host_cores()
    runs = [run_name(n, r) for n in names for r in range(1, repeats + 1)]
    measured = {n: calibration.measure(views.meta_of(table, n), load("planner_data", run=n), model=first.model)
                for n in runs}
    every = whatif.calibrate_from(load, runs=runs).measured
    every["step_time_s"] = [report.build(load, run=r)["step_time_s"] for r in every["run"]]
    every["run"] = every["run"].str.replace(r"-r\d+$", "", regex=True)
    layouts = every.groupby("run", as_index=False, sort=False).agg(
        {**{c: "first" for c in every.columns if c not in ("run", "step_time_s")}, "step_time_s": "median"})
    rows = []
    for a, b in itertools.combinations(names, 2):
        cal = calibration.calibrate([measured[run_name(x, r)] for x in (a, b) for r in range(1, calibration_repeats + 1)],
                                    model=first.model, device=first.device, peak_flops=first.peak_flops, cores=cores)
        s = summary(planner.comparison(cal, layouts))
        rows.append({"calibration": f"{a}+{b}", "median": s["median_abs_error"], "worst": s["worst_abs_error"],
                     "worst_run": s["worst_run"], "beats_textbook": s["beats_textbook_in_every_family"]})
    return pd.DataFrame(rows).sort_values("median").reset_index(drop=True)


def each_alone(store: Path, *, names: list[str], repeats: int) -> pd.DataFrame:
    """Each run calibrated from itself alone and its own layout predicted: ``report``'s step time against
    the prediction (the self-consistency every schedule must meet within 5 %)."""
    load = views.direct_loader(Store.open(store))
    rows = []
    for run in (run_name(n, r) for n in names for r in range(1, repeats + 1)):
        cal = whatif.calibrate_from(load, runs=[run], holdout=False)
        row = cal.measured.iloc[0].to_dict()
        p = planner.predict(cal, measured_layout(row, model=cal.model))
        measured = report.build(load, run=run)["step_time_s"]
        rows.append({"run": run, "layout": p.layout.label, "measured_s": measured, "predicted_s": p.step_time_s,
                     "error": p.step_time_s / measured - 1, "extrapolated": "; ".join(p.extrapolated)})
    return pd.DataFrame(rows)


def summary(comp: pd.DataFrame) -> dict:
    others = comp[~comp["calibration"]]
    fam = others.assign(cal=others["error"].abs(), tb=others["textbook_error"].abs()).groupby("family")[["cal", "tb"]].median()
    mem = others["memory_error"].abs().dropna()
    return {"inside_interval": f"{int(others['inside'].sum())}/{len(others)}",
            "median_abs_error": float(others["error"].abs().median()), "worst_abs_error": float(others["error"].abs().max()),
            "worst_run": str(others.loc[others["error"].abs().idxmax(), "run"]),
            "textbook_median_abs_error": float(others["textbook_error"].abs().median()),
            "beats_textbook_in_every_family": bool((fam["cal"] < fam["tb"]).all()),
            "families": {f: {"calibrated": float(r.cal), "textbook": float(r.tb)} for f, r in fam.iterrows()},
            "memory_median_abs_error": float(mem.median()) if len(mem) else math.nan,
            "memory_worst_abs_error": float(mem.max()) if len(mem) else math.nan}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="", help="run store (default: a new temporary directory)")
    ap.add_argument("--reuse", action="store_true", help="keep the runs already in --store")
    ap.add_argument("--model", default="tiny-wide")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--calibrate", default="ddp2,fsdptp4", help="runs to calibrate from (grid names)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per layout (measured: their median)")
    ap.add_argument("--calibration-repeats", type=int, default=0,
                    help="runs of each calibration layout the calibration uses (default: all --repeats)")
    ap.add_argument("--only", default="", help="grid names to run (default: all)")
    ap.add_argument("--pairs", action="store_true", help="also: every pair of layouts as the calibration")
    ap.add_argument("--each-alone", action="store_true", help="also: each run's own layout from itself alone")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    store = Path(a.store or tempfile.mkdtemp(prefix="meshscope-planner-"))
    names = [n for n in (a.only.split(",") if a.only else GRID) if n]
    calibrate = [n for n in a.calibrate.split(",") if n]
    bad = [n for n in names + calibrate if n not in GRID]
    if bad:
        print(f"planner_grid: error: unknown grid name {bad[0]!r} (choose from {', '.join(GRID)})", file=sys.stderr)
        return 2
    load0 = os.getloadavg()
    print(f"grid of {len(names)} layouts x {a.repeats} ({a.model}, {a.steps} steps, batch {a.batch_size}) into {store}; "
          f"load average {load0[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    t0 = time.monotonic()
    took = run_grid(store, model=a.model, steps=a.steps, batch=a.batch_size, reuse=a.reuse, names=names,
                    repeats=a.repeats)
    grid_s = time.monotonic() - t0
    cal_reps = min(a.calibration_repeats or a.repeats, a.repeats)
    comp, memory_measure = compare(store, calibrate=calibrate, names=names, repeats=a.repeats,
                                   calibration_repeats=cal_reps)
    # The same from each calibration layout's first run alone: what one run each gives.
    single = summary(compare(store, calibrate=calibrate, names=names, repeats=a.repeats, calibration_repeats=1)[0])
    s = {**summary(comp), "calibration": calibrate, "calibration_repeats": cal_reps,
         "first_runs_only": {k: single[k] for k in ("median_abs_error", "worst_abs_error", "worst_run",
                                                     "beats_textbook_in_every_family")},
         "grid_seconds": grid_s, "jobs_run": len(took),
         "load_average_before": load0[0], "load_average_after": os.getloadavg()[0]}
    if a.json:
        from meshscope.dashboard.planner.cli import clean_json

        print(json.dumps(clean_json({"summary": s, "runs": comp.to_dict("records")}), indent=2, default=float))
        return 0
    show = comp.assign(
        measured=comp["measured_s"].map("{:.3f}".format), calibrated=comp["predicted_s"].map("{:.3f}".format),
        err=comp["error"].map("{:+.1%}".format),
        interval=[f"{lo:.3f}-{hi:.3f}{'' if ok else ' OUT'}" for lo, hi, ok in zip(comp["low_s"], comp["high_s"], comp["inside"])],
        textbook=comp["textbook_s"].map("{:.3f}".format),
        tb_err=comp["textbook_error"].map("{:+.1%}".format),
        mem_MiB=(comp["memory_measured"] / 2**20).map("{:.0f}".format),
        mem_pred=(comp["memory_predicted"] / 2**20).map("{:.0f}".format), mem_err=comp["memory_error"].map("{:+.1%}".format),
        spread=comp["repeat_spread"].map("{:.0%}".format), cal=comp["calibration"].map({True: "calibration", False: ""}))
    print(show[["run", "layout", "family", "measured", "spread", "calibrated", "err", "interval", "textbook", "tb_err", "mem_MiB",
                "mem_pred", "mem_err", "cal"]].to_string(index=False))
    print("(spread: slowest / fastest repeat - 1)")
    print(f"\ncalibrated from {', '.join(calibrate)} ({cal_reps} run{'s' if cal_reps > 1 else ''} each); over the "
          f"{int((~comp['calibration']).sum())} other layouts: "
          f"measured inside the interval {s['inside_interval']}; median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%} ({s['worst_run']}); "
          f"textbook median {s['textbook_median_abs_error']:.1%}")
    print("per family, median |error| calibrated vs textbook: " + ", ".join(
        f"{f} {v['calibrated']:.1%} vs {v['textbook']:.1%}" for f, v in s["families"].items())
          + f" -> calibrated better in every family: {s['beats_textbook_in_every_family']}")
    if cal_reps > 1:
        f1 = s["first_runs_only"]
        print(f"from the first run of each alone: median |error| {f1['median_abs_error']:.1%}, worst "
              f"{f1['worst_abs_error']:.1%} ({f1['worst_run']}); better in every family: "
              f"{f1['beats_textbook_in_every_family']}")
    print(f"peak memory ({memory_measure}): median |error| {s['memory_median_abs_error']:.1%}, "
          f"worst {s['memory_worst_abs_error']:.1%}")
    print(f"grid: {s['jobs_run']} jobs in {grid_s:.0f} s; load average {s['load_average_before']:.2f} before, "
          f"{s['load_average_after']:.2f} after")
    for r in comp[comp["extrapolated"] != ""].itertuples():
        print(f"  {r.run}: extrapolated: {r.extrapolated}")
    if a.each_alone:
        alone = each_alone(store, names=names, repeats=a.repeats)
        print(f"\neach run from itself alone: |error| median {alone['error'].abs().median():.1%}, worst "
              f"{alone['error'].abs().max():.1%} ({alone.loc[alone['error'].abs().idxmax(), 'run']}); "
              f"{int((alone['error'].abs() <= 0.05).sum())} of {len(alone)} within 5 %")
        print(alone.assign(error=alone["error"].map("{:+.1%}".format)).drop(columns="extrapolated")
              .to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    if a.pairs:
        pairs = every_pair(store, names=names, repeats=a.repeats, calibration_repeats=cal_reps)
        ok = (pairs["median"] <= 0.10) & (pairs["worst"] <= 0.25)
        print(f"\nevery pair as the calibration ({len(pairs)}): median of the medians {pairs['median'].median():.1%}, "
              f"{int(ok.sum())} meet median <= 10 % and worst <= 25 %, {int(pairs['beats_textbook'].sum())} beat the "
              f"textbook in every family; the best and the worst five:")
        print(pd.concat([pairs.head(5), pairs.tail(5)]).to_string(index=False, float_format=lambda x: f"{x:.1%}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
