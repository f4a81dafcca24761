"""What NCCL's own bookkeeping offers a collective tracer, measured on one GPU (NCCL world size 1).

Issue #15 asks the CUDA path to prefer what torch already records in C++ (NCCL's per-op timing, the
ProcessGroupNCCL on-completion hook, the flight recorder) over Python CUDA events: the GPU check's section 7
measured 9-43 µs of training-thread CPU per traced op on an H100, two or three ``torch.Event`` records
(2.5-2.8 µs each) being the largest known part. Before that path is rewritten, this probe answers on the
real thing:

1. ``apis``: which of ``ProcessGroup._enable_collectives_timing`` / ``_register_on_completion_hook`` /
   ``_get_sequence_number_for_group`` and the flight recorder's ``_dump_nccl_trace`` this torch has.
2. ``cost``: training-thread CPU per op (``time.thread_time_ns``, blocks of ``CALLS`` ops, the variants
   interleaved block by block, the median over blocks) of an untraced all-reduce on a process group
   without NCCL timing, with it, with it and an on-completion hook, and of the pieces a tracer built on
   them would add (keeping the Work, reading the sequence number, two CUDA events as today).
3. ``accuracy``: per op, ``Work._get_duration()``, the hook's ``active_duration`` and two CUDA events
   around the call, against torch.profiler's NCCL kernel time; the hook's ``seq`` against
   ``_get_sequence_number_for_group()`` read after the call; how late the hook fires.
4. ``exit``: a job that registers a hook and exits without ``destroy_process_group``: its exit code.
5. ``flight_recorder``: with ``TORCH_FR_BUFFER_SIZE`` set, what an entry holds and what a dump costs; and
   the default buffer size.

``python bench/gpu_nccl_probe.py --out probe.json`` (one JSON object; a one-line message without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

CALLS, BLOCKS = 400, 9
SMALL = 256  # fp32 values: 1 KiB, the op's GPU work negligible next to its issue


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init() -> Any:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    return torch.device("cuda", 0)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def apis() -> dict[str, Any]:
    import torch
    import torch._C._distributed_c10d as c

    from torch._C._distributed_c10d import ProcessGroup

    names = ("_enable_collectives_timing", "_register_on_completion_hook", "_get_sequence_number_for_group")
    return {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            **{f"ProcessGroup.{n}": hasattr(ProcessGroup, n) for n in names},
            "_dump_nccl_trace": hasattr(c, "_dump_nccl_trace"),
            "env": {k: os.environ.get(k) for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                                                   "TORCH_NCCL_ENABLE_TIMING")}}


def cost(device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    plain = dist.new_group([0])
    timed = dist.new_group([0])
    hooked = dist.new_group([0])
    out: dict[str, Any] = {}
    for pg in (timed, hooked):
        pg._enable_collectives_timing()
    infos: list = []
    try:
        hooked._register_on_completion_hook(infos.append)
        out["hook_registered"] = True
    except Exception as exc:
        out["hook_registered"] = _err(exc)
    t = torch.ones(SMALL, device=device)
    keep: list = []
    seq = timed._get_sequence_number_for_group

    def keep_work() -> None:
        w = dist.all_reduce(t, group=timed, async_op=True)
        w.wait()
        keep.append(w)

    def keep_work_seq() -> None:
        w = dist.all_reduce(t, group=timed, async_op=True)
        w.wait()
        keep.append((w, seq()))

    def two_events() -> None:
        a = torch.Event("cuda", enable_timing=True)
        a.record()
        dist.all_reduce(t, group=plain)
        b = torch.Event("cuda", enable_timing=True)
        b.record()
        keep.append((a, b))

    variants: dict[str, Callable[[], Any]] = {
        "blocking_plain": lambda: dist.all_reduce(t, group=plain),
        "blocking_timed": lambda: dist.all_reduce(t, group=timed),
        "blocking_hooked": lambda: dist.all_reduce(t, group=hooked),
        "async_wait_keep_work_timed": keep_work,
        "async_wait_keep_work_seq_timed": keep_work_seq,
        "blocking_plain_two_events": two_events,
        "async_wait_plain": lambda: dist.all_reduce(t, group=plain, async_op=True).wait(),
        "async_wait_timed": lambda: dist.all_reduce(t, group=timed, async_op=True).wait(),
        "funcol_plain": lambda: funcol.all_reduce(t, "sum", plain).wait(),
        "funcol_timed": lambda: funcol.all_reduce(t, "sum", timed).wait(),
        "funcol_hooked": lambda: funcol.all_reduce(t, "sum", hooked).wait(),
        "seq_read_only": seq,
    }
    per: dict[str, list[float]] = {k: [] for k in variants}
    wall: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    names = list(variants)
    for b in range(BLOCKS):
        order = names[b % len(names):] + names[:b % len(names)]
        for name in order:
            fn = variants[name]
            torch.cuda.synchronize()
            keep.clear()
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            for _ in range(CALLS):
                fn()
            c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
            per[name].append((c1 - c0) / CALLS / 1e3)
            wall[name].append((w1 - w0) / CALLS / 1e3)
    torch.cuda.synchronize()
    out["cpu_us"] = {k: round(statistics.median(v), 2) for k, v in per.items()}
    out["cpu_iqr_us"] = {k: [round(q, 2) for q in statistics.quantiles(v, n=4)[::2]] for k, v in per.items()}
    out["wall_us"] = {k: round(statistics.median(v), 2) for k, v in wall.items()}
    out["hook_calls"] = len(infos)
    # what resolving costs (the flusher's side)
    works = []
    for _ in range(200):
        works.append(dist.all_reduce(t, group=timed, async_op=True))
    torch.cuda.synchronize()
    for name, fn in (("work_is_completed", lambda w: w.is_completed()),
                     ("work_get_duration", lambda w: w._get_duration())):
        c0 = time.thread_time_ns()
        for w in works:
            fn(w)
        out[f"{name}_us"] = round((time.thread_time_ns() - c0) / len(works) / 1e3, 2)
    try:
        plain_work = dist.all_reduce(t, group=plain, async_op=True)
        torch.cuda.synchronize()
        out["get_duration_without_timing"] = plain_work._get_duration()
    except Exception as exc:
        out["get_duration_without_timing"] = _err(exc)
    # does a Work made before timing was enabled report a duration after?
    late = dist.new_group([0])
    w_before = dist.all_reduce(t, group=late, async_op=True)
    late._enable_collectives_timing()
    w_after = dist.all_reduce(t, group=late, async_op=True)
    torch.cuda.synchronize()
    for name, w in (("work_before_enable", w_before), ("work_after_enable", w_after)):
        try:
            out[name] = w._get_duration()
        except Exception as exc:
            out[name] = _err(exc)
    # a second hook on the same group
    try:
        hooked._register_on_completion_hook(lambda info: None)
        out["second_hook"] = "accepted"
    except Exception as exc:
        out["second_hook"] = _err(exc)
    return out


def accuracy(device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    pg = dist.new_group([0])
    pg._enable_collectives_timing()
    infos: list = []
    arrived: list = []

    def hook(info: Any) -> None:
        arrived.append(time.perf_counter())
        infos.append(info)

    pg._register_on_completion_hook(hook)
    sizes = (1024, 1 << 20, 16 << 20, 64 << 20)
    tensors = {n: torch.ones(n // 4, device=device) for n in sizes}
    for n in sizes:  # warm
        dist.all_reduce(tensors[n], group=pg)
    torch.cuda.synchronize()
    time.sleep(0.5)
    infos.clear()
    arrived.clear()
    rows = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for rep in range(10):
            for n in sizes:
                a = torch.Event("cuda", enable_timing=True)
                a.record()
                w = dist.all_reduce(tensors[n], group=pg, async_op=True)
                seq_after = pg._get_sequence_number_for_group()
                w.wait()
                b = torch.Event("cuda", enable_timing=True)
                b.record()
                rows.append({"bytes": n, "work": w, "a": a, "b": b, "seq_after": seq_after,
                             "issued": time.perf_counter()})
        torch.cuda.synchronize()
    deadline = time.monotonic() + 5
    while len(infos) < len(rows) and time.monotonic() < deadline:
        time.sleep(0.01)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "nccl" in e.name.lower()]
    out_rows = []
    for i, r in enumerate(rows):
        row = {"bytes": r["bytes"], "seq_after": r["seq_after"], "events_ms": r["a"].elapsed_time(r["b"])}
        try:
            row["work_ms"] = r["work"]._get_duration()
        except Exception as exc:
            row["work_ms"] = _err(exc)
        if i < len(kernels):
            k = kernels[i]
            row["profiler_ms"] = getattr(k, "device_time_total", None) or getattr(k, "cuda_time_total", 0.0)
            row["profiler_ms"] /= 1e3
            row["kernel"] = k.name[:60]
        if i < len(infos):
            info = infos[i]
            dur = info.active_duration
            row["hook_ms"] = dur.total_seconds() * 1e3 if hasattr(dur, "total_seconds") else dur
            row["hook_seq"] = info.seq
            row["hook_op_type"] = str(info.op_type)
            row["hook_late_ms"] = (arrived[i] - r["issued"]) * 1e3
        out_rows.append(row)
    sample = infos[0] if infos else None
    return {"rows": out_rows, "kernels": len(kernels), "hook_calls": len(infos),
            "types": {f: type(getattr(sample, f)).__name__ for f in
                      ("op_type", "seq", "time_started", "time_finished", "active_duration")} if sample else {},
            "sample": {f: str(getattr(sample, f)) for f in
                       ("op_type", "seq", "time_started", "time_finished", "active_duration")} if sample else {}}


CHILD_EXIT = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from bench.gpu_nccl_probe import _init
dev = _init()
pg = dist.new_group([0])
pg._enable_collectives_timing()
seen = []
pg._register_on_completion_hook(lambda info: seen.append(info.seq))
t = torch.ones(256, device=dev)
for _ in range(10):
    dist.all_reduce(t, group=pg)
torch.cuda.synchronize()
print("ops done", flush=True)
if {destroy}:
    dist.destroy_process_group()
"""

CHILD_FR = """
import os, sys, pickle, time, json, torch, torch.distributed as dist
import torch._C._distributed_c10d as c
sys.path.insert(0, {root!r})
from bench.gpu_nccl_probe import _init
dev = _init()
pg = dist.new_group([0])
pg._enable_collectives_timing()
t = torch.ones(256, device=dev)
for _ in range({ops}):
    dist.all_reduce(t, group=pg)
    dist.all_reduce(t, group=pg, async_op=True).wait()
torch.cuda.synchronize()
time.sleep(0.3)
out = {{}}
try:
    t0 = time.perf_counter()
    raw = c._dump_nccl_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    t1 = time.perf_counter()
    d = pickle.loads(raw)
    t2 = time.perf_counter()
    entries = d.get("entries", [])
    out = {{"dump_ms": (t1 - t0) * 1e3, "unpickle_ms": (t2 - t1) * 1e3, "bytes": len(raw), "entries": len(entries),
           "top_keys": sorted(d), "entry_keys": sorted(entries[-1]) if entries else [],
           "last_entry": {{k: str(v)[:120] for k, v in entries[-1].items()}} if entries else {{}}}}
    t3 = time.perf_counter()
    for _ in range(5):
        c._dump_nccl_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    out["dump_ms_median5"] = (time.perf_counter() - t3) / 5 * 1e3
except Exception as exc:
    out = {{"error": f"{{type(exc).__name__}}: {{exc}}"[:300]}}
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


CHILD_GIL = """
import os, sys, threading, time, json, torch, torch.distributed as dist
import torch._C._distributed_c10d as c
sys.path.insert(0, {root!r})
from bench.gpu_nccl_probe import _init
dev = _init()
pg = dist.new_group([0])
t = torch.ones(256, device=dev)
for _ in range(3000):
    dist.all_reduce(t, group=pg)
torch.cuda.synchronize()
ticks = []
stop = False
def spin():  # a Python thread's progress: it stalls while another thread holds the GIL
    while not stop:
        ticks.append(time.perf_counter())
th = threading.Thread(target=spin, daemon=True)
th.start()
time.sleep(0.2)
gaps = []
for _ in range(5):
    t0 = time.perf_counter()
    c._dump_nccl_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    t1 = time.perf_counter()
    inside = [x for x in ticks if t0 <= x <= t1]
    gaps.append({{"dump_ms": (t1 - t0) * 1e3, "spinner_ticks_inside": len(inside)}})
    time.sleep(0.05)
stop = True
th.join()
base = len([x for x in ticks if ticks[-1] - 0.03 <= x <= ticks[-1]])
print("RESULT " + json.dumps({{"dumps": gaps, "spinner_ticks_per_30ms_idle": base}}), flush=True)
dist.destroy_process_group()
"""


def _child(code: str, *, env: dict[str, str] | None = None, timeout_s: float = 60) -> dict[str, Any]:
    e = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT",)}
    e.update(env or {})
    try:
        p = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"rc": "timeout"}
    result: dict[str, Any] = {"rc": p.returncode, "stderr_tail": p.stderr[-600:]}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[7:]))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-nccl-probe.json")
    ap.add_argument("--only-gil", action="store_true", help="only whether a flight-recorder dump holds the GIL")
    ns = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-nccl-probe: no CUDA GPU on this machine (torch {torch.__version__}); nothing to probe")
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "gpu": torch.cuda.get_device_name(0)}
    if ns.only_gil:
        report["flight_recorder_gil"] = _child(CHILD_GIL.format(root=root), env={"TORCH_FR_BUFFER_SIZE": "2000"})
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"gpu-nccl-probe: written to {ns.out}")
        return 0
    device = _init()
    for name, fn in (("apis", apis), ("cost", lambda: cost(device)), ("accuracy", lambda: accuracy(device))):
        t0 = time.monotonic()
        try:
            report[name] = fn()
        except Exception as exc:
            report[name] = {"error": _err(exc)}
        report[f"{name}_s"] = round(time.monotonic() - t0, 1)
        print(f"gpu-nccl-probe: {name} done in {report[name + '_s']} s", flush=True)
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    report["exit_without_destroy"] = _child(CHILD_EXIT.format(root=root, destroy=False))
    report["exit_with_destroy"] = _child(CHILD_EXIT.format(root=root, destroy=True))
    report["flight_recorder_default"] = _child(CHILD_FR.format(root=root, ops=50))
    report["flight_recorder_2000"] = _child(CHILD_FR.format(root=root, ops=1500),
                                            env={"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"gpu-nccl-probe: written to {ns.out}")
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
