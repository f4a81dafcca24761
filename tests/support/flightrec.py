"""torch's Flight Recorder analyser (``torch.distributed.flight_recorder``, the code behind ``fr_trace``) over a
folder of dumps (``agent.instrument.flightrec``): the independent verdict a hang's culprit is compared with."""

from __future__ import annotations

import gc
from pathlib import Path

from meshscope.agent.instrument.flightrec import PREFIX


def torch_findings(directory: Path) -> list[dict]:
    """Each collective torch's analyser flags, in its order: group, seq, op, the ranks missing from it, the
    ranks whose op differs (``mismatch``), and ``culprits`` (missing + differing: when most ranks are
    flagged for differing from the first, it is the first that differs, so the minority is named)."""
    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.loader import read_dir

    args = JobConfig().parse_args([str(directory), "--prefix", PREFIX])
    try:
        details, version = read_dir(args)
    finally:
        gc.enable()  # read_dir disables the collector and leaves it so
    # the analyser compares every rank with the first file it read (os.walk order): rank order instead
    details = dict(sorted(details.items(), key=lambda kv: kv[1]["rank"]))
    db = build_db(details, args, version)
    out = []
    for c in db.collectives:
        missing = set(c.missing_ranks or ())
        differ = {int(r): mc.collective_name for r, mc in (c.mismatch_collectives or {}).items()}
        flagged = set(differ)
        if flagged and len(flagged) > len(c.expected_ranks) / 2:
            flagged = set(c.expected_ranks) - flagged - missing
        if missing or differ or not c.pass_check:
            out.append({"group": c.pg_desc, "seq": c.collective_seq_id, "op": c.collective_name,
                        "missing": sorted(missing), "mismatch": differ, "culprits": sorted(missing | flagged)})
    return out
