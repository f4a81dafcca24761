"""``meshscope plan --probe``: measure what the calibration did not. For each parallelism kind the
predictions need and no calibration run measured (TP's, FSDP's or a pipeline's compute rate:
``predict.PROBED_KINDS``), a few steps of the smallest layout that has it, on the calibration's model,
batch and ranks, with the reference trainer (``meshscope.trainer.train``) under torchrun, into the
calibration's store, marked ``telemetry.purpose = "probe"`` in the run's config; ``meshscope plan`` then
calibrates from them too and lists them. A job that is not the reference trainer's cannot be probed
(its model is not one of the trainer's flavors): the message names what to run instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from meshscope.agent.contract import layout as rules
from meshscope.dashboard.config import ConfigError
from meshscope.dashboard.data import parse_config
from meshscope.dashboard.planner import layouts
from meshscope.dashboard.planner.calibration import Calibration
from meshscope.dashboard.planner.predict import Prediction, unmeasured
from meshscope.dashboard.planner.whatif import flavor_name

PROBE_STEPS = 10  # warm-up (2-3 steps) and at least MIN_STEADY_STEPS after it
PROBE_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    kind: str  # "tp", "fsdp" or "pp"
    layout: layouts.Layout
    run: str  # its run name in the store
    seconds: float  # wall time of the job


def needed(cal: Calibration, preds: list[Prediction]) -> list[str]:
    """The kinds (``tp``, ``fsdp``, ``pp``) whose compute rate the predictions borrowed and no calibration
    run measured."""
    return unmeasured(cal, {k for p in preds for k in p.extrapolation_kinds})


def smallest(kind: str, *, cal: Calibration, world_size: int, global_batch: int) -> layouts.Layout:
    """The smallest layout of ``world_size`` ranks that has ``kind`` (degree 2 first, the trainer's rules)."""
    tries = {"tp": [{"tp": d, "fsdp": True} for d in range(2, world_size + 1)],
             "fsdp": [{"fsdp": True}],
             "pp": [{"pp": d, "schedule": "1f1b", "microbatches": d * k} for d in range(2, world_size + 1)
                    for k in (1, 2, 4)]}[kind]
    for spec in tries:
        try:
            return layouts.resolve(spec, model=cal.model, world_size=world_size, global_batch=global_batch)
        except rules.LayoutError:
            continue
    raise ConfigError(f"--probe: no layout of {world_size} ranks with {kind.upper()} fits this model and batch "
                      f"{global_batch}")


def trainer_args(lay: layouts.Layout) -> list[str]:
    args = ["--dp", str(lay.dp), "--tp", str(lay.tp), "--pp", str(lay.pp)]
    if lay.fsdp:
        args.append("--fsdp")
    if lay.pp > 1:
        args += ["--schedule", lay.schedule, "--microbatches", str(lay.microbatches),
                 "--virtual-stages", str(lay.virtual_stages)]
    return args


def run_probes(cal: Calibration, kinds: list[str], *, meta: dict, store: Path, steps: int = PROBE_STEPS,
               log=print) -> list[Probe]:
    """Run one probe per kind into ``store`` (``meta``: the first calibration run's runs-table row, whose
    model, sequence length, batch, world size and device the probes take). ConfigError where the job is
    not the reference trainer's; RuntimeError (with the job's last output) where a probe fails."""
    flavor = flavor_name(meta)
    if flavor not in rules.FLAVORS:
        raise ConfigError(f"--probe runs the reference trainer, but run {meta.get('run')!r} is a "
                          f"{meta.get('model') or 'unknown'} job: run a few steps of your job with "
                          f"{', '.join(k.upper() for k in kinds)} and name that run with --run instead")
    world, batch = int(meta["world_size"]), int(meta["global_batch"])
    device = "cuda" if str(meta.get("device") or "").startswith("cuda") else "cpu"
    out = []
    for kind in kinds:
        lay = smallest(kind, cal=cal, world_size=world, global_batch=batch)
        name = f"probe-{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "meshscope.trainer.train", "--model", flavor, "--seq-len", str(int(meta["seq_len"])),
               "--batch-size", str(batch), "--steps", str(steps), "--log-every", str(steps), "--device", device,
               "--store", str(store), "--run-name", name, "--set", "telemetry.purpose=probe", *trainer_args(lay)]
        log(f"meshscope plan: probe {name}: {lay.label} on {world} ranks, {steps} steps")
        t0 = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"probe {name} ({lay.label}) failed with exit {proc.returncode}:\n"
                               f"{(proc.stderr or proc.stdout)[-2000:]}")
        out.append(Probe(kind=kind, layout=lay, run=name, seconds=time.monotonic() - t0))
    return out


def is_probe(meta: dict) -> bool:
    """Whether a runs-table row is a probe (``telemetry.purpose``)."""
    telemetry = parse_config(meta.get("config")).get("telemetry")
    return isinstance(telemetry, dict) and telemetry.get("purpose") == "probe"
