"""What a rank's hang watchdog writes when its training thread stops making progress: a ``hang`` record
(agent.contract's ``hang`` kind) saying where that thread is, which op it waits in, each group's last
entered and completed sequence number, and the Python stack of every thread of the process.

Everything here runs on the telemetry's flusher thread, once per stall, while the training thread stays
where it is: the stacks come from ``sys._current_frames()`` (what ``faulthandler`` reads, without a signal
or a debugger), the entered numbers from the collective tracer's group counters (read, never advanced:
``GroupTable.issued``), the completed ones from the records the flusher already built. Nothing is added
to a collective's path.

The threshold adapts (``hang_threshold_s``): before the first step ends (a ``torch.compile`` or a
checkpoint load can take minutes) the watchdog waits ``hang_first_step_s``; afterwards ``HANG_STEPS``
times the median of the recent steps, at least ``hang_min_s`` and at most ``hang_after_s``. A 0.2 s step
is then reported after ``hang_min_s`` rather than after a minute; a 20 s step is never taken for a hang.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
from typing import Any, Iterable

HANG_STEPS = 10  # a stall of this many median steps is a hang (a step that slow once is a straggler)
MAX_FRAMES = 48  # per thread, innermost kept: a deep recursion must not make the record large
MAX_THREADS = 32
RECENT_STEPS = 20  # the steps the median is taken over

# torch.distributed functions → the op they issue or wait in (nccl-tests names: agent.contract.OPS). The
# innermost such frame on the training thread's stack names the op it is blocked in; FSDP2's and the
# pipeline's own functions stand for the collectives they wait for.
OP_OF_FUNCTION = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_multigpu": "all_reduce",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
    "all_gather_object": "all_gather", "all_gather_coalesced": "all_gather", "all_gather_single": "all_gather",
    "foreach_all_gather": "all_gather", "wait_for_unshard": "all_gather", "foreach_all_gather_copy_out": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "foreach_reduce": "reduce_scatter",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "broadcast_object_list": "broadcast", "_broadcast_coalesced": "broadcast",
    "reduce": "reduce", "barrier": "barrier", "monitored_barrier": "barrier",
    "send": "send", "isend": "send", "send_object_list": "send",
    "recv": "recv", "irecv": "recv", "recv_object_list": "recv",
    "batch_isend_irecv": "send/recv", "_batch_p2p": "send/recv", "_wait_batch_p2p": "send/recv",
}


def hang_threshold_s(*, after_s: float, first_step_s: float, min_s: float, walls: Iterable[float]) -> float:
    """How long without progress is a hang: ``first_step_s`` until a step has ended (``walls`` empty),
    then HANG_STEPS median steps within [min_s, after_s] (``after_s`` wins where min_s is above it).
    0 (``after_s``): the watchdog is off."""
    if not after_s:
        return 0.0
    walls = [w for w in walls if w == w and w >= 0]
    if not walls:
        return max(after_s, first_step_s)
    return min(after_s, max(min_s, HANG_STEPS * statistics.median(walls)))


# meshscope's own source root (an editable install's checkout, or site-packages/meshscope)
_OWN_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).replace("\\", "/") + "/"


def _short(path: str) -> str:
    # The path from the package root on (torch/distributed/..., meshscope/trainer/...): what a reader
    # recognises, and the same on every host whatever the install prefix.
    path = path.replace("\\", "/")
    for root in ("/site-packages/", "/dist-packages/"):
        if root in path:
            return path.rsplit(root, 1)[1]
    if path.startswith(_OWN_ROOT):
        return "meshscope/" + path[len(_OWN_ROOT):]
    return path


def frames_of(frame: Any) -> list[list]:
    """A thread's stack as [file, line, function] from outermost to innermost (innermost MAX_FRAMES)."""
    out = []
    while frame is not None and len(out) < MAX_FRAMES:
        out.append([_short(frame.f_code.co_filename), frame.f_lineno, frame.f_code.co_name])
        frame = frame.f_back
    return out[::-1]


def op_on_stack(frames: list[list]) -> str:
    """The op the innermost torch.distributed frame (or DDP's wait in the autograd engine) is in; ""
    when none is on the stack."""
    for path, _, function in reversed(frames):
        if "torch/distributed/" in path:
            op = OP_OF_FUNCTION.get(function)
            if op:
                return op
    for path, _, function in reversed(frames):
        if "torch/distributed/" in path:
            return function  # a distributed function this table does not name: shown as it is
        if "torch/autograd/" in path:  # the C++ engine, where DDP's reducer waits for its all-reduces
            return "all_reduce"
    return ""


def stacks(train_thread: int) -> list[dict]:
    """Every thread's stack, the training thread first (then by name), at most MAX_THREADS."""
    names = {t.ident: t.name for t in threading.enumerate()}
    current = sys._current_frames()
    order = sorted(current, key=lambda ident: (ident != train_thread, names.get(ident, "~"), ident))
    return [{"thread": names.get(ident, f"thread {ident}"), "training": ident == train_thread,
             "frames": frames_of(current[ident])} for ident in order[:MAX_THREADS]]


def group_states(tables: Iterable[Any], completed: dict[str, tuple]) -> list[dict]:
    """Per group: its identity, the sequence number of the last op this rank entered on it (the tracer's
    counter) and of the last it completed (``completed``: group name → (op, seq, t_end), the records
    built so far)."""
    out: dict[str, dict] = {}
    for table in tables:
        for info, entered in table.issued():
            done = completed.get(info.name)
            out.setdefault(info.name, {
                "group": info.name, "dim": info.dim, "mesh_dim": info.label, "size": info.size,
                "ranks": list(info.ranks), "entered": entered,
                "completed": done[1] if done else 0, "completed_op": done[0] if done else "",
                "completed_t": done[2] if done else None})
    for name, (op, seq, t_end, dim, size) in completed.items():  # groups only a direct recorder saw
        out.setdefault(name, {"group": name, "dim": dim, "mesh_dim": "", "size": size, "ranks": [],
                              "entered": None, "completed": seq, "completed_op": op, "completed_t": t_end})
    return list(out.values())


def hang_fields(*, train_thread: int, tables: Iterable[Any], completed: dict[str, tuple]) -> dict:
    """The ``hang`` record's fields other than t / step / since_s / phase."""
    threads = stacks(train_thread)
    train = threads[0]["frames"] if threads and threads[0]["training"] else []
    op = op_on_stack(train)
    where = ""
    for path, line, function in reversed(train):
        if "torch/distributed/" in path or "torch/autograd/" in path:
            where = f"{function} ({path.rsplit('/', 1)[-1]}:{line})"
            break
    if not where and train:
        path, line, function = train[-1]
        where = f"{function} ({path.rsplit('/', 1)[-1]}:{line})"
    return {"in_collective": bool(op), "op": op, "where": where,
            "groups": json.dumps(group_states(tables, completed), separators=(",", ":")),
            "stacks": json.dumps(threads, separators=(",", ":"))}
