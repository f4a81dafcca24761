"""``meshscope report --store DIR|s3://BUCKET/PREFIX [--store ...] --run NAME [--steps A:B] [--json]``: a run's verdicts
in the terminal, computed by the same views the dashboard's pages render (one computation: what the
Overview and Pipeline pages say, ``report`` says). ``--json`` prints one object for scripts and CI.

Every headline figure says what it is: step time as the median and the mean of the ranks' step times over
the steady steps (``step_time_s_median``, ``step_time_s_mean``; ``step_time_s`` is the median), the
breakdown as means over the same rank-steps that sum to that mean (``analysis.step_time``, which the
Communication page's exposed communication is too), tokens/s and MFU as medians over those steps, the loss
as the last step's (non-finite: ``loss_nonfinite`` and a warning, never "n/a")."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from meshscope.agent.cliargs import ArgParser, run_command
from meshscope.agent.collector.catchup import catch_up
from meshscope.agent.store.reader import Store, StoreError
from meshscope.dashboard import analysis, environment, hang, stragglers, views
from meshscope.dashboard.config import ConfigError


def build(load: views.Loader, *, run: str, steps: tuple[int, int] | None = None) -> dict[str, Any]:
    """The report of ``run`` as a JSON-able dict. Raises ConfigError for a run the store does not have."""
    table = load("runs_table")
    if run not in set(table["run"]):
        known = ", ".join(sorted(table["run"])) or "none"
        raise ConfigError(f"no run {run!r} in the store (runs: {known})")
    meta = views.meta_of(table, run)
    ov = views.overview(load, run=run, runs=[run], steps=steps)
    rng = steps or (meta.get("first_step"), meta.get("last_step"))
    out: dict[str, Any] = {
        "run": run, "world_size": _int(meta.get("world_size")), "strategy": meta.get("strategy"),
        "device": meta.get("device"), "steps": [_int(rng[0]), _int(rng[1])],
        "first_steady_step": _int(ov.first_steady_step), "warmup_steps_excluded": None,
        "verdict_steps": ov.verdict_steps, "tokens_per_s": _num(ov.metrics.get("tokens_per_s")),
        "step_time_s": _num(ov.metrics.get("step_time_s")), "mfu": _num(ov.metrics.get("mfu")),
        "loss": _num(ov.metrics.get("loss")), "straggler_verdict": ov.has_peers, "stragglers": [],
        "straggler_cost_s_per_step": None,
        "breakdown": None, "pipeline": None, "warnings": list(ov.warnings),
        "attempts": _int(meta.get("attempts", 0)) + 1 if meta.get("attempts") is not None else None,
        "events": analysis.event_summary(load("events", run=run)),
        # the same figures, named for what they are (the keys above are kept for scripts that read them)
        "step_time_s_median": _num(ov.metrics.get("step_time_s")), "step_time_s_mean": _num(ov.metrics.get("step_time_s_mean")),
        "tokens_per_s_median": _num(ov.metrics.get("tokens_per_s")), "mfu_median": _num(ov.metrics.get("mfu")),
        "loss_last": _num(ov.metrics.get("loss")), "figures_steps": None, "figures_rank_steps": None,
        "mfu_reason": None if _num(ov.metrics.get("mfu")) is not None else analysis.mfu_reason(
            meta, tokens=bool(ov.series.loc[ov.series["run"] == run, "tokens_mean"].gt(0).any()) if len(ov.series) else False),
        "loss_nonfinite": ov.loss_nonfinite and {k: v for k, v in ov.loss_nonfinite.items() if k != "steps"},
        "attempt_steps": [{"attempt": int(a["attempt"]) + 1, "ranks": int(a["ranks"]), "rank_steps": int(a["rank_steps"]),
                           "steps": [int(a["first_step"]), int(a["last_step"])]}
                          for a in load("attempts", run=run).to_dict("records")],
    }
    # the watchdogs' stalls (dashboard.hang): None when no rank reported one
    rows = load("hang_rows", run=run)
    stall = hang.analyse(rows["hangs"], rows["last_steps"], world_size=out["world_size"] or 0)
    out["hang"] = None if stall["status"] == "none" else stall
    if ov.step_time is not None:
        out["figures_steps"] = [ov.step_time["first_step"], ov.step_time["last_step"]]
        out["figures_rank_steps"] = ov.step_time["rank_steps"]
    if ov.first_steady_step is not None and rng[0] is not None:
        out["warmup_steps_excluded"] = int(ov.first_steady_step) - int(rng[0])
    if ov.stragglers is not None:
        out["stragglers"] = [{"rank": int(r.rank), "cause": r.cause, "cost_s_per_step": _num(r.cost_s_per_step),
                              "excess_s": _num(r.excess_s), "slow_share": _num(r.slow_share)}
                             for r in ov.stragglers.itertuples()]
        out["straggler_cost_s_per_step"] = _num(ov.metrics.get("cost_s"))
    if ov.breakdown is not None and len(ov.breakdown):
        cols = ["wall_s", "compute_s", "exposed_comm_s", "bubble_s", "other_s"]
        t = ov.step_time
        out["breakdown"] = {"mean_over_ranks": {c: _num(ov.breakdown[c].mean()) for c in cols},
                            "per_rank": [{"rank": int(r["rank"]), **{c: _num(r[c]) for c in cols}}
                                         for r in ov.breakdown.to_dict("records")],
                            # means over the steady rank-steps: they sum to step_time_s_mean
                            "mean_per_rank_step": {**{c: _num(t[c]) for c in analysis.BREAKDOWN},
                                                   "sum_s": _num(t["step_time_s_mean"])}}
    if int(meta["mesh"].get("pp", 1)) > 1:
        out["pipeline"] = _pipeline(load, run=run, steps=steps)
    window = tuple(out["figures_steps"]) if out["figures_steps"] else steps
    out["collectives"] = [{"op": c["op"], "dim": c["dim"], "mesh_dim": c["mesh_dim"],
                           "ops_per_rank_step": _num(c["ops_per_rank_step"]), "bytes_per_op": _num(c["bytes_per_op"]),
                           "exposed_s_per_rank_step": _num(c["exposed_s_per_rank_step"])}
                          for c in load("collective_counts", run=run, steps=window).to_dict("records")]
    return out


def _pipeline(load: views.Loader, *, run: str, steps) -> dict[str, Any] | None:
    pipe = views.pipeline(load, run=run, steps=steps)
    if pipe.stages is None:
        return None
    return {"schedule": pipe.schedule, "p": pipe.p, "m": pipe.m, "v": pipe.v, "theory": _num(pipe.theory),
            "theory_source": pipe.theory_source or None, "steps": list(pipe.steps) if pipe.steps else None,
            "stages": [{"stage": int(r["stage"]), "bubble": _num(r["bubble"]),
                        "schedule_share": _num(r["schedule_share"]), "schedule_idle": _num(r["schedule_idle"]),
                        "p2p_share": _num(r["p2p_share"]), "unexplained": _num(r["unexplained"]),
                        "imbalance": _num(r["imbalance"])} for r in pipe.stages.to_dict("records")]}


def format_text(rep: dict[str, Any]) -> str:
    """A short readable summary of ``build``'s dict."""
    lines = [f"run {rep['run']}: {rep['world_size']} ranks, {rep['strategy'] or '?'} on {rep['device'] or '?'}, "
             f"steps {rep['steps'][0]}..{rep['steps'][1]}"]
    if rep["first_steady_step"] is not None:
        w = rep["warmup_steps_excluded"]
        lines.append(f"  verdicts from step {rep['first_steady_step']} ({w} warm-up step{'' if w == 1 else 's'} "
                     f"left out; {rep['verdict_steps']} judged)")
    median, mean = rep.get("step_time_s_median", rep["step_time_s"]), rep.get("step_time_s_mean")
    mfu = f"MFU {_fmt(rep['mfu'], '.1%')} (median)" if rep["mfu"] is not None else "MFU n/a"
    lines.append(f"  step time {_secs(median)} median, {_secs(mean)} mean · "
                 f"{_fmt(rep['tokens_per_s'], ',.0f')} tokens/s (median) · {mfu} · loss {_loss(rep)}")
    if rep.get("figures_steps"):
        a, b = rep["figures_steps"]
        lines.append(f"    (over steps {a}..{b}, {rep['figures_rank_steps']} rank-steps; the loss is the last step's)")
    if rep["mfu"] is None and rep.get("mfu_reason"):
        lines.append(f"    MFU n/a: {rep['mfu_reason']}")
    b = rep["breakdown"]
    if b and b.get("mean_per_rank_step"):
        m = b["mean_per_rank_step"]
        wall = m["sum_s"] or float("nan")
        lines.append("  per step (mean over rank-steps): " + " + ".join(
            f"{name} {_secs(m[c])} ({_fmt(m[c] / wall if m[c] is not None else None, '.0%')})"
            for name, c in (("compute", "compute_s"), ("exposed comm", "exposed_comm_s"), ("bubble", "bubble_s"),
                            ("other", "other_s"))) + f" = {_secs(m['sum_s'])}, the mean step time")
    if rep["stragglers"]:
        for s in rep["stragglers"]:
            lines.append(f"  STRAGGLER rank {s['rank']}: {s['cause']}; its peers wait "
                         f"{_fmt(s['cost_s_per_step'] * 1e3 if s['cost_s_per_step'] is not None else None, '.1f')} "
                         f"ms per step for it")
    elif rep["verdict_steps"] < environment.MIN_STEADY_STEPS:
        lines.append(f"  no straggler verdict: only {rep['verdict_steps']} steps after warm-up")
    elif rep["verdict_steps"] and not rep["straggler_verdict"]:
        lines.append("  no straggler verdict: every rank is alone in its pipeline stage (no peers doing the same work)")
    elif rep["verdict_steps"]:
        lines.append(f"  no straggler: no rank was >= {stragglers.STRAGGLER_REL:.0%} slower than its peers and last "
                     f"to arrive in most steps")
    p = rep["pipeline"]
    if p:
        lines.append(f"  pipeline {p['schedule']} p={p['p']} m={p['m']} v={p['v']}: theory "
                     f"{_fmt(p['theory'], '.1%')}" + (f" ({p['theory_source']})" if p["theory_source"] else ""))
        for s in p["stages"]:
            lines.append(f"    stage {s['stage']}: bubble {_fmt(s['bubble'], '.1%')} = imbalance "
                         f"{_fmt(s['imbalance'], '.1%')} + schedule share {_fmt(s['schedule_share'], '.1%')} "
                         f"(fill & drain {_fmt(s['schedule_idle'], '.1%')}, P2P & host gaps "
                         f"{_fmt(s['p2p_share'], '.1%')}, other {_fmt(s['unexplained'], '.1%')})")
    ev = rep["events"]
    if ev["counts"]:
        counts = ", ".join(f"{k} x{n}" for k, n in ev["counts"].items())
        last = ev["key_event"]
        lines.append(f"  events: {counts}; key event: rank {last['rank']} step {last['step']} {last['kind']}: "
                     f"{last['message'][:160]}")
    if (rep["attempts"] or 1) > 1:
        parts = "; ".join(f"attempt {a['attempt']}: steps {a['steps'][0]}..{a['steps'][1]} ({a['rank_steps']} "
                          f"rank-steps)" for a in rep.get("attempt_steps") or ())
        lines.append(f"  attempts: {rep['attempts']} (a restart, or a launch with --new-attempt)" +
                     (f": {parts}" if parts else "") + "; a step run by several attempts counts once, the newest "
                     "attempt's")
    if rep.get("hang"):
        lines.append(f"  HANG{'' if rep['hang']['status'] == 'hung' else ' (resolved)'}: {rep['hang']['verdict']} "
                     f"(meshscope hang: every rank's state and stack)")
    for w in rep["warnings"]:
        lines.append(f"  WARNING {w}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="meshscope report", description=(
        "A run's verdicts in the terminal, computed by the same views the dashboard's pages render; --json "
        "prints one object for scripts and CI."))
    run_args(p)
    p.add_argument("--steps", default=None, metavar="A:B", help="step range, inclusive (default: the whole run)")
    return p


def run_args(p: argparse.ArgumentParser) -> None:
    """``--store`` (repeatable), ``--run`` and ``--json``: the flags of the commands about one run."""
    p.add_argument("--store", action="append", required=True, metavar="DIR",
                   help="run store directory or s3://bucket/prefix (the agent's --upload); repeatable")
    p.add_argument("--run", required=True, help="run name")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def open_stores(stores: list[str], *, prog: str) -> Store:
    """The stores, records still only in spools (no agent ran) ingested first, each note on stderr; a store
    that cannot be opened is the user's mistake (ConfigError)."""
    try:
        store = Store.open_many(stores)
    except StoreError as e:
        raise ConfigError(str(e)) from None
    for root in store.local_roots():
        if note := catch_up(root).message():
            print(f"{prog}: {note}", file=sys.stderr)
    return store


def parse_steps(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    a, sep, b = text.partition(":")
    if not sep or not a.strip().isdigit() or not b.strip().isdigit() or int(a) > int(b):
        raise ConfigError(f"--steps must be A:B with whole numbers A <= B, got {text!r}")
    return int(a), int(b)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body(a: argparse.Namespace) -> int:
        steps = parse_steps(a.steps)
        store = open_stores(a.store, prog="meshscope report")
        rep = build(views.direct_loader(store), run=a.run, steps=steps)
        print(json.dumps(rep, indent=2) if a.json else format_text(rep))
        return 0

    return run_command(prog="meshscope report", parser=_parser(), argv=argv, body=body)


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) or math.isinf(f) else f


def _int(v) -> int | None:
    f = _num(v)
    return None if f is None else int(f)


def _loss(rep: dict[str, Any]) -> str:
    """The loss for the text: non-finite is said, never "n/a"."""
    bad = rep.get("loss_nonfinite")
    if bad and bad["last"]:
        return f"non-finite ({'NaN' if bad['nan'] else 'inf'})"
    return f"{_fmt(rep['loss'], '.3f')} (last)"


def _secs(v) -> str:
    """Seconds, in ms below 0.1 s (a CPU test job's steps are fractions of a millisecond)."""
    if v is None or v != v:
        return "n/a"
    return f"{v:.3f} s" if abs(v) >= 0.1 else f"{v * 1e3:.3g} ms"


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None or v != v else format(v, spec)
