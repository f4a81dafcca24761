"""How fast and how right ``meshscope hang`` is on injected hangs of the reference trainer (gloo, CPU, default
thresholds): per case and repeat, the seconds from the hang's start (rank 0 printed the last step before it)
to a verdict naming every rank, whether the culprit and the waited-for collective are the injected ones, and
whether torch's Flight Recorder analyser (over the dumps the same watchdogs write) names the same culprit.
Also the cost of a watchdog that does not fire: the first step of a clean run made 20 s slower
(``--first-step-seconds``) must leave no hang record.

    python bench/hang_detect.py [--cases fsdp4,ddp2,pp2,desync3] [--repeats 3] [--no-slow-first]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshscope.agent.collector.catchup import catch_up  # noqa: E402
from meshscope.agent.store.reader import Store, read_table  # noqa: E402
from meshscope.dashboard import hangcli, views  # noqa: E402
from tests.support.flightrec import torch_findings  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
HANG_STEP = 6
CASES = {  # name → (ranks, trainer arguments, culprit)
    "fsdp4": (4, ["--fsdp", "--hang-rank", "2", "--hang-step", str(HANG_STEP)], 2),
    "ddp2": (2, ["--hang-rank", "1", "--hang-step", str(HANG_STEP)], 1),
    "pp2": (2, ["--pp", "2", "--hang-rank", "1", "--hang-step", str(HANG_STEP)], 1),
    "desync3": (3, ["--desync-rank", "1", "--desync-step", str(HANG_STEP)], 1),
}


def _kill(proc: subprocess.Popen) -> None:
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in [psutil.Process(proc.pid), *tree] if proc.poll() is None else tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def one(name: str, work: Path) -> dict:
    world, args, culprit = CASES[name]
    store, fr = work / name, work / name / "fr"
    store.mkdir(parents=True)
    log = open(store / "job.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                             "-m", "meshscope.trainer.train", "--steps", "400", "--batch-size", str(4 * world),
                             "--log-every", "1", "--store", str(store), "--run-name", name, *args,
                             "--set", f"telemetry.flight_recorder_dir={fr}"],
                            cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while f"step={HANG_STEP - 1} " not in (store / "job.log").read_text(errors="replace"):
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{name}: step {HANG_STEP - 1} never printed")
            time.sleep(0.1)
        t0, h = time.time(), None
        while time.time() - t0 < 90:
            catch_up(store)
            try:
                h = hangcli.build(views.direct_loader(Store.open_many([str(store)])), run=name, now=time.time())
            except hangcli.ConfigError:
                h = None
            if h and h["status"] == "hung" and h["culprit_ranks"] and len(h["ranks"]) == world:
                break
            time.sleep(0.5)
        detected = time.time() - t0
        alive = proc.poll() is None
        while len(list(fr.glob("rank_*"))) < world and time.time() - t0 < 120:
            time.sleep(0.5)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            found = torch_findings(fr) if len(list(fr.glob("rank_*"))) == world else []  # its report: stderr
        colls = read_table(store, "collective", run=name)
        w = (h or {}).get("waiting") or {}
        done = colls[colls["group"] == w.get("group")].groupby("rank")["seq"].max() if w else None
        return {"case": name, "detected_s": detected, "alive": alive, "culprit_ok": (h or {}).get("culprit_ranks") == [culprit],
                "seq_ok": bool(w) and (name == "pp2" or set(done) == {w["seq"] - 1}),
                "torch": found[0]["culprits"] if found else [], "verdict": (h or {}).get("verdict", "none")}
    finally:
        _kill(proc)
        log.close()


def slow_first(work: Path) -> dict:
    store = work / "slow-first"
    store.mkdir(parents=True)
    t0 = time.time()
    rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                         "meshscope.trainer.train", "--steps", "12", "--batch-size", "8", "--store", str(store),
                         "--run-name", "slow-first", "--first-step-seconds", "20"],
                        cwd=ROOT, env=ENV, capture_output=True, timeout=300).returncode
    catch_up(store)
    return {"rc": rc, "wall_s": time.time() - t0, "hang_records": len(read_table(store, "hang", run="slow-first")),
            "first_step_s": float(read_table(store, "step", run="slow-first").query("step == 0")["wall_s"].min())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-slow-first", action="store_true")
    a = p.parse_args()
    logging.disable(logging.WARNING)  # torch's analyser logs its findings: the table below has them
    print(f"load average before: {os.getloadavg()}")
    work = Path(tempfile.mkdtemp(prefix="meshscope-hangbench-"))
    try:
        print(f"{'case':<8} {'run':>3} {'named after':>11} {'alive':>5} {'culprit':>7} {'seq':>4} {'torch FR culprit':>16}  verdict")
        for name in a.cases.split(","):
            for i in range(a.repeats):
                r = one(name, work / f"r{i}")
                print(f"{name:<8} {i:>3} {r['detected_s']:>10.1f}s {str(r['alive']):>5} {str(r['culprit_ok']):>7} "
                      f"{str(r['seq_ok']):>4} {str(r['torch']):>16}  {r['verdict'][:110]}", flush=True)
        if not a.no_slow_first:
            s = slow_first(work)
            print(f"slow first step: exit {s['rc']}, first step {s['first_step_s']:.1f} s, hang records "
                  f"{s['hang_records']} (expected 0), job {s['wall_s']:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
