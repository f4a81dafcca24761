"""The GPU check's device-agnostic sections (bench/gpu_check_opcost.py, section 7; bench/gpu_check_ddp.py,
section 8) run here on CPU tensors and a gloo world of one, as they run on a GPU with CUDA tensors and
NCCL; and their verdicts on given figures."""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is a folder of scripts, not an installed package
    sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------------- 7. op cost
def on_cpu(module: str, kwargs: str) -> dict:
    """``bench.<module>.measure(device=cpu, <kwargs>)`` in a fresh process, on a gloo world of one: the
    device-agnostic sections run here as on a GPU, with CPU tensors."""
    from tests.support.hookcost import run_isolated

    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch, torch.distributed as dist
        from tests.support.profiler import free_port
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo")
        from bench.{module} import measure
        result = measure(device=torch.device("cpu"), {kwargs})
        dist.destroy_process_group()
    """)
    return run_isolated(code, what=f"{module} on CPU", timeout_s=180)


def test_the_op_cost_section_measures_every_path_on_cpu_and_records_without_errors():
    """Section 7's measurement is device-agnostic: on CPU / gloo (the C sites here, CUDA's Python sites
    and events on a GPU) it measures every path with the real telemetry core, without errors or drops."""
    data = on_cpu("gpu_check_opcost", "calls=40, blocks=3")
    from bench.gpu_check_opcost import PATHS, render_opcost

    assert set(data["paths"]) == set(PATHS)
    assert data["errors"] == 0 and data["dropped_records"] == 0
    for row in data["paths"].values():
        assert row["without_cpu_us"] > 0 and math.isfinite(row["overhead_cpu_us"])
    assert render_opcost(data).verdict in ("PASS", "FAIL")


def test_the_op_cost_verdict_is_the_per_op_goal():
    from bench.gpu_check_opcost import render_opcost

    def data(*overheads: float, errors: int = 0) -> dict:
        return {"paths": {f"p{i}": {"without_cpu_us": 30.0, "overhead_cpu_us": o, "iqr_us": [o - 0.1, o + 0.1]}
                          for i, o in enumerate(overheads)}, "errors": errors, "dropped_records": 0,
                "calls": 400, "blocks": 9, "device": "cuda:0"}

    assert render_opcost(data(1.2, 1.9)).verdict == "PASS"
    bad = render_opcost(data(1.2, 14.5))
    assert bad.verdict == "FAIL" and "1 of 2 paths over 2 µs" in bad.summary and "14.5 µs" in bad.summary
    assert render_opcost(data(1.0, errors=3)).verdict == "FAIL"
    assert render_opcost({"paths": {}}).verdict == "FAIL"


# ------------------------------------------------------------------------------------------ 8. DDP
def test_the_ddp_section_matches_ddps_own_buckets_on_cpu():
    """Section 8's measurement is device-agnostic: on CPU / gloo each step after the first has one record
    per bucket DDP's reducer reports, with its bytes."""
    data = on_cpu("gpu_check_ddp", "steps=3")
    from bench.gpu_check_ddp import render_ddp

    assert len(data["buckets"]) >= 2 and data["errors"] == []
    for records in data["steps"][1:]:
        assert sorted(r["nbytes"] for r in records) == sorted(data["buckets"])
    assert render_ddp(data).verdict == "PASS"


def test_the_ddp_verdict_wants_every_bucket_once_with_its_bytes_and_times():
    from bench.gpu_check_ddp import render_ddp

    def data(*steps: list[int], device: str = "cuda:0", duration: float = 1e-3, timing: str = "") -> dict:
        return {"buckets": [100, 200], "errors": [], "stats": {}, "nccl_timing_env": timing, "device": device,
                "steps": [[{"nbytes": b, "duration_s": duration, "wait_s": 0.0} for b in s] for s in steps]}

    assert render_ddp(data([300], [200, 100], [100, 200])).verdict == "PASS"  # the first step is not judged
    missing = render_ddp(data([300], [200], [100, 200]))
    assert missing.verdict == "FAIL" and "1 of 2 steps" in missing.summary
    assert render_ddp(data([300], [100, 200, 200])).verdict == "FAIL"  # a bucket recorded twice
    # A NaN duration: by design on CUDA without NCCL timing, a fault anywhere else.
    assert render_ddp(data([300], [100, 200], duration=math.nan)).verdict == "PASS"
    assert render_ddp(data([300], [100, 200], duration=math.nan, timing="1")).verdict == "FAIL"
    assert render_ddp(data([300], [100, 200], duration=math.nan, device="cpu")).verdict == "FAIL"
    assert render_ddp({**data([300], [100, 200]), "errors": ["ddp_comm_hook: boom"]}).verdict == "FAIL"
