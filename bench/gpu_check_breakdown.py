"""Section 6 of the GPU check: where a step goes. The trainer's ``Trainer.train_step`` in a bare loop
(no telemetry, no CLI), eager and with its blocks compiled (``bench/gpu_mfu_probe.py``'s ``measure``):
step time, the training thread's CPU, the GPU's kernel time by kind and the top kernels. Its check: the
trainer's own command (section 1, telemetry on, compiled) runs within ``GAP_LIMIT`` of the bare compiled
loop per step; telemetry accounts for ≤ 1 % of it (section 5), so a larger gap is the command's own cost
and a number users read (its MFU) is lower than the model's."""

from __future__ import annotations

import math

from bench.gpu_check_analysis import Rendered, _fmt, md_table, train_summary

GAP_LIMIT = 0.05
TOP = 6


def _mode_row(m: dict) -> list[str]:
    if "error" in m:
        return [m["mode"], m["error"][:200], "", "", "", "", "", ""]
    kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(m["by_kind_ms"].items(), key=lambda kv: -kv[1]))
    return [m["mode"], f"{m['step_ms']:.1f}", f"{m.get('run_loop_step_ms', float('nan')):.1f}", f"{100 * m['mfu']:.1f} %",
            f"{m.get('thread_cpu_ms', float('nan')):.1f}", f"{m['gpu_busy_ms']:.1f}",
            f"{m['step_ms'] - m['gpu_busy_ms']:.1f}", kinds]


def render_breakdown(data: dict, train: dict | None = None) -> Rendered:
    """``data``: ``{"modes": [measure(...) per mode]}``; ``train``: section 1's data, when it ran."""
    modes = {m["mode"]: m for m in data["modes"]}
    md = [
        "`Trainer.train_step` of the `1b` flavor in a bare loop (NCCL world size 1, bf16 autocast, no telemetry, "
        "no CLI; `bench/gpu_mfu_probe.py`): 3 warm-up steps, then the mean of timed steps; the training "
        "thread's CPU over the same steps; the GPU's kernel time per step by kind from torch.profiler (CUDA "
        "activity) over two more steps; then the same trainer through its own loop (`Trainer.run`, what the "
        "command runs after its set-up), per step.",
        "",
        md_table(["mode", "step (ms)", "`Trainer.run` step (ms)", "MFU", "thread CPU (ms)", "GPU kernels (ms)",
                  "GPU idle (ms)", "kernels by kind (ms)"], [_mode_row(m) for m in data["modes"]]),
    ]
    for m in data["modes"]:
        if m.get("top"):
            md += ["", f"Top kernels, {m['mode']}:", "",
                   md_table(["ms per step", "calls per step", "kernel"],
                            [[k["ms_per_step"], k["calls_per_step"], f"`{k['kernel']}`"] for k in m["top"][:TOP]])]
    compiled = modes.get("compiled", {})
    failed = [m["mode"] for m in data["modes"] if "error" in m]
    if failed:
        verdict, line = "FAIL", f"{', '.join(failed)} could not be measured"
    elif train is None or not train.get("compiled") or "step_ms" not in compiled:
        verdict, line = "PASS", "measured; no compiled trainer run (section 1) to set against the bare loop"
    else:
        run = train["run"]
        s = train_summary(train["steps"], peak_flops=float(run.get("peak_flops") or 0.0))
        gap = 1e3 * s["step_s"] / compiled["step_ms"] - 1.0
        verdict = "PASS" if math.isfinite(gap) and gap <= GAP_LIMIT else "FAIL"
        line = (f"the trainer's command {_fmt(1e3 * s['step_s'], '.1f')} ms per step (section 1) against the bare "
                f"compiled loop's {compiled['step_ms']:.1f} ms: {100 * gap:+.1f} % (limit +{100 * GAP_LIMIT:.0f} %)")
    md += ["", f"**{verdict}**: {line}."]
    return Rendered(verdict, line, "\n".join(md))
