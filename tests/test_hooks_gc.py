"""What waits for the flusher is invisible to the cyclic GC.

Completed ops (``Entry`` tuples) and ended steps wait up to ``flush_interval_s`` for the flusher: long enough
for the GC to promote whatever it still tracks to its oldest generation, and the full collections that
promotion brings on are paid by whichever thread allocates, in a training loop the training thread
(1.7-2.9 µs per op and 12 µs per step before the tuples held plain values; see ``agent.instrument.ops`` and
``StepState``). A tuple of plain values is untracked by the first collection that sees it, so after a
young collection nothing an op left behind may still be tracked, and a pending step only as itself.
Run in its own process: the ``fake`` process group is process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent("""
    import gc, json, tempfile
    import torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    # The flusher held off: everything stays queued, as it does between two drains.
    tel = Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(), run="gc", flush_interval_s=1000.0),
                    rank=0, world_size=2)
    tracer = CollectiveTracer(tel)
    tracer.attach(None)
    t = torch.ones(16)
    for step in range(5):
        with tel.step(step):
            with tel.phase("forward"):
                dist.all_reduce(t)
                dist.all_reduce(t, async_op=True).wait()
                funcol.all_reduce(t, "sum", dist.group.WORLD).wait()
                dist.isend(t, 1).wait()
                dist.irecv(t, 1).wait()
    gc.collect(1)  # a young collection (generations 0 and 1), as the interpreter runs thousands of
    entries = list(tracer._done)
    steps = list(tel._ended)
    held = [(name, getattr(s, name)) for s in steps
            for name in ("phases", "waits_in_phase", "span_kind_time", "outer", "segments", "colls", "key",
                         "cpu0", "cpu_end", "spans", "tensors", "values")]
    print(json.dumps({
        "entries": len(entries),
        "tracked_entries": [repr(e) for e in entries if gc.is_tracked(e)],
        "steps": len(steps),
        "steps_tracked": sum(gc.is_tracked(s) for s in steps),
        "tracked_held": sorted({name for name, v in held if gc.is_tracked(v)}),
    }))
    tracer.detach()
    tel.close()
    dist.destroy_process_group()
""")


def test_ops_and_steps_waiting_for_the_flusher_are_not_tracked_by_the_gc() -> None:
    # The functional collectives' sites, not their kernels (agent/instrument/funcol_kernels.py): what the
    # kernels queue is C++ memory the GC never sees; the sites' tuples are what this checks.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MESHSCOPE_FUNCOL_KERNELS="0")
    proc = subprocess.run([sys.executable, "-c", WORKER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["entries"] == 5 * 5  # every op of the five steps is queued (so the check below saw them)
    assert got["tracked_entries"] == []
    assert got["steps"] == 5 and got["steps_tracked"] == 5  # the StepState itself: one object per step
    assert got["tracked_held"] == []
