"""``meshscope hang --store DIR|s3://... --run NAME [--json]``: why a run hangs, while it is still alive —
the culprit ranks, the collective the others wait in (op, group, sequence number), a mismatch where ranks
wait in different ops, and each rank's stack (``dashboard.hang`` over the ranks' ``hang`` records).

Records still in the ranks' spools (no agent running) are ingested first, as ``report`` does. Exit 0 with
a verdict (also "no hang"); 2 for a store or run that does not exist."""

from __future__ import annotations

import argparse
import json
import sys
import time

from meshscope.agent.cliargs import ArgParser, run_command
from meshscope.dashboard import report, views
from meshscope.dashboard.config import ConfigError


def build(load: views.Loader, *, run: str, now: float | None = None) -> dict:
    """``hang.analyse`` of ``run``. Raises ConfigError for a run the store does not have."""
    table = load("runs_table")
    if run not in set(table["run"]):
        known = ", ".join(sorted(table["run"])) or "none"
        raise ConfigError(f"no run {run!r} in the store (runs: {known})")
    return {"run": run, **views.hang_view(load, run=run, now=now)}


def format_text(h: dict) -> str:
    lines = [f"run {h['run']}: {h['verdict']}"]
    if h["status"] == "none":
        return "\n".join(lines)
    m = h.get("mismatch")
    lines.append(f"  {'rank':>4}  {'state':<40} {'step':>5}  {'phase':<9} where")
    for r, info in sorted(h["ranks"].items(), key=lambda kv: int(kv[0])):
        if info["in_collective"]:
            open_ = [g for g in h["groups"] if int(r) in g["ranks"]]
            state = (f"waits in {info['op'] or '?'}" + (f" on group {open_[0]['group']} seq {open_[0]['seq']}"
                                                      if open_ else ""))
        else:
            state = "NOT in a collective"
        flag = " <- culprit" if int(r) in h["culprit_ranks"] else ""
        lines.append(f"  {r:>4}  {state:<40} {info['step']:>5}  {info['phase'] or '-':<9} {info['where']}{flag}")
    for r in h.get("missing_ranks") or ():
        lines.append(f"  {r:>4}  no hang record")
    if m:
        lines.append(f"  mismatch on group {m['group']} seq {m['seq']}: " +
                     ", ".join(f"rank {r} {op}" for r, op in m["ops"].items()))
    for r in h["culprit_ranks"]:
        frames = h["stacks"].get(str(r)) or []
        if frames:
            lines.append(f"  rank {r}'s training thread (innermost last):")
            lines += [f"    {f}" for f in frames]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="meshscope hang", description=(
        "Why a run hangs, while it is alive: the culprit ranks, the collective the others wait in and each "
        "rank's stack, from the ranks' hang watchdogs; --json prints one object."))
    report.run_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body(a: argparse.Namespace) -> int:
        store = report.open_stores(a.store, prog="meshscope hang")
        h = build(views.direct_loader(store), run=a.run, now=time.time())
        print(json.dumps(h, indent=2) if a.json else format_text(h))
        return 0

    return run_command(prog="meshscope hang", parser=_parser(), argv=argv, body=body)
