"""One Perfetto / Chrome-trace timeline of a deep trace (``meshscope trace``): every rank's torch.profiler
trace and meshscope's own records of the same steps, ranks as processes.

* one process per rank (``pid`` = rank), as ``meshscope export-trace`` lays it out (``agent.trace``):
  meshscope's threads ``steps``, ``phases``, ``pp stage S``, ``comm <dim>``, ``events`` first;
* then the profiler's threads of that rank, the training thread (the one with the ``ProfilerStep#``
  marks) first: ``torch: <thread>`` for the process's threads (gloo's too), ``torch <device>: <stream>``
  on a GPU, ``torch profiler`` for Kineto's own marks; each ``tid`` renumbered from ``TID_TORCH0`` (the
  OS's thread ids of two ranks may be equal, and may be meshscope's numbers); flow arrows keep their
  pairs per rank.

Both sides are put on one clock: Kineto's ``ts`` are microseconds after the trace's
``baseTimeNanoseconds`` (Unix time), meshscope's records are Unix seconds; the merged ``ts`` are
microseconds after the earliest of both (``metadata.t0_unix_s``, a microsecond before it).
"""

from __future__ import annotations

import math
from meshscope.agent.trace import trace_events

TID_TORCH0 = 100_000
FLOW_ID_STRIDE = 1 << 40  # a rank's flow ids are moved by rank * this (Kineto numbers them per process)
_FLOW = frozenset({"s", "t", "f"})


def profiler_t0(trace: dict) -> float:
    """Unix seconds of a Kineto trace's earliest timed event (inf when it has none)."""
    base = float(trace.get("baseTimeNanoseconds", 0)) / 1e9
    ts = [e["ts"] for e in trace.get("traceEvents", ()) if e.get("ph") != "M" and "ts" in e]
    return base + min(ts) / 1e6 if ts else math.inf


def merged_trace(rank_traces: dict[int, dict], *, steps, spans, collectives, events, hosts: dict[int, str],
                 run: str, trace_id: str, traced: dict[int, tuple[int, int]]) -> dict:
    """The merged timeline. ``rank_traces``: each rank's Kineto JSON (parsed); ``steps`` .. ``events``:
    meshscope's records of the traced steps (frames with a ``rank`` column, as ``agent.trace.trace_events``
    takes them); ``traced``: each rank's first and last traced step (the metadata says them)."""
    starts = [profiler_t0(t) for t in rank_traces.values()]
    for frame, column in ((steps, "t_start"), (spans, "t_start"), (collectives, "t_start"), (events, "t")):
        if len(frame):
            starts.append(float(frame[column].min()))
    # a whole microsecond, one before the earliest event: the two clocks' Unix seconds carry a quarter of a
    # microsecond of float rounding, which must not put the earliest event before the origin
    t0 = math.floor(min((t for t in starts if math.isfinite(t)), default=0.0) * 1e6 - 1.0) / 1e6
    out: list[dict] = []
    if len(steps):
        out, _ = trace_events(steps, spans=spans, collectives=collectives, events=events, hosts=hosts, t0=t0)
    named = {e["pid"] for e in out if e.get("name") == "process_name"}
    for rank in sorted(rank_traces):
        if rank not in named:
            label = f"rank {rank}" + (f" ({hosts[rank]})" if rank in hosts else "")
            out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        out.extend(_profiler_events(rank, rank_traces[rank], t0=t0))
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "metadata": {"run": run, "trace_id": trace_id, "t0_unix_s": t0, "ranks": sorted(rank_traces),
                     "steps": {str(r): list(v) for r, v in sorted(traced.items())}, "source": "meshscope trace"},
    }


def _profiler_events(rank: int, trace: dict, *, t0: float) -> list[dict]:
    base = float(trace.get("baseTimeNanoseconds", 0)) / 1e9
    shift = (base - t0) * 1e6  # µs to add to a Kineto ts
    timed = [e for e in trace.get("traceEvents", ()) if e.get("ph") != "M" and "ts" in e]
    names: dict[tuple, str] = {}
    for e in trace.get("traceEvents", ()):
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            key = (e.get("pid"),) if e["name"] == "process_name" else (e.get("pid"), e.get("tid"))
            names.setdefault(key, str((e.get("args") or {}).get("name", "")))  # Kineto may name a thread twice
    # the training thread (the one with the ProfilerStep# marks) first, then the others as they appear
    keys = list(dict.fromkeys((e.get("pid"), e.get("tid")) for e in timed))
    main = next(((e.get("pid"), e.get("tid")) for e in timed if str(e.get("name", "")).startswith("ProfilerStep#")),
                None)
    if main in keys:
        keys.remove(main)
        keys.insert(0, main)
    tids = {key: TID_TORCH0 + i for i, key in enumerate(keys)}
    out: list[dict] = []
    for key, tid in tids.items():
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": _thread_label(key, names)}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    for e in timed:
        ev = dict(e)
        ev["pid"], ev["tid"], ev["ts"] = rank, tids[(e.get("pid"), e.get("tid"))], round(float(e["ts"]) + shift, 3)
        if ev.get("ph") in _FLOW and isinstance(ev.get("id"), int):
            ev["id"] = ev["id"] + rank * FLOW_ID_STRIDE
        out.append(ev)
    return out


def _thread_label(key: tuple, names: dict[tuple, str]) -> str:
    pid, tid = key
    if not isinstance(pid, int):  # Kineto's own marks (iteration start, window end)
        return "torch profiler"
    thread = names.get(key) or f"thread {tid}"
    process = names.get((pid,), "")
    return f"torch: {thread}" if process in ("", "python") else f"torch {process}: {thread}"
