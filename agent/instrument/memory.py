"""Per-step memory sample: process RSS and peak everywhere, the caching allocator's stats on CUDA.

Costs (measured in the brief): ru_maxrss ~1 µs, reading /proc/self/statm a few µs, torch.cuda.memory_stats
tens of µs: cheap enough for every step.
"""

from __future__ import annotations

import os
import resource

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: fall back to the peak (an upper bound)
        return rss_peak_bytes()


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def sample(step: int, t: float, device: torch.device) -> tuple:
    """A row of the ``memory`` kind (field order of agent.schema). -1 marks what this device lacks."""
    rss, peak = rss_bytes(), rss_peak_bytes()
    if device.type != "cuda":
        return (step, t, rss, peak, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1)
    s = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    return (
        step, t, rss, peak,
        s.get("allocated_bytes.all.current", 0), s.get("allocated_bytes.all.peak", 0),
        s.get("reserved_bytes.all.current", 0), s.get("reserved_bytes.all.peak", 0),
        s.get("active_bytes.all.current", 0), s.get("active_bytes.all.peak", 0),
        s.get("num_alloc_retries", 0), s.get("num_ooms", 0),
        free, total,
    )
