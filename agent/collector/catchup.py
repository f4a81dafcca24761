"""Bring a store's tables up to its spools for a reader: ``meshscope dashboard`` and ``meshscope report``
call :func:`catch_up` before they read, so a run whose records are still only in spools (a job run with
``--store`` and no agent: the README tour) shows without a separate ``meshscope ingest``.

Safe beside a running agent: a store has one writer at a time, the holder of ``agent/agent.lock``
(:func:`lock_store`). When an agent holds it, the agent is the writer and its parts reach the tables
within its part age; the reader only says so. Otherwise the reader takes the lock, ingests what the
spools hold beyond the saved offsets (the agent's own exactly-once path, :mod:`agent.collector.ingest`)
and lets go.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from meshscope.agent.collector.ingest import Ingestor
from meshscope.agent.collector.offsets import OffsetStore
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.contract import SPOOL_NAME, AnchoredClock
from meshscope.agent.contract.storelayout import StoreLayout, spool_key

def lock_store(store: str | Path, *, wait_s: float = 0.0) -> int | None:
    """The store's writer lock as an open file descriptor (close it to let go), or None if another
    process holds it after ``wait_s``. The kernel drops the lock when its holder dies, SIGKILL included.
    Raises OSError when the lock file cannot be created (a read-only store)."""
    layout = StoreLayout.of(store)
    Path(layout.agent).mkdir(exist_ok=True)
    fd = os.open(layout.lock, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.1)


def pending_bytes(store: str | Path) -> int:
    """Spool bytes beyond the saved offsets: records not yet in the tables (0 when the store has no spools).
    Reads sizes and ``offsets.json`` only; it takes no lock and writes nothing."""
    layout = StoreLayout.of(store)
    spool = Path(layout.spool)
    if not spool.is_dir():
        return 0
    saved = OffsetStore(Path(layout.offsets)).load()
    total = 0
    for run_dir in spool.iterdir():
        if not run_dir.is_dir():
            continue
        for path in run_dir.iterdir():
            if SPOOL_NAME.match(path.name):
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                done = int(saved.get(spool_key(run_dir.name, path.name), {}).get("offset", 0))
                total += size - done if size >= done else size  # smaller: a new generation of the file
    return total


@dataclass(frozen=True, slots=True)
class CatchUp:
    """What :func:`catch_up` did, for one line on the page or in the terminal."""

    store: Path
    outcome: Literal["current", "ingested", "agent", "unwritable", "failed"]
    records: int = 0
    pending_bytes: int = 0
    detail: str = ""

    def message(self) -> str | None:
        """One sentence for the reader, or None when there is nothing to say."""
        where = f"store {str(self.store)!r}"
        if self.outcome == "ingested":
            return f"Ingested {self.records:,} records from the spools of {where}."
        if self.outcome == "agent" and self.pending_bytes:
            return (f"An agent (or ingest) is writing {where}; {self.pending_bytes:,} spool bytes are not in its "
                    "tables yet and appear within its part age.")
        if self.outcome == "unwritable" and self.pending_bytes:
            return (f"{where} has {self.pending_bytes:,} spool bytes not in its tables, and this process cannot "
                    f"write it ({self.detail}): run `meshscope ingest --store {self.store}` as its owner.")
        if self.outcome == "failed":
            return f"Could not ingest the spools of {where}: {self.detail}. The pages show what is in its tables."
        return None


def catch_up(store: str | Path) -> CatchUp:
    """Ingest the spools of ``store`` that are not in its tables yet, unless another process is its writer.
    Never raises for the store's state: what happened is in the result."""
    root = Path(store)
    pending = pending_bytes(root)
    if not pending:
        return CatchUp(root, "current")
    try:
        fd = lock_store(root)
    except OSError as exc:
        return CatchUp(root, "unwritable", pending_bytes=pending, detail=exc.strerror or str(exc))
    if fd is None:
        return CatchUp(root, "agent", pending_bytes=pending)
    try:
        state = MetricsState()
        ingestor = Ingestor(store=root, state=state, clock=AnchoredClock())
        ingestor.ingest_all()
        records = sum(state.ingested.values())
        if state.store_write_errors:
            return CatchUp(root, "failed", records=records, pending_bytes=pending_bytes(root),
                           detail=f"{state.store_write_errors} store write(s) failed")
        return CatchUp(root, "ingested" if records else "current", records=records)
    except OSError as exc:
        return CatchUp(root, "failed", pending_bytes=pending, detail=exc.strerror or str(exc))
    finally:
        os.close(fd)
