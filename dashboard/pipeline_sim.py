"""A small pipeline-schedule simulator: the span timeline of one step for GPipe, 1F1B, interleaved 1F1B
and interleaved zero-bubble, used by the synthetic store so that its spans have the shape (and the
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

import pandas as pd

from dashboard.analysis import normalize_schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "interleavedzerobubble")


def simulate(*, schedule: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 2.0,
             w: float = 0.0) -> pd.DataFrame:
    """Spans of one step: ``rank``, ``stage``, ``microbatch``, ``kind`` (forward/backward/weight),
    ``t_start``, ``t_end`` (relative to the step's first span). ``f``, ``b``, ``w`` are per stage chunk
    (with v chunks per rank, each holds 1/v of the rank's layers)."""
    s = normalize_schedule(schedule)
    if s not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p ({p}), m ({m}) and v ({v}) must be >= 1")
    v = v if s.startswith("interleaved") else 1
    zero_bubble = s == "interleavedzerobubble"
    n_stages = p * v
    dur = {"F": f, "B": b, "W": w}
    order = {r: _order(s, rank=r, p=p, v=v, m=m) for r in range(p)}
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
                ready = _deps_finish(act, done=done, n_stages=n_stages)
                if ready is not None:
                    cand = (max(free[r], ready), act)
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
        if kind == "W":
            deferred_w[r].pop(0)
        else:
            nxt[r] += 1
        end = start + dur[kind]
        done[act] = end
        free[r] = end
        rows.append((r, j, k, {"F": "forward", "B": "backward", "W": "weight"}[kind], start, end))
        if kind == "B" and zero_bubble:
            deferred_w[r].append(("W", j, k))
    return pd.DataFrame(rows, columns=["rank", "stage", "microbatch", "kind", "t_start", "t_end"])


def _order(s: str, *, rank: int, p: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """The fixed action order of one rank. Microbatches go in groups of p, each group through every
    chunk in turn (Megatron's interleaved order; plain 1F1B when v = 1). Backwards take chunks in reverse."""
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


def _deps_finish(act, *, done, n_stages: int) -> float | None:
    """Time all dependencies are done, or None if one is not scheduled yet."""
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
        t = max(t, done[d])
    return t
