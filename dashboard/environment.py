"""When the environment makes a figure mean something else: DataFrame in, warnings out, no I/O.

- **CPU contention** (CPU runs): a rank's *run-queue share* (``run_queue_share``, what the pages warn
  on) is the time its training thread was runnable but waited for a CPU (the kernel's run-queue delay,
  ``cpu_wait_s``) over the time it was runnable at all, on a CPU or waiting for one (``cpu_s +
  cpu_wait_s``), median over the steps: a true share, 0-1. On the dev VM a rank with a core to itself
  reads 0.01-0.08; with a busy loop on one of its 2 cores 0.2-0.45. A rank that waits for a core has that
  wait in its compute time: compute, its peers' exposed communication (they wait for it), bubble vs
  theory and MFU then describe the machine's load, not the job. Above ``CPU_WAIT_MAX`` the pages say so.
  On GPUs the training thread mostly launches and synchronises, so the rule is for CPU devices only.
  (``cpu_wait_share``, the planner's input, divides the same delay by ``compute_s + other_s`` instead:
  the thread also waits for a core when a collective or a pipeline neighbour wakes it, in exposed
  communication and bubble time, so on ranks that mostly wait for peers it exceeds 1: 1.63 read as
  "163 % of the time" in the warning that used it.)
- **Too short**: fewer than ``MIN_STEADY_STEPS`` steps after warm-up is too little for a verdict.
- **GPU clocks**: a GPU whose SM clock ran below ``CLOCK_MIN`` of its maximum (mean over samples) while
  NVML reported a slowdown reason (power cap, thermal, ...) in at least ``THROTTLED_SHARE`` of its samples,
  where the reasons were sampled: a busy GPU below its boost clock for no reason NVML gives is not throttled
  (the synthetic H100s run at 89 % with a rare power cap, and an unconditional 90 % rule named every rank).
- Sentences name at most ``MAX_NAMED`` ranks (the lowest first), then how many more: at 16,384 ranks a
  list of every rank is not a sentence.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

CPU_WAIT_MAX = 0.10
MIN_STEADY_STEPS = 5
CLOCK_MIN = 0.90
THROTTLED_SHARE = 0.5
MAX_NAMED = 8


def cpu_wait_share(steps: pd.DataFrame) -> pd.DataFrame:
    """Per rank, the median CPU wait share over ``steps`` (``rank``, ``cpu_wait_s``, ``compute_s``,
    ``other_s``): ``rank``, ``cpu_wait_share``. Ranks without ``cpu_wait_s`` (stores written before it
    existed, kernels that do not report it) are absent. Not a share of any time: it exceeds 1 on ranks
    that mostly wait for peers (see the module's doc); the warnings use ``run_queue_share``."""
    if "cpu_wait_s" not in steps or steps.empty:
        return pd.DataFrame({"rank": pd.Series(dtype="int64"), "cpu_wait_share": pd.Series(dtype=float)})
    busy = steps["compute_s"] + steps["other_s"]
    t = steps.assign(cpu_wait_share=steps["cpu_wait_s"] / busy.where(busy > 0)).dropna(subset=["cpu_wait_share"])
    return t.groupby("rank", as_index=False)["cpu_wait_share"].median()


def run_queue_share(steps: pd.DataFrame) -> pd.DataFrame:
    """Per rank, the median share of its training thread's runnable time spent waiting for a CPU over
    ``steps`` (``rank``, ``cpu_s``, ``cpu_wait_s``): ``rank``, ``cpu_wait_share``, in 0-1 (the kernel
    counts a thread's time on a CPU and in the run queue apart, and both within the step). Ranks without
    both columns (stores written before them, kernels that do not report the delay) are absent."""
    if not {"cpu_s", "cpu_wait_s"} <= set(steps) or steps.empty:
        return pd.DataFrame({"rank": pd.Series(dtype="int64"), "cpu_wait_share": pd.Series(dtype=float)})
    runnable = steps["cpu_s"] + steps["cpu_wait_s"]
    t = steps.assign(cpu_wait_share=steps["cpu_wait_s"] / runnable.where(runnable > 0))
    return t.dropna(subset=["cpu_wait_share"]).groupby("rank", as_index=False)["cpu_wait_share"].median()


def contended(shares: pd.DataFrame, *, limit: float = CPU_WAIT_MAX) -> pd.DataFrame:
    """The ranks of ``cpu_wait_share`` above ``limit``."""
    return shares[shares["cpu_wait_share"] > limit].sort_values("rank").reset_index(drop=True)


def warnings(*, device: str | None, shares: pd.DataFrame, n_steady: int, hosts: pd.DataFrame | None = None,
             clocks: pd.DataFrame | None = None) -> list[str]:
    """The sentences the pages and ``report`` show above the figures.

    ``shares``: ``run_queue_share``'s output (shares of the time the ranks were runnable, 0-1). ``hosts``
    (optional): ``rank``, ``host``. ``clocks`` (optional, ``analysis.gpu_ranks``): ``rank``, ``clock_ratio``
    (its GPU's SM clock / max)."""
    out = []
    if (device or "").startswith("cpu") and len(shares):
        low = contended(shares)
        if len(low):
            where = ""
            if hosts is not None and len(hosts):
                per_host = hosts.groupby("host")["rank"].nunique()
                where = "; ranks per host: " + ", ".join(f"{h} {n}" for h, n in per_host.items())
            out.append(
                f"CPU contention: {_ranks(low['rank'])} waited for a CPU {_span(low['cpu_wait_share'])} of the time "
                f"they were ready to run (their training thread's run-queue delay over that delay plus its CPU time; "
                f"above {CPU_WAIT_MAX:.0%}{where}). Their compute includes waiting for the CPU, their peers' "
                f"exposed communication includes waiting for them, and bubble and MFU describe the machine's "
                f"load, not the job. Give each rank a core (fewer ranks, or a quieter machine).")
    if n_steady < MIN_STEADY_STEPS:
        out.append(f"Only {n_steady} step{'s' if n_steady != 1 else ''} after warm-up: too few for a verdict "
                   f"(at least {MIN_STEADY_STEPS}).")
    if clocks is not None and "clock_ratio" in clocks and len(clocks):
        slow = clocks[clocks["clock_ratio"] < CLOCK_MIN]
        if "throttle_share" in slow:  # NULL share: reasons not sampled, the clock alone decides
            slow = slow[slow["throttle_share"].isna() | (slow["throttle_share"] >= THROTTLED_SHARE)]
        if len(slow):
            shown = slow.sort_values(["clock_ratio", "rank"]).head(MAX_NAMED).sort_values("rank")
            names = ", ".join(f"rank {int(r.rank)} {r.clock_ratio:.0%}" for r in shown.itertuples())
            if len(slow) > len(shown):
                names += f" and {len(slow) - len(shown)} more ranks (the lowest named)"
            out.append(f"Throttled GPU clocks: SM clock of the maximum, {names} (below {CLOCK_MIN:.0%}, with a "
                       f"slowdown reason from NVML); compute and MFU read low there.")
    return out


def _ranks(ranks: pd.Series) -> str:
    r = sorted(int(x) for x in ranks)
    more = f" and {len(r) - MAX_NAMED} more" if len(r) > MAX_NAMED else ""
    return f"rank {r[0]}" if len(r) == 1 else "ranks " + ", ".join(map(str, r[:MAX_NAMED])) + more


def _span(values: pd.Series) -> str:
    lo, hi = float(np.min(values)), float(np.max(values))
    return f"{lo:.0%}" if round(lo, 2) == round(hi, 2) else f"{lo:.0%}-{hi:.0%}"
