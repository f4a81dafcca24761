"""Config validation: each user mistake gets one clear message naming the bad value."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.jobs import ROOT, trainer_env
from meshscope.trainer import config
from meshscope.trainer.config import ConfigError


def resolve(argv: list[str], world: int):
    return config.from_args(config.parser("t").parse_args(argv)).resolve(world)


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (["--tp", "3"], 3, "tp=3 does not divide n_heads=4"),
        (["--dp", "3"], 4, "dp*tp*pp = 3*1*1 = 3 but the world size is 4"),
        (["--tp", "2", "--pp", "4"], 4, "tp*pp = 8 exceeds the world size 4"),
        (["--schedule", "zigzag"], 1, "unknown schedule 'zigzag'"),
        (["--pp", "2", "--microbatches", "3"], 2, "microbatches=3 does not divide the per-replica batch 8"),
        (["--pp", "2", "--microbatches", "1", "--schedule", "1f1b"], 2, "microbatches=1 must be >= pp=2"),
        (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "4"], 2,
         "pp*virtual_stages = 8 stages do not divide n_layers=4"),
        (["--model", "huge"], 1, "unknown model flavor 'huge'"),
        (["--batch-size", "6"], 4, "batch_size=6 is not divisible by dp=4"),
        (["--grad-accum", "3"], 2, "grad_accum=3 does not divide the per-replica batch 4"),
        (["--tp", "2", "--dp", "2"], 4, "needs --fsdp"),
        (["--steps", "0"], 1, "steps=0 must be >= 1"),
        (["--steps", "ten"], 1, "steps='ten' is not a valid int"),
        (["--lr", "-1"], 1, "lr=-1.0 must be > 0"),
        (["--data", "web"], 1, "unknown data source 'web'"),
        (["--straggler-ranks", "5"], 2, "fault rank 5 does not exist in a world of size 2"),
        (["--hang-rank", "1"], 2, "hang_rank=1 and hang_step=-1 must be set together"),
        (["--sequence-parallel"], 1, "sequence_parallel needs tp > 1"),
        (["--seq-len", "4096"], 1, "seq_len=4096 exceeds the tiny flavor's max_seq_len=64"),
        (["--run", "../escape"], 1, "run name '../escape' is not usable as a directory name"),
        (["--set", "optim.nope=1"], 1, "unknown config key(s) optim.nope"),
        (["--set", "nonsense"], 1, "--set 'nonsense' must look like KEY=VALUE"),
        (["--config", "/no/such/file.toml"], 1, "config file '/no/such/file.toml' does not exist"),
        (["--compile", "--tp", "2"], 2, "model.compile with tp=2: compiled blocks do not support tensor parallelism"),
    ],
)
def test_bad_config_names_the_value(argv, world, message):
    with pytest.raises(ConfigError) as err:
        resolve(argv, world)
    assert message in str(err.value)


def test_toml_file_and_cli_override(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text('steps = 7\n[parallel]\ntp = 2\n[optim]\nlr = 0.001\n')
    cfg = resolve(["--config", str(f), "--steps", "9"], 2)
    assert (cfg.steps, cfg.parallel.tp, cfg.parallel.dp, cfg.optim.lr) == (9, 2, 1, 0.001)
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = [")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        resolve(["--config", str(bad)], 1)


def test_resolved_strategy_names():
    assert resolve([], 2).parallel.strategy == "ddp"
    assert resolve(["--fsdp", "--tp", "2"], 4).parallel.strategy == "fsdp+tp"
    assert resolve(["--pp", "2", "--fsdp"], 4).parallel.strategy == "pp+fsdp"
    assert resolve([], 1).parallel.strategy == "single"


@pytest.mark.parametrize(
    ("cmd", "message"),
    [
        ([sys.executable, "-m", "meshscope.trainer.train", "--tp", "3"], "tp=3 does not divide n_heads=4"),
        ([sys.executable, "-m", "meshscope.trainer.train", "--schedule", "zigzag"], "unknown schedule 'zigzag'"),
        ([sys.executable, "-m", "meshscope.cli", "train", "--nproc", "4", "--dp", "3"],
         "dp*tp*pp = 3*1*1 = 3 but the world size is 4"),
        ([sys.executable, "-m", "meshscope.cli", "train", "--nproc", "0"], "--nproc=0 must be >= 1"),
        ([sys.executable, "-m", "meshscope.cli", "train", "--nnodes", "2", "--store", "s"],
         "--run NAME is required with --store when --nnodes > 1"),
        ([sys.executable, "-m", "meshscope.cli", "train", "--config", "missing.toml"],
         "config file 'missing.toml' does not exist"),
        # The contract's one run-name rule, before any rank starts (the trainer's own check let it through
        # and every rank died in the spool writer).
        ([sys.executable, "-m", "meshscope.cli", "train", "--nproc", "2", "--steps", "2", "--run", "run-ü",
          "--store", "never-created"], "run name 'run-ü' is not usable as a directory name: use 1-128 letters"),
        ([sys.executable, "-m", "meshscope.cli", "sweep", "--store", "never-created", "--name", "run-ü"],
         "--name 'run-ü' cannot start a run name"),
    ],
)
def test_cli_error_is_one_line_without_traceback(cmd, message):
    proc = subprocess.run(cmd, cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (ROOT / "never-created").exists()  # refused before anything started or wrote


def test_one_run_name_rule_everywhere():
    """Telemetry, the spool writer's path, the trainer's config and the store reader refuse the same names."""
    from meshscope.agent.store.reader import read_table
    from meshscope.agent.instrument.telemetry import TelemetryConfig
    from meshscope.agent.contract import spool_path
    from meshscope.trainer.config import TelemetrySection as TrainerTelemetry

    for bad in ("run-ü", "../escape", ".hidden", "a b", "x" * 129, "run\n"):
        for make in (lambda: TelemetryConfig(store="s", run=bad), lambda: spool_path("s", run=bad, rank=0, attempt=0),
                     lambda: TrainerTelemetry(run=bad), lambda: read_table("s", "step", run=bad)):
            with pytest.raises(ValueError):
                make()
    TelemetryConfig(store="s", run="ok-run_1.2")
    TrainerTelemetry(run="ok-run_1.2")
