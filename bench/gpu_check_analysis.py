"""What ``bench/gpu_check.py`` concludes from each section's measurements, and the Markdown it writes: plain
dicts and lists in, verdicts and text out. No torch and no GPU here, so every rule is unit-tested on CPU
(tests/test_gpu_check.py); ``bench/gpu_check_sections.py`` makes the measurements on the GPU.

Each ``render_*`` returns a :class:`Rendered`: the verdict (PASS or FAIL), one line for the summary table
and the section's Markdown.
"""

from __future__ import annotations

import bisect
import math
import statistics
from typing import NamedTuple

import pandas as pd

from meshscope.agent.contract import mfu as model_flops_utilisation
from meshscope.dashboard.stragglers import first_steady_step

MFU_GOAL = 0.45  # the issue's goal for the 1b flavor on one H100
RATIO_BAND = (0.8, 1.25)  # meshscope's CUDA-event duration / the profiler's GPU time of the same op
# Or within this many seconds of it: the event pair around an op also spans the launch gaps between the
# events and the op's kernels, a constant measured at +2.4-2.6 µs (blocking) and +3.7-4.1 µs (async) on an
# H200 (gpu-check, NCCL 2.28.9), which no ratio band can absorb for ops of a few µs.
ABS_TOLERANCE_S = 5e-6
OVERHEAD_GOAL = 0.01  # the README's "<= 1 % goal" for always-on telemetry
LABEL_PREFIX = "gpu_check|"
MIB = 1 << 20
# Chrome-trace categories (Kineto): work that ran on the GPU, and the host calls that launched it.
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
# The memory sampler's field -> what it is compared with (bench/gpu_check_sections.py reads these directly).
MEMORY_SOURCES = {
    "allocated_bytes": "torch.cuda.memory_allocated()",
    "allocated_peak_bytes": "torch.cuda.max_memory_allocated()",
    "reserved_bytes": "torch.cuda.memory_reserved()",
    "reserved_peak_bytes": "torch.cuda.max_memory_reserved()",
    "active_bytes": 'memory_stats()["active_bytes.all.current"]',
    "active_peak_bytes": 'memory_stats()["active_bytes.all.peak"]',
    "alloc_retries": 'memory_stats()["num_alloc_retries"]',
    "ooms": 'memory_stats()["num_ooms"]',
    "device_free_bytes": "torch.cuda.mem_get_info()[0]",
    "device_total_bytes": "torch.cuda.mem_get_info()[1]",
}
# The driver's free memory moves with any process on the GPU between the sampler's read and ours.
MEMORY_TOLERANCE = {"device_free_bytes": 64 * MIB}
# NVML sample vs nvidia-smi, read a fraction of a second apart: quantity -> (meshscope field, to smi units,
# smi column, allowed |difference| as a function of the smi value).
NVML_QUANTITIES = {
    "utilization (%)": ("util_ratio", lambda v: 100.0 * v, "util_pct", lambda ref: 10.0),
    "memory used (MiB)": ("mem_used_bytes", lambda v: v / MIB, "mem_used_mib", lambda ref: 64.0),
    "power (W)": ("power_watts", lambda v: v, "power_w", lambda ref: max(15.0, 0.1 * ref)),
    "temperature (°C)": ("temperature_celsius", lambda v: v, "temp_c", lambda ref: 3.0),
}
SMI_QUERY = "uuid,utilization.gpu,memory.used,power.draw,temperature.gpu"


class Rendered(NamedTuple):
    verdict: str  # PASS or FAIL
    summary: str  # one line for the report's summary table
    markdown: str


def md_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _num(value: object) -> float:
    """A measurement as a float, NaN where it is missing (JSON null)."""
    return float("nan") if value is None else float(value)


def _fmt(value: float, spec: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


# ------------------------------------------------------------------------------- 1. trainer throughput
def train_summary(steps: list[dict], *, peak_flops: float) -> dict:
    """Median tokens/s and MFU of a run's step records (``step``, ``wall_s``, ``tokens``, ``flops``, ``mfu``)
    over the steps after warm-up (the report's rule, ``dashboard.stragglers.first_steady_step``). MFU is
    recomputed here as flops / wall_s / ``peak_flops`` (docs/formulas.md) beside the trainer's own."""
    rows = sorted((s for s in steps if _num(s.get("wall_s")) > 0), key=lambda s: s["step"])
    if not rows:
        raise ValueError("the run recorded no steps with a wall time")
    series = pd.DataFrame({"step": [s["step"] for s in rows], "step_time_s": [s["wall_s"] for s in rows]})
    first = first_steady_step(series, run_first_step=rows[0]["step"])
    steady = [s for s in rows if s["step"] >= first]
    mfu = statistics.median(model_flops_utilisation(flops=s["flops"], seconds=s["wall_s"], peak_flops=peak_flops)
                            for s in steady)
    own = [_num(s.get("mfu")) for s in steady if math.isfinite(_num(s.get("mfu")))]
    cpu = [_num(s.get("cpu_s")) for s in steady if math.isfinite(_num(s.get("cpu_s")))]
    cpu_wait = [_num(s.get("cpu_wait_s")) for s in steady if math.isfinite(_num(s.get("cpu_wait_s")))]
    return {
        "steps": len(rows), "first_steady_step": first, "steady_steps": len(steady), "warmup": len(rows) - len(steady),
        "step_s": statistics.median(s["wall_s"] for s in steady),
        "tokens_per_s": statistics.median(s["tokens"] / s["wall_s"] for s in steady),
        "mfu": mfu, "trainer_mfu": statistics.median(own) if own else float("nan"),
        # The training thread's CPU time and run-queue wait per step: near the step's wall time, the host
        # (launches, Python) bounds the step, not the GPU.
        "cpu_s": statistics.median(cpu) if cpu else float("nan"),
        "cpu_wait_s": statistics.median(cpu_wait) if cpu_wait else float("nan"),
        "verdict": "PASS" if mfu >= MFU_GOAL else "FAIL",
    }


def _memory_line(memory: dict | None) -> str:
    """The allocator under the run, from its memory records: near a full device, allocation retries (free
    the cache, synchronise, allocate again) slow every step they hit."""
    if not memory:
        return "The run recorded no memory samples."
    total = _num(memory.get("device_total_bytes"))
    peak = _num(memory.get("reserved_peak_bytes"))
    share = f" ({100 * peak / total:.0f} % of the device's {total / 2**30:.1f} GiB)" if total > 0 else ""
    return (f"Allocator: peak reserved {peak / 2**30:.1f} GiB{share}, "
            f"{int(_num(memory.get('alloc_retries')))} allocation retries over the run.")


def render_train(data: dict) -> Rendered:
    run = data["run"]
    s = train_summary(data["steps"], peak_flops=_num(run.get("peak_flops")))
    line = (f"median MFU {_fmt(100 * s['mfu'], '.1f')} % (goal ≥ {100 * MFU_GOAL:.0f} %), "
            f"{_fmt(s['tokens_per_s'], ',.0f')} tokens/s")
    tokens_per_step = int(run.get("global_batch", 0)) * int(run.get("seq_len", 0))
    md = [
        f"Run `{data['run_name']}`: {data['requested_steps']} steps of the `{run.get('model')}` flavor "
        f"({int(run.get('n_params', 0)) / 1e9:.2f} B parameters), batch {run.get('global_batch')} × sequence "
        f"{run.get('seq_len')} = {tokens_per_step:,} tokens per step, backend `{run.get('backend')}`, world size 1, "
        f"telemetry on (store in a temporary directory), on {run.get('device')}.",
        "",
        f"Precision: `{run.get('dtype')}`" + (
            ": the trainer's own CUDA path (trainer/train.py) runs forward and loss under "
            "`torch.autocast(device_type=\"cuda\", dtype=torch.bfloat16)` over fp32 parameters and fp32 AdamW "
            "state; the trainer has no other bf16 option." if run.get("dtype") == "bf16-autocast" else
            " (not bf16: the run did not train on CUDA).") + (
            " Each transformer block is compiled with `torch.compile` (the trainer's `--compile`); the first "
            "steps, which compile, are warm-up." if data.get("compiled") else " Eager mode (no `torch.compile`)."),
        "",
        md_table(["steps recorded", "warm-up left out", "median step", "median tokens/s", "median MFU (recomputed)",
                  "median MFU (trainer's records)", "peak"],
                 [[s["steps"], s["warmup"],
                   f"{_fmt(1e3 * s['step_s'], '.1f')} ms", _fmt(s["tokens_per_s"], ",.0f"),
                   f"{_fmt(100 * s['mfu'], '.1f')} %", f"{_fmt(100 * s['trainer_mfu'], '.1f')} %",
                   f"{_fmt(_num(run.get('peak_flops')) / 1e12, ',.1f')} TFLOP/s ({run.get('peak_source')})"]]),
        "",
        f"Training thread per step (median): {_fmt(1e3 * s['cpu_s'], '.1f')} ms of CPU, "
        f"{_fmt(1e3 * s['cpu_wait_s'], '.1f')} ms runnable but waiting for a core, of "
        f"{_fmt(1e3 * s['step_s'], '.1f')} ms.",
        "",
        _memory_line(data.get("memory")),
        "",
        "MFU = step FLOPs (6·N_nonembedding + 12·L·D·S per token) / step wall time / the device's dense bf16 "
        "peak (`agent/instrument/flops.py`), median over the steps after warm-up; records read back from the "
        "run store with `agent/store/reader.py`.",
        "",
        f"**{s['verdict']}**: {line}; the goal is set for one H100.",
    ]
    return Rendered(s["verdict"], line, "\n".join(md))


# ---------------------------------------------------------------------- 2. collectives vs the profiler
def label(*, op: str, nbytes: int, variant: str, rep: int) -> str:
    """The ``record_function`` name one traced op runs under."""
    return f"{LABEL_PREFIX}{op}|{nbytes}|{variant}|{rep}"


def parse_label(name: str) -> tuple[str, int, str, int] | None:
    if not name.startswith(LABEL_PREFIX):
        return None
    parts = name[len(LABEL_PREFIX):].split("|")
    if len(parts) != 4 or not parts[1].isdigit() or not parts[3].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2], int(parts[3])


def gpu_work_by_label(events: list[dict], *, prefix: str = LABEL_PREFIX) -> dict[str, dict]:
    """For each labelled region of a Chrome trace (``user_annotation`` events named ``prefix...``), the GPU
    work launched inside it: kernels, memcpys and memsets whose ``correlation`` is that of a CUDA runtime or
    driver call made on the region's thread within its time. Where no launch can be matched, the region's
    ``gpu_user_annotation`` (Kineto's span of the region's GPU work) stands in.

    Returns label -> ``{"span_us": first start to last end, or None without GPU work, "busy_us": summed
    durations, "names": sorted names, "source": "correlation" | "gpu_user_annotation" | "none"}``."""
    regions = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("pid"), e.get("tid"), e["name"])
                     for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                     and str(e.get("name", "")).startswith(prefix))
    starts = [r[0] for r in regions]
    owner: dict[object, str] = {}  # correlation id -> label
    for e in events:
        if e.get("cat") not in LAUNCH_CATEGORIES or "correlation" not in e.get("args", {}):
            continue
        ts = float(e["ts"])
        i = bisect.bisect_right(starts, ts) - 1
        # Regions do not nest (one op each), so the latest one starting before the call is the only candidate.
        if i >= 0 and ts <= regions[i][1] and (e.get("pid"), e.get("tid")) == regions[i][2:4]:
            owner[e["args"]["correlation"]] = regions[i][4]
    work: dict[str, list[dict]] = {r[4]: [] for r in regions}
    for e in events:
        if e.get("cat") in GPU_CATEGORIES and e.get("args", {}).get("correlation") in owner:
            work[owner[e["args"]["correlation"]]].append(e)
    spans = {e["name"]: float(e.get("dur", 0.0)) for e in events
             if e.get("cat") == "gpu_user_annotation" and e.get("name") in work}
    out = {}
    for name, acts in work.items():
        if acts:
            first = min(float(a["ts"]) for a in acts)
            last = max(float(a["ts"]) + float(a.get("dur", 0.0)) for a in acts)
            out[name] = {"span_us": last - first, "busy_us": sum(float(a.get("dur", 0.0)) for a in acts),
                         "names": sorted({a["name"] for a in acts}), "source": "correlation"}
        elif name in spans:
            out[name] = {"span_us": spans[name], "busy_us": spans[name], "names": [], "source": "gpu_user_annotation"}
        else:
            out[name] = {"span_us": None, "busy_us": 0.0, "names": [], "source": "none"}
    return out


def compare_collectives(durations: dict[str, list[float]], *, gpu: dict[str, dict],
                        band: tuple[float, float] = RATIO_BAND) -> list[dict]:
    """One row per (op, bytes, variant): the median over repetitions of meshscope's duration (seconds, one
    record expected per labelled op), of the profiler's GPU span, and of their per-repetition ratio.

    ``status``: ``ok`` (ratio within ``band``), ``out of band``, ``no GPU work`` (nothing ran on the GPU:
    not judged), ``missing record`` / ``extra records`` (the tracer saw the op not exactly once)."""
    groups: dict[tuple[str, int, str], list[tuple[list[float], dict | None]]] = {}
    for name in dict.fromkeys([*durations, *gpu]):  # issue order
        key = parse_label(name)
        if key is not None:
            groups.setdefault(key[:3], []).append((durations.get(name, []), gpu.get(name)))
    rows = []
    for (op, nbytes, variant), reps in groups.items():
        counts = [len(d) for d, _ in reps]
        paired = [(d[0], g["span_us"] / 1e6) for d, g in reps if len(d) == 1 and g and g.get("span_us")]
        names = sorted({n for _, g in reps if g for n in g.get("names", [])})
        ours = [d[0] for d, _ in reps if len(d) == 1]
        row = {"op": op, "bytes": nbytes, "variant": variant, "reps": len(reps),
               "meshscope_us": 1e6 * statistics.median(ours) if ours else float("nan"),
               "profiler_us": 1e6 * statistics.median(p for _, p in paired) if paired else float("nan"),
               "ratio": statistics.median(m / p for m, p in paired) if paired else float("nan"),
               "gpu_work": ", ".join(names) or "none", "nccl_kernel": any("nccl" in n.lower() for n in names)}
        if min(counts) == 0:
            row["status"] = "missing record"
        elif max(counts) > 1:
            row["status"] = "extra records"
        elif not paired:
            row["status"] = "no GPU work"
        else:
            diff_s = statistics.median(m - p for m, p in paired)
            row["status"] = ("ok" if band[0] <= row["ratio"] <= band[1] or abs(diff_s) <= ABS_TOLERANCE_S
                             else "out of band")
        rows.append(row)
    return rows


def judged_cell(row: dict) -> bool:
    """Whether a cell counts for the verdict: it had GPU work, and the GPU was busy when the op was issued.
    On an idle GPU the start event fires at issue, before the host has launched the op, so the host's own
    issue time (tens of µs) is in meshscope's duration by design: those cells are shown, not judged."""
    return row["status"] != "no GPU work" and not row["variant"].startswith("idle")


def render_collectives(data: dict) -> Rendered:
    rows = compare_collectives(data["durations"], gpu=data["gpu"])
    judged = [r for r in rows if judged_cell(r)]
    bad = [r for r in judged if r["status"] != "ok"]
    lo, hi = RATIO_BAND
    verdict = "PASS" if judged and not bad else "FAIL"
    if not judged:
        line = "no op issued on a busy GPU had GPU work the profiler could attribute: nothing compared"
    else:
        line = (f"{len(judged) - len(bad)} of {len(judged)} op/size/variant cells within {lo}–{hi} "
                f"or ±{ABS_TOLERANCE_S * 1e6:.0f} µs")
    table = md_table(
        ["op", "size", "variant", "meshscope (µs)", "profiler GPU (µs)", "difference (µs)", "ratio", "status",
         "GPU work"],
        [[r["op"], fmt_bytes(r["bytes"]), r["variant"], _fmt(r["meshscope_us"], ",.1f"),
          _fmt(r["profiler_us"], ",.1f"), _fmt(r["meshscope_us"] - r["profiler_us"], "+,.1f"),
          _fmt(r["ratio"], ".3f"), r["status"] if judged_cell(r) or r["status"] == "no GPU work"
          else f"{r['status']} (not judged)", r["gpu_work"]] for r in rows])
    any_nccl = any(r["nccl_kernel"] for r in rows)
    md = [
        f"{data['reps']} repetitions per cell on NCCL {data.get('nccl_version', '?')}, world size 1, traced by "
        "meshscope's `CollectiveTracer` (a `ListRecorder`; `flush()` after `torch.cuda.synchronize()`) under "
        "`torch.profiler` with CPU and CUDA activities. meshscope's duration is its record's `t_end - t_start` "
        "(CUDA events); the profiler's is the span of the GPU work launched inside the op's "
        "`record_function` region (matched by CUPTI correlation id); medians over the repetitions. Variants: "
        "`queued-*` issue the op behind a bf16 matmul (the GPU busy, as in training: these cells are judged), "
        "`idle-*` on an idle GPU (the start event fires at issue, so the host's issue time counts: shown, not "
        "judged); `*-sync` blocking calls, `*-async` `async_op=True` + `wait()`; `funcol_*` ops (the functional "
        "collectives, TP's DTensor path) are issued and then waited (`wait_tensor`) in both. "
        f"`TORCH_NCCL_ENABLE_TIMING={data.get('nccl_timing_env') or 'unset'}`.",
        "",
        table,
        "",
        "No kernel named `nccl*` ran: at world size 1 NCCL takes its one-rank path (an in-place sum is a no-op, "
        "out-of-place ops a device-to-device copy, AVG a one-rank reduce kernel), so what is compared is that "
        "work; run with ≥ 2 GPUs to compare ring/tree kernels." if not any_nccl else
        "Kernels named `nccl*` ran and are included in the profiler's span.",
    ]
    if data.get("tracer_errors"):
        md += ["", f"Tracer errors: {'; '.join(data['tracer_errors'][:5])}"]
    md += ["", f"**{verdict}**: {line}."]
    return Rendered(verdict, line, "\n".join(md))


# ----------------------------------------------------------------------------- 3. allocator fields
def compare_memory(points: list[dict]) -> list[dict]:
    """One row per (moment, field): meshscope's memory sample against the same quantity read directly, the
    two reads back to back with no allocation between (``MEMORY_TOLERANCE`` where the driver's state can
    move)."""
    rows = []
    for point in points:
        for field, source in MEMORY_SOURCES.items():
            ours, direct = point["sampled"].get(field), point["direct"].get(field)
            ok = ours is not None and direct is not None and abs(ours - direct) <= MEMORY_TOLERANCE.get(field, 0)
            rows.append({"when": point["when"], "field": field, "source": source, "meshscope": ours,
                         "direct": direct, "ok": ok})
    return rows


def render_memory(data: dict) -> Rendered:
    rows = compare_memory(data["points"])
    bad = [r for r in rows if not r["ok"]]
    verdict = "PASS" if rows and not bad else "FAIL"
    line = (f"all {len(rows)} readings agree" if not bad else
            f"{len(bad)} of {len(rows)} readings differ: {', '.join(sorted({r['field'] for r in bad}))}")
    md = [
        "`agent/instrument/memory.py`'s `sample(...)` (what every step's `memory` record holds) against "
        "`torch.cuda` read right after it, at each moment below. Exact equality is expected except the "
        "driver's free memory (within 64 MiB: other processes can allocate between the reads).",
        "",
        md_table(["moment", "field", "compared with", "meshscope", "direct", "agree"],
                 [[r["when"], r["field"], f"`{r['source']}`", f"{r['meshscope']:,}" if r["meshscope"] is not None
                   else "missing", f"{r['direct']:,}" if r["direct"] is not None else "missing",
                   "yes" if r["ok"] else "**no**"] for r in rows]),
        "",
        f"**{verdict}**: {line}.",
    ]
    return Rendered(verdict, line, "\n".join(md))


# ------------------------------------------------------------------------------ 4. NVML vs nvidia-smi
def norm_uuid(uuid: str) -> str:
    """NVML and nvidia-smi say ``GPU-<hex>``, torch's device properties the bare ``<hex>``."""
    text = str(uuid).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def _smi_value(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_smi(text: str) -> dict[str, dict]:
    """``nvidia-smi --query-gpu=<SMI_QUERY> --format=csv,noheader,nounits`` -> normalised uuid -> values."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 5 or not cells[0]:
            continue
        util, mem, power, temp = (_smi_value(c) for c in cells[1:])
        out[norm_uuid(cells[0])] = {"util_pct": util, "mem_used_mib": mem, "power_w": power, "temp_c": temp}
    return out


def compare_nvml(pairs: list[dict]) -> list[dict]:
    """One row per (reading, quantity): meshscope's NVML sample (``GpuRecord`` fields) and nvidia-smi's, in
    nvidia-smi's units, with the allowed difference (``NVML_QUANTITIES``). A quantity either side lacks
    (NaN, N/A) is reported and not judged."""
    rows = []
    for i, pair in enumerate(pairs):
        ours_rec, smi = pair.get("meshscope"), pair.get("smi")
        for quantity, (field, convert, column, tolerance) in NVML_QUANTITIES.items():
            raw = None if ours_rec is None else ours_rec.get(field)
            ours = convert(raw) if raw is not None and math.isfinite(raw) and raw >= 0 else None
            ref = None if smi is None else smi.get(column)
            row = {"reading": i + 1, "phase": pair["phase"], "quantity": quantity, "meshscope": ours, "nvidia_smi": ref,
                   "allowed": None, "ok": None}
            if ours is not None and ref is not None:
                row["allowed"] = tolerance(ref)
                row["ok"] = abs(ours - ref) <= row["allowed"]
            rows.append(row)
    return rows


def render_nvml(data: dict) -> Rendered:
    rows = compare_nvml(data["pairs"])
    judged = [r for r in rows if r["ok"] is not None]
    bad = [r for r in judged if not r["ok"]]
    verdict = "PASS" if judged and not bad else "FAIL"
    line = (f"{len(judged) - len(bad)} of {len(judged)} readings within tolerance" if judged
            else "no reading had both sides")
    if bad:
        line += f"; off: {', '.join(sorted({r['quantity'] for r in bad}))}"
    reserved = [p["nvml_reserved_bytes"] for p in data["pairs"] if p.get("nvml_reserved_bytes") is not None]
    md = [
        "`agent/collector/gpu.py`'s `GpuSampler` (NVML, what the agent exports) read, then `nvidia-smi "
        f"--query-gpu={SMI_QUERY} --format=csv,noheader,nounits` right after it, for the GPU torch sees as "
        "`cuda:0` (matched by UUID): three readings under a matmul load, two idle.",
        "",
        md_table(["#", "phase", "quantity", "meshscope", "nvidia-smi", "allowed ±", "agree"],
                 [[r["reading"], r["phase"], r["quantity"], _fmt(r["meshscope"] if r["meshscope"] is not None
                   else float("nan"), ",.1f"), _fmt(r["nvidia_smi"] if r["nvidia_smi"] is not None else float("nan"),
                   ",.1f"), _fmt(r["allowed"] if r["allowed"] is not None else float("nan"), ".0f"),
                   {None: "not judged", True: "yes", False: "**no**"}[r["ok"]]] for r in rows]),
    ]
    if reserved:
        md += ["", f"NVML's driver-reserved memory (`nvmlDeviceGetMemoryInfo` v2 `.reserved`): "
               f"{max(reserved) / MIB:,.0f} MiB. The sampler reads v2's `used`, which leaves it out as nvidia-smi "
               "does (v1's `used` includes it); a difference of about this size means the v1 fallback ran."]
    md += ["", f"**{verdict}**: {line}."]
    return Rendered(verdict, line, "\n".join(md))


# ------------------------------------------------------------------------------- 5. telemetry overhead
def overhead_summary(blocks: list[dict]) -> dict:
    """Per A/B pair of blocks (``{"pair", "arm": "on"|"off", "steps", "seconds"}``), on/off − 1 of the
    seconds per step; the median over pairs is the figure (as bench/telemetry_overhead.py)."""
    by_pair: dict[int, dict[str, float]] = {}
    for b in blocks:
        by_pair.setdefault(b["pair"], {})[b["arm"]] = b["seconds"] / b["steps"]
    full = [p for p in by_pair.values() if "on" in p and "off" in p]
    if not full:
        raise ValueError("no complete on/off pair of blocks")
    ratios = [p["on"] / p["off"] - 1.0 for p in full]
    median = statistics.median(ratios)
    return {"pairs": len(full), "ratios": ratios, "median": median, "mean": statistics.fmean(ratios),
            "step_s_on": statistics.fmean(p["on"] for p in full),
            "step_s_off": statistics.fmean(p["off"] for p in full),
            "verdict": "PASS" if median <= OVERHEAD_GOAL else "FAIL"}


def render_overhead(data: dict) -> Rendered:
    s = overhead_summary(data["blocks"])
    line = f"median overhead {100 * s['median']:+.2f} % per step (goal ≤ {100 * OVERHEAD_GOAL:.0f} %)"
    md = [
        f"The trainer's `1b` flavor in one process (NCCL, world size 1, bf16 autocast"
        f"{', blocks compiled' if data.get('compiled') else ', eager'}): {data['warmup']} warm-up "
        f"steps, then {s['pairs']} pairs of {data['block']}-step blocks, telemetry attached in one block of each "
        "pair and detached (`NullTelemetry`) in the other, the order alternating between pairs "
        "(bench/overhead_worker.py's method); block times between `torch.cuda.synchronize()` calls.",
        "",
        md_table(["step off (ms)", "step on (ms)", "median overhead", "mean", "per pair", "dropped records",
                  "telemetry errors"],
                 [[f"{1e3 * s['step_s_off']:.1f}", f"{1e3 * s['step_s_on']:.1f}", f"{100 * s['median']:+.2f} %",
                   f"{100 * s['mean']:+.2f} %", ", ".join(f"{100 * r:+.2f} %" for r in s["ratios"]),
                   data.get("dropped", "?"), data.get("errors", "?")]]),
        "",
        f"**{s['verdict']}**: {line}.",
    ]
    return Rendered(s["verdict"], line, "\n".join(md))


RENDERERS = {"train": render_train, "collectives": render_collectives, "memory": render_memory,
             "nvml": render_nvml, "overhead": render_overhead}
