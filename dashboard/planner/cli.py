"""``meshscope plan``: from measured runs of a model, the predicted step time, its breakdown, tokens/s,
MFU and peak memory of another layout or world size (``--layout``), or every layout of a world size
ranked by predicted tokens/s (``--rank-layouts``), each with the interval a run of it may measure
(``dashboard.planner.interval``); ``--probe`` first measures what no run did (``dashboard.planner.probe``).
One computation with the What-if page (``dashboard.planner.whatif``, ``dashboard.planner.predict``);
``--json`` for scripts.

    meshscope plan --store DIR --run NAME [--run NAME ...] --layout dp=2,tp=1,pp=1,fsdp=0,schedule=1f1b,microbatches=4
                   [--world-size N] [--probe] [--json]
    meshscope plan --store DIR --run NAME [--run NAME ...] --rank-layouts --world-size N [--probe] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from meshscope.agent.cliargs import ArgParser, run_command
from meshscope.agent.collector.catchup import catch_up
from meshscope.agent.store.reader import Store, StoreError
from meshscope.dashboard import views
from meshscope.dashboard.planner import layouts, probe, whatif
from meshscope.dashboard.planner import predict as planner
from meshscope.dashboard.config import ConfigError
from meshscope.agent.contract.layout import LayoutError


DESCRIPTION = ("From measured runs of a model, the predicted step time (with the interval a run may measure), its "
               "breakdown, tokens/s, MFU and peak memory of another layout or world size, or every layout of a "
               "world size ranked.")


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="meshscope plan", description=DESCRIPTION)
    p.add_argument("--store", action="append", required=True, metavar="DIR",
                   help="run store directory or s3://bucket/prefix (the agent's --upload); repeatable")
    p.add_argument("--run", action="append", required=True, metavar="NAME",
                   help="a measured run to calibrate from (repeatable; runs of one model)")
    p.add_argument("--layout", default=None, metavar="K=V,...",
                   help=f"the layout to predict; keys: {', '.join(layouts.KEYS)} (layers / width: a scaled model)")
    p.add_argument("--rank-layouts", action="store_true", help="every valid layout of --world-size, fastest first")
    p.add_argument("--world-size", type=int, default=None, metavar="N", help="ranks (default: the first run's)")
    p.add_argument("--batch", type=int, default=None, metavar="B", help="global batch (default: the first run's)")
    p.add_argument("--probe", action="store_true",
                   help="first run a few steps of the smallest layout with each parallelism kind (TP, FSDP, a "
                        "pipeline) the predictions need and no run measured (the reference trainer, into the store)")
    p.add_argument("--probe-steps", type=int, default=probe.PROBE_STEPS, metavar="N", help="steps per probe")
    p.add_argument("--include-unclean", action="store_true",
                   help="calibrate from named runs that are not clean too (injected faults, a crash, Ctrl-C or "
                        "SIGTERM); by default they are left out and listed")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    def body(a: argparse.Namespace) -> int:
        if (a.layout is None) == (not a.rank_layouts):
            raise ConfigError("give either --layout K=V,... or --rank-layouts")
        if a.world_size is not None and a.world_size < 1:
            raise ConfigError(f"--world-size {a.world_size} must be >= 1")
        if a.batch is not None and a.batch < 1:
            raise ConfigError(f"--batch {a.batch} must be >= 1")
        try:
            spec = layouts.parse_layout(a.layout) if a.layout is not None else {}
            store = Store.open_many(a.store)
        except (LayoutError, StoreError) as e:
            raise ConfigError(str(e)) from None
        for root in store.local_roots():  # records still only in spools (no agent ran) count too
            if note := catch_up(root).message():
                print(f"meshscope plan: {note}", file=sys.stderr)
        if a.probe_steps < 2:
            raise ConfigError(f"--probe-steps {a.probe_steps} must be >= 2")
        named = list(dict.fromkeys(a.run))
        load = views.direct_loader(store)
        whatif.calibrate_from(load, runs=named, holdout=False)  # a bad name or run: its message first
        runs, said = whatif.clean_choice(load, runs=named, include_unclean=a.include_unclean)
        for r in said.itertuples():
            if not r.clean:
                what = "included though not clean" if a.include_unclean else "left out"
                print(f"meshscope plan: {what}: {r.run}: {r.reason}"
                      + ("" if a.include_unclean else " (--include-unclean to calibrate from it)"), file=sys.stderr)
        if not runs:
            raise ConfigError("every named run is left out as not clean (listed above): name clean runs, or give "
                              "--include-unclean")
        cal = whatif.calibrate_from(load, runs=runs)
        first = cal.measured.iloc[0]
        world = a.world_size or int(first["world_size"])
        if a.batch and spec.get("batch", a.batch) != a.batch:
            raise ConfigError(f"--batch {a.batch} and --layout batch={spec['batch']} disagree: give one")
        spec.setdefault("batch", a.batch or int(first["global_batch"]))
        preds = _predict(cal, spec, ranked=a.rank_layouts, world=world)
        probes: list[probe.Probe] = []
        if a.probe and (kinds := probe.needed(cal, preds)):
            roots = store.local_roots()
            if not roots:
                raise ConfigError("--probe writes its runs into a local store: give a directory as --store")
            meta = views.meta_of(views.direct_loader(store)("runs_table"), runs[0])
            try:
                probes = probe.run_probes(cal, kinds, meta=meta, store=Path(roots[0]), steps=a.probe_steps,
                                          log=lambda line: print(line, file=sys.stderr))
            except RuntimeError as e:
                print(f"meshscope plan: {e}", file=sys.stderr)
                return 1
            catch_up(roots[0])
            store = Store.open_many(a.store)
            cal = whatif.calibrate_from(views.direct_loader(store), runs=runs + [p.run for p in probes])
            preds = _predict(cal, spec, ranked=a.rank_layouts, world=world)
        elif a.probe:
            print("meshscope plan: nothing to probe: the calibration runs measured every parallelism kind the "
                  "predictions need", file=sys.stderr)
        if a.json:
            listed = [{"run": p.run, "kind": p.kind, "layout": p.layout.label, "seconds": p.seconds} for p in probes]
            left = [{"run": r.run, "reason": r.reason} for r in said.itertuples()
                    if not r.clean and not a.include_unclean]
            out = [{**p.as_json(), "warnings": list(cal.warnings), "calibration_runs": list(cal.runs), "probes": listed,
                    "left_out": left} for p in preds]
            print(json.dumps(clean_json(out if a.rank_layouts else out[0]), indent=2))
        else:
            print(format_text(cal, preds, ranked=a.rank_layouts, probes=probes))
        return 0

    return run_command(prog="meshscope plan", parser=_parser(), argv=argv, body=body)


def _predict(cal, spec: dict, *, ranked: bool, world: int) -> list[planner.Prediction]:
    batch = spec["batch"]
    try:
        if ranked:
            preds = planner.rank_layouts(cal, world_size=world, global_batch=batch)
            if not preds:
                raise ConfigError(f"no layout of {world} ranks divides this model and batch {batch}")
            return preds
        return [planner.predict(cal, layouts.resolve(spec, model=cal.model, world_size=world, global_batch=batch))]
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def format_text(cal, preds: list[planner.Prediction], *, ranked: bool, probes: list = ()) -> str:
    lines = [f"calibrated from {', '.join(cal.runs)} ({cal.model.name}, {cal.model.n_params:,.0f} params, "
             f"{cal.device}" + (f", {cal.cores:.3g} cores shared" if cal.cores else "") + ")"]
    lines += [f"probe {p.run}: {p.layout.label}, measured {p.kind.upper()} in {p.seconds:.0f} s" for p in probes]
    if ranked:
        lines.append(f"{'layout':<38} {'step s':>8} {'interval s':>15} {'tokens/s':>10} {'MFU':>6} {'memory':>10}  fits")
        for p in preds:
            fits = {None: "?", True: "yes", False: "NO"}[p.memory_fits]
            lines.append(f"{p.layout.label:<38} {p.step_time_s:>8.3f} {_interval(p):>15} {p.tokens_per_s:>10,.0f} "
                         f"{_pct(p.mfu):>6} {p.peak_memory_bytes / 2**20:>7,.0f} MiB  {fits}")
        lines.append(planner.verdict(preds, cal=cal)["sentence"])
        notes = sorted({n for p in preds for n in p.extrapolated})
    else:
        p = preds[0]
        b = p.breakdown
        comm = ", ".join(f"{k} {v:.3f} s" for k, v in b["exposed_comm_s"].items() if v > 0) or "none"
        lines += [f"layout {p.layout.label} on {p.layout.world_size} ranks, global batch {p.layout.global_batch}",
                  f"  step time {p.step_time_s:.3f} s (a run may measure {_interval(p)} s) · "
                  f"{p.tokens_per_s:,.0f} tokens/s · MFU {_pct(p.mfu)} · "
                  f"peak memory {p.peak_memory_bytes / 2**20:,.0f} MiB per rank",
                  f"  compute {b['compute_s']:.3f} s, optimizer {b['optimizer_s']:.3f} s, exposed comm: {comm}, "
                  f"bubble {b['bubble_s']:.3f} s, other {b['other_s']:.3f} s"]
        notes = list(p.extrapolated)
    if notes:
        lines.append("extrapolated (not measured by the calibration runs):")
        lines += [f"  - {n}" for n in notes]
    lines += [f"WARNING {w}" for w in cal.warnings]
    return "\n".join(lines)


def _interval(p: planner.Prediction) -> str:
    return f"{p.step_time_low_s:.3f}-{p.step_time_high_s:.3f}"


def _pct(x: float) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.1%}"


def clean_json(x):
    """JSON without NaN (not JSON): None instead."""
    if isinstance(x, dict):
        return {k: clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
