"""The GPU side of ``bench/gpu_check.py``: each section runs in a process of its own, so that a crash, a hung
NCCL call or a leaked allocation in one cannot take the others down, and its budget is enforced by
killing the process.

    python bench/gpu_check_sections.py {train,collectives,memory,nvml,overhead,breakdown,opcost,ddp} --workdir DIR --result FILE
        [--steps N]

A section writes its measurements as JSON to ``--result``; ``bench/gpu_check_analysis.py`` turns them
into verdicts and Markdown. Any failure is an exception: its traceback goes to the section's log and
the exit status says it failed.

Run on GPUs: one H200 (torch 2.11, an earlier session, eager) and one H100 80GB (torch 2.11.0+cu130, NCCL
2.28.9, 2026-11-26, compiled): sections 1-5 ran and passed on both (bench/RESULTS.md: the H100's latest
figures); section 6 was written after those runs and has run only on the CPU, with the CUDA calls stubbed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_check_analysis as analysis  # noqa: E402

MIB = 1 << 20
TRAIN_RUN = "gpu-check-1b"
# Section 2: ops x sizes x variants x repetitions, each op in a record_function region of its own.
# c10d's, then the functional collectives' (TP's DTensor path: issue, then ``wait_tensor`` on first use).
COLLECTIVE_OPS = ("all_reduce_sum", "all_reduce_avg", "all_gather_single", "all_gather", "funcol_all_reduce_avg",
                  "funcol_all_gather_single")
COLLECTIVE_SIZES = (1 * MIB, 16 * MIB, 256 * MIB)
COLLECTIVE_VARIANTS = ("queued-sync", "queued-async", "idle-sync")
COLLECTIVE_REPS = 5
BUSY_N = 8192  # side of the bf16 matmul queued ahead of a `queued-*` op: ~1-2 ms on an H100
# Section 5: the A/B schedule of bench/overhead_worker.py, shortened to fit the check's budget.
OVERHEAD_WARMUP, OVERHEAD_PAIRS, OVERHEAD_BLOCK = 3, 4, 5
# Sections 1 and 5 train with each transformer block compiled (the trainer's --compile), as a job that cares
# about MFU runs; the first steps, which compile, fall in the warm-up the analysis leaves out. Without
# Triton (inductor's GPU code generator) they train eager, and the report says which.
COMPILE = importlib.util.find_spec("triton") is not None
# Section 4: seconds of matmuls queued so that the readings under load see a busy GPU.
NVML_LOAD_S = 8.0


def world_of_one():
    """NCCL process group of one rank on ``cuda:0`` over loopback (a free port), as the trainer makes it
    without torchrun. Returns the device."""
    import torch
    import torch.distributed as dist

    from tests.support.profiler import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def _plain(value):
    """A numpy scalar from a DataFrame as the Python value JSON can hold."""
    return value.item() if hasattr(value, "item") else value


# ---------------------------------------------------------------------------------------- 1. trainer
def train(*, workdir: Path, steps: int) -> dict:
    """The trainer's 1b flavor for ``steps`` steps with telemetry on, then its step and run records read
    back from the store through the one reader (after ingesting the spools, as ``meshscope report``)."""
    from meshscope.agent.collector.catchup import catch_up
    from meshscope.agent.store.reader import read_table
    from meshscope.trainer import train as trainer

    store = workdir / "store"
    code = trainer.main(["--model", "1b", "--steps", str(steps), "--device", "cuda", "--store", str(store),
                         "--run-name", TRAIN_RUN, "--log-every", "10", *(["--compile"] if COMPILE else [])])
    if code != 0:
        raise RuntimeError(f"the trainer exited with status {code} (its output is above)")
    caught = catch_up(store)
    if caught.outcome == "failed":
        raise RuntimeError(caught.message())
    cols = ["step", "wall_s", "tokens", "flops", "mfu", "cpu_s", "cpu_wait_s"]
    step_df = read_table(store, "step", run=TRAIN_RUN, columns=cols, order_by="step")
    memory_df = read_table(store, "memory", run=TRAIN_RUN, columns=["step", "reserved_peak_bytes", "alloc_retries",
                                                                    "device_total_bytes"], order_by="step")
    run_df = read_table(store, "run", run=TRAIN_RUN)
    if run_df.empty:
        raise RuntimeError(f"no run record for {TRAIN_RUN!r} in {store}")
    keys = ("model", "n_params", "seq_len", "global_batch", "flops_per_token", "peak_flops", "peak_source", "device",
            "backend", "dtype")
    return {"run_name": TRAIN_RUN, "requested_steps": steps, "compiled": COMPILE,
            "steps": [{k: _plain(v) for k, v in row.items()} for row in step_df.to_dict("records")],
            "run": {k: _plain(run_df.iloc[0][k]) for k in keys},
            # The allocator under the run: retries (cudaFree and try again) near a full device cost whole syncs.
            "memory": {"reserved_peak_bytes": _plain(memory_df["reserved_peak_bytes"].max()),
                       "alloc_retries": _plain(memory_df["alloc_retries"].max()),
                       "device_total_bytes": _plain(memory_df["device_total_bytes"].max())} if len(memory_df) else None}


# ----------------------------------------------------------------------------------- 2. collectives
def _issue(op: str, *, x, out, async_op: bool):
    """The op issued; what it returns has ``wait()`` (a Work, or a functional collective's
    AsyncCollectiveTensor, whose ``wait()`` is ``wait_tensor``), or is None (a blocking c10d call). A
    functional collective has no blocking form: both variants issue it and wait."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    if op == "funcol_all_reduce_avg":
        return funcol.all_reduce(x, "avg", dist.group.WORLD)
    if op == "funcol_all_gather_single":
        # (torch 2.13's name; all_gather_tensor, which calls it there, in releases before it)
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        return gather(x, 0, dist.group.WORLD)
    if op == "all_reduce_sum":
        return dist.all_reduce(x, async_op=async_op)
    if op == "all_reduce_avg":  # NCCL runs AVG of floats as a pre-multiplied sum: a kernel even on one rank
        return dist.all_reduce(x, op=dist.ReduceOp.AVG, async_op=async_op)
    if op == "all_gather_single":
        return dist.all_gather_into_tensor(out, x, async_op=async_op)
    return dist.all_gather([out], x, async_op=async_op)


def collectives(*, workdir: Path, steps: int) -> dict:
    """Each op of ``COLLECTIVE_OPS`` x sizes x variants, ``COLLECTIVE_REPS`` times, traced by meshscope's
    CollectiveTracer and profiled by torch.profiler at once; per labelled op, meshscope's durations and the
    GPU work the profiler attributes to it."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.recorder import ListRecorder

    device = world_of_one()
    recorder = ListRecorder()
    tracer = CollectiveTracer(recorder)
    tracer.attach(None)
    a = torch.randn(BUSY_N, BUSY_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(BUSY_N, BUSY_N, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    bufs = {n: (torch.ones(n // 4, device=device), torch.empty(n // 4, device=device)) for n in COLLECTIVE_SIZES}
    for op in COLLECTIVE_OPS:  # first calls (NCCL communicator, allocations) stay out of the comparison
        for x, out in bufs.values():
            work = _issue(op, x=x, out=out, async_op=False)
            if work is not None:
                work.wait()
    torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    tracer.flush()
    durations: dict[str, list[float]] = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for op in COLLECTIVE_OPS:
            for nbytes, (x, out) in bufs.items():
                for variant in COLLECTIVE_VARIANTS:
                    for rep in range(COLLECTIVE_REPS):
                        if variant.startswith("queued"):
                            torch.mm(a, b, out=c)  # work ahead of the op on the current stream
                        n0 = len(recorder.collectives)
                        name = analysis.label(op=op, nbytes=nbytes, variant=variant, rep=rep)
                        with record_function(name):
                            work = _issue(op, x=x, out=out, async_op=variant.endswith("async"))
                            if work is not None:
                                work.wait()
                        torch.cuda.synchronize()  # every event complete: flush resolves the op's timing
                        tracer.flush()
                        durations[name] = [r["t_end"] - r["t_start"] for r in recorder.collectives[n0:]]
    tracer.detach()
    trace = workdir / "collectives-trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    dist.destroy_process_group()
    return {"durations": durations, "gpu": analysis.gpu_work_by_label(events), "reps": COLLECTIVE_REPS,
            "nccl_version": ".".join(str(v) for v in torch.cuda.nccl.version()),
            "nccl_timing_env": os.environ.get("TORCH_NCCL_ENABLE_TIMING", ""),
            "tracer_errors": [f"{where}: {exc!r}" for where, exc in recorder.errors],
            "tracer_stats": dict(tracer.stats)}


# --------------------------------------------------------------------------------------- 3. memory
def _memory_point(when: str, *, device) -> dict:
    import torch

    from meshscope.agent.contract import RECORDS, TAGS
    from meshscope.agent.instrument import memory

    row = memory.sample(0, time.time(), memory.readings(device))
    assert row[0] == TAGS["memory"], row[0]  # a tagged tuple: the layout tag, then the values in schema order
    sampled = dict(zip(RECORDS["memory"]._fields, row[1:]))
    stats = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    direct = {
        "allocated_bytes": torch.cuda.memory_allocated(device),
        "allocated_peak_bytes": torch.cuda.max_memory_allocated(device),
        "reserved_bytes": torch.cuda.memory_reserved(device),
        "reserved_peak_bytes": torch.cuda.max_memory_reserved(device),
        "active_bytes": stats.get("active_bytes.all.current"),
        "active_peak_bytes": stats.get("active_bytes.all.peak"),
        "alloc_retries": stats.get("num_alloc_retries"),
        "ooms": stats.get("num_ooms"),
        "device_free_bytes": free,
        "device_total_bytes": total,
    }
    return {"when": when, "sampled": {k: _plain(sampled[k]) for k in direct}, "direct": direct}


def memory(*, workdir: Path, steps: int) -> dict:
    """meshscope's memory sample against torch.cuda's own reads, after a known allocation pattern (current
    below peak) and after a provoked out-of-memory error (the retry and OOM counters move)."""
    import torch

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    held = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    spike = torch.empty(512 * MIB, dtype=torch.uint8, device=device)
    del spike
    points = [_memory_point("1 GiB held, 512 MiB freed", device=device)]
    total = torch.cuda.get_device_properties(device).total_memory
    try:
        torch.empty(2 * total, dtype=torch.uint8, device=device)
        raise RuntimeError(f"allocating {2 * total:,} bytes on a {total:,}-byte device did not fail")
    except torch.OutOfMemoryError:
        pass
    points.append(_memory_point("after a provoked out-of-memory", device=device))
    del held
    return {"points": points}


# ----------------------------------------------------------------------------------------- 4. NVML
def _nvml_pair(phase: str, *, sampler, nvml, smi: str, uuid: str) -> dict:
    rows = sampler.sample()
    mine = next((r for r in rows if analysis.norm_uuid(r.uuid) == analysis.norm_uuid(uuid)), None)
    out = subprocess.run([smi, f"--query-gpu={analysis.SMI_QUERY}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True)
    reserved = None
    if mine is not None:
        try:  # v2 reports the driver's reserved memory; drivers before it raise
            handle = nvml.nvmlDeviceGetHandleByUUID(mine.uuid)
            reserved = int(nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2).reserved)
        except nvml.NVMLError:
            reserved = None
    fields = ("util_ratio", "mem_used_bytes", "power_watts", "temperature_celsius")
    return {"phase": phase, "meshscope": None if mine is None else {f: getattr(mine, f) for f in fields},
            "smi": analysis.parse_smi(out.stdout).get(analysis.norm_uuid(uuid)), "nvml_reserved_bytes": reserved}


def nvml(*, workdir: Path, steps: int) -> dict:
    """The agent's NVML sampler and nvidia-smi read back to back, three times under a matmul load and twice
    idle, for the GPU torch calls ``cuda:0``."""
    import torch

    from meshscope.agent.collector.gpu import GpuSampler, load_nvml
    from meshscope.agent.contract import AnchoredClock

    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise RuntimeError("nvidia-smi is not on PATH")
    module, why = load_nvml()
    if module is None:
        raise RuntimeError(why)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    sampler = GpuSampler(module, host=socket.gethostname(), clock=AnchoredClock())
    a = torch.randn(16384, 16384, device=device, dtype=torch.bfloat16)
    b = torch.randn(16384, 16384, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    torch.mm(a, b, out=c)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.mm(a, b, out=c)
    end.record()
    end.synchronize()
    # Few, long kernels: the launch queue holds (nearly) all of them, so the host is free to sample while
    # they run; should it block on a full queue, the GPU has been busy all that time.
    t0 = time.monotonic()
    for _ in range(min(1000, math.ceil(NVML_LOAD_S / (start.elapsed_time(end) / 1e3)))):
        torch.mm(a, b, out=c)
    # The utilization counters average over the driver's last sample period (up to 1 s): busy for that long.
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    pairs = []
    for _ in range(3):
        pairs.append(_nvml_pair("load", sampler=sampler, nvml=module, smi=smi, uuid=uuid))
        time.sleep(0.3)
    torch.cuda.synchronize()
    time.sleep(2.0)
    for _ in range(2):
        pairs.append(_nvml_pair("idle", sampler=sampler, nvml=module, smi=smi, uuid=uuid))
        time.sleep(0.3)
    errors = sampler.errors
    sampler.close()
    return {"pairs": pairs, "sampler_errors": errors, "uuid": uuid}


# ------------------------------------------------------------------------------------- 5. overhead
def overhead(*, workdir: Path, steps: int) -> dict:
    """Telemetry on vs off in one process on the 1b flavor, in alternating blocks (bench/overhead_worker.py's
    A/B method, on NCCL and timed between device synchronisations)."""
    import torch
    import torch.distributed as dist

    from meshscope.agent.instrument.flops import device_peak
    from meshscope.agent.instrument.nulltelemetry import NullTelemetry
    from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig
    from meshscope.trainer import config
    from meshscope.trainer.parallel import build_mesh, schedule_stages
    from meshscope.trainer.train import Trainer

    device = world_of_one()
    total = OVERHEAD_WARMUP + 2 * OVERHEAD_PAIRS * OVERHEAD_BLOCK
    cfg = config.load(None, {"model.flavor": "1b", "model.compile": COMPILE, "device": "cuda",
                             "steps": total}).resolve(1)
    layout = build_mesh(cfg.parallel, device_type=device.type)
    peak, _ = device_peak(device)
    trainer = Trainer(cfg, device=device, layout=layout, peak_flops=peak)
    on = Telemetry(config=TelemetryConfig(store=str(workdir / "store"), run="gpu-check-overhead"), rank=0,
                   world_size=1, device=device)
    on.start({"strategy": cfg.parallel.strategy, "model": "1b", "peak_flops": peak})
    off = NullTelemetry()
    step = 0
    for _ in range(OVERHEAD_WARMUP):
        trainer.train_step(step, off)
        step += 1
    blocks = []
    for pair in range(OVERHEAD_PAIRS):
        for arm in (("on", "off") if pair % 2 == 0 else ("off", "on")):
            if arm == "on":
                on.attach(model_parts=trainer.parts, mesh=layout.mesh, schedule=trainer.schedule,
                          stages=schedule_stages(trainer.schedule))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(OVERHEAD_BLOCK):
                trainer.train_step(step, on if arm == "on" else off)
                step += 1
            torch.cuda.synchronize()
            blocks.append({"pair": pair, "arm": arm, "steps": OVERHEAD_BLOCK, "seconds": time.perf_counter() - t0})
            if arm == "on":
                on.detach()
    on.close()
    dist.destroy_process_group()
    return {"blocks": blocks, "warmup": OVERHEAD_WARMUP, "compiled": COMPILE, "block": OVERHEAD_BLOCK,
            "dropped": on.dropped_records, "errors": on.errors}


# ---------------------------------------------------------------------------------- 6. breakdown
def breakdown(*, workdir: Path, steps: int) -> dict:
    """``Trainer.train_step`` in a bare loop, eager then compiled (bench/gpu_mfu_probe.py's ``measure``):
    step time, thread CPU, kernel time by kind and the top kernels; a mode that fails says why."""
    import torch.distributed as dist

    from bench import gpu_mfu_probe as probe

    device = world_of_one()
    modes = []
    for mode in ("eager", "compiled"):
        try:
            modes.append(probe.measure(mode, flavor="1b", steps=8, top=10, device=device))
        except Exception as exc:  # the other mode's figures still count
            modes.append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"})
    dist.destroy_process_group()
    return {"modes": modes}


# ----------------------------------------------------------------------------- 7. op cost, 8. DDP
def _in_world_of_one(measure) -> dict:
    """``measure(device=...)`` (a device-agnostic section, tested on CPU) on NCCL world size 1."""
    import torch.distributed as dist

    device = world_of_one()
    try:
        return measure(device=device)
    finally:
        dist.destroy_process_group()


def opcost(*, workdir: Path, steps: int) -> dict:
    """The training thread's CPU per traced CUDA collective (bench/gpu_check_opcost.py)."""
    from bench.gpu_check_opcost import measure

    return _in_world_of_one(measure)


def ddp(*, workdir: Path, steps: int) -> dict:
    """DDP's buckets as meshscope records them on CUDA, against DDP's own (bench/gpu_check_ddp.py)."""
    from bench.gpu_check_ddp import measure

    return _in_world_of_one(measure)


SECTIONS = {"train": train, "collectives": collectives, "memory": memory, "nvml": nvml, "overhead": overhead,
            "breakdown": breakdown, "opcost": opcost, "ddp": ddp}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("section", choices=list(SECTIONS))
    ap.add_argument("--workdir", required=True, help="scratch directory of this section (store, trace)")
    ap.add_argument("--result", required=True, help="where the measurements go (JSON)")
    ap.add_argument("--steps", type=int, default=50, help="trainer steps (section train)")
    ns = ap.parse_args(argv)
    workdir = Path(ns.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = SECTIONS[ns.section](workdir=workdir, steps=ns.steps)
    tmp = Path(ns.result + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(ns.result)  # whole or absent: a section killed while writing leaves no half result
    return 0


if __name__ == "__main__":
    sys.exit(main())
