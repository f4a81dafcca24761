"""Model FLOPs and the peak they are compared against (MFU).

MFU = achieved model FLOPs per second / peak FLOP/s of the device. Model FLOPs per token for training a
decoder-only transformer: 6·N_nonembedding + 12·L·D·S (see ``trainer.model.flops_per_token``: the
attention term counts scores and values, forward and backward, causal mask NOT discounted). Per rank:
that rank's share of the step's model FLOPs / its wall time / its device peak.

The peak comes from, in order: an explicit override; a per-device table of dense bf16 peaks (GPU); on
CPU a short fp32 matmul benchmark at start, because no table can know a CPU's effective peak and a
measured one is the only honest denominator there (the best this host has shown: ``cpu_peak``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

# Dense bf16 tensor-core peaks (FLOP/s), from the vendors' data sheets (SXM parts where both exist).
PEAK_BF16: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
}


def table_peak(device_name: str) -> tuple[float, str] | None:
    """Longest table key contained in the device name (so 'GH200' wins over 'H200')."""
    name = device_name.upper()
    for key in sorted(PEAK_BF16, key=len, reverse=True):
        if key in name:
            return PEAK_BF16[key], f"table:{key}"
    return None


def calibrate_cpu_peak(*, size: int = 512, min_seconds: float = 0.2, dtype: torch.dtype = torch.float32) -> float:
    """Best observed FLOP/s of a square matmul on this process's CPU threads (2·n³ FLOPs per matmul). Its
    operands come from a generator of its own: the job's random stream is not advanced."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, dtype=dtype, generator=g)
    b = torch.randn(size, size, dtype=dtype, generator=g)
    torch.mm(a, b)  # warm-up: thread pool, caches
    best = 0.0
    deadline = time.perf_counter() + min_seconds
    while True:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 2.0 * size**3 / dt)
        if time.perf_counter() > deadline:
            return best


CPU_PEAK_FILE = "cpu-peak.json"  # in meshscope's cache directory (agent.env.cache_root)
LOCK_WAIT_S = 5.0  # the most a start waits for the other ranks' calibrations (then calibrates without the lock)


def _cpu_key() -> str:
    from meshscope.agent.instrument.runenv import cpu_model

    return f"{cpu_model()} | {torch.get_num_threads()} threads | fp32 512 | torch {torch.__version__}"


@contextlib.contextmanager
def _locked(lock: Path, *, wait_s: float):
    """An exclusive ``flock`` on ``lock`` for the block, waited for up to ``wait_s``; without it (no lock
    before the deadline, a file system that cannot lock) the block still runs."""
    fd = None
    try:
        import fcntl

        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
    except (OSError, ImportError):
        pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _stored(cache: Path) -> dict:
    try:
        stored = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def cpu_peak(*, cache: Path | None) -> float:
    """The best FLOP/s this host's CPU has shown for this process's thread count and torch: this start's
    calibration or a higher one from an earlier start, kept in ``cache`` (a JSON file; None: this start's
    alone).

    A start calibrates while the job's other ranks start too: on 2 cores, two ranks read 59-102 GF/s where
    the host gives 100-103 to one process alone (2026-12-07), so one start's figure made MFU swing by up to
    70 % between identical runs. The best seen is the host's peak, the same for every rank and run. The ranks
    of a host calibrate one at a time (a lock beside the file, waited for up to ``LOCK_WAIT_S``): alone on
    their core, and none overwrites a better figure another just wrote. Failing to read, lock or write is
    this start's calibration alone, never an error."""
    if cache is None:
        return calibrate_cpu_peak()
    key = _cpu_key()
    with _locked(cache.with_name(cache.name + ".lock"), wait_s=LOCK_WAIT_S):
        measured = calibrate_cpu_peak()
        stored = _stored(cache)
        try:
            known = float(stored.get(key) or 0.0)
        except (TypeError, ValueError):
            known = 0.0
        if not (math.isfinite(known) and known > 0):
            known = 0.0
        if measured > known:
            tmp = None
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=f".{cache.name}.")
                with os.fdopen(fd, "w") as f:
                    json.dump({**stored, key: measured}, f, indent=1, sort_keys=True)
                os.replace(tmp, cache)  # whole or not at all
                tmp = None
            except OSError:
                pass
            finally:
                if tmp is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
    return max(measured, known)


def device_peak(device: torch.device, *, override: float = 0.0, calibrate_gpu: bool = True) -> tuple[float, str]:
    """(peak FLOP/s, where it came from). ``calibrate_gpu=False``: a GPU missing from the table has no
    peak (0.0, "unknown:<name>"), for callers that must not allocate or synchronise on the device (a job
    observed with zero code)."""
    if override > 0:
        return override, "override"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = table_peak(name)
        if found:
            return found
        # Unknown GPU: say so rather than guess; MFU is then reported against the calibrated figure.
        if not calibrate_gpu:
            return 0.0, f"unknown:{name}"
        return _calibrate_cuda(device), f"calibrated:{name}"
    from meshscope.agent.env import cache_root

    return cpu_peak(cache=cache_root() / CPU_PEAK_FILE), "calibrated-cpu"


def _calibrate_cuda(device: torch.device, *, size: int = 8192) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=g)
    torch.mm(a, b)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    return 10 * 2.0 * size**3 / (start.elapsed_time(end) / 1e3)


def sdpa_flop_mapping() -> dict:
    """``FlopCounterMode``'s ``custom_mapping`` for the SDPA kernels it counts as 0 in this torch (the CPU
    ones among them): torch's own SDPA formulas. ``FlopCounterMode`` hands a mapping the arguments' shapes,
    not the tensors."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def fwd(q_shape, k_shape, v_shape, *args, out_shape=None, **kw):
        return sdpa_flop_count(q_shape, k_shape, v_shape)

    def bwd(grad_out_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kw):
        return sdpa_backward_flop_count(grad_out_shape, q_shape, k_shape, v_shape)

    mapping = {}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = fwd
    for name in ("_scaled_dot_product_flash_attention_for_cpu_backward",
                 "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention_backward",
                 "_scaled_dot_product_cudnn_attention_backward"):
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = bwd
    return mapping
