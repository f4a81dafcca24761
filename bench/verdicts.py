"""What the pages and ``meshscope report`` conclude, against the truth, on real 2-rank torchrun jobs of the
reference trainer (gloo, CPU). Each figure is computed by the product's own view functions (the ones the
pages and ``report`` call) and printed beside its independent truth:

- straggler: ``--straggler-seconds D`` on the last rank (DDP and FSDP2): the rank named, the share of
  steady 5-step windows that name it, the cost per step against D;
- bubble: GPipe, 1F1B, interleaved 1F1B and interleaved zero-bubble (p = 2, m = 4, tiny-wide): the theory
  (closed form, or the run's own order replayed with balanced stages), the measured schedule share, the
  replayed fill and drain and P2P share; the CPU wait share says whether the machine was quiet;
- memory: the model's parameters, gradients and optimizer state per device against each rank's tensors,
  per strategy (DDP, FSDP2, TP, PP);
- the tour's catch-up: how long ``report`` takes to ingest spools no agent read, for a 2-rank tour run and
  for a synthetic 8-rank run of ``--catchup-steps`` steps.

    python bench/verdicts.py [--only straggler,bubble,memory,catchup] [--steps 24] [--catchup-steps 5000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshscope.agent.collector.catchup import catch_up  # noqa: E402
from meshscope.agent.collector.reader import Store  # noqa: E402
from meshscope.agent.contract.storelayout import StoreLayout  # noqa: E402
from meshscope.testing.spools import write_run  # noqa: E402
from meshscope.dashboard import views  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
WINDOW = 5


def job(store: Path, run: str, *args: str) -> float:
    """One 2-rank torchrun job of the trainer writing spools under ``store``; returns its wall seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                    "meshscope.trainer.train", "--store", str(store), "--run-name", run, *args],
                   cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=1800)
    return time.perf_counter() - t0


def loader(store: Path):
    catch_up(store)
    return views.direct_loader(Store.open(store))


def contended(ov) -> str:
    """Whether the product warned that ranks waited for a CPU (dashboard.environment)."""
    return "CONTENDED" if any(w.startswith("CPU contention") for w in ov.warnings) else "quiet"


def straggler(tmp: Path, *, steps: int, delay: float) -> None:
    print(f"\n## straggler: --straggler-seconds {delay} on rank 1 of 2, {steps} steps")
    print(f"{'layout':8} {'named':>6} {'windows naming it':>18} {'cost s/step':>12} {'vs delay':>9} {'cause':>10} "
          f"{'machine':>10}")
    for name, layout in (("ddp", ()), ("fsdp2", ("--fsdp",))):
        store = tmp / f"s-{name}"
        job(store, "s", "--steps", str(steps), "--straggler-ranks", "1", "--straggler-seconds", str(delay), *layout)
        load = loader(store)
        ov = views.overview(load, run="s", runs=["s"], steps=None)
        named = ov.stragglers["rank"].tolist()
        windows = [(a, a + WINDOW - 1) for a in range(ov.first_steady_step, steps - WINDOW + 1)]
        hit = sum(views.overview(load, run="s", runs=["s"], steps=w).stragglers["rank"].tolist() == [1]
                  for w in windows)
        cost = float(ov.metrics["cost_s"])
        cause = ov.stragglers["cause"].iloc[0].split(" ")[0] if len(ov.stragglers) else "-"
        print(f"{name:8} {str(named):>6} {hit:>7}/{len(windows):<3} {hit / max(len(windows), 1):6.0%} "
              f"{cost:12.4f} {cost / delay - 1:+9.1%} {cause:>10} {contended(ov):>10}")


BUBBLE = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved": ("interleaved", 2),
          "interleaved-zb": ("interleaved-zb", 2)}


def bubble(tmp: Path, *, steps: int) -> None:
    print("\n## bubble: p = 2, m = 4, tiny-wide, batch 32 (steps from the first steady one)")
    print(f"{'schedule':15} {'theory':>7} {'source':>12} {'sched share':>12} {'fill&drain':>11} {'P2P&gaps':>9} "
          f"{'other':>7} {'share-theory':>13} {'machine':>10}")
    for name, (schedule, v) in BUBBLE.items():
        store = tmp / f"b-{name}"
        job(store, "b", "--model", "tiny-wide", "--steps", str(steps), "--pp", "2", "--batch-size", "32",
            "--schedule", schedule, "--microbatches", "4")
        pipe = views.pipeline(loader(store), run="b", steps=None)
        st = pipe.stages.mean(numeric_only=True)
        src = "closed form" if pipe.theory_source == "closed form" else "own order"
        ov = views.overview(loader(store), run="b", runs=["b"], steps=None)
        print(f"{name:15} {pipe.theory:7.1%} {src:>12} {st['schedule_share']:12.1%} {st['schedule_idle']:11.1%} "
              f"{st['p2p_share']:9.1%} {st['unexplained']:7.1%} {(st['schedule_share'] - pipe.theory) * 100:+12.1f}pp "
              f"{contended(ov):>10}")


MEMORY = {"ddp": (), "fsdp2": ("--fsdp",), "tp": ("--tp", "2"), "pp": ("--pp", "2", "--microbatches", "4")}


def memory(tmp: Path) -> None:
    print("\n## memory: the model's states per device vs each rank's tensors (max rank), tiny, fp32 AdamW")
    print(f"{'strategy':9} {'component':16} {'model MiB':>10} {'measured MiB':>13} {'error':>8}")
    for name, args in MEMORY.items():
        store = tmp / f"m-{name}"
        job(store, "m", "--steps", "3", *args)
        view = views.memory(loader(store), run="m", steps=None)
        for r in view.states.itertuples():
            print(f"{name:9} {r.component:16} {r.model_bytes / 2**20:10.4f} {r.measured_max / 2**20:13.4f} "
                  f"{r.error:+8.3%}")


def catchup(tmp: Path, *, steps: int) -> None:
    print("\n## catch-up: `report` on spools no agent read")
    store = tmp / "tour"
    train_s = job(store, "tour", "--steps", "8")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "meshscope.cli", "report", "--store", str(store), "--run", "tour"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600, check=True)
    print(f"tour (2 ranks, 8 steps): train {train_s:.1f} s; report incl. catch-up {time.perf_counter() - t0:.2f} s "
          f"({out.stderr.strip()})")
    big = tmp / "big"
    counts = write_run(big, run="big", world_size=8, steps=steps, collectives_per_step=40)
    size = sum(p.stat().st_size for p in Path(StoreLayout.of(big).spool).rglob("*.spool"))
    t0 = time.perf_counter()
    res = catch_up(big)
    dt = time.perf_counter() - t0
    print(f"synthetic 8 ranks x {steps} steps: {sum(counts.values()):,} records, {size / 2**20:.0f} MiB of spools: "
          f"catch-up {dt:.1f} s ({sum(counts.values()) / dt:,.0f} records/s, {size / 2**20 / dt:.1f} MiB/s); "
          f"{res.outcome}; again: {catch_up(big).outcome}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="straggler,bubble,memory,catchup")
    p.add_argument("--steps", type=int, default=24, help="steps of the straggler jobs")
    p.add_argument("--delay", type=float, default=0.1, help="injected straggler delay, seconds per step")
    p.add_argument("--bubble-steps", type=int, default=12)
    p.add_argument("--catchup-steps", type=int, default=5000)
    a = p.parse_args()
    only = set(a.only.split(","))
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    with tempfile.TemporaryDirectory() as tmp:
        if "straggler" in only:
            straggler(Path(tmp), steps=a.steps, delay=a.delay)
        if "bubble" in only:
            bubble(Path(tmp), steps=a.bubble_steps)
        if "memory" in only:
            memory(Path(tmp))
        if "catchup" in only:
            catchup(Path(tmp), steps=a.catchup_steps)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
