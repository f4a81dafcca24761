"""Runs the real third-party trainer torchtitan 0.3.0 (from PyPI, unchanged) on CPU ranks over gloo, with or
without ``meshscope run``: its llama3 ``llama3_debugmodel`` config, launched the way torchtitan's own
``run_train.sh`` launches it (``torchrun ... --role rank --tee 3 -m torchtitan.train --module llama3 --config
llama3_debugmodel``), with the parallelism chosen by torchtitan's own flags.

What differs from torchtitan's defaults, and why (everything else is llama3_debugmodel's own):

- ``titan_cpu/sitecustomize.py`` on PYTHONPATH: the device-selection workarounds CPU needs (see its docstring).
- ``--parallelism.spmd-backend partial_dtensor``: the default ``spmd_types`` fails in ``fully_shard``
  ("ValueError: When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh (e.g. via
  distribute_module). Got plain tensor for parameter 'weight'.", torch 2.13).
- ``--hf-assets-path`` / ``--dataloader.dataset-path``: the tokenizer and ``c4_test`` data set come from
  torchtitan's repository (``tests/assets``), which the wheel does not ship; ``assets/`` holds small ones in
  the same layouts (``build_assets.py``). HF_DATASETS_OFFLINE / HF_HUB_OFFLINE: nothing is downloaded.
- ``--training.seq-len 128 --training.local-batch-size 4`` (defaults 2048 and 8): eager flex attention on one
  CPU core per rank; 10 steps then take ~1 s each rather than minutes.
- ``--debug.seed 42``: the default (None) draws a different initialisation per run; the with/without
  comparison needs the same one.
- ``--metrics.disable-color-printing``: the log's ANSI colours off (parsing; nothing else changes).
- ``--dump-folder ./outputs`` in the run's own working directory.

Layouts (world size): "fsdp" (2), "ddp" (2), "tp" (2), "hsdp" (4), "fsdp+tp" (4) and "cp" (2, at
seq_len 256: flex attention's context parallel needs seq_len divisible by cp x its block size 128, else
"NotImplementedError: Q_LEN 128 is not divisible by CP mesh world size 2 * BLOCK_SIZE 128") run. "pp" does
not, on this torch, with or without any observer (measured 2026-11-28, torch 2.13.0+cpu, torchtitan 0.3.0):
``SKIPPED`` holds the reason and the test skips it with that reason.

Measured (2026-11-28, 2 cores shared with other test runs, so +-30 %; wall of one 10-step run, plain / under
``meshscope run``): fsdp 48 / 57 s, ddp 27 / 31 s, tp 29 / 29 s, hsdp 65 / 72 s, fsdp+tp 77 / 91 s, cp 49 / 49 s;
~20 s of each is start-up (imports, the compiled create_block_mask) before step 1.

The job's own log line per step (``torchtitan/components/metrics.py:523``) is
``step: N  loss: X  grad_norm: G  memory: M GiB(P%)  tps: T  tflops: F  mfu: U%``; it prints no step time
(``time_metrics/end_to_end(s)`` goes only to TensorBoard / W&B), so the job's step time is taken from the
log's own timestamps: step N's time is the time between the log lines of steps N-1 and N, which is exactly
what torchtitan's ``end_to_end`` measures (the time between two ``log`` calls, log_freq 1). Step 1 has none.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = HERE / "titan_cpu"
TOKENIZER = HERE / "assets" / "tokenizer"
DATASET = HERE / "assets" / "c4_test"

SEQ_LEN = 128
LOCAL_BATCH = 4
SEED = 42


@dataclass(frozen=True)
class Layout:
    nproc: int
    flags: tuple[str, ...]
    strategy: str  # meshscope's canonical name for it
    seq_len: int = SEQ_LEN


LAYOUTS: dict[str, Layout] = {
    "fsdp": Layout(2, ("--parallelism.data-parallel-shard-degree", "2"), "fsdp"),
    "ddp": Layout(2, ("--parallelism.data-parallel-replicate-degree", "2",
                      "--parallelism.data-parallel-shard-degree", "1"), "ddp"),
    "tp": Layout(2, ("--parallelism.tensor-parallel-degree", "2",
                     "--parallelism.data-parallel-shard-degree", "1"), "tp"),
    "hsdp": Layout(4, ("--parallelism.data-parallel-replicate-degree", "2",
                       "--parallelism.data-parallel-shard-degree", "2"), "hsdp"),
    "fsdp+tp": Layout(4, ("--parallelism.data-parallel-shard-degree", "2",
                          "--parallelism.tensor-parallel-degree", "2"), "fsdp+tp"),
    "pp": Layout(2, ("--parallelism.pipeline-parallel-degree", "2",
                     "--parallelism.data-parallel-shard-degree", "1",
                     "--training.disable-cuda-graphs"), "pp"),
    # context parallel with flex attention needs seq_len divisible by cp x the flex block size (128)
    # torchtitan shards the parameters with FSDP over dp_shard x cp (its mesh's "fsdp" dim, size 2 here; the
    # log says "Applied FSDP to the model"): FSDP sharding plus context parallel, "fsdp+cp" in meshscope's words
    "cp": Layout(2, ("--parallelism.context-parallel-degree", "2",
                     "--parallelism.data-parallel-shard-degree", "1"), "fsdp+cp", seq_len=256),
}

# Layouts torchtitan 0.3.0 cannot train on this torch without any observer: the reason, with the error.
SKIPPED: dict[str, str] = {
    "pp": "torchtitan/trainer.py:856 calls pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., "
          "losses=..., loss_kwargs=..., return_outputs=False), the schedule API of a newer torch; torch 2.13's "
          "PipelineScheduleMulti.step(*args, target=None, losses=None, return_outputs=True, loss_kwargs=None, "
          "**kwargs) takes arg_mbs as a model keyword argument and every rank fails in the first step: "
          "'ValueError: Expecting 4 arg_mbs but got 1' (torch/distributed/pipelining/schedules.py:563, "
          "_check_inputs), without any observer",
}

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:(.*)$")
_TITAN_TIME = re.compile(r"^\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<memory_gib>\S+)GiB\((?P<memory_pct>[^)]*)%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+%|N/A)")


@dataclass
class StepLog:
    """One ``step:`` line of the job's own log (one rank)."""

    step: int
    loss: float
    grad_norm: float
    tps: int
    tflops: float
    mfu_pct: float | None
    memory_gib: float
    logged_at: _dt.datetime
    step_time_s: float | None = None  # since the previous step's line; None for the first


@dataclass
class TitanResult:
    layout: str
    world: int
    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float
    command: list[str]
    workdir: Path
    meshscope_store: Path | None
    run_name: str | None
    steps_by_rank: dict[int, list[StepLog]] = field(default_factory=dict)

    @property
    def steps(self) -> list[StepLog]:
        """Rank 0's step lines (torchtitan's own log rank)."""
        return self.steps_by_rank.get(0, [])

    @property
    def losses(self) -> dict[int, float]:
        return {s.step: s.loss for s in self.steps}

    @property
    def last_loss(self) -> float:
        return self.steps[-1].loss

    @property
    def step_time_median_s(self) -> float | None:
        times = [s.step_time_s for s in self.steps if s.step_time_s is not None]
        return statistics.median(times) if times else None

    def failure(self) -> str:
        return (f"{' '.join(self.command)}\nexit {self.returncode} after {self.elapsed_s:.1f} s\n"
                f"--- stdout (tail)\n{self.stdout[-4000:]}\n--- stderr (tail)\n{self.stderr[-6000:]}")


def command(layout: str, steps: int) -> list[str]:
    spec = LAYOUTS[layout]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec.nproc}",
        "--role", "rank", "--tee", "3",
        "-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel",
        "--hf-assets-path", str(TOKENIZER), "--dataloader.dataset-path", str(DATASET),
        "--dump-folder", "./outputs",
        "--parallelism.spmd-backend", "partial_dtensor",
        "--training.seq-len", str(spec.seq_len), "--training.local-batch-size", str(LOCAL_BATCH),
        "--training.steps", str(steps), "--debug.seed", str(SEED), "--metrics.disable-color-printing",
        *spec.flags,
    ]


def environment(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_HOME"] = str(workdir / "hf")  # the datasets cache of this run, not ~/.cache
    env["TITAN_C10D_COUNTS"] = str(workdir / "c10d")  # c10d's own collective counts (titan_cpu/sitecustomize.py)
    env.pop("MESHSCOPE_DISABLE", None)
    return env


def run(*, layout: str, steps: int, workdir: Path, meshscope_store: Path | None, run_name: str | None,
        timeout_s: float) -> TitanResult:
    """Run torchtitan's llama3_debugmodel in ``layout`` for ``steps`` steps in ``workdir`` (its working
    directory); under ``meshscope run --store meshscope_store --run run_name`` when a store is given."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = command(layout, steps)
    if meshscope_store is not None:
        cmd = [sys.executable, "-m", "meshscope", "run", "--store", str(meshscope_store),
               *(["--run", run_name] if run_name else []), "--", *cmd]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=environment(workdir), capture_output=True, text=True,
                              timeout=timeout_s)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        err += f"\n[harness] timed out after {timeout_s} s"
    elapsed = time.perf_counter() - t0
    (workdir / "stdout.txt").write_text(out)
    (workdir / "stderr.txt").write_text(err)
    (workdir / "result.json").write_text(json.dumps({"layout": layout, "returncode": rc, "elapsed_s": elapsed,
                                                     "command": cmd}, indent=1) + "\n")
    return TitanResult(layout=layout, world=LAYOUTS[layout].nproc, returncode=rc, stdout=out, stderr=err,
                       elapsed_s=elapsed, command=cmd, workdir=workdir, meshscope_store=meshscope_store,
                       run_name=run_name, steps_by_rank=parse_steps(out))


def lines_by_rank(text: str) -> dict[int, list[str]]:
    """The ``[rankN]:`` lines torchrun's ``--tee`` writes, per rank, prefix and ANSI colours removed."""
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = _RANK_PREFIX.match(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(_ANSI.sub("", m.group(2)))
    return out


def parse_steps(stdout: str) -> dict[int, list[StepLog]]:
    result: dict[int, list[StepLog]] = {}
    for rank, lines in lines_by_rank(stdout).items():
        logs: list[StepLog] = []
        for line in lines:
            m, t = _STEP.search(line), _TITAN_TIME.match(line)
            if not m or not t or "validate step" in line:
                continue
            mfu = m.group("mfu")
            logs.append(StepLog(
                step=int(m.group("step")), loss=float(m.group("loss")), grad_norm=float(m.group("grad_norm")),
                tps=int(m.group("tps").replace(",", "")), tflops=float(m.group("tflops").replace(",", "")),
                mfu_pct=None if mfu == "N/A" else float(mfu.rstrip("%")),
                memory_gib=float(m.group("memory_gib")),
                logged_at=_dt.datetime.strptime(t.group(1), "%Y-%m-%d %H:%M:%S,%f")))
        for prev, cur in zip(logs, logs[1:]):
            if cur.step == prev.step + 1:
                cur.step_time_s = (cur.logged_at - prev.logged_at).total_seconds()
        if logs:
            result[rank] = logs
    return result


# Time-like and throughput fields of torchtitan's log: masked before two runs' logs are compared. The loss,
# grad_norm, memory and everything else stay as printed.
_MASKS = [
    (re.compile(r"^\[titan\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "), "[titan] <time> "),
    (re.compile(r"\btps: [\d,]+"), "tps: <n>"),
    (re.compile(r"\btflops: [\d,.]+"), "tflops: <n>"),
    (re.compile(r"\bmfu: [\d.]+%"), "mfu: <n>%"),
    (re.compile(r"\btook \d+(\.\d+)? (seconds|ms|s)\b"), "took <t> \\2"),
    (re.compile(r"\.\d{8}-\d{6}-[A-Za-z0-9]+\.jsonl\b"), ".<time-id>.jsonl"),  # structured log file names
]


def normalise(stdout: str, workdir: Path | None = None) -> dict[int, list[str]]:
    """The job's own stdout per rank (torchrun's ``[rankN]:`` lines; other lines are the launcher's or
    meshscope's), with the time-like and throughput numbers masked and ``workdir`` replaced by a name."""
    out: dict[int, list[str]] = {}
    for rank, lines in lines_by_rank(stdout).items():
        norm = []
        for line in lines:
            if line.startswith("meshscope:"):
                continue
            if workdir is not None:
                line = line.replace(str(workdir), "<workdir>")
            for pattern, repl in _MASKS:
                line = pattern.sub(repl, line)
            norm.append(line.rstrip())
        out[rank] = norm
    return out


@dataclass(frozen=True)
class GroupCount:
    """One process group of one rank, as c10d counts it (titan_cpu/sitecustomize.py, section 7)."""

    ops: int  # collectives c10d issued on it between the run's first and last optimizer steps
    desc: str  # its description: DeviceMesh names its groups "mesh_<dim>", the default group "default_pg"
    size: int
    world: bool


def c10d_counts(workdir: Path) -> dict[int, dict[str, GroupCount]]:
    """Per rank and process group name: the collectives c10d itself counted from the end of step 0 (the
    first optimizer step) to the end of the last step."""
    out: dict[int, dict[str, GroupCount]] = {}
    for path in sorted((Path(workdir) / "c10d").glob("rank*.json")):
        data = json.loads(path.read_text())
        first = data["first"]["groups"]
        out[data["last"]["rank"]] = {
            name: GroupCount(ops=g["seq"] - first.get(name, {"seq": 0})["seq"], desc=g["desc"], size=g["size"],
                             world=g["world"])
            for name, g in data["last"]["groups"].items()}
    return out


def report_json(store: Path, run_name: str, timeout_s: float = 120) -> dict:
    """``python -m meshscope report --store DIR --run NAME --json``'s object."""
    proc = subprocess.run([sys.executable, "-m", "meshscope", "report", "--store", str(store), "--run", run_name,
                           "--json"], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"meshscope report failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


if __name__ == "__main__":  # python3 tests/realworld/titan.py LAYOUT [STEPS] [--meshscope]: one run, a summary
    import argparse
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("layout", choices=sorted(LAYOUTS))
    ap.add_argument("steps", nargs="?", type=int, default=10)
    ap.add_argument("--meshscope", action="store_true")
    ap.add_argument("--workdir")
    a = ap.parse_args()
    wd = Path(a.workdir or tempfile.mkdtemp(prefix=f"titan-{a.layout}-"))
    res = run(layout=a.layout, steps=a.steps, workdir=wd / "job",
              meshscope_store=wd / "store" if a.meshscope else None,
              run_name=f"titan-{a.layout}" if a.meshscope else None, timeout_s=600)
    print(f"exit {res.returncode}  elapsed {res.elapsed_s:.1f} s  workdir {wd}")
    for s in res.steps:
        print(f"step {s.step}: loss {s.loss}  tps {s.tps}  step_time {s.step_time_s}")
    print(f"median step time {res.step_time_median_s}")
    if res.returncode != 0:
        print(res.failure())
    sys.exit(res.returncode)
