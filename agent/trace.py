"""``meshscope export-trace``: a Perfetto / Chrome-trace JSON of a step range, from the run store (read
with ``agent.store.reader``, so a restarted run shows each rank's re-executed steps once: the newest
attempt's).

    meshscope export-trace --store DIR --run NAME [--steps A:B] --out FILE

Layout (open the file in https://ui.perfetto.dev or chrome://tracing):

* one process per rank (``pid`` = rank, named ``rank R (host)``, sorted by rank);
* thread ``steps``: one slice per optimizer step, args = the step breakdown, tokens, MFU, loss;
* thread ``phases``: data / forward / backward / optimizer laid end to end from the step start (the
  durations are measured; the placement is sequential, since overlap is not recorded per phase);
* threads ``pp stage S``: pipeline compute spans (``F3`` = forward of microbatch 3, ``B``, ``W``);
* threads ``comm <dim>``: collectives by parallel dim, args = bytes, algbw/busbw (GB/s, 10^9 B/s), seq,
  group; overlapping collectives of one dim go to extra lanes ``comm <dim> #2`` so slices nest;
* thread ``events``: instant events (crash, non-finite loss, restart, ...).

Timestamps are microseconds since the earliest slice in the range (``metadata.t0_unix_s`` gives the
origin), which keeps sub-microsecond precision that absolute Unix microseconds would lose in a double.
``--steps A:B`` is half-open like a Python slice (``A:`` and ``:B`` work; ``A`` alone is one step).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from meshscope.agent.cliargs import ArgParser
from meshscope.agent.cliargs import UsageError as TraceError  # a user's mistake: unknown run, empty range
from meshscope.agent.store.objectstore import is_remote
from meshscope.agent.store.reader import Store, StoreError, read_table
from meshscope.agent.contract import DIMS

TID_EVENTS, TID_STEPS, TID_PHASES, TID_STAGE0, TID_COMM0 = 0, 1, 2, 10, 1000
LANES_PER_DIM = 100
PHASE_FIELDS = (("data", "data_s"), ("forward", "forward_s"), ("backward", "backward_s"),
                ("optimizer", "optimizer_s"))


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    if text is None or text == ":":
        return None, None
    try:
        if ":" not in text:
            step = int(text)
            return step, step + 1
        lo, hi = text.split(":", 1)
        bounds = (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise TraceError(f"--steps {text!r} is not A:B, A:, :B or A (integers)") from None
    if bounds[0] is not None and bounds[1] is not None and bounds[1] <= bounds[0]:
        raise TraceError(f"--steps {text!r} is empty (B must be greater than A)")
    return bounds


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _clean(value):
    """JSON has no NaN/Infinity: map them to None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return _clean(value.item())
    return value


def build_trace(store: Store | str | os.PathLike, *, run: str,
                steps: tuple[int | None, int | None] = (None, None)) -> dict:
    """The trace as a dict (``traceEvents`` + ``metadata``); raises TraceError for user mistakes.

    Read through the store reader (``agent.store.reader``): a restarted run's re-executed steps appear
    once per rank, from the newest attempt, with that attempt's collectives and spans; ``store`` may be a
    ``Store`` over several nodes' stores."""
    if not isinstance(store, Store):
        store = Store.open(store)
    runs = store.runs()
    if run not in runs:
        where = ", ".join(repr(source) for source in store.sources)
        raise TraceError(f"unknown run {run!r} in store {where} (known: {', '.join(runs) or 'none'})")
    step_df = read_table(store, "step", run=run, steps=steps)
    if step_df.empty:
        present = read_table(store, "step", run=run, columns=["step"])
        what = f"steps {present['step'].min()}..{present['step'].max()}" if len(present) else "no step records"
        lo, hi = steps
        raise TraceError(f"run {run!r} has no steps in {'' if lo is None else lo}:{'' if hi is None else hi} "
                         f"({what})")
    spans = read_table(store, "span", run=run, steps=steps)
    coll = read_table(store, "collective", run=run, steps=steps)
    hosts = {}
    info = read_table(store, "run", run=run)
    for row in info.sort_values("t_start").itertuples(index=False):
        hosts[int(row.rank)] = row.host
    events, t0 = trace_events(step_df, spans=spans, collectives=coll,
                              events=read_table(store, "event", run=run, steps=steps), hosts=hosts)
    lo, hi = steps
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {"run": run, "steps": f"{'' if lo is None else lo}:{'' if hi is None else hi}",
                     "t0_unix_s": t0, "ranks": int(step_df["rank"].nunique()), "source": "meshscope"},
    }


def trace_events(step_df, *, spans, collectives, events, hosts: dict[int, str],
                 t0: float | None = None) -> tuple[list[dict], float]:
    """The trace events of meshscope's records (frames of the store's columns, ``rank`` included, as
    ``read_table`` gives them) in the layout of the module docstring, and the origin of their timestamps
    (Unix seconds): ``t0``, or the earliest step, span or collective start. ``meshscope trace`` lays the
    profiler's ops of the same steps beside them (``agent.tracemerge``)."""
    coll, event_rows = collectives, events
    if t0 is None:
        t0 = float(min(step_df["t_start"].min(), spans["t_start"].min() if len(spans) else math.inf,
                       coll["t_start"].min() if len(coll) else math.inf))
    events: list[dict] = []
    named_threads: set[tuple[int, int]] = set()

    def thread(pid: int, tid: int, name: str) -> None:
        if (pid, tid) not in named_threads:
            named_threads.add((pid, tid))
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})

    for rank in sorted(set(step_df["rank"].astype(int))):
        label = f"rank {rank}" + (f" ({hosts[rank]})" if rank in hosts else "")
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})

    for s in step_df.sort_values(["rank", "step"]).to_dict("records"):
        pid = int(s["rank"])
        thread(pid, TID_STEPS, "steps")
        thread(pid, TID_PHASES, "phases")
        args = {k: _clean(s[k]) for k in ("step", "wall_s", "compute_s", "exposed_comm_s", "bubble_s", "other_s",
                                          "tokens", "mfu", "loss", "grad_norm", "skipped", "n_collectives")}
        events.append({"ph": "X", "name": f"step {s['step']}", "cat": "step", "pid": pid, "tid": TID_STEPS,
                       "ts": _us(s["t_start"], t0), "dur": _us(s["t_end"], s["t_start"]), "args": args})
        t = s["t_start"]
        for name, col in PHASE_FIELDS:
            dur = s[col]
            if dur is not None and math.isfinite(dur) and dur > 0:
                events.append({"ph": "X", "name": name, "cat": "phase", "pid": pid, "tid": TID_PHASES,
                               "ts": _us(t, t0), "dur": _us(t + dur, t),
                               "args": {"step": int(s["step"]), "seconds": dur}})
                t += dur

    for sp in spans.sort_values(["rank", "t_start"]).to_dict("records"):
        pid, tid = int(sp["rank"]), TID_STAGE0 + int(sp["stage"])
        thread(pid, tid, f"pp stage {sp['stage']}")
        events.append({"ph": "X", "name": f"{str(sp['kind'])[:1].upper()}{sp['microbatch']}", "cat": "pipeline",
                       "pid": pid, "tid": tid, "ts": _us(sp["t_start"], t0), "dur": _us(sp["t_end"], sp["t_start"]),
                       "args": {"step": int(sp["step"]), "stage": int(sp["stage"]),
                                "microbatch": int(sp["microbatch"]), "kind": sp["kind"]}})

    lanes: dict[tuple[int, str], list[float]] = {}
    for c in coll.sort_values(["rank", "t_start"]).to_dict("records"):
        pid, dim = int(c["rank"]), str(c["dim"])
        ends = lanes.setdefault((pid, dim), [])
        lane = next((i for i, end in enumerate(ends) if end <= c["t_start"]), len(ends))
        if lane == len(ends):
            ends.append(c["t_end"])
        else:
            ends[lane] = c["t_end"]
        lane = min(lane, LANES_PER_DIM - 1)
        dim_index = DIMS.index(dim) if dim in DIMS else len(DIMS)
        tid = TID_COMM0 + dim_index * LANES_PER_DIM + lane
        thread(pid, tid, f"comm {dim}" + (f" #{lane + 1}" if lane else ""))
        events.append({"ph": "X", "name": c["op"], "cat": f"comm,{dim}", "pid": pid, "tid": tid,
                       "ts": _us(c["t_start"], t0), "dur": _us(c["t_end"], c["t_start"]), "args": {
                           "step": int(c["step"]), "seq": int(c["seq"]), "bytes": int(c["bytes"]),
                           "algbw_GBps": _clean(c["algbw"] / 1e9), "busbw_GBps": _clean(c["busbw"] / 1e9),
                           "group": _clean(c["group"]), "group_size": int(c["group_size"]),
                           "wait_s": _clean(c["wait_s"]),
                           "peer": int(c["peer"]), "source": _clean(c["source"])}})

    for e in event_rows.to_dict("records"):
        pid = int(e["rank"])
        thread(pid, TID_EVENTS, "events")
        events.append({"ph": "i", "s": "p", "name": e["kind"], "cat": "event", "pid": pid, "tid": TID_EVENTS,
                       "ts": _us(e["t"], t0), "args": {"step": int(e["step"]), "message": _clean(e["message"])}})
    return events, t0


def main(argv: list[str] | None = None) -> int:
    prog = "meshscope export-trace"
    parser = ArgParser(prog=prog, description="Write a Perfetto / Chrome-trace JSON of a step range.")
    parser.add_argument("--store", required=True, action="append",
                        help="run store directory or s3://bucket/prefix; repeat for several nodes' stores")
    parser.add_argument("--run", required=True)
    parser.add_argument("--steps", default=None, help="A:B (half-open), A:, :B or A")
    parser.add_argument("--out", required=True, type=Path)
    try:
        args = parser.parse_args(argv)
        if not args.out.parent.is_dir():  # checked before the work; a typo'd path creates no directories
            raise TraceError(f"--out {str(args.out)!r}: directory {str(args.out.parent)!r} does not exist")
        for store in args.store:
            if not is_remote(store) and not Path(store).is_dir():
                raise TraceError(f"store directory {store!r} does not exist")
        trace = build_trace(Store.open_many(args.store), run=args.run, steps=parse_steps(args.steps))
        args.out.write_text(json.dumps(trace, separators=(",", ":")))
    except (TraceError, StoreError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{prog}: error: cannot write {str(args.out)!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    n = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
    print(f"{prog}: wrote {n} events for run {args.run!r} steps {trace['metadata']['steps']} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
