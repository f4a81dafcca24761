"""What CUDA op timing would cost the training thread in C++, measured on one GPU: the next step of issue
#15's CUDA path, answered in a minute by the next session that has a device.

The GPU check's section 7 (``make gpu-check``) read 8.5 µs (blocking all-reduce) to 24 µs (functional
all-reduce) of training-thread CPU per traced CUDA op on an H100, against the goal's 2 µs; the pieces it
timed were Python's: ``torch.Event(...)`` + ``record()`` 2.5 µs each, ``torch.cuda.current_stream()`` 3.9 µs
(bench/results/gpu-check-2026-11-27-h100-84d4362-partial.md). This probe builds ``gpu_event_probe.cpp``
(c10's device-generic ``Event`` and stream API: no CUDA headers, the same build as the CPU kernels of
agent/instrument/_funcol_kernels.cpp) and reports, as one JSON object:

1. ``cxx``: µs per call in C++ of the current stream, a new timing event recorded, a pooled one re-recorded,
   ``query`` + ``elapsedTime``, and an event's destruction (medians of ``BLOCKS`` runs of ``CALLS``);
2. ``python``: the same pieces through torch's Python API, in the same process;
3. ``per_op``: a blocking 1 KiB NCCL all-reduce (world size 1), the training thread's CPU per op above the
   untraced op (``tests.support.hookcost``'s ABBA blocks) with two C++ marks around it (a Python call
   each: a C site would not pay that) and with two ``torch.Event``\\ s, as the tracer records today;
4. ``agreement``: per op queued behind a matmul, the C++ pair's elapsed time inside the Python pair's.

``python bench/gpu_event_probe.py --out probe.json``; without a GPU one line, and with ``--build-only`` the
C++ source is compiled (what this machine can check of it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CALLS, BLOCKS = 2000, 9
SOURCE = Path(__file__).with_name("gpu_event_probe.cpp")


def build(directory: str) -> Any:
    from torch.utils.cpp_extension import load

    return load(name="meshscope_gpu_event_probe", sources=[str(SOURCE)], build_directory=directory,
                extra_cflags=["-O2"])


def _median_of(fn: Any) -> dict[str, float]:
    runs = [fn() for _ in range(BLOCKS)]
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0] if k != "sink"}


def python_costs() -> dict[str, float]:
    import torch

    def one() -> dict[str, float]:
        out = {}
        for name, call in (("current_stream_us", torch.cuda.current_stream),
                           ("new_event_record_us", lambda: torch.Event("cuda", enable_timing=True).record())):
            c0 = time.thread_time_ns()
            for _ in range(CALLS):
                call()
            out[name] = (time.thread_time_ns() - c0) / CALLS / 1e3
        torch.cuda.synchronize()
        return out

    return _median_of(one)


def per_op(ext: Any, device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tests.support.hookcost import _ab

    t = torch.ones(256, device=device)
    arm = {"form": None}

    def run() -> None:
        form = arm["form"]
        if form == "cxx":
            ext.mark()
            dist.all_reduce(t)
            ext.mark()
        elif form == "python":
            e0 = torch.Event("cuda", enable_timing=True)
            e0.record()
            dist.all_reduce(t)
            e1 = torch.Event("cuda", enable_timing=True)
            e1.record()
        else:
            dist.all_reduce(t)

    out = {}
    for form in ("cxx", "python"):
        def on(form: str = form) -> None:
            arm["form"] = form

        def off() -> None:
            arm["form"] = None
            torch.cuda.synchronize()
            ext.resolve()

        out[form] = _ab(run, on, off, calls=400, blocks=BLOCKS)
    return out


def agreement(ext: Any, device: Any, *, ops: int = 20) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t = torch.ones(4 << 20, device=device)  # 16 MiB
    outer = []
    for _ in range(ops):
        a @ a  # the GPU busy when the op is issued, as in training
        e0 = torch.Event("cuda", enable_timing=True)
        e0.record()
        ext.mark()
        dist.all_reduce(t)
        ext.mark()
        e1 = torch.Event("cuda", enable_timing=True)
        e1.record()
        outer.append((e0, e1))
    torch.cuda.synchronize()
    inner = ext.resolve()
    rows = [(round(i * 1e3, 1), round(e0.elapsed_time(e1) * 1e3, 1)) for i, (e0, e1) in zip(inner, outer)]
    return {"ops": len(rows), "cxx_us_python_us": rows,
            "cxx_within_python": sum(1 for i, o in rows if i <= o + 1.0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-event-probe.json")
    ap.add_argument("--build-only", action="store_true", help="compile the C++ source and stop")
    ns = ap.parse_args(argv)
    import torch

    if ns.build_only:
        with tempfile.TemporaryDirectory(prefix="meshscope-event-probe-") as d:
            build(d)
        print("gpu-event-probe: built")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu-event-probe: no CUDA GPU on this machine (torch {torch.__version__}); nothing to probe")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch.distributed as dist

    from bench.gpu_nccl_probe import _init

    device = _init()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "calls": CALLS, "blocks": BLOCKS}
    with tempfile.TemporaryDirectory(prefix="meshscope-event-probe-") as d:
        ext = build(d)
        for name, fn in (("cxx", lambda: _median_of(lambda: ext.cost(CALLS))), ("python", python_costs),
                         ("per_op", lambda: per_op(ext, device)), ("agreement", lambda: agreement(ext, device))):
            t0 = time.monotonic()
            try:
                report[name] = fn()
            except Exception as exc:  # one part failing still reports the others
                report[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"gpu-event-probe: {name} done in {time.monotonic() - t0:.1f} s", flush=True)
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"gpu-event-probe: written to {ns.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
