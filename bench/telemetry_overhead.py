"""Telemetry overhead: steps/s with telemetry on vs off, A/B interleaved, per strategy.

Method: one 2-rank gloo torchrun job per strategy runs `--pairs` pairs of blocks of `--block` steps; in
each pair one block has telemetry attached (collective hooks, pipeline spans, step records, memory
samples, spool writer thread) and one has it detached (NullTelemetry), the order alternating between
pairs so drift on the machine falls on both arms. Overhead per pair = on/off − 1 of the block times;
reported: median and mean with a 95 % bootstrap interval over pairs.

Caveat: a DDP comm hook cannot be unregistered, so DDP's "off" blocks still run a pass-through Python
comm hook (identical to DDP's default all-reduce plus one Python call per bucket); the DDP overhead
figure therefore slightly understates the hook's share.

    python bench/telemetry_overhead.py [--pairs 10] [--block 10] [--model tiny] [--strategies ddp,fsdp,...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = {
    "ddp": [],
    "fsdp": ["--fsdp"],
    "tp": ["--tp", "2"],
    "pp-1f1b": ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"],
    "pp-gpipe": ["--pp", "2", "--schedule", "gpipe", "--microbatches", "4"],
}


def bootstrap_ci(values: list[float], *, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def run(strategy: str, *, pairs: int, block: int, model: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "blocks.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "bench" / "overhead_worker.py"), "--pairs", str(pairs), "--block", str(block),
               "--out", str(out), "--model", model, *STRATEGIES[strategy]]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    tail = rows[-1]
    blocks = [r for r in rows if "arm" in r]
    by_pair: dict[int, dict[str, float]] = {}
    for r in blocks:
        by_pair.setdefault(r["pair"], {})[r["arm"]] = r["seconds"] / r["steps"]
    ratios = [p["on"] / p["off"] - 1.0 for p in by_pair.values()]
    on = statistics.fmean(p["on"] for p in by_pair.values())
    off = statistics.fmean(p["off"] for p in by_pair.values())
    lo, hi = bootstrap_ci(ratios)
    return {"strategy": strategy, "pairs": len(ratios), "steps_per_s_on": 1 / on, "steps_per_s_off": 1 / off,
            "overhead_median": statistics.median(ratios), "overhead_mean": statistics.fmean(ratios),
            "ci95": (lo, hi), "dropped": tail.get("dropped"), "errors": tail.get("errors")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ns = ap.parse_args()
    print(f"telemetry overhead, {ns.model}, 2 gloo ranks, {ns.pairs} A/B pairs of {ns.block} steps "
          f"(cores: {os.cpu_count()})")
    print(f"{'strategy':<10} {'steps/s off':>12} {'steps/s on':>11} {'median':>8} {'mean':>8} {'95% CI of mean':>20}")
    for name in ns.strategies.split(","):
        r = run(name, pairs=ns.pairs, block=ns.block, model=ns.model)
        lo, hi = r["ci95"]
        print(f"{name:<10} {r['steps_per_s_off']:>12.2f} {r['steps_per_s_on']:>11.2f} "
              f"{r['overhead_median']:>+8.2%} {r['overhead_mean']:>+8.2%} [{lo:+.2%}, {hi:+.2%}]"
              f"   dropped={r['dropped']} errors={r['errors']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
