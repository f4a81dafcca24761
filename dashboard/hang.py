"""Why a job hangs, while it is still alive: the culprit ranks, the collective the others wait in, and
each rank's stack — from the ``hang`` records the ranks' watchdogs write (agent.instrument.hangdump).

Pure: ``analyse(hangs, last_steps, world_size=...)`` takes the run's hang rows and each rank's last step
end, and returns the dict that ``meshscope hang``, ``report --json`` (``hang``) and the pages show.

How the culprit is found. Each hang row says whether the rank's training thread waits in a collective
(and which op), and per group the sequence number of the last op the rank entered and the last it
completed. For a group some rank waits on, the op waited for is the first one not completed (``seq``).
- Collectives: a member of the group that has not entered ``seq`` is behind: the others wait for it. A
  member that waits in another group is followed there (a chain ends at a rank that waits in nothing).
- Point-to-point (a pipeline's send / recv: each rank numbers its own sends and receives, so the numbers
  of two ranks do not line up): the members that wait in nothing.
- Ranks waiting in one group at one sequence number in different ops (an all-gather where the others
  all-reduce) are a mismatch, the classic desync: the ranks of the rarer op are named.
- A member with no hang record (its watchdog has not fired yet, its process died, or its telemetry is
  stuck) is named only when no reported rank explains the wait.
A stall is current while no step of the rank ended after its hang record; when every rank made progress
again, the last stall is shown as resolved.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pandas as pd

P2P_OPS = ("send", "recv", "send/recv")
STACK_FRAMES = 12  # frames of each rank's training thread shown (innermost)


def _groups(text: Any) -> list[dict]:
    try:
        out = json.loads(text) if isinstance(text, str) and text else []
    except ValueError:
        return []
    return [g for g in out if isinstance(g, dict) and g.get("group") is not None]


def _training_frames(text: Any) -> list[list]:
    try:
        threads = json.loads(text) if isinstance(text, str) and text else []
    except ValueError:
        return []
    for t in threads:
        if isinstance(t, dict) and t.get("training"):
            return [f for f in t.get("frames", []) if isinstance(f, list) and len(f) == 3]
    return []


def frame_text(frame: list) -> str:
    path, line, function = frame
    return f"{path}:{line} {function}"


def _open(group: dict, in_collective: bool, n_groups: int) -> int | None:
    """The first sequence number this rank has not completed on ``group``, if it waits on it."""
    entered, completed = group.get("entered"), int(group.get("completed") or 0)
    if entered is None:  # a counter that could not be read: the rank's only group, if it waits at all
        return completed + 1 if in_collective and n_groups == 1 else None
    return completed + 1 if int(entered) > completed else None


def current_stall(hangs: pd.DataFrame, last_steps: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """Each rank's newest hang row, and whether the stall is current (some rank has a hang row newer than
    its last step end). Resolved: the newest rows of ranks that progressed since."""
    if hangs is None or hangs.empty:
        return pd.DataFrame(), False
    newest = hangs.sort_values("t").groupby("rank", as_index=False).tail(1).set_index("rank")
    ended = (last_steps.set_index("rank")["t_end"] if last_steps is not None and not last_steps.empty
             else pd.Series(dtype=float))
    still = newest[[newest.at[r, "t"] > ended.get(r, float("-inf")) for r in newest.index]]
    return (still, True) if not still.empty else (newest, False)


def analyse(hangs: pd.DataFrame, last_steps: pd.DataFrame, *, world_size: int, now: float | None = None) -> dict:
    """The run's hang verdict (module docstring). ``hangs``: hang rows (rank, t, step, since_s, phase,
    in_collective, op, where, groups, stacks); ``last_steps``: per rank ``t_end`` of its last step;
    ``now``: the time the stall is measured to (default: its newest record)."""
    rows, ongoing = current_stall(hangs, last_steps)
    if rows.empty:
        return {"status": "none", "verdict": "No hang: no rank's watchdog reported a stall."}
    ranks = sorted(int(r) for r in rows.index)
    groups = {r: _groups(rows.at[r, "groups"]) for r in ranks}
    waiting = {r for r in ranks if bool(rows.at[r, "in_collective"])}
    # per (group name) → {rank: first seq not completed} for the ranks that wait on it
    opened: dict[str, dict[int, int]] = {}
    info: dict[str, dict] = {}
    for r in waiting:
        for g in groups[r]:
            seq = _open(g, True, len(groups[r]))
            if seq is not None:
                opened.setdefault(str(g["group"]), {})[r] = seq
                info.setdefault(str(g["group"]), g)
    entered = {r: {str(g["group"]): g.get("entered") for g in groups[r]} for r in ranks}

    def behind(group: str, seq: int, p2p: bool) -> list[int]:
        members = [int(m) for m in info[group].get("ranks") or []]
        out = []
        for m in members:
            if m in opened[group] or m not in rows.index:
                continue
            e = entered[m].get(group)
            if p2p:
                if m not in waiting:
                    out.append(m)
            elif e is None or int(e) < seq or m not in waiting:
                out.append(m)
        return out

    def op_of(r: int) -> str:
        return str(rows.at[r, "op"] or "")

    blamed: set[int] = set()
    mismatch = None
    per_group = []
    for name, seqs in opened.items():
        ops = Counter(op_of(r) for r in seqs)
        p2p = all(op in P2P_OPS for op in ops) or info[name].get("dim") == "pp"
        seq = min(seqs.values())
        late = behind(name, seq, p2p)
        per_group.append({"group": name, "dim": info[name].get("dim", ""), "mesh_dim": info[name].get("mesh_dim", ""),
                          "seq": seq, "op": ops.most_common(1)[0][0], "ranks": sorted(seqs), "behind": late,
                          "p2p": p2p})
        same = [r for r, s in seqs.items() if s == seq]
        kinds = Counter(op_of(r) for r in same)
        if not p2p and len([k for k in kinds if k]) > 1 and mismatch is None:
            rare = min(kinds.values())
            odd = sorted(r for r in same if kinds[op_of(r)] == rare) if list(kinds.values()).count(rare) == 1 else sorted(same)
            mismatch = {"group": name, "dim": info[name].get("dim", ""), "seq": seq,
                        "ops": {str(r): op_of(r) for r in sorted(same)}, "odd_ranks": odd}
        blamed.update(late)
    # A blamed rank that itself waits elsewhere passes the blame on (a chain ends at a rank that waits in
    # nothing); ranks without a record are named only if no reported rank explains the wait.
    roots = {r for r in blamed if r not in waiting}
    if not roots and blamed:
        roots = blamed
    if mismatch is not None and not roots:
        roots = set(mismatch["odd_ranks"])
    missing = [r for r in range(int(world_size)) if r not in rows.index] if world_size else []
    if not roots and waiting:
        members = {int(m) for g in per_group for m in info[g["group"]].get("ranks") or []}
        roots = {m for m in missing if m in members} or set(missing)
    if not waiting:
        roots = set()
    primary = max(per_group, key=lambda g: (len(g["ranks"]), -g["seq"])) if per_group else None
    t_ref = float(now) if now is not None else float(rows["t"].max())
    since = max(float(rows.at[r, "since_s"]) + max(0.0, t_ref - float(rows.at[r, "t"])) for r in ranks)
    culprits = sorted(roots)
    stacks = {str(r): [frame_text(f) for f in _training_frames(rows.at[r, "stacks"])[-STACK_FRAMES:]]
              for r in ranks}
    culprit_frames = {str(r): stacks[str(r)][-1] for r in culprits if stacks.get(str(r))}
    out = {
        "status": "hung" if ongoing else "resolved",
        "culprit_ranks": culprits,
        "waiting": ({k: primary[k] for k in ("op", "group", "dim", "mesh_dim", "seq", "ranks")}
                    if primary else None),
        "groups": per_group,
        "mismatch": mismatch,
        "since_s": since,
        "step": int(rows["step"].max()),
        "ranks": {str(r): {"in_collective": r in waiting, "op": op_of(r), "where": str(rows.at[r, "where"] or ""),
                           "step": int(rows.at[r, "step"]), "phase": str(rows.at[r, "phase"] or ""),
                           "since_s": float(rows.at[r, "since_s"]), "groups": groups[r]} for r in ranks},
        "missing_ranks": missing,
        "stacks": stacks,
        "culprit_frames": culprit_frames,
    }
    out["verdict"] = verdict(out)
    return out


def verdict(h: dict) -> str:
    """One sentence: who, waiting in what, where the culprit is."""
    if h.get("status") == "none":
        return h["verdict"]
    when = "" if h["status"] == "hung" else " (resolved: the ranks progressed again)"
    lasting = f"no progress for {h['since_s']:.0f} s at step {h['step']}{when}"
    w, culprits = h.get("waiting"), h.get("culprit_ranks") or []
    names = ", ".join(map(str, culprits))
    if h.get("mismatch"):
        m = h["mismatch"]
        ops = ", ".join(f"rank {r} {op or '?'}" for r, op in m["ops"].items())
        return (f"Mismatched collectives on group {m['group']} ({m['dim']}) at seq {m['seq']}: {ops}; "
                f"rank{'s' if len(m['odd_ranks']) > 1 else ''} {', '.join(map(str, m['odd_ranks']))} "
                f"differ{'' if len(m['odd_ranks']) > 1 else 's'}; {lasting}.")
    if w is None:
        return (f"Every reporting rank is stalled outside communication (no rank waits in a collective: data "
                f"loading, I/O or a lock in the job's own code); {lasting}.")
    waiting = ", ".join(map(str, w["ranks"]))
    dim = w["mesh_dim"] or w["dim"]
    where = "; ".join(f"rank {r} at {f}" for r, f in h.get("culprit_frames", {}).items())
    if not culprits:
        return (f"Ranks {waiting} wait in {w['op']} on {dim} (group {w['group']}, seq {w['seq']}) and no rank "
                f"is known to be behind; {lasting}.")
    silent = [r for r in culprits if r in (h.get("missing_ranks") or [])]
    tail = f" (rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} sent no hang record: dead, or its telemetry is stuck)" if silent else ""
    return (f"Rank{'s' if len(culprits) > 1 else ''} {names} {'hold' if len(culprits) > 1 else 'holds'} the job: "
            f"rank{'s' if len(w['ranks']) > 1 else ''} {waiting} wait{'' if len(w['ranks']) > 1 else 's'} in {w['op']} on {dim} (group {w['group']}, "
            f"seq {w['seq']}){tail}" + (f"; {where}" if where else "") + f"; {lasting}.")
