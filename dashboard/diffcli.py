"""``meshscope diff --store S [--store-b S2] RUN_A RUN_B [--json] [--fail-above PCT]``: is B slower than A,
by how much with what confidence, which part of the step explains it and what changed between them
(``dashboard.diff`` over each run's steady steps; MFU, tokens/s, stragglers from ``report``).

The runs may live in different stores (``--store-b``, local or ``s3://``). Exit 0 with a comparison; 1 with
``--fail-above PCT`` when B is slower than A by more than PCT % with confidence (the interval's low end
above it: noise never fails); 2 for a store or run that does not exist, or a bad flag."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meshscope.agent.cliargs import ArgParser, run_command
from meshscope.dashboard import diff, report, views
from meshscope.dashboard.config import ConfigError


def run_frame(load: views.Loader, *, run: str) -> tuple[Any, dict, dict]:
    """(the steady step frame of ``diff.step_parts``, the run's meta with its run record's fields, the
    peak memory per rank) of ``run``. Raises ConfigError for a run the store does not have."""
    table = load("runs_table")
    if run not in set(table["run"]):
        known = ", ".join(sorted(table["run"])) or "none"
        raise ConfigError(f"no run {run!r} in the store (runs: {known})")
    meta = views.meta_of(table, run)
    d = load("diff_data", run=run)
    record = d["record"].iloc[0].to_dict() if len(d["record"]) else {}
    meta = {**{k: v for k, v in record.items() if not views._isna(v)}, **meta}
    rank_steps = d["rank_steps"]
    if len(rank_steps):
        _, rank_steps = views.steady_rank_steps(rank_steps, meta=meta)
    # a run record with an ``environment`` (schema 6 on) comes with step records that count stage waits as bubble
    frame = diff.step_parts(rank_steps, d["exposed"], dp=views._dp(meta, fallback=1) if "mesh" in meta else 1,
                            stage_waits="environment" in meta)
    peak = d["memory"]["peak_bytes"].max() if len(d["memory"]) else None
    return frame, meta, {"peak_bytes": None if views._isna(peak) else int(peak)}


MAX_REPEATS = 8  # the newest runs of a configuration read for its run-to-run noise


def repeats(load: views.Loader, *, run: str, meta: dict) -> list[str]:
    """The runs of the store that repeat ``run``: nothing in their records differs from its (``diff.changes``
    over the runs table's fields and config), ``run`` first, newest first, at most ``MAX_REPEATS``."""
    table = load("runs_table")
    same = [r for r in table["run"] if r != run
            and not diff.changes(meta, views.meta_of(table, r), fields=diff.TABLE_CHANGE_FIELDS)]
    return [run, *same][:MAX_REPEATS]


def noise_of(load_a: views.Loader, load_b: views.Loader, *, run_a: str, run_b: str, meta_a: dict,
             meta_b: dict, means_a: dict[str, float], means_b: dict[str, float]) -> dict | None:
    """Run-to-run noise from the runs that repeat A (or B) in their stores: the relative SD of their mean
    steady step times (``diff.run_noise``), from the side with more repeats; None with fewer than 3.
    ``means_a`` / ``means_b``: mean steady step times already read from each side's store (A's, B's): not
    read again."""
    if load_a is load_b:
        means_a = means_b = {**means_a, **means_b}
    best: tuple[list[str], list[float]] = ([], [])
    for load, run, meta, known in ((load_a, run_a, meta_a, means_a), (load_b, run_b, meta_b, means_b)):
        names = repeats(load, run=run, meta=meta)
        if len(names) >= 3 and len(names) > len(best[0]):
            means = [known[r] if r in known else float(run_frame(load, run=r)[0]["wall_s"].mean()) for r in names]
            best = (names, means)
    if not best[0]:
        return None
    return {"rel_sd": diff.run_noise(best[1]), "runs": best[0],
            "source": f"{len(best[0])} runs of one configuration ({', '.join(best[0])})"}


def _summary(rep: dict, memory: dict) -> dict:
    return {"step_time_s_mean": rep.get("step_time_s_mean"), "tokens_per_s": rep.get("tokens_per_s_median"),
            "mfu": rep.get("mfu_median"), "peak_memory_bytes": memory["peak_bytes"],
            "stragglers": rep.get("stragglers") or [], "strategy": rep.get("strategy"),
            "world_size": rep.get("world_size")}


def build(load_a: views.Loader, load_b: views.Loader, *, run_a: str, run_b: str,
          resamples: int = diff.RESAMPLES) -> dict:
    """The comparison of ``run_b`` against ``run_a`` as one JSON-able dict: ``verdict``, ``unit`` ("step",
    or "token" where the model or global batch differ), ``parts`` (the whole first: B − A with its
    interval, in seconds and in % of A's step time), ``changes``, ``a`` / ``b`` (MFU, tokens/s, peak memory,
    stragglers) and ``new_stragglers``."""
    fa, meta_a, mem_a = run_frame(load_a, run=run_a)
    fb, meta_b, mem_b = run_frame(load_b, run=run_b)
    noise = noise_of(load_a, load_b, run_a=run_a, run_b=run_b, meta_a=meta_a, meta_b=meta_b,
                     means_a={run_a: float(fa["wall_s"].mean())}, means_b={run_b: float(fb["wall_s"].mean())})
    out = {"a": run_a, "b": run_b,
           **diff.compare(fa, fb, meta_a=meta_a, meta_b=meta_b, resamples=resamples, noise=noise)}
    if ("environment" in meta_a) != ("environment" in meta_b):
        old = "A" if "environment" not in meta_a else "B"
        out["verdict"] += (f"; {old} was recorded before schema 6: its optimizer time holds its waits and its "
                           "waits over pp are exposed communication, not bubble")
    ra, rb = report.build(load_a, run=run_a), report.build(load_b, run=run_b)
    out["summary"] = {"a": _summary(ra, mem_a), "b": _summary(rb, mem_b)}
    out["new_stragglers"] = diff.new_stragglers(out["summary"]["a"]["stragglers"], out["summary"]["b"]["stragglers"])
    if out["new_stragglers"]:
        out["verdict"] += "; new straggler" + ("s" if len(out["new_stragglers"]) > 1 else "") + ": " + ", ".join(
            f"rank {s['rank']} ({s['cause']})" for s in out["new_stragglers"])
    return out


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:+.1f}"


def format_text(c: dict) -> str:
    unit = "s per token" if c["unit"] == "token" else "s per step"
    lines = [f"{c['b']} against {c['a']}: {c['verdict']}"]
    if c["parts"]:
        lines.append(f"  {'part':<34} {'A':>10} {'B':>10} {'B - A':>10}  {'% of A':>7}  interval (%)")
        for p in c["parts"]:
            lines.append(f"  {p['part']:<34} {p['a_s']:>10.4g} {p['b_s']:>10.4g} {p['diff_s']:>+10.3g}  "
                         f"{_pct(p['diff_pct']):>7}  {_pct(p['lo_pct'])} … {_pct(p['hi_pct'])}"
                         + ("  *" if p["significant"] and p["part"] != "step" else ""))
        lines.append(f"  ({unit}; means over {c['steps'][0]} and {c['steps'][1]} steady steps, "
                     f"{c['level']:.0%} bootstrap intervals; * a part whose interval excludes 0)")
        n = c["run_noise"]
        lines.append(f"  (the step's interval includes run-to-run noise of {n['rel_sd']:.1%} per run, from "
                     f"{n['source']})")
    s = c.get("summary") or {}
    for key, label, fmt in (("mfu", "MFU", "{:.2%}"), ("tokens_per_s", "tokens/s", "{:,.0f}"),
                            ("peak_memory_bytes", "peak memory", "{:,.0f} B")):
        a, b = (s.get(x, {}).get(key) for x in ("a", "b"))
        if a is not None or b is not None:
            lines.append(f"  {label:<12} {'n/a' if a is None else fmt.format(a)} → {'n/a' if b is None else fmt.format(b)}")
    for ch in c["changes"]:
        lines.append(f"  changed {ch['key']}: {diff._val(ch['a'])} → {diff._val(ch['b'])}")
    for st in c.get("new_stragglers") or ():
        lines.append(f"  new straggler: rank {st['rank']} ({st['cause']})")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="meshscope diff", description=(
        "Compare run B with run A: the steady step time's difference with a bootstrap interval, split into "
        "compute, exposed communication per op and dim, bubble, optimizer and other; MFU, tokens/s, peak "
        "memory, new stragglers and what changed. --fail-above makes it a CI gate."))
    p.add_argument("--store", action="append", required=True, metavar="DIR",
                   help="run store directory or s3://bucket/prefix holding A (and B unless --store-b); repeatable")
    p.add_argument("--store-b", action="append", default=None, metavar="DIR",
                   help="the store(s) holding B, where it is not in --store; repeatable")
    p.add_argument("run_a", metavar="RUN_A", help="the baseline run")
    p.add_argument("run_b", metavar="RUN_B", nargs="+", help="the run compared with it (or several, each against A)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (a list of them for several runs B)")
    p.add_argument("--fail-above", type=float, default=None, metavar="PCT",
                   help="exit 1 when B (any of them) is slower than A by more than PCT %% with confidence")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body(a: argparse.Namespace) -> int:
        if a.fail_above is not None and not (a.fail_above >= 0):
            raise ConfigError(f"--fail-above must be a percentage >= 0, got {a.fail_above!r}")
        store_a = report.open_stores(a.store, prog="meshscope diff")
        store_b = report.open_stores(a.store_b, prog="meshscope diff") if a.store_b else store_a
        load_a, load_b = views.direct_loader(store_a), views.direct_loader(store_b)
        results, any_failed = [], False
        for i, run_b in enumerate(a.run_b):
            c = build(load_a, load_b, run_a=a.run_a, run_b=run_b)
            failed = a.fail_above is not None and diff.gate(c, fail_above_pct=a.fail_above)
            any_failed |= failed
            if a.fail_above is not None:
                c["gate"] = {"fail_above_pct": a.fail_above, "failed": failed}
            results.append(c)
            if not a.json:
                print(("\n" if i else "") + format_text(c))
                if a.fail_above is not None:
                    print(f"gate: {run_b} is {'' if failed else 'not '}slower than {a.run_a} by more than "
                          f"{a.fail_above:g} % with confidence" + (" (exit 1)" if failed else ""))
        if a.json:
            print(json.dumps(results[0] if len(results) == 1 else results, indent=2, default=str))
        return 1 if any_failed else 0

    return run_command(prog="meshscope diff", parser=_parser(), argv=argv, body=body)
