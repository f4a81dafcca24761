"""Every path of the run store, in one place: the ranks write spools under it, the agent ingests them into
Parquet partitions and uploads those to an object store under the same relative keys, and every reader
lists them back. Nothing else spells ``tables``, ``run=``, ``rank=``, ``packs`` or ``spool``.

Layout (hive partitions; ``run``/``rank`` are not columns of the files, readers add them back)::

    <store>/spool/<run>/rank-<rank>.a<attempt>.spool              rank spools (agent.transport)
    <store>/tables/<kind>/run=<run>/rank=<rank>/part-*.parquet     ingested records (rank=-1: GPU samples)
    <store>/tables/<kind>/run=<run>/packs/pack-<id>.parquet        many parts packed into one (agent.store.packs)
    <store>/agent/offsets.json                                     the agent's durable spool offsets
    <store>/spool/<run>/deeptrace/request.json                     an armed deep trace (agent.contract.deeptrace)
    <store>/spool/<run>/deeptrace/<id>/rank<k>.json, .done.json    what each rank's profiler wrote for it
    <store>/traces/<run>/<id>/rank<k>.json, merged.json            collected deep traces (meshscope trace)

An object store holds ``tables/...`` under its prefix with the same keys (``StoreLayout.keys()``), so a
local and a remote store are read by the same code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath

SPOOL, TABLES, AGENT, PACKS = "spool", "tables", "agent", "packs"
DEEPTRACE, TRACES = "deeptrace", "traces"
OFFSETS, LOCK = "offsets.json", "agent.lock"
PARTITION_KEYS = ("run", "rank")  # the hive keys, outer first
_RUN, _RANK = "run=", "rank="

# An object key below a store's prefix: a part under a rank partition or a pack of the run.
TABLE_KEY = re.compile(rf"^{TABLES}/(?P<kind>[a-z_]+)/{_RUN}(?P<run>[^/]+)/"
                       rf"(?:{_RANK}(?P<rank>-?\d+)|(?P<packs>{PACKS}))/(?P<name>[^/]+)$")


def run_dirname(run: str) -> str:
    return f"{_RUN}{run}"


def rank_dirname(rank: int) -> str:
    return f"{_RANK}{int(rank)}"


def run_of(dirname: str) -> str | None:
    """The run a ``run=<run>`` directory holds, None for any other name."""
    return dirname[len(_RUN):] if dirname.startswith(_RUN) else None


def rank_of(dirname: str) -> int | None:
    """The rank a ``rank=<rank>`` directory holds, None for any other name."""
    rest = dirname[len(_RANK):] if dirname.startswith(_RANK) else ""
    return int(rest) if rest.lstrip("-").isdigit() and rest.count("-") <= 1 else None


@dataclass(frozen=True)
class StoreLayout:
    """The paths of one store root: a local directory (``StoreLayout(Path(store))``) or the relative keys
    of an object store (``StoreLayout.keys()``, ``str()`` of each path is the key)."""

    root: PurePath

    @classmethod
    def of(cls, store: str | Path) -> StoreLayout:
        return cls(Path(store))

    @classmethod
    def keys(cls) -> StoreLayout:
        return cls(PurePosixPath())

    # ------------------------------------------------------------------------------------ tables
    @property
    def tables(self) -> PurePath:
        return self.root / TABLES

    def table(self, kind: str) -> PurePath:
        return self.tables / kind

    def run_dir(self, kind: str, run: str) -> PurePath:
        return self.table(kind) / run_dirname(run)

    def partition(self, kind: str, *, run: str, rank: int) -> PurePath:
        return self.run_dir(kind, run) / rank_dirname(rank)

    def packs(self, kind: str, run: str) -> PurePath:
        return self.run_dir(kind, run) / PACKS

    # ------------------------------------------------------------------------------------ spools
    @property
    def spool(self) -> PurePath:
        return self.root / SPOOL

    def spool_file(self, *, run: str, rank: int, attempt: int) -> PurePath:
        return self.spool / run / f"rank-{int(rank)}.a{int(attempt)}.spool"

    def deeptrace(self, run: str) -> PurePath:
        """Where ``meshscope trace`` arms a run's ranks and they answer (beside their spools, where every rank
        of the run writes; the agent reads only spool files there)."""
        return self.spool / run / DEEPTRACE

    # ------------------------------------------------------------------------------------ traces
    @property
    def traces(self) -> PurePath:
        return self.root / TRACES

    def trace(self, run: str, trace_id: str) -> PurePath:
        """One collected deep trace of a run: ``rank<k>.json`` per rank and ``merged.json``."""
        return self.traces / run / trace_id

    # ------------------------------------------------------------------------------- agent state
    @property
    def agent(self) -> PurePath:
        return self.root / AGENT

    @property
    def offsets(self) -> PurePath:
        return self.agent / OFFSETS

    @property
    def lock(self) -> PurePath:
        return self.agent / LOCK


def spool_key(run: str, file_name: str) -> str:
    """A spool file's key in ``offsets.json`` (relative to the store: a moved store keeps its offsets)."""
    return str(StoreLayout.keys().spool / run / file_name)
