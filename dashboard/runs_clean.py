"""Which runs measure the job and not an accident: DataFrame in, DataFrame out, no I/O. Scaling families
(``dashboard.scaling``, the Scaling page, ``meshscope sweep``) and the planner's calibrations take clean runs
only, unless asked to include the others.

A run is **clean** when nothing but the job itself shaped its step times:

- **no fault injected**: the trainer's config (``run.config`` JSON, section ``faults``,
  ``trainer.config.FaultConfig``) names no straggler (ranks with ``straggler_seconds`` > 0 from a step
  before the run's last), no hang, no crash and no non-finite loss at a step the run reached;
- **no failure event**: no ``crash``, ``hang`` (unless every rank ended: a stall the job got over, such
  as a long checkpoint save, is no hang), ``restart`` (a resumed attempt), ``nonfinite_loss`` or
  ``skipped_step`` (a non-finite gradient) event;
- **it finished**: every rank that wrote a ``start`` event wrote an ``end`` event, and no step was aborted.
  What an interrupted run leaves in the store, seen on real torchrun jobs (2 gloo ranks): Ctrl-C (SIGINT to
  torchrun, which forwards it to the ranks) leaves on every rank an ``aborted_step`` event "step N aborted:
  KeyboardInterrupt: " and no ``end``; SIGTERM to torchrun (forwarded as SIGTERM; the trainer turns it into
  ``SystemExit(128 + 15)``) leaves "step N aborted: SystemExit: 143" and no ``end``; the step records stop
  at step N - 1, so such a run looks like a short clean one by its step records alone. A rank killed
  outright (SIGKILL, the OOM killer) leaves neither: only the missing ``end`` says so, as for a run still
  going. A crash leaves a ``crash`` event on its rank and ``aborted_step`` (a collective's error) on the
  others. (Seen once too: torchrun gone with exit 143 after a SIGTERM while its ranks ran on to their last
  step: ``end`` on every rank, a complete run, clean.)

**CPU contention** (``environment``: a CPU run whose ranks waited for a core) does not make a run unclean,
its throughput is what that machine gives, but it is said (``cpu_contention``), so a family that mixes
contended and uncontended world sizes reads as such.
"""

from __future__ import annotations

import re
import signal

import pandas as pd

from meshscope.dashboard import environment
from meshscope.dashboard.data import parse_config

COLUMNS = ("run", "clean", "reason", "cpu_contention", "cpu_wait_share")
RULE = ("Clean runs only: no fault injected in the trainer's config, no crash, hang, restart or non-finite "
        "loss event, and every rank wrote its end event (a run stopped by Ctrl-C or SIGTERM has an aborted "
        "step and no end). CPU contention (ranks that waited for a core) leaves a run in, marked.")
_MAX_NAMED = 4
_ABORTED = re.compile(r"aborted: (\w+)(?:: ?(.*))?", re.S)


def faults_of(config: str | None) -> list[str]:
    """What the trainer's config (``run.config`` JSON) injected, one phrase each: "straggler rank 1,
    +0.05 s/step", "crash of rank 1 at step 5", ... Faults set for a step the run never reached are none."""
    cfg = parse_config(config)
    f = cfg.get("faults")
    if not isinstance(f, dict):
        return []
    steps = cfg.get("steps")
    reached = (lambda s: s < steps) if isinstance(steps, int) and steps > 0 else (lambda s: True)  # noqa: E731
    out = []
    ranks = [int(r) for r in f.get("straggler_ranks") or ()]
    extra = float(f.get("straggler_seconds") or 0.0)
    start = int(f.get("straggler_from_step") or 0)
    if ranks and extra > 0 and reached(start):
        out.append(f"straggler {_ranks(ranks)}, +{extra:g} s/step" + (f" from step {start}" if start > 0 else ""))
    for name in ("hang", "crash", "desync"):
        rank, step = int(f.get(f"{name}_rank", -1)), int(f.get(f"{name}_step", -1))
        if rank >= 0 and step >= 0 and reached(step):
            out.append(f"{name} of rank {rank} at step {step}")
    slow = float(f.get("first_step_seconds") or 0.0)
    if slow > 0:
        out.append(f"first step +{slow:g} s")
    nan = int(f.get("nan_step", -1))
    if nan >= 0 and reached(nan):
        out.append(f"non-finite loss at step {nan}")
    return out


def stop_cause(message: str) -> str | None:
    """How an ``aborted_step`` event's message says the step stopped: "Ctrl-C" (KeyboardInterrupt), the
    signal of a ``SystemExit(128 + signal)`` ("SIGTERM"), or None (an error, e.g. a peer's collective)."""
    m = _ABORTED.search(message or "")
    if m is None:
        return None
    exc, arg = m.group(1), (m.group(2) or "").strip()
    if exc == "KeyboardInterrupt":
        return "Ctrl-C"
    if exc == "SystemExit":
        try:
            return signal.Signals(int(arg) - 128).name
        except ValueError:
            return f"exit {arg}" if arg else "exit"
    return None


def clean_runs(table: pd.DataFrame, events: pd.DataFrame, *, shares: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per run of ``table`` (the runs table: ``run``, ``config``; ``device`` for the contention rule):
    ``clean`` (bool), ``reason`` ("" when clean; else phrases joined by "; ", e.g. "fault injected
    (straggler rank 1, +0.05 s/step)", "interrupted (SIGTERM: step 13 aborted, no end event)", "crashed
    (rank 1 at step 5)"), ``cpu_contention`` (bool) and ``cpu_wait_share`` (the highest contended rank's,
    NaN when none).

    ``events``: the runs' events, ``run``, ``rank``, ``step``, ``kind``, ``message``: raw rows, or one row per
    (run, kind, rank) as ``data.run_events`` returns them (``step`` and ``message`` the first of that rank's).
    ``shares`` (optional): per ``run`` and ``rank``, ``cpu_wait_share`` (``environment.run_queue_share`` of the
    run's steady steps, what the Overview's warning states); a run is contended where
    ``environment.contended`` names a rank of it and its device is a CPU (the rule ``environment.warnings``
    states on the pages)."""
    ev = events if len(events) else pd.DataFrame(columns=["run", "rank", "step", "kind", "message"])
    by_run = dict(tuple(ev.groupby("run", sort=False)))
    share_of = dict(tuple(shares.groupby("run", sort=False))) if shares is not None and len(shares) else {}
    rows = []
    for r in table.itertuples(index=False):
        run = r.run
        reasons = [f"fault injected ({f})" for f in faults_of(getattr(r, "config", None))]
        reasons += _event_reasons(by_run.get(run))
        device = getattr(r, "device", None)
        hot = (environment.contended(share_of[run]) if run in share_of and isinstance(device, str)
               and device.startswith("cpu") else None)
        busy = hot is not None and len(hot) > 0
        rows.append({"run": run, "clean": not reasons, "reason": "; ".join(reasons), "cpu_contention": busy,
                     "cpu_wait_share": float(hot["cpu_wait_share"].max()) if busy else float("nan")})
    return pd.DataFrame(rows, columns=list(COLUMNS)).astype({"clean": bool, "cpu_contention": bool})


def _event_reasons(ev: pd.DataFrame | None) -> list[str]:
    if ev is None or ev.empty:
        return ["not known to have finished (no start or end event recorded)"]
    out = []
    kinds = {k: g for k, g in ev.groupby("kind", sort=False)}
    started = set(kinds["start"]["rank"]) if "start" in kinds else set()
    ended = set(kinds["end"]["rank"]) if "end" in kinds else set()
    missing = sorted((started or set(ev["rank"])) - ended)
    if "hang" in kinds and not missing:  # every rank ended: a stall the job got over (a long save), no hang
        kinds.pop("hang")
    for kind, what in (("crash", "crashed"), ("hang", "hung")):
        if kind in kinds:
            out.append(f"{what} ({_where(kinds[kind])})")
    if "restart" in kinds:
        out.append(f"restarted (resumed at step {int(kinds['restart']['step'].min())})")
    bad = [kinds[k] for k in ("nonfinite_loss", "skipped_step") if k in kinds]
    if bad:
        out.append(f"non-finite loss (from step {int(pd.concat(bad)['step'].min())})")
    if "aborted_step" in kinds and not {"crash", "hang"} & set(kinds):
        a = kinds["aborted_step"]
        causes = sorted({c for c in map(stop_cause, a["message"].astype(str)) if c})
        step = int(a["step"].min())
        if causes:
            out.append(f"interrupted ({' / '.join(causes)}: step {step} aborted" +
                       (", no end event)" if missing else ")"))
        else:
            first = a.sort_values("step").iloc[0]
            out.append(f"aborted (step {step}: {str(first['message']).split('aborted: ', 1)[-1][:80]})")
    elif missing and not out:
        out.append(f"not finished (no end event from {_ranks(missing)}: still running, or killed)")
    return out


def _where(g: pd.DataFrame) -> str:
    ranks = sorted(int(r) for r in g["rank"].dropna().unique())
    steps = g["step"].dropna()
    at = f" at step {int(steps.min())}" if len(steps) and steps.min() >= 0 else ""
    return (_ranks(ranks) if ranks else "rank unknown") + at


def _ranks(ranks) -> str:
    r = sorted(int(x) for x in ranks)
    if len(r) == 1:
        return f"rank {r[0]}"
    more = f" and {len(r) - _MAX_NAMED} more" if len(r) > _MAX_NAMED else ""
    return "ranks " + ", ".join(map(str, r[:_MAX_NAMED])) + more
