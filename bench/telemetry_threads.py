"""CPU time of the telemetry's own threads per step, beside the training thread's: the flusher (builds the
records) and the spool writer (encodes them to Arrow and appends them to the spool file).

    python bench/telemetry_threads.py [--steps 1000] [--step-ms 2] [--form pyarrow.array]   # one JSON object

One process, a ``Telemetry`` writing to a temporary store, steps of ``--step-ms`` of busy work in a
``forward`` phase with a loss tensor and a token count, a memory sample every ``memory_every`` steps (the
default). Each thread's CPU from ``/proc/self/task/<tid>/schedstat``, from the end of a 100-step warm-up
(one-time costs apart: ``first_flush_ms`` is the writer's CPU during the warm-up) to the end of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time


def _cpu_ns(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--form", choices=("buffers", "pyarrow.array"), default="buffers",
                    help="how the writer builds record columns: pyarrow.array is what it used before")
    ns = ap.parse_args()
    import torch

    from meshscope.agent.transport import columns

    if ns.form == "pyarrow.array":
        columns._from_buffers = lambda values, arrow_type: None  # every column through pyarrow.array

    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

    load_start = os.getloadavg()
    tel = Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(prefix="meshscope-threads-"), run="threads"),
                    rank=0, world_size=1)
    tel.start({"strategy": "none"})
    threads = {t.name: t.native_id for t in threading.enumerate()}
    tids = {"training": threads["MainThread"], "flusher": threads["meshscope-flush"],
            "writer": next(v for k, v in threads.items() if k.startswith("meshscope-spool"))}

    def run(first: int, n: int) -> None:
        for i in range(first, first + n):
            with tel.step(i) as ctx:
                with tel.phase("forward"):
                    end = time.perf_counter() + ns.step_ms / 1e3
                    while time.perf_counter() < end:
                        pass
                ctx.update(loss=torch.tensor(1.0), tokens=128)

    base = {k: _cpu_ns(t) for k, t in tids.items()}
    run(0, 100)
    time.sleep(0.8)  # the warm-up's records flushed and written
    warm = {k: _cpu_ns(t) for k, t in tids.items()}
    run(100, ns.steps)
    time.sleep(0.8)
    end = {k: _cpu_ns(t) for k, t in tids.items()}
    report = {
        "form": ns.form, "steps": ns.steps, "step_ms": ns.step_ms, "load_avg_start": load_start,
        "cpu_us_per_step": {k: round((end[k] - warm[k]) / ns.steps / 1e3, 1) for k in tids},
        "first_flush_ms": round((warm["writer"] - base["writer"]) / 1e6, 1),
        "pandas_imported": "pandas" in sys.modules, "dropped_records": tel.dropped_records, "errors": tel.errors,
    }
    tel.close()
    report["load_avg_end"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
