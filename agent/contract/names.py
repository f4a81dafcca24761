"""The names both ends of the data path derive paths from: run names, spool files and store parts.

A rank creates its spool file and the agent finds it by pattern; the agent names a Parquet part after the
spool byte range it holds and the readers (agent restart, compaction, dashboard) parse that name back. A
rule that lives on one side only lets the sides drift apart, so every name is made and matched here.
"""

from __future__ import annotations

import re
from pathlib import Path

from meshscope.agent.contract.storelayout import StoreLayout

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")

# ``<store>/spool/<run>/rank-<rank>.a<attempt>.spool``: what spool_path makes and the agent scans for.
SPOOL_NAME = re.compile(r"^rank-(\d+)\.a(\d+)\.spool$")

# ``part-<stream>-<start>-<end>.parquet``: a spool stream's byte range [start, end), zero-padded so names
# sort in range order. Group names are part of the contract (the dashboard extracts ``stream`` in SQL).
PART_RE = re.compile(r"^part-(?P<stream>[0-9a-z]+)-(?P<start>\d{16})-(?P<end>\d{16})\.parquet$")
# A node pack (agent.store.packs): many ranks' parts of one run and kind, named by a digest of its
# manifest (the spool ranges it holds).
PACK_RE = re.compile(r"^pack-(?P<id>[0-9a-f]{24})\.parquet$")


def check_run_name(run: str) -> str:
    """Run names become directory and hive-partition names: letters, digits, ``.``, ``_``, ``-``."""
    if not isinstance(run, str) or not _RUN_NAME.match(run):
        raise ValueError(
            f"run name {run!r} is not usable as a directory name: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run


def is_run_name(name: str) -> bool:
    """Whether ``name`` passes :func:`check_run_name` (for listings, which skip what no writer makes)."""
    return isinstance(name, str) and _RUN_NAME.match(name) is not None


def spool_path(store: str | Path, *, run: str, rank: int, attempt: int) -> Path:
    """The spool file of one rank and restart attempt: ``<store>/spool/<run>/rank-<rank>.a<attempt>.spool``."""
    check_run_name(run)
    if int(rank) < 0 or int(attempt) < 0:
        raise ValueError(f"rank ({rank}) and attempt ({attempt}) must be >= 0")
    return Path(StoreLayout.of(store).spool_file(run=run, rank=rank, attempt=attempt))


def pack_name(digest: str) -> str:
    """The file name of the pack whose manifest digest is ``digest`` (24 hex digits; matches PACK_RE)."""
    return f"pack-{digest}.parquet"


def part_name(stream: str, start: int, end: int) -> str:
    """The file name of the part holding ``[start, end)`` of spool stream ``stream`` (matches PART_RE)."""
    return f"part-{stream}-{start:016d}-{end:016d}.parquet"
