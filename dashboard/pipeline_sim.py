"""A small pipeline-schedule simulator: the span timeline of one step for GPipe, 1F1B, interleaved 1F1B,
interleaved zero-bubble and looped BFS, used by the synthetic store so that its spans have the shape (and the
bubble) of the real schedules.

Model: p ranks, v virtual stages per rank (stage j lives on rank j % p, as in torch's looped/interleaved
schedules), m microbatches; forward f, backward b (input + weight gradient), optional split weight
gradient w (zero-bubble: b is then the input-gradient part only). Dependencies: F(j,k) after F(j-1,k);
B(j,k) after F(j,k) and B(j+1,k); W(j,k) after B(j,k). Each rank runs its actions one at a time in the
schedule's fixed order (``_order``), each as soon as its dependencies are done; zero-bubble defers weight
gradients and runs them whenever the next action would otherwise wait. With balanced stages this
reproduces the textbook makespans, (m+p-1)(f+b) for GPipe and 1F1B and (v·m+p-1)(f+b) with per-chunk
f, b for interleaved 1F1B, which the tests check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pandas as pd

from meshscope.dashboard.analysis import normalize_schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "interleavedzerobubble", "loopedbfs")
# Schedules whose order ``_order`` reproduces as torch runs it; ``replay`` takes any other schedule's order
# from the run itself (torch's zero-bubble, V-shaped schedules).
ORDERED = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs")
MULTI_CHUNK = ("interleaved1f1b", "interleavedzerobubble", "loopedbfs")  # v stage chunks per rank


def chunks(schedule: str, v: int) -> int:
    """Stage chunks per rank: ``v`` for the schedules that hold several (``MULTI_CHUNK``), else 1."""
    return v if normalize_schedule(schedule) in MULTI_CHUNK else 1


def simulate(*, schedule: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 2.0,
             w: float = 0.0, durations: Mapping[tuple[str, int, int], float] | None = None,
             hop: float = 0.0, gap: float = 0.0, order: Mapping[int, list] | None = None,
             stage_rank: Mapping[int, int] | None = None) -> pd.DataFrame:
    """Spans of one step: ``rank``, ``stage``, ``microbatch``, ``kind`` (forward/backward/weight),
    ``t_start``, ``t_end`` (relative to the step's first span). ``f``, ``b``, ``w`` are per stage chunk
    (with v chunks per rank, each holds 1/v of the rank's layers). ``durations`` (optional) gives single
    actions their own time, keyed ("F" | "B" | "W", stage, microbatch); the others take f, b, w. ``hop``:
    the time an activation or gradient takes from one rank to the next (P2P); ``gap``: the host's time
    between two actions of a rank (issuing sends and receives, the schedule's own Python). ``order``
    (optional): each rank's actions in the order it ran them (W included), for a schedule whose order is
    taken from a run instead of ``_order`` (``schedule`` is then only a label); ``stage_rank``: which rank
    holds each stage (default stage % p; V-shaped schedules place them otherwise)."""
    s = normalize_schedule(schedule)
    if order is None and s not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p ({p}), m ({m}) and v ({v}) must be >= 1")
    v = chunks(s, v)
    zero_bubble = order is None and s == "interleavedzerobubble"
    if order is None:
        order = {r: _order(s, rank=r, p=p, v=v, m=m) for r in range(p)}
    else:
        order = {r: list(order.get(r, [])) for r in range(p)}
    n_stages = 1 + max((a[1] for acts in order.values() for a in acts), default=p * v - 1)
    where = dict(stage_rank) if stage_rank is not None else {j: j % p for j in range(n_stages)}
    dur = {"F": f, "B": b, "W": w}
    nxt = [0] * p
    deferred_w: dict[int, list] = {r: [] for r in range(p)}  # zero-bubble: weight grads waiting to fill
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    rows = []
    while any(nxt[r] < len(order[r]) or deferred_w[r] for r in range(p)):
        best = None
        for r in range(p):
            cand = None
            if nxt[r] < len(order[r]):
                act = order[r][nxt[r]]
                ready = _deps_finish(act, done=done, n_stages=n_stages, where=where, hop=hop)
                if ready is not None:
                    cand = (max(free[r] + (gap if nxt[r] else 0.0), ready), act)
                # Zero-bubble: run a pending weight gradient rather than sit idle.
                if deferred_w[r] and (cand is None or cand[0] > free[r]):
                    cand = (free[r], deferred_w[r][0])
            elif deferred_w[r]:
                cand = (free[r], deferred_w[r][0])
            if cand is not None and (best is None or (cand[0], r) < (best[0], best[2])):
                best = (cand[0], cand[1], r)
        assert best is not None, "schedule deadlocked"  # internal invariant of the fixed orders
        start, act, r = best
        kind, j, k = act
        if deferred_w[r] and deferred_w[r][0] == act:
            deferred_w[r].pop(0)
        else:
            nxt[r] += 1
        end = start + (durations.get(act, dur[kind]) if durations else dur[kind])
        done[act] = end
        free[r] = end
        rows.append((r, j, k, {"F": "forward", "B": "backward", "W": "weight"}[kind], start, end))
        if kind == "B" and zero_bubble:
            deferred_w[r].append(("W", j, k))
    return pd.DataFrame(rows, columns=["rank", "stage", "microbatch", "kind", "t_start", "t_end"])


def _order(s: str, *, rank: int, p: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """The fixed action order of one rank. Microbatches go in groups of p, each group through every
    chunk in turn (Megatron's interleaved order; plain 1F1B when v = 1). Backwards take chunks in reverse.
    Looped BFS (torch's ``ScheduleLoopedBFS``): every microbatch's forward of a chunk before the next
    chunk's, then the backwards chunk by chunk in reverse, microbatches in reverse."""
    if s == "loopedbfs":
        stages = [c * p + rank for c in range(v)]
        return ([("F", j, k) for j in stages for k in range(m)]
                + [("B", j, k) for j in reversed(stages) for k in reversed(range(m))])
    fwd, bwd = [], []
    for g in range(0, m, p):
        group = range(g, min(g + p, m))
        for c in range(v):
            fwd += [("F", c * p + rank, k) for k in group]
            bwd += [("B", (v - 1 - c) * p + rank, k) for k in group]
    if s == "gpipe":
        return fwd + bwd
    # Warm-up forwards before the first backward: p - rank - 1 for 1F1B; Megatron's
    # (p - rank - 1) * 2 + (v - 1) * p for interleaved.
    warmup = p - rank - 1 if v == 1 else (p - rank - 1) * 2 + (v - 1) * p
    warmup = min(warmup, len(fwd))
    out = fwd[:warmup]
    fi, bi = warmup, 0
    while fi < len(fwd):
        out += [fwd[fi], bwd[bi]]
        fi, bi = fi + 1, bi + 1
    return out + bwd[bi:]


def _deps_finish(act, *, done, n_stages: int, where: Mapping[int, int], hop: float) -> float | None:
    """Time all dependencies are done (and, for one on another rank, its output has arrived: + hop), or
    None if one is not scheduled yet."""
    kind, j, k = act
    if kind == "F":
        deps = [("F", j - 1, k)] if j > 0 else []
    elif kind == "B":
        deps = [("F", j, k)] + ([("B", j + 1, k)] if j < n_stages - 1 else [])
    else:
        deps = [("B", j, k)]
    t = 0.0
    for d in deps:
        if d not in done:
            return None
        t = max(t, done[d] + (hop if where[d[1]] != where[j] else 0.0))
    return t


_KIND_LETTER = {"forward": "F", "backward": "B", "weight": "W"}


def replay(spans: pd.DataFrame, *, schedule: str, p: int, m: int, v: int = 1) -> pd.DataFrame:
    """The schedule's own idle for the op times a run measured: per step, each span's measured duration
    through ``simulate`` (the schedule's order and dependencies). Under balanced stages and equal op times
    and free transfers this is the closed-form theory; when op times differ (a heavier last stage, fill
    and drain running faster on a shared CPU) it is what the schedule implies for them.

    ``spans``: ``step``, ``stage``, ``microbatch``, ``kind``, ``t_start``, ``t_end``. Returns per step:

    - ``schedule_idle``: 1 - the busiest rank's busy time / the replayed extent with free transfers: the
      fill and drain the schedule itself causes (what the closed form describes);
    - ``hop_s``: the measured transfer time between stages, the median gap between an op's end and the
      start of the op on the next rank that waited for it (that rank idle in between);
    - ``gap_s``: the measured host time between two ops of a rank whose input was already there (issuing
      sends and receives, the schedule's Python);
    - ``replay_bubble``: the same with ``hop_s`` per transfer and ``gap_s`` per op: fill, drain, transfers
      and the schedule's host overhead. A measured schedule share above it is waiting the schedule does
      not explain (host stalls, a wrong order);
    - ``balanced_idle``: the schedule's theory, the same order with balanced stages, equal op times and
      free transfers (equal to the closed form where one exists; for zero-bubble and other schedules
      without one, the theory of the order the run used).

    The order is ``_order``'s for the schedules in ``ORDERED``, else each rank's own, from its spans. One
    pipeline replica is replayed: per stage, the spans of its lowest rank (PP x DP runs have one
    replica per data-parallel rank, all running the same schedule). Steps whose spans do not cover the
    schedule's actions (other p, m, v) are left out."""
    s = normalize_schedule(schedule)
    cols = ["step", "schedule_idle", "hop_s", "gap_s", "replay_bubble", "balanced_idle"]
    empty = pd.DataFrame({c: pd.Series(dtype="int64" if c == "step" else float) for c in cols})
    from_run = s not in ORDERED
    if spans.empty or (from_run and not s):
        return empty
    n_chunks = v if from_run else chunks(s, v)
    if from_run:  # every stage's forward and backward of every microbatch (W comes on top where split)
        expected = {(kind, j, k) for kind in "FB" for j in range(p * n_chunks) for k in range(m)}
    else:
        expected = {a for r in range(p) for a in _order(s, rank=r, p=p, v=n_chunks, m=m)}
    if "rank" in spans:
        first = spans.groupby(["step", "stage"])["rank"].transform("min")
        spans = spans[spans["rank"] == first]
        ranks = sorted(spans["rank"].unique())
        where = {int(j): ranks.index(r) for j, r in spans.groupby("stage")["rank"].first().items()}
        if len(ranks) != p:
            return empty
    else:
        where = {j: j % p for j in range(p * n_chunks)}
    out, balanced = [], {}
    for step, g in spans.groupby("step", sort=True):
        keys = [(_KIND_LETTER.get(k, "?"), int(j), int(mb)) for k, j, mb in zip(g["kind"], g["stage"], g["microbatch"])]
        durations: dict[tuple[str, int, int], float] = {}
        start, end = {}, {}
        for key, a, b in zip(keys, g["t_start"].to_numpy(float), g["t_end"].to_numpy(float)):
            durations[key] = durations.get(key, 0.0) + (b - a)
            start[key], end[key] = min(start.get(key, a), a), max(end.get(key, b), b)
        if not expected <= set(durations) or not set(where) >= {k[1] for k in durations}:
            continue
        order = None
        if from_run:
            order = {r: [] for r in range(p)}
            for key in sorted(start, key=start.get):
                order[where[key[1]]].append(key)
        hop, gap = _transfer_and_gap(start=start, end=end, where=where)
        row = [int(step)]
        for h, gp in ((0.0, 0.0), (hop, gap)):
            row.append(_idle(simulate(schedule=s, p=p, m=m, v=v, durations=durations, hop=h, gap=gp, order=order,
                                      stage_rank=where)))
        # The schedule's own theory: balanced stages, F = B = W (B = 2F when W is not split off, as in the
        # closed forms), free transfers; the closed form where one exists, for any order a run used.
        # It depends on the order only (the same in every step of a run): simulated once per distinct order.
        split = any(k[0] == "W" for k in durations)
        key = (split, None if order is None else tuple(tuple(order[r]) for r in range(p)))
        if key not in balanced:
            balanced[key] = _idle(simulate(schedule=s, p=p, m=m, v=v, f=1.0, b=1.0 if split else 2.0, w=1.0,
                                           order=order, stage_rank=where))
        row.append(balanced[key])
        out.append([row[0], row[1], hop, gap, row[2], row[3]])
    return pd.DataFrame(out, columns=cols) if out else empty


def _idle(sim: pd.DataFrame) -> float:
    """1 - the busiest rank's busy time / the extent."""
    extent = float(sim["t_end"].max() - sim["t_start"].min())
    busy = float((sim["t_end"] - sim["t_start"]).groupby(sim["rank"]).sum().max())
    return 1.0 - busy / extent if extent > 0 else np.nan


def _transfer_and_gap(*, start: dict, end: dict, where: Mapping[int, int]) -> tuple[float, float]:
    """(hop, gap) measured in one step: ``hop``, the median time from an op's end to the start of the op
    on the next rank that waited for it (its rank idle until its input came); ``gap``, the median time
    between two ops of a rank when the second's input was already there (host work between actions)."""
    by_rank: dict[int, list] = {}
    for key, t in start.items():
        by_rank.setdefault(where[key[1]], []).append((t, key))
    hops, gaps = [], []
    for ops in by_rank.values():
        ops.sort()
        for (_, prev), (t0, key) in zip(ops, ops[1:]):
            kind, j, k = key
            dep = ("F", j - 1, k) if kind == "F" else ("B", j + 1, k) if kind == "B" else None
            remote = dep is not None and dep in end and where[dep[1]] != where[j]
            if remote and end[dep] >= end[prev]:  # the rank was free before its input came: it waited
                hops.append(t0 - end[dep])
            else:
                gaps.append(t0 - end[prev])
    return (max(0.0, float(np.median(hops))) if hops else 0.0, max(0.0, float(np.median(gaps))) if gaps else 0.0)


def makespan_shared(*, schedule: str, p: int, m: int, v: int = 1, f: float, b: float, hop: float = 0.0,
                    gap: float = 0.0, cores: float) -> tuple[float, float]:
    """(makespan, the mean over ranks of the time their actions ran) of one step when the p ranks share
    ``cores`` processors (a CPU host): the same order and dependencies as ``simulate`` (schedules in
    ``ORDERED``), but an action's work (f, b: seconds with a processor to itself) advances at
    min(1, cores / actions running at once), so fill and drain, with ranks idle, run faster than the steady
    state. Event driven: time moves to the next finish or the next start an idle rank may make; each event
    finishes or starts at least one action, so it ends after at most twice as many events as actions."""
    s = normalize_schedule(schedule)
    if s not in ORDERED:
        raise ValueError(f"processor sharing is simulated for {', '.join(ORDERED)}, not {schedule!r}")
    values = (f, b, hop, gap, cores)
    if not all(math.isfinite(x) and x >= 0 for x in values) or cores <= 0:
        raise ValueError(f"f, b, hop, gap must be finite and >= 0 and cores > 0, got {values}")
    v = chunks(s, v)
    order = {r: _order(s, rank=r, p=p, v=v, m=m) for r in range(p)}
    where = {j: j % p for j in range(p * v)}
    work = {"F": f, "B": b}
    done: dict[tuple[str, int, int], float] = {}
    nxt, free = [0] * p, [0.0] * p
    running: dict[int, list] = {}  # rank -> [action, work left, started]
    ran = [0.0] * p
    total = sum(len(o) for o in order.values())
    t = 0.0
    for _ in range(4 * total + 4):
        if len(done) == total:
            return max(done.values()), sum(ran) / p
        starts = {}
        for r in range(p):
            if r in running or nxt[r] >= len(order[r]):
                continue
            ready = _deps_finish(order[r][nxt[r]], done=done, n_stages=p * v, where=where, hop=hop)
            if ready is not None:
                starts[r] = max(ready, free[r] + (gap if nxt[r] else 0.0))
        for r, at in starts.items():
            if at <= t:
                running[r] = [order[r][nxt[r]], work[order[r][nxt[r]][0]], t]
                nxt[r] += 1
        later = [at for r, at in starts.items() if r not in running]
        if not running:
            assert later, "schedule deadlocked"  # internal invariant of the fixed orders
            t = min(later)
            continue
        speed = min(1.0, cores / len(running))
        first = min(running, key=lambda r: running[r][1])
        step = running[first][1] / speed
        if later and min(later) < t + step:  # a rank starts before the next finish
            t_next, finished = min(later), set()
        else:  # the shortest running action finishes now, exactly (and any other within rounding)
            t_next = t + step
            finished = {r for r in running if running[r][1] <= running[first][1] * (1 + 1e-9)}
        for r in list(running):
            running[r][1] -= (t_next - t) * speed
            if r in finished:
                done[running[r][0]] = t_next
                free[r] = t_next
                ran[r] += t_next - running[r][2]
                del running[r]
        t = t_next
    raise AssertionError("pipeline simulation did not finish")  # internal invariant: bounded events
