"""Real jobs of the reference trainer for the tests: torchrun / single-process launches, ingest, and the
session's shared **reference runs**.

A reference run is one parallel layout of the reference trainer (2 gloo ranks, ``tiny-wide``, 11 steps, seed
11, global batch 8, telemetry on, a torch.profiler trace of steps 2-9 on every rank, ingested) run once per
test session, the first time a test asks for it; every test that only *reads* a run of that layout (the
store's completeness, telemetry against the profiler, clean runs name no straggler, the memory model, loss
parity, the planner's self-consistency, the pages and ``report`` on a real store) reads the same one instead
of starting its own job. A reference run is read-only: a test that must add runs to a store asks for a copy
(``ReferenceRuns.store_of``). The profiler window costs the steps it covers well under 1 % on ``tiny-wide``
(its ops take 2-120 ms, the profiler tens of µs per op), so the runs are also the planner's and the pages'.
Runs with injected faults or another world size are not reference runs: they change what they measure, so
the tests that need them start their own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"^step=(\d+) loss=(\S+)")


def trainer_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _checked(cmd: list[str], *, timeout: float, check: bool,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env={**trainer_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def torchrun(nproc: int, *args: str, timeout: float = 240, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node=nproc -m meshscope.trainer.train *args`` from the repo root
    (``env``: variables set for the job on top of ``trainer_env``)."""
    return _checked([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                     "-m", "meshscope.trainer.train", *args], timeout=timeout, check=check, env=env)


def single(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """The same trainer as one plain process (a world of one)."""
    return _checked([sys.executable, "-m", "meshscope.trainer.train", *args], timeout=timeout, check=check)


def losses(stdout: str) -> dict[int, float]:
    """The trainer's printed loss per step."""
    out = {}
    for line in stdout.splitlines():
        m = STEP_LINE.match(line)
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out


def ingest(store: Path) -> None:
    """``meshscope ingest --store``: the spool into the tables, as a user runs it."""
    _checked([sys.executable, "-m", "meshscope.cli", "ingest", "--store", str(store)], timeout=120, check=True)


def run_job(store: Path, run: str, nproc: int, *args: str,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A torchrun job with telemetry into ``store`` as run ``run``, then ingested."""
    proc = torchrun(nproc, "--store", str(store), "--run-name", run, *args, env=env)
    ingest(store)
    return proc


# The reference runs' common flags, and each layout's own (2 ranks each); the profiled steps [first, last).
REFERENCE_STEPS, PROFILED = 11, (2, 10)
REFERENCE_ARGS = ("--model", "tiny-wide", "--steps", str(REFERENCE_STEPS), "--seed", "11", "--batch-size", "8")
REFERENCE_LAYOUTS: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "fsdp2": ("--fsdp",),
    "tp": ("--tp", "2"),
    "pp-1f1b": ("--pp", "2", "--schedule", "1f1b", "--microbatches", "4"),
    "pp-gpipe": ("--pp", "2", "--schedule", "gpipe", "--microbatches", "4"),
}
REFERENCE_NPROC = 2


@dataclass(frozen=True)
class ReferenceRun:
    name: str  # the layout's name, and the run's name in its store
    store: Path  # a store that holds this run only (read it; never write to it)
    stdout: str  # the job's own output (torchrun's and the ranks')

    @property
    def profile(self) -> Path:
        """The folder of the profiler's traces, ``rank-<k>.json``."""
        return self.store / "prof"

    @property
    def losses(self) -> dict[int, float]:
        return losses(self.stdout)


class ReferenceRuns:
    """The session's reference runs, each started the first time it is asked for (``runs["ddp"]``).

    ``base`` may be shared by the session's pytest-xdist workers: the first worker to ask for a run starts
    it under a file lock, and the others wait for it and read the same store (its job's output is kept
    beside it, ``<name>.stdout``, written last: a run whose job failed is started again by the next ask)."""

    def __init__(self, base: Path) -> None:
        self._base = base
        self._runs: dict[str, ReferenceRun] = {}

    def __getitem__(self, name: str) -> ReferenceRun:
        from filelock import FileLock

        if name not in REFERENCE_LAYOUTS:
            raise KeyError(f"no reference run {name!r} (one of {', '.join(REFERENCE_LAYOUTS)})")
        if name not in self._runs:
            self._base.mkdir(parents=True, exist_ok=True)
            store, done = self._base / name, self._base / f"{name}.stdout"
            with FileLock(str(self._base / f"{name}.lock"), timeout=900):
                if not done.is_file():
                    shutil.rmtree(store, ignore_errors=True)  # a job that failed under another worker
                    proc = run_job(store, name, REFERENCE_NPROC, *REFERENCE_ARGS, *REFERENCE_LAYOUTS[name],
                                   "--profile-dir", str(store / "prof"),
                                   "--profile-steps", f"{PROFILED[0]}:{PROFILED[1]}")
                    done.write_text(proc.stdout)
            self._runs[name] = ReferenceRun(name=name, store=store, stdout=done.read_text())
        return self._runs[name]

    def store_of(self, *names: str, into: Path) -> Path:
        """A new store at ``into`` holding the named reference runs (copies of their tables), for a test that
        reads several runs together or adds its own runs to them."""
        from meshscope.agent.contract.storelayout import StoreLayout

        target = StoreLayout.of(into)
        for name in names:
            source = StoreLayout.of(self[name].store)
            for table in Path(source.tables).iterdir():
                run_dir = Path(source.run_dir(table.name, name))
                if run_dir.is_dir():
                    shutil.copytree(run_dir, Path(target.run_dir(table.name, name)))
        return into
