"""What ``meshscope trace`` costs the training thread of a running job: the reference trainer on 2 gloo ranks
with telemetry, traced ``--rounds`` times for ``--traced`` steps each while it runs; every step's record
read back from the ranks' spools afterwards.

Per rank and window, the median of meshscope's own step records (ms):

* ``wall``: the step's ``wall_s`` (its start to its end; the profiler's start and stop lie outside it, the
  profiler's per-op cost inside the traced steps);
* ``period``: start of the step to the start of the next (what throughput sees: the stop included);

windows, each next to its trace (a shared machine's load drifts): ``unarmed`` (the ``--after`` steps
before the request), ``armed`` (a request seen, its start step not reached: one method call a boundary),
``traced`` (the N steps), ``collecting`` (the steps that follow while ``meshscope trace`` reads the traces
and writes the merged one: on a 2-core machine whose cores the ranks hold, it competes with them, at nice
19), ``after`` (the rest of the ``--after`` steps that follow), and the step boundaries the profiler's
start and stop fall in (``start gap``, ``stop gap``: end of one step to the start of the next, against the
unarmed median gap).
The ranks' own figures (``profiler_start_s``, ``profiler_stop_s`` on the training thread, ``export_s`` off
it) come from their answers.

    python bench/deeptrace_cost.py [--traced 5] [--rounds 3] [--after 20] [--json FILE] [-- TRAINER ARGS]
    (trainer default: --model tiny-wide --batch-size 8, the reference runs' layout)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from meshscope.agent.contract import spool_path
from meshscope.agent.deeptrace import read_records

ROOT = Path(__file__).resolve().parents[1]
RUN, WORLD, WARMUP = "cost", 2, 10


def steps_of(store: Path) -> pd.DataFrame:
    frames = []
    for rank in range(WORLD):
        path = spool_path(store, run=RUN, rank=rank, attempt=0)
        if path.exists():
            tables = read_records(path, 0, ("step",))["step"]
            for t in tables:
                df = t.to_pandas()
                df["rank"] = rank
                frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["rank", "step"])


def wait_steps(store: Path, at_least: int, *, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        df = steps_of(store)
        if len(df) and df.groupby("rank")["step"].max().min() >= at_least and df["rank"].nunique() == WORLD:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the job did not reach step {at_least} within {timeout_s:.0f} s")


def stop(job: subprocess.Popen) -> None:
    """torchrun and its ranks (torch 2.13 starts each rank in a session of its own: killing torchrun's group
    would leave them running)."""
    import psutil

    try:
        ranks = psutil.Process(job.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    job.send_signal(signal.SIGTERM)  # torchrun stops its ranks
    try:
        job.wait(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait(timeout=30)
    for p in ranks:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(ranks, timeout=30)


def ms(values) -> float:
    values = [v for v in values if v == v]
    return round(statistics.median(values) * 1e3, 3) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, trainer_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traced", type=int, default=5, help="steps per trace")
    ap.add_argument("--rounds", type=int, default=3, help="traces taken one after another")
    ap.add_argument("--after", type=int, default=20, help="steps after each trace before the next")
    ap.add_argument("--json", default=None)
    ap.add_argument("--csv", default=None, help="every step's record with its window, for a closer look")
    ns = ap.parse_args(ours)
    trainer_args = trainer_args or ["--model", "tiny-wide", "--batch-size", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    answers, requested, returned = [], [], []
    with tempfile.TemporaryDirectory(prefix="meshscope-deeptrace-cost-") as tmp:
        store = Path(tmp)
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={WORLD}", "-m", "meshscope.trainer.train", *trainer_args,
                                "--steps", "1000000", "--log-every", "1000000", "--store", str(store),
                                "--run-name", RUN], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_steps(store, WARMUP + ns.after)
            for _ in range(ns.rounds):
                requested.append(int(steps_of(store)["step"].max()))
                proc = subprocess.run([sys.executable, "-m", "meshscope.cli", "trace", "--store", str(store), "--run",
                                       RUN, "--steps", str(ns.traced), "--json"], cwd=ROOT, env=env,
                                      capture_output=True, text=True, timeout=300)
                returned.append(time.time())  # the collection competes for the cores until now
                if proc.returncode != 0:
                    raise RuntimeError(f"meshscope trace exited {proc.returncode}: {proc.stderr[-2000:]}")
                res = json.loads(proc.stdout)
                answers.append(res)
                # the steps after it, then as many again: the next trace's unarmed steps
                wait_steps(store, max(a["last_step"] for a in res["ranks"].values()) + 2 * ns.after)
            df = steps_of(store)
        finally:
            stop(job)
    rows, tables = [], []
    for rank in range(WORLD):
        d = df[df["rank"] == rank].sort_values("step").drop_duplicates("step").set_index("step")
        d["period"] = d["t_start"].shift(-1) - d["t_start"]
        d["gap"] = d["t_start"].shift(-1) - d["t_end"]  # this step's end to the next one's start
        window = pd.Series("", index=d.index)
        starts, stops = [], []
        for asked, res, back in zip(requested, answers, returned):
            a = res["ranks"][str(rank)]
            first, last = a["first_step"], a["last_step"]
            window[(d.index > asked - ns.after) & (d.index <= asked)] = "unarmed"
            window[(d.index > asked) & (d.index < first)] = "armed"
            window[(d.index >= first) & (d.index <= last)] = "traced"
            window[(d.index > last) & (d.index <= last + ns.after)] = "after"
            window[(d.index > last) & (d["t_start"] < back)] = "collecting"
            starts.append(first - 1)
            stops.append(last)
        tables.append(d.assign(window=window))
        unarmed = d[window == "unarmed"]
        row = {"rank": rank, "unarmed_steps": len(unarmed)}
        for name in ("unarmed", "armed", "traced", "collecting", "after"):
            part = d[window == name]
            row[f"{name}_wall_ms"], row[f"{name}_period_ms"] = ms(part["wall_s"]), ms(part["period"])
            row[f"{name}_steps"] = len(part)
        row["unarmed_gap_ms"] = ms(unarmed["gap"])
        row["start_gap_ms"] = ms(d.loc[[s for s in starts if s in d.index], "gap"])
        row["stop_gap_ms"] = ms(d.loc[[s for s in stops if s in d.index], "gap"])
        for key in ("profiler_start_s", "profiler_stop_s", "export_s"):
            row[key[:-2] + "_ms"] = ms([res["ranks"][str(rank)][key] for res in answers])
        rows.append(row)
    summary = {"trainer_args": trainer_args, "traced": ns.traced, "rounds": ns.rounds, "ranks": rows,
               "traces": [{"first": min(a["first_step"] for a in r["ranks"].values()),
                           "last": max(a["last_step"] for a in r["ranks"].values())} for r in answers]}
    for r in rows:
        print(f"rank {r['rank']}: step wall (median ms) unarmed {r['unarmed_wall_ms']:.2f} ({r['unarmed_steps']}), "
              f"armed {r['armed_wall_ms']:.2f} ({r['armed_steps']}), traced {r['traced_wall_ms']:.2f} "
              f"({r['traced_steps']}), collecting {r['collecting_wall_ms']:.2f} ({r['collecting_steps']}), after "
              f"{r['after_wall_ms']:.2f} ({r['after_steps']}); period unarmed "
              f"{r['unarmed_period_ms']:.2f}, traced {r['traced_period_ms']:.2f}, after {r['after_period_ms']:.2f}; "
              f"gap between steps unarmed {r['unarmed_gap_ms']:.3f}, at the start {r['start_gap_ms']:.3f}, "
              f"at the stop {r['stop_gap_ms']:.3f}; profiler start {r['profiler_start_ms']:.2f}, stop "
              f"{r['profiler_stop_ms']:.2f} (training thread), export {r['export_ms']:.2f} (own thread)")
    print(json.dumps(summary))
    if ns.json:
        Path(ns.json).write_text(json.dumps(summary, indent=2))
    if ns.csv:
        pd.concat(tables).reset_index()[["rank", "step", "window", "t_start", "t_end", "wall_s", "period", "gap",
                                         "cpu_s"]].to_csv(ns.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
