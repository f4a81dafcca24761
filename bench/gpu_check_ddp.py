"""Section 8 of the GPU check: DDP's buckets as meshscope records them, against DDP's own account.

meshscope sees DDP's gradient all-reduces through its comm hook (``agent/instrument/comm_ddp.py``); on CUDA
tensors the hook and the exposure window are timed with CUDA events (``comm_nccl``), a path no CPU test
runs. Here a small DDP model (``LAYERS`` linear layers, ``BUCKET_CAP_MB`` buckets) trains ``STEPS`` steps
on NCCL world size 1 under meshscope's collective tracer, and each step's bucket records are set against
the buckets DDP's C++ reducer reports itself (``_get_ddp_logging_data()["rebuilt_bucket_sizes"]``, the
buckets of every step after the first, when the reducer rebuilds them in gradient order). The check: from
the second step on, one record per bucket with the bucket's bytes, every duration and exposed time a
number (a duration NaN only where NCCL timing is off: the per-bucket duration needs
``TORCH_NCCL_ENABLE_TIMING=1``), and no tracer error.

``measure`` takes an initialised process group of one and a device, so that tests run it on CPU / gloo.
"""

from __future__ import annotations

import math
import os
from collections import Counter

from bench.gpu_check_analysis import Rendered, _fmt, md_table

LAYERS, WIDTH, BATCH = 8, 1024, 16  # 8.4 M parameters: 4.2 MB of fp32 gradient per layer
BUCKET_CAP_MB = 8
STEPS = 4


def measure(*, device, steps: int = STEPS) -> dict:
    """``{"buckets": DDP's rebuilt bucket bytes, "steps": [[{nbytes, duration_s, wait_s}] per step], ...}``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.recorder import ListRecorder

    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device] if cuda else None, bucket_cap_mb=BUCKET_CAP_MB)
    recorder = ListRecorder()
    tracer = CollectiveTracer(recorder)
    tracer.attach(ddp)
    x = torch.randn(BATCH, WIDTH, device=device)
    per_step = []
    try:
        for _ in range(steps):
            n0 = len(recorder.collectives)
            ddp(x).square().mean().backward()
            if cuda:
                torch.cuda.synchronize()  # every event complete: the step end's flush resolves them all
            tracer.flush()
            per_step.append([{"nbytes": r["nbytes"], "duration_s": r["t_end"] - r["t_start"], "wait_s": r["wait_s"]}
                             for r in recorder.collectives[n0:] if r["source"] == "ddp_comm_hook"])
    finally:
        tracer.detach()
    logged = ddp._get_ddp_logging_data()
    rebuilt = str(logged.get("rebuilt_bucket_sizes", ""))
    return {"buckets": [int(v) for v in rebuilt.split(",") if v.strip()], "steps": per_step,
            "errors": [f"{where}: {exc!r}" for where, exc in recorder.errors],
            "stats": {k: v for k, v in tracer.stats.items() if v},
            "nccl_timing_env": os.environ.get("TORCH_NCCL_ENABLE_TIMING", ""), "device": str(device)}


def compare_ddp(data: dict) -> list[dict]:
    """One row per step: its records against DDP's buckets (steps after the first: the rebuilt buckets)."""
    truth = Counter(data["buckets"])
    timing = data.get("nccl_timing_env") not in ("", "0")
    rows = []
    for i, records in enumerate(data["steps"]):
        durations = [r["duration_s"] for r in records]
        waits = [r["wait_s"] for r in records]
        ok_bytes = Counter(r["nbytes"] for r in records) == truth
        # A NaN duration is expected only on CUDA without NCCL's own timing (comm_nccl's docstring).
        nan_allowed = data.get("device", "").startswith("cuda") and not timing
        ok_times = (all(not math.isnan(w) and w >= 0 for w in waits)
                    and all((math.isnan(d) and nan_allowed) or d >= 0 for d in durations))
        rows.append({"step": i, "records": len(records), "buckets": sum(truth.values()),
                     "bytes_ok": ok_bytes, "times_ok": ok_times, "judged": i >= 1,
                     "exposed_s": sum(waits) if waits else float("nan"),
                     "duration_s": max(durations) if durations and not any(map(math.isnan, durations)) else float("nan")})
    return rows


def render_ddp(data: dict) -> Rendered:
    rows = compare_ddp(data)
    judged = [r for r in rows if r["judged"]]
    bad = [r for r in judged if not (r["bytes_ok"] and r["times_ok"])]
    verdict = "PASS" if data["buckets"] and judged and not bad and not data.get("errors") else "FAIL"
    if not data["buckets"]:
        line = "DDP reported no rebuilt buckets: nothing to compare"
    elif data.get("errors"):
        line = f"{len(data['errors'])} tracer errors"
    elif bad:
        line = f"{len(bad)} of {len(judged)} steps whose records do not match DDP's {len(data['buckets'])} buckets"
    else:
        line = (f"{len(judged)} of {len(judged)} steps: one record per bucket of DDP's {len(data['buckets'])}, "
                "with its bytes, and every time a number")
    table = md_table(
        ["step", "records", "DDP's buckets", "bytes match", "times", "exposed (ms)", "longest bucket (ms)", "judged"],
        [[r["step"], r["records"], r["buckets"], "yes" if r["bytes_ok"] else "no", "ok" if r["times_ok"] else "bad",
          _fmt(1e3 * r["exposed_s"], ".3f"), _fmt(1e3 * r["duration_s"], ".3f"), "yes" if r["judged"] else "no (first step)"]
         for r in rows])
    md = [
        f"A DDP model of {LAYERS} linear layers ({WIDTH}×{WIDTH}, fp32), `bucket_cap_mb={BUCKET_CAP_MB}`, on "
        f"{data.get('device', 'cuda')} (NCCL world size 1), {len(rows)} steps under meshscope's collective tracer "
        "(`comm_ddp`'s hook, CUDA events), against the buckets DDP's reducer reports "
        f"(`rebuilt_bucket_sizes`: {', '.join(f'{b:,}' for b in data['buckets']) or 'none'} bytes). "
        f"`TORCH_NCCL_ENABLE_TIMING={data.get('nccl_timing_env') or 'unset'}` (without it a bucket's duration "
        "is NaN on CUDA by design; the exposed window is timed either way).",
        "",
        table,
    ]
    if data.get("errors"):
        md += ["", f"Tracer errors: {'; '.join(data['errors'][:5])}"]
    if data.get("stats"):
        md += ["", f"Tracer counters: {data['stats']}"]
    md += ["", f"**{verdict}**: {line}."]
    return Rendered(verdict, line, "\n".join(md))
