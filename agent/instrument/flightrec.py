"""torch's own evidence beside meshscope's: when the hang watchdog fires and ``flight_recorder_dir`` is set,
each rank writes its Flight Recorder buffer there (``rank_<global rank>``, the pickle torch's analyser
``python -m torch.distributed.flight_recorder.fr_trace DIR --prefix rank_`` reads).

Measured on torch 2.13 / gloo (CPU): the recorder is on by default (2,000 entries) and records gloo's
all-reduce, all-gather, broadcast and barrier with a per-group sequence id (reduce-scatter as all-reduce,
send / recv not at all); it never dumps on its own on gloo, so the watchdog asks for the buffer
(``_dump_fr_trace``, from the flusher thread while the training thread is blocked). Its ``pg_config`` names
every group ``""`` (ProcessGroupGloo records its ranks in its constructor, before ``distributed_c10d`` names
the group), on which the analyser fails with a KeyError: the groups are named again from
``distributed_c10d._get_all_pg_configs`` before the file is written.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

PREFIX = "rank_"


def _pg_config() -> dict:
    from torch.distributed import distributed_c10d as c10d

    return {pg["pg_name"]: {"name": pg["pg_name"], "desc": pg["pg_desc"], "ranks": str(sorted(pg["ranks"]))}
            for pg in c10d._get_all_pg_configs()}


def dump(directory: str | os.PathLike, *, rank: int) -> Path:
    """Write this process's Flight Recorder buffer to ``directory/rank_<rank>`` (atomically: the analyser
    reads every file whose name holds the prefix). Raises what torch raises (no recorder, no group)."""
    import torch._C._distributed_c10d as c10d_c

    data = pickle.loads(c10d_c._dump_fr_trace(includeStackTraces=False))
    data["pg_config"] = _pg_config()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-{os.getpid()}"
    tmp.write_bytes(pickle.dumps(data))
    os.replace(tmp, out / f"{PREFIX}{rank}")
    return out / f"{PREFIX}{rank}"
