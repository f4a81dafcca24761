"""What encoding records costs the spool writer's thread in a rank, with the columns built from buffers
(agent/transport/columns.py) and with ``pyarrow.array`` (what the writer used before).

    python bench/spool_encode.py [--rows 200] [--blocks 9]

One JSON object. Per form, in a fresh interpreter each (pyarrow imported, nothing encoded yet):
``first_batch_ms`` (wall time of the first ``rows_to_batch``: pyarrow.array's first call imports pandas),
``rss_mb`` (resident memory it added), ``pandas_imported``; then ``us_per_row`` per record kind: CPU time of
the calling thread per row to make a record batch of ``--rows`` rows and frame it, the median of
``--blocks`` blocks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import psutil
import pyarrow as pa
from meshscope.agent.contract import FACTORIES, SCHEMAS
from meshscope.agent.transport import columns
from meshscope.agent.transport.frame import encode_data_frame, rows_to_batch
if {form!r} == "pyarrow.array":
    columns._from_buffers = lambda values, arrow_type: None  # every column through pyarrow.array
SAMPLE = {{"double": 1.5, "int64": 3, "int32": 2, "bool": False, "string": "all_reduce"}}
def rows(kind, n):
    return [FACTORIES[kind](**{{f.name: SAMPLE[str(f.type)] for f in SCHEMAS[kind]}}) for _ in range(n)]
proc = psutil.Process()
rss0 = proc.memory_info().rss
t0 = time.perf_counter()
rows_to_batch("event", rows("event", 1))
out = {{"first_batch_ms": round((time.perf_counter() - t0) * 1e3, 1),
        "rss_mb": round((proc.memory_info().rss - rss0) / 2 ** 20, 1), "pandas_imported": "pandas" in sys.modules,
        "us_per_row": {{}}}}
for kind in ("step", "collective", "memory", "span"):
    batch = rows(kind, {rows})
    blocks = []
    for _ in range({blocks}):
        c0 = time.thread_time()
        encode_data_frame(kind, rows_to_batch(kind, batch))
        blocks.append((time.thread_time() - c0) / len(batch) * 1e6)
    out["us_per_row"][kind] = round(statistics.median(blocks), 2)
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=9)
    ns = ap.parse_args()
    report = {}
    for form in ("buffers", "pyarrow.array"):
        out = subprocess.run([sys.executable, "-c", CHILD.format(form=form, rows=ns.rows, blocks=ns.blocks)],
                             capture_output=True, text=True, check=True, timeout=300)
        report[form] = json.loads(out.stdout)
    report["rows_per_batch"] = ns.rows
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
