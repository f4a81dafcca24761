"""Benchmark: the agent's ingest path on ONE core — read + validate + aggregate metrics + write Parquet.

    python bench/agent_ingest.py [--ranks 8] [--records 4000000] [--frame-rows 4000]

1. Generates synthetic spool files (mostly ``collective`` records, ``--frame-rows`` per frame, plus the
   run/step/memory records of the steps they cover) for ``--ranks`` ranks, in a temporary store.
2. Starts a fresh child process that pins itself to one CPU (``os.sched_setaffinity``), builds the same
   ``MetricsState`` + ``Ingestor`` the agent runs, and times ``ingest_all()`` end to end: every frame is
   CRC-checked and decoded, checked against its schema, folded into the Prometheus state, and written
   as zstd Parquet parts with the durable offsets saved. Imports and store set-up are outside the timed
   region; the child's peak RSS (``ru_maxrss``, whole process incl. imports) is reported.
3. Checks that the Parquet row count equals what was generated, and prints the figures.

Goal: >= 1,000,000 records/s on one core with peak RSS <= 200 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshscope.agent.contract.storelayout import StoreLayout  # noqa: E402

GOAL_RPS = 1_000_000
GOAL_RSS_MB = 200


def measure(store: Path) -> dict:
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    import pyarrow as pa

    pa.set_cpu_count(1)  # Arrow's own pool would otherwise spread over the one pinned core anyway
    pa.set_io_thread_count(1)
    from meshscope.agent.collector.ingest import Ingestor
    from meshscope.agent.collector.state import MetricsState
    from meshscope.agent.contract import AnchoredClock

    state = MetricsState()
    ingestor = Ingestor(store=store, state=state, clock=AnchoredClock())
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    ingestor.ingest_all()
    wall = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0
    records = sum(state.ingested.values())
    return {
        "cpu": cpu, "records": records, "wall_s": wall, "cpu_s": cpu_s, "records_per_s": records / wall,
        "spool_bytes": state.ingested_bytes, "parts": state.parts_written,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rejected": sum(state.rejected.values()),
    }


def count_rows(store: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(p).num_rows for p in Path(StoreLayout.of(store).tables).rglob("*.parquet"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--records", type=int, default=4_000_000, help="collective records in total")
    parser.add_argument("--frame-rows", type=int, default=4000)
    parser.add_argument("--collectives-per-step", type=int, default=40)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return 0

    from tests.support.spools import write_run

    tmp = Path(tempfile.mkdtemp(prefix="meshscope-bench-"))
    try:
        t = time.perf_counter()
        steps = max(1, args.records // (args.ranks * args.collectives_per_step))
        counts = write_run(tmp, run="bench", world_size=args.ranks, steps=steps,
                           collectives_per_step=args.collectives_per_step, frame_rows=args.frame_rows)
        generated = sum(counts.values())
        spool_mb = sum(p.stat().st_size for p in Path(StoreLayout.of(tmp).spool).rglob("*.spool")) / 1e6
        print(f"generated {generated:,} records ({counts}) in {args.ranks} spools, {spool_mb:.0f} MB, "
              f"{args.frame_rows} collectives per frame, in {time.perf_counter() - t:.1f} s")
        out = subprocess.run([sys.executable, __file__, "--measure", str(tmp)], check=True, capture_output=True,
                             text=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        stored = count_rows(tmp)
        parquet_mb = sum(p.stat().st_size for p in Path(StoreLayout.of(tmp).tables).rglob("*.parquet")) / 1e6
        ok_rate = result["records_per_s"] >= GOAL_RPS
        ok_rss = result["peak_rss_mb"] <= GOAL_RSS_MB
        print(f"ingest on cpu {result['cpu']} (pinned): {result['records']:,} records in {result['wall_s']:.2f} s "
              f"wall ({result['cpu_s']:.2f} s cpu) = {result['records_per_s']:,.0f} records/s "
              f"[goal >= {GOAL_RPS:,}: {'met' if ok_rate else 'NOT met'}]")
        print(f"peak RSS of the ingest process (ru_maxrss, incl. imports): {result['peak_rss_mb']:.0f} MB "
              f"[goal <= {GOAL_RSS_MB} MB: {'met' if ok_rss else 'NOT met'}]")
        print(f"spool {result['spool_bytes'] / 1e6:.0f} MB -> {result['parts']} Parquet parts, {parquet_mb:.0f} MB; "
              f"rows stored {stored:,} (generated {generated:,}); rejected frames {result['rejected']}")
        if stored != generated:
            print("ERROR: stored row count differs from generated", file=sys.stderr)
            return 1
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
