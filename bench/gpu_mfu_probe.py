"""Where a GPU step of the trainer goes: step time and MFU of a flavor eager and with its blocks compiled,
and the CUDA kernels that take the most time in each (torch.profiler), so that an MFU short of its goal
says which work to attack. One process, NCCL world size 1, no telemetry; needs a CUDA GPU.

    python3 bench/gpu_mfu_probe.py [--flavor 1b] [--steps 8] [--top 15] [--modes eager,compiled]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP = 3  # the compiled mode compiles in its first step
# Kernel names -> the work they do, for a per-kind total (first match wins).
KINDS = (("matmul", r"gemm|sm90_|cutlass|nvjet|cublas"), ("attention", r"flash|fmha|attention|sdpa"),
         ("optimizer", r"adam|multi_tensor|foreach"), ("triton (fused)", r"^triton_"),
         ("copy/cast", r"copy|Memcpy|Memset|cast|to_copy"), ("reduction/norm", r"reduce|norm|softmax|nll"))


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other elementwise"


def measure(mode: str, *, flavor: str, steps: int, top: int, device) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from meshscope.agent.instrument.flops import device_peak
    from meshscope.agent.instrument.nulltelemetry import NullTelemetry
    from meshscope.trainer import config
    from meshscope.trainer.parallel import build_mesh
    from meshscope.trainer.train import Trainer

    cfg = config.load(None, {"model.flavor": flavor, "model.compile": mode == "compiled", "device": "cuda",
                             "steps": WARMUP + steps + 2}).resolve(1)
    layout = build_mesh(cfg.parallel, device_type=device.type)
    peak, _ = device_peak(device)
    t = time.perf_counter()
    trainer = Trainer(cfg, device=device, layout=layout, peak_flops=peak)
    build_s = time.perf_counter() - t
    tel, step, first = NullTelemetry(), 0, []
    for _ in range(WARMUP):
        torch.cuda.synchronize()
        t = time.perf_counter()
        trainer.train_step(step, tel)
        torch.cuda.synchronize()
        first.append(time.perf_counter() - t)
        step += 1
    t, c = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        r = trainer.train_step(step, tel)
        step += 1
    torch.cuda.synchronize()
    step_s, cpu_s = (time.perf_counter() - t) / steps, (time.thread_time() - c) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            trainer.train_step(step, tel)
            step += 1
        torch.cuda.synchronize()
    # The same trainer through its own loop (``Trainer.run``: what the trainer's command runs after its
    # set-up), all of the config's steps: the bare loop above against it places a gap to the command (the
    # GPU check's section 6) either in the loop or in the command's set-up. Its step lines are not printed.
    torch.cuda.synchronize()
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.run(tel)
    torch.cuda.synchronize()
    run_step_ms = 1e3 * (time.perf_counter() - t) / cfg.steps
    kernels = sorted(((e.key, e.device_time_total / 2e3, e.count // 2) for e in prof.key_averages()
                      if e.device_time_total > 0), key=lambda k: -k[1])
    by_kind: dict[str, float] = {}
    for name, ms, _ in kernels:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + ms
    out = {"mode": mode, "build_s": build_s, "warmup_steps_s": first, "step_ms": 1e3 * step_s,
           "thread_cpu_ms": 1e3 * cpu_s, "run_loop_step_ms": run_step_ms,
           "tokens_per_s": trainer.tokens_per_step / step_s, "mfu": r["flops"] / step_s / peak,
           "gpu_busy_ms": sum(ms for _, ms, _ in kernels), "by_kind_ms": by_kind,
           "top": [{"kernel": n[:110], "ms_per_step": round(ms, 3), "calls_per_step": c} for n, ms, c in kernels[:top]]}
    if mode == "compiled":
        from torch._dynamo.utils import counters

        out["dynamo"] = {"unique_graphs": counters["stats"]["unique_graphs"], "frames": dict(counters["frames"])}
    del trainer, prof
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="1b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--json", default=None, help="also write the results here")
    ns = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_mfu_probe: no CUDA GPU on this machine; nothing to measure")
        return 0
    from bench.gpu_check_sections import world_of_one

    device = world_of_one()
    results = []
    for mode in ns.modes.split(","):
        try:
            res = measure(mode, flavor=ns.flavor, steps=ns.steps, top=ns.top, device=device)
        except Exception as exc:  # one mode's failure must not cost the other's figures
            res = {"mode": mode, "error": f"{type(exc).__name__}: {exc}"}
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "top"}, default=str), flush=True)
        for k in res.get("top", []):
            print(f"  {k['ms_per_step']:9.3f} ms  x{k['calls_per_step']:<5d} {k['kernel']}", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
