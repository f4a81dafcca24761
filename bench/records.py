"""Training-thread cost of building one record, and of one ``Telemetry.record_collective`` call.

    python bench/records.py [--n 200000]

Prints CPU µs per call of the calling thread (median of 7 blocks, ``time.thread_time``): a positional tuple (what records were
before they were typed), the named tuple class called by keyword, the contract's keyword-only factory
(what producers use), and the whole ``record_collective`` path of a Telemetry writing to a throwaway
spool."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from meshscope.agent.contract import CollectiveRecord, collective_record

KW = dict(step=1, op="all_reduce", dim="dp", group="g", group_size=2, seq=3, bytes=100, t_start=1.0, t_end=2.0,
          duration_s=1.0, wait_s=0.1, algbw=1.0, busbw=1.0, peer=-1, source="c10d")


def _per_call_us(fn, *, n: int) -> float:
    blocks = []
    for _ in range(7):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        blocks.append((time.thread_time() - t0) / n * 1e6)
    return statistics.median(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    n = ap.parse_args().n
    rows = {
        "positional tuple": lambda: (1, "all_reduce", "dp", "g", 2, 3, 100, 1.0, 2.0, 1.0, 0.1, 1.0, 1.0, -1, "c10d"),
        "CollectiveRecord(**kw, mesh_dim="") class": lambda: CollectiveRecord(
            step=1, op="all_reduce", dim="dp", group="g", group_size=2, seq=3, bytes=100, t_start=1.0, t_end=2.0,
            duration_s=1.0, wait_s=0.1, algbw=1.0, busbw=1.0, peer=-1, source="c10d", mesh_dim=""),
        "collective_record(**kw) factory": lambda: collective_record(
            step=1, op="all_reduce", dim="dp", group="g", group_size=2, seq=3, bytes=100, t_start=1.0, t_end=2.0,
            duration_s=1.0, wait_s=0.1, algbw=1.0, busbw=1.0, peer=-1, source="c10d"),
    }
    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

    with tempfile.TemporaryDirectory() as store:
        tel = Telemetry(config=TelemetryConfig(store=store, run="bench", max_rows_per_kind=10 ** 7), rank=0,
                        world_size=1)
        rows["Telemetry.record_collective"] = lambda: tel.record_collective(
            op="all_reduce", dim="dp", group="g", group_size=2, nbytes=100, t_start=1.0, t_end=2.0, wait_s=0.1,
            source="c10d")
        print(f"{'what':<34} {'µs per call':>12}")
        for name, fn in rows.items():
            print(f"{name:<34} {_per_call_us(fn, n=n):>12.3f}")
        tel.close()


if __name__ == "__main__":
    main()
