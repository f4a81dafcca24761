"""Collective time per op, telemetry vs torch.profiler, on real 2-rank torchrun jobs of the trainer.

Method: the trainer profiles steps A:B (``--profile-dir``/``--profile-steps``, a Chrome trace per rank)
with telemetry on; the agent's ``ingest`` writes the store. Per rank, step, gloo op and path, the
telemetry's Σ(t_end − t_start) is compared with the profiler's Σ(issue → observed completion),
``profiler_op_refs`` in ``tests/support/profiler.py`` (the same one ``tests/test_telemetry_e2e.py``
asserts on): c10d issue event start → ``gloo:*`` range end, and for functional collectives (TP)
``_c10d_functional::<op>`` start → ``wait_tensor`` end.

Printed per strategy, rank, op and path: the per-step ratios, their median, the profiler's mean op time
and the mean bias per op in µs ((Σ ours − Σ profiler) / count). A ratio hides whether a gap is a fixed
cost per op (Python timestamps, a thread's wake-up) or proportional; the bias per op across model widths
tells which. For functional collectives the ratio to their gloo ranges is printed as well (what the tracer
would read if it could see gloo's completion).

First, ``--reference-check``: how late the profiler's gloo range end can be, with no telemetry at all.

    python bench/profiler_agreement.py [--strategies ddp,fsdp,tp,pp-1f1b,pp-gpipe] [--models tiny,tiny-wide]
        [--reference-check STEPS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshscope.agent.store.reader import read_table  # noqa: E402
from bench.telemetry_overhead import STRATEGIES  # noqa: E402  (the same jobs as the overhead A/B)
from meshscope.trainer.model import FLAVORS  # noqa: E402
from tests.support.profiler import (  # noqa: E402  (the profiler mapping lives with the tests)
    OP_TO_GLOO, chrome_trace_events, init, profiler_op_refs, profiler_step_totals, spawn, tracer_op_refs,
)


def run(strategy: str, *, model: str, steps: int, first: int, last: int) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "meshscope.trainer.train", "--store", str(store), "--run-name", "r", "--model", model,
               "--steps", str(steps), "--profile-dir", str(store / "prof"),
               "--profile-steps", f"{first}:{last}", *STRATEGIES[strategy]]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
        subprocess.run([sys.executable, "-m", "meshscope.cli", "ingest", "--store", str(store)], cwd=ROOT,
                       env=env, check=True, capture_output=True, timeout=300)
        coll = read_table(store, "collective", run="r")
        for rank in (0, 1):
            events = chrome_trace_events(store / "prof" / f"rank-{rank}.json")
            refs = profiler_op_refs(events, window_prefix="train_step_", first_step=first, n_steps=last - first)
            gloo = profiler_step_totals(None, last - first, window_prefix="train_step_", events=events,
                                        first_step=first)
            mine = coll[coll["rank"] == rank]
            per_op: dict[tuple[str, str], dict[str, list[float]]] = {}
            for i, step in enumerate(range(first, last)):
                recs = mine[mine["step"] == step][["op", "source", "t_start", "t_end"]].to_dict("records")
                for key, t in tracer_op_refs(recs).items():
                    p = refs[i].get(key)
                    if p is None or p["count"] != t["count"] or p["issue_to_done_s"] != p["issue_to_done_s"]:
                        continue  # not pairable in this step (see the e2e test)
                    d = per_op.setdefault(key, {"ratio": [], "bias_us": [], "op_us": [], "gloo": []})
                    d["ratio"].append(t["duration_s"] / p["issue_to_done_s"])
                    d["bias_us"].append((t["duration_s"] - p["issue_to_done_s"]) / t["count"] * 1e6)
                    d["op_us"].append(p["issue_to_done_s"] / t["count"] * 1e6)
                    g = gloo[i].get(key[0], {})
                    if key[1] == "funcol" and g.get("funcol_issue_to_wait_s") == g.get("funcol_issue_to_wait_s"):
                        # the funcol ops' gloo ranges: c10d issue → range end of every gloo op of this name
                        # minus the c10d-path ones (what the tracer would read if it saw gloo's completion)
                        c10d = refs[i].get((key[0], "c10d"), {"issue_to_done_s": 0.0})["issue_to_done_s"]
                        d["gloo"].append(t["duration_s"] / (g["issue_to_done_s"] - c10d))
            for (name, path), d in sorted(per_op.items()):
                line = (f"{strategy:9s} {model:9s} rank {rank} {name:16s} {path:6s} ratios "
                        f"{[round(v, 3) for v in d['ratio']]} median {statistics.median(d['ratio']):.3f}; "
                        f"op {statistics.fmean(d['op_us']):8.1f} us, bias {statistics.fmean(d['bias_us']):+7.1f} us/op")
                if d["gloo"]:
                    line += f"; vs its gloo ranges (c10d issue -> range end): median {statistics.median(d['gloo']):.3f}"
                lines.append(line)
        ops = {OP_TO_GLOO[op] for op in set(coll["op"])}
        lines.append(f"{strategy:9s} {model:9s} ops traced: {sorted(ops)}")
    return lines


def reference_check(steps: int) -> list[str]:
    """How loose the profiler's ``gloo:*`` range end is as a completion time, with no telemetry at all: a
    2-rank DDP job (6 × Linear(256, 256), one bucket) under the profiler, once with DDP's C++ all-reduce and
    once with torch's own Python ``allreduce_hook``. DDP's backward cannot return before its bucket's
    all-reduce has completed, so a range that ends after backward's return ended late (the worker thread
    woke the training thread, then waited to be scheduled)."""
    out = Path(tempfile.mkdtemp())
    lines = []
    for hook in ("builtin", "python"):
        spawn(_reference_rank, args=(hook, steps, str(out)))
        late = [v for r in (0, 1) for v in json.loads((out / f"{hook}-{r}.json").read_text())]
        lines.append(f"reference {hook:8s}: gloo range end - backward return over {len(late)} rank-steps: "
                     f"median {statistics.median(late):+.0f} us, max {max(late):+.0f} us, "
                     f"{sum(v > 300 for v in late)} over +300 us")
    return lines


def _reference_rank(rank: int, world_size: int, port: int, hook: str, steps: int, out: str) -> None:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.profiler import ProfilerActivity, profile, record_function

    init(rank, world_size, port)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(6))))
    if hook == "python":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters())
    x = torch.randn(64, 256)

    def step() -> None:
        with record_function("backward"):
            ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(5):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = list(prof.events())
    ranges = [e.time_range for e in events if e.name == "gloo:all_reduce"]
    late = []
    for b in (e.time_range for e in events if e.name == "backward"):
        ends = [r.end for r in ranges if b.start <= r.start <= b.end]
        if ends:
            late.append(max(ends) - b.end)
    Path(out, f"{hook}-{rank}.json").write_text(json.dumps(late))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--models", default="tiny,tiny-wide")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile-steps", default="2:10", help="A:B, the profiled steps (default 2:10)")
    ap.add_argument("--reference-check", type=int, default=30, metavar="STEPS",
                    help="steps of the no-telemetry check of the profiler's reference (0: skip; default 30)")
    args = ap.parse_args()
    try:
        first, last = (int(x) for x in args.profile_steps.split(":"))
    except ValueError:
        ap.error(f"--profile-steps {args.profile_steps!r} must look like A:B")
    if not 0 <= first < last - 1 or last > args.steps:
        ap.error(f"--profile-steps {args.profile_steps!r} needs 0 <= A < B - 1 and B <= --steps ({args.steps})")
    strategies, models = args.strategies.split(","), args.models.split(",")
    for bad, known, what in ((set(strategies) - set(STRATEGIES), STRATEGIES, "strategy"),
                             (set(models) - set(FLAVORS), FLAVORS, "model")):
        if bad:
            ap.error(f"unknown {what} {', '.join(sorted(bad))}; choose from {', '.join(known)}")
    if args.reference_check < 0:
        ap.error(f"--reference-check {args.reference_check} must be >= 0")
    if args.reference_check:
        for line in reference_check(args.reference_check):
            print(line, flush=True)
    for strategy in strategies:
        for model in models:
            for line in run(strategy, model=model, steps=args.steps, first=first, last=last):
                print(line, flush=True)


if __name__ == "__main__":
    main()
