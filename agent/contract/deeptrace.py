"""The deep-trace protocol: how ``meshscope trace`` arms torch.profiler on the ranks of a running job and how
each rank answers, through small files beside the run's spools (``StoreLayout.deeptrace(run)``), where every
rank of the run already writes.

    <store>/spool/<run>/deeptrace/request.json            the CLI: one armed trace (``TraceRequest``)
    <store>/spool/<run>/deeptrace/<id>/rank<k>.json        rank k: its Kineto (Chrome-trace) JSON
    <store>/spool/<run>/deeptrace/<id>/rank<k>.done.json   rank k: the steps it traced (``TraceDone``)

Every file is written whole under a temporary name and renamed into place (``write_atomic``): a reader sees
no file or the whole file. A rank's flusher thread stats ``request.json`` once per ``POLL_S`` and reads it
only when it changed; a request names the ranks, the number of steps, the step to start at (every rank
then traces the same steps; a rank that sees the request after that step started begins at its next step)
and when it expires (a CLI that died leaves no trace armed for ever). A rank answers each request id once.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REQUEST = "request.json"
MERGED = "merged.json"
POLL_S = 1.0  # how often a rank's flusher looks for a request (one stat)


def trace_name(rank: int) -> str:
    return f"rank{int(rank)}.json"


def done_name(rank: int) -> str:
    return f"rank{int(rank)}.done.json"


def new_trace_id(now: float | None = None) -> str:
    """A request's id: sortable by time, unique across CLIs started in the same second."""
    t = time.time() if now is None else now
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(t)) + f"-{secrets.token_hex(2)}"


def write_atomic(path: str | Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file in the same directory and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRequest:
    id: str
    run: str
    steps: int  # how many steps each rank traces
    ranks: tuple[int, ...] | None  # None: every rank
    start_step: int | None  # the first step to trace; None: each rank's next step
    created: float  # Unix seconds
    expires: float  # Unix seconds: after this, no rank starts it and a new request may replace it

    def __post_init__(self) -> None:
        if not self.id or "/" in self.id or self.id.startswith("."):
            raise ValueError(f"trace id {self.id!r}")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} (at least 1)")

    def wants(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def expired(self, now: float) -> bool:
        return now > self.expires

    def dumps(self) -> str:
        d = asdict(self)
        d["ranks"] = None if self.ranks is None else list(self.ranks)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> TraceRequest:
        """Raises ValueError for anything that is not a request."""
        try:
            d = json.loads(text)
            ranks = d["ranks"]
            return cls(id=str(d["id"]), run=str(d["run"]), steps=int(d["steps"]),
                       ranks=None if ranks is None else tuple(int(r) for r in ranks),
                       start_step=None if d["start_step"] is None else int(d["start_step"]),
                       created=float(d["created"]), expires=float(d["expires"]))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a trace request: {exc}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceDone:
    """A rank's answer to one request: the steps it traced (``first_step``..``last_step``, each one ended
    inside the profiler) or why it traced none (``error``)."""

    rank: int
    world_size: int
    host: str
    pid: int
    first_step: int = -1
    last_step: int = -1
    steps: int = 0  # steps traced: last_step - first_step + 1 when the trace is whole
    trace: str = ""  # the trace's file name beside this one, "" when none was written
    error: str = ""  # why the trace is short or absent ("" when whole)
    # what the profiler cost, seconds: its start and stop (on the training thread), the export (off it)
    start_s: float = 0.0
    stop_s: float = 0.0
    export_s: float = 0.0

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> TraceDone:
        try:
            d = json.loads(text)
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a trace answer: {exc}") from None
