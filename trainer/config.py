"""One dataclass tree for the reference trainer, validated at construction.

Sources, lowest precedence first: the dataclass defaults, a TOML file (``--config``), then CLI flags. A
user mistake raises ``ConfigError`` (a ``ValueError``) whose message names the bad value; the entry points
print that one line and exit 2, never a traceback. Checks that need the world size (the parallel degrees
must multiply to it) live in ``ParallelConfig.resolve``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from meshscope.agent.contract import strategy_name
from meshscope.agent.cliargs import ArgParser
from meshscope.agent.cliargs import UsageError as ConfigError  # one error type for every command line
from meshscope.agent.instrument.telemetry import TelemetryConfig
from meshscope.agent.contract import layout
from meshscope.agent.contract.layout import FLAVORS, MULTI_STAGE, SCHEDULES  # noqa: F401 (re-exported)
DATA_SOURCES = ("synthetic", "corpus")
_TELEMETRY_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TelemetryConfig)}




def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _layout(rule, **kwargs):
    """One of ``agent.contract.layout``'s rules (shared with the planner), its error as the trainer's."""
    try:
        return rule(**kwargs)
    except layout.LayoutError as e:
        raise ConfigError(str(e)) from None


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    flavor: str = "tiny"
    seq_len: int = 0  # 0: the flavor's default
    activation_checkpoint: bool = False
    compile: bool = False  # torch.compile each transformer block (fuses its norms, rotary and GELU)

    def __post_init__(self) -> None:
        _check(self.flavor in FLAVORS, f"unknown model flavor {self.flavor!r} (choose from {', '.join(FLAVORS)})")
        _check(self.seq_len >= 0, f"seq_len={self.seq_len} must be >= 0 (0 = the flavor's default)")
        if self.seq_len == 0:
            self.seq_len = FLAVORS[self.flavor].max_seq_len
        _check(
            self.seq_len <= FLAVORS[self.flavor].max_seq_len,
            f"seq_len={self.seq_len} exceeds the {self.flavor} flavor's max_seq_len={FLAVORS[self.flavor].max_seq_len}",
        )


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Degrees of the parallel layout. dp=0 means "whatever is left": world // (tp * pp)."""

    dp: int = 0
    tp: int = 1
    pp: int = 1
    fsdp: bool = False  # shard the dp dimension with FSDP2 instead of replicating with DDP
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 0  # 0: pp (the smallest count that fills the pipeline)
    virtual_stages: int = 2  # stages per rank for the interleaved schedule

    def __post_init__(self) -> None:
        _layout(layout.check_degrees, dp=self.dp, tp=self.tp, pp=self.pp, microbatches=self.microbatches,
                virtual_stages=self.virtual_stages, schedule=self.schedule, sequence_parallel=self.sequence_parallel)
        if self.microbatches == 0:
            self.microbatches = self.pp
        if self.pp == 1:
            self.virtual_stages = 1
        elif self.schedule not in MULTI_STAGE:
            self.virtual_stages = 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Fill dp=0 and check that the degrees multiply to the world size."""
        dp = _layout(layout.resolve_dp, world_size=world_size, dp=self.dp, tp=self.tp, pp=self.pp)
        return dataclasses.replace(self, dp=dp)

    @property
    def strategy(self) -> str:
        """The contract's name of this layout: ddp, fsdp, tp, pp, fsdp+tp, pp+fsdp, pp+fsdp+tp, ..."""
        dp = ("fsdp" if self.fsdp else "ddp") if self.dp > 1 or self.fsdp else ""
        return strategy_name(dp=dp, tp=self.tp, pp=self.pp)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: str = "synthetic"
    batch_size: int = 8  # global sequences per optimizer step, across all data-parallel replicas

    def __post_init__(self) -> None:
        _check(self.source in DATA_SOURCES, f"unknown data source {self.source!r} (choose from {', '.join(DATA_SOURCES)})")
        _check(self.batch_size >= 1, f"batch_size={self.batch_size} must be >= 1")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # on the true global norm; 0 disables
    grad_accum: int = 1

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"lr={self.lr} must be > 0")
        _check(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        _check(self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps} must be >= 0")
        _check(self.grad_clip >= 0, f"grad_clip={self.grad_clip} must be >= 0")
        _check(self.grad_accum >= 1, f"grad_accum={self.grad_accum} must be >= 1")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"betas=({self.beta1}, {self.beta2}) must be in [0, 1)")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str = ""  # empty: no checkpoints
    every: int = 0  # save every N steps (and at the end when dir is set); 0: only at the end
    resume: bool = False  # resume from the latest checkpoint in dir

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"checkpoint every={self.every} must be >= 0")
        _check(not self.resume or bool(self.dir), "checkpoint resume needs a checkpoint dir")


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    """Faults injected on purpose, to prove the observability path. Steps are optimizer steps."""

    straggler_ranks: tuple[int, ...] = ()
    straggler_seconds: float = 0.0  # extra seconds of compute per step on each straggler rank
    straggler_from_step: int = 0
    hang_rank: int = -1
    hang_step: int = -1
    crash_rank: int = -1
    crash_step: int = -1
    nan_step: int = -1  # the loss becomes non-finite at this step (that optimizer step is skipped)
    # desync: at this step every rank issues one more collective on the world group, this rank an
    # all-gather where the others issue an all-reduce (the classic mismatch)
    desync_rank: int = -1
    desync_step: int = -1
    # every rank's first step takes this many seconds longer (in its first forward): what a
    # torch.compile or a lazy initialisation does to the first step, which is no hang
    first_step_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.straggler_ranks = tuple(int(r) for r in self.straggler_ranks)
        _check(self.straggler_seconds >= 0, f"straggler_seconds={self.straggler_seconds} must be >= 0")
        _check(self.first_step_seconds >= 0, f"first_step_seconds={self.first_step_seconds} must be >= 0")
        _check(all(r >= 0 for r in self.straggler_ranks), f"straggler_ranks={list(self.straggler_ranks)} must be >= 0")
        for name in ("hang", "crash", "desync"):
            rank, step = getattr(self, f"{name}_rank"), getattr(self, f"{name}_step")
            _check((rank < 0) == (step < 0), f"{name}_rank={rank} and {name}_step={step} must be set together")

    def check_world(self, world_size: int) -> None:
        for r in (*self.straggler_ranks, self.hang_rank, self.crash_rank, self.desync_rank):
            _check(r < world_size, f"fault rank {r} does not exist in a world of size {world_size}")


PURPOSES = ("", "probe")


@dataclass(kw_only=True, slots=True)
class TelemetrySection:
    """The ``[telemetry]`` table: where the records go, and the instrumentation's own settings, which the
    instrumentation's :class:`TelemetryConfig` validates (one rule; this section adds what only the
    trainer decides: telemetry off without a store, a derived run name, the peak override)."""

    store: str = ""  # run store root; empty: telemetry off
    run: str = ""  # run name; empty: derived from the strategy and a timestamp
    peak_flops: float = 0.0  # override the per-device peak (FLOP/s); 0: table (GPU) or calibrated (CPU)
    purpose: str = ""  # why the run was started: "" (training) or "probe" (``meshscope plan --probe``)
    hang_after_s: float = _TELEMETRY_DEFAULTS["hang_after_s"]
    hang_min_s: float = _TELEMETRY_DEFAULTS["hang_min_s"]
    hang_first_step_s: float = _TELEMETRY_DEFAULTS["hang_first_step_s"]
    flight_recorder_dir: str = _TELEMETRY_DEFAULTS["flight_recorder_dir"]
    spool_hold_bytes: int = _TELEMETRY_DEFAULTS["spool_hold_bytes"]

    def __post_init__(self) -> None:
        _check(self.peak_flops >= 0, f"peak_flops={self.peak_flops} must be >= 0")
        _check(self.purpose in PURPOSES, f"purpose={self.purpose!r} must be one of {', '.join(map(repr, PURPOSES))}")
        try:  # a placeholder run and store where the trainer derives them
            self.instrumentation(run=self.run or "unnamed", store=self.store or ".")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def instrumentation(self, *, run: str, store: str | None = None) -> TelemetryConfig:
        """The instrumentation's config for one run of this trainer."""
        return TelemetryConfig(store=store or self.store, run=run, hang_after_s=self.hang_after_s,
                               hang_min_s=self.hang_min_s, hang_first_step_s=self.hang_first_step_s,
                               flight_recorder_dir=self.flight_recorder_dir,
                               spool_hold_bytes=self.spool_hold_bytes)


@dataclass(kw_only=True, slots=True)
class ProfileConfig:
    """A torch.profiler trace of a step range, per rank (the ground truth the telemetry is tested against)."""

    dir: str = ""  # empty: no profiling
    steps: str = ""  # "A:B": steps A .. B-1

    def __post_init__(self) -> None:
        if self.dir or self.steps:
            _check(bool(self.dir) and bool(self.steps), "profiling needs both --profile-dir and --profile-steps")
            a, sep, b = self.steps.partition(":")
            _check(sep == ":" and a.isdigit() and b.isdigit() and int(a) < int(b),
                   f"profile steps {self.steps!r} must look like A:B with A < B")

    @property
    def range(self) -> tuple[int, int]:
        a, _, b = self.steps.partition(":")
        return int(a), int(b)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    steps: int = 10
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    log_every: int = 1

    def __post_init__(self) -> None:
        _check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        _check(self.device in ("auto", "cpu", "cuda"), f"device={self.device!r} must be auto, cpu or cuda")
        _check(self.log_every >= 1, f"log_every={self.log_every} must be >= 1")
        flavor = FLAVORS[self.model.flavor]
        p = self.parallel
        _layout(layout.check_model_fit, tp=p.tp, n_stages=p.n_stages, n_heads=flavor.n_heads,
                n_layers=flavor.n_layers)
        # Tried on 2 gloo ranks: DDP, FSDP2 and PP train compiled with eager's losses (to 1e-7); with TP, DTensor's
        # redistribute backward gets a plain tensor out of the compiled block and fails in the first backward.
        _check(not (self.model.compile and p.tp > 1), f"model.compile with tp={p.tp}: compiled blocks do not "
               "support tensor parallelism yet (drop --compile or use tp=1)")

    def resolve(self, world_size: int) -> "TrainConfig":
        """The config with the world-size dependent parts filled in and checked."""
        par = self.parallel.resolve(world_size)
        self.faults.check_world(world_size)
        _layout(layout.check_batch, dp=par.dp, tp=par.tp, pp=par.pp, fsdp=par.fsdp, batch_size=self.data.batch_size,
                grad_accum=self.optim.grad_accum, microbatches=par.microbatches, schedule=par.schedule)
        return dataclasses.replace(self, parallel=par)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------- loading
_SECTIONS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _coerce(value, typ, where: str):
    """Convert a TOML/CLI value to a field's type, naming the field on failure."""
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if isinstance(value, str):
                low = value.lower()
                if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(value)
                return low in ("1", "true", "yes", "on")
            return bool(value)
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return str(value)
        if origin is tuple:
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            return tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={value!r} is not a valid {getattr(typ, '__name__', typ)}") from None
    return value


def _build(cls, values: dict, where: str):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    _check(not unknown, f"unknown config key(s) {', '.join(f'{where}.{k}'.lstrip('.') for k in unknown)}")
    kwargs = {}
    for name, value in values.items():
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            _check(isinstance(value, dict), f"config section [{name}] must be a table")
            kwargs[name] = _build(typ, value, name)
        else:
            kwargs[name] = _coerce(value, typ, f"{where}.{name}".lstrip("."))
    return cls(**kwargs)


def load(path: str | None, overrides: dict[str, object]) -> TrainConfig:
    """TOML file (optional) + dotted overrides such as {"parallel.tp": 2} → a validated TrainConfig."""
    tree: dict = {}
    if path:
        p = Path(path)
        _check(p.is_file(), f"config file {path!r} does not exist")
        try:
            tree = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    for dotted, value in overrides.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            _check(isinstance(node, dict), f"config key {dotted!r} crosses a non-table value")
        node[leaf] = value
    return _build(TrainConfig, tree, "")


# ------------------------------------------------------------------------------------------------- CLI
# The flags both entry points share (`torchrun -m meshscope.trainer.train` and `meshscope train`): flag -> dotted key.
FLAGS: dict[str, tuple[str, type, str]] = {
    "--dp": ("parallel.dp", int, "data-parallel degree (default: world / (tp*pp))"),
    "--tp": ("parallel.tp", int, "tensor-parallel degree"),
    "--pp": ("parallel.pp", int, "pipeline-parallel degree"),
    "--schedule": ("parallel.schedule", str, "pipeline schedule: " + ", ".join(SCHEDULES)),
    "--microbatches": ("parallel.microbatches", int, "pipeline microbatches per step (default: pp)"),
    "--virtual-stages": ("parallel.virtual_stages", int, "stages per rank for the interleaved schedule"),
    "--model": ("model.flavor", str, f"model flavor: {', '.join(FLAVORS)}"),
    "--seq-len": ("model.seq_len", int, "sequence length (default: the flavor's)"),
    "--batch-size": ("data.batch_size", int, "global batch (sequences per optimizer step)"),
    "--data": ("data.source", str, "synthetic or corpus"),
    "--lr": ("optim.lr", float, "peak learning rate"),
    "--grad-accum": ("optim.grad_accum", int, "gradient accumulation steps"),
    "--steps": ("steps", int, "optimizer steps"),
    "--seed": ("seed", int, "random seed"),
    "--device": ("device", str, "auto, cpu or cuda"),
    "--log-every": ("log_every", int, "print every N steps"),
    "--store": ("telemetry.store", str, "meshscope run store (telemetry on when set)"),
    "--run": ("telemetry.run", str, "run name in the store (under raw torchrun use --run-name: torchrun's "
              "parser takes --run for an abbreviation of its own --run-path)"),
    "--run-name": ("telemetry.run", str, "same as --run"),
    "--peak-flops": ("telemetry.peak_flops", float, "override the per-device peak FLOP/s for MFU"),
    "--profile-dir": ("profile.dir", str, "write a torch.profiler Chrome trace per rank here"),
    "--profile-steps": ("profile.steps", str, "steps to profile, A:B"),
    "--checkpoint-dir": ("checkpoint.dir", str, "checkpoint directory (torch.distributed.checkpoint)"),
    "--checkpoint-every": ("checkpoint.every", int, "save every N steps"),
    "--straggler-ranks": ("faults.straggler_ranks", str, "fault: comma-separated straggler ranks"),
    "--straggler-seconds": ("faults.straggler_seconds", float, "fault: extra compute seconds per step"),
    "--straggler-from-step": ("faults.straggler_from_step", int, "fault: first straggling step"),
    "--hang-rank": ("faults.hang_rank", int, "fault: rank that hangs"),
    "--hang-step": ("faults.hang_step", int, "fault: step at which it hangs"),
    "--crash-rank": ("faults.crash_rank", int, "fault: rank that exits"),
    "--crash-step": ("faults.crash_step", int, "fault: step at which it exits"),
    "--nan-step": ("faults.nan_step", int, "fault: step with a non-finite loss"),
    "--desync-rank": ("faults.desync_rank", int, "fault: rank that issues an all-gather where the others all-reduce"),
    "--desync-step": ("faults.desync_step", int, "fault: step of the desync"),
    "--first-step-seconds": ("faults.first_step_seconds", float, "fault: every rank's first step this much slower"),
}
SWITCHES: dict[str, tuple[str, str]] = {
    "--fsdp": ("parallel.fsdp", "shard the dp dimension with FSDP2 (default: DDP)"),
    "--sequence-parallel": ("parallel.sequence_parallel", "sequence parallel with tp"),
    "--activation-checkpoint": ("model.activation_checkpoint", "recompute each block's activations"),
    "--compile": ("model.compile", "torch.compile each transformer block (for GPUs; compiling takes a while)"),
    "--resume": ("checkpoint.resume", "resume from the latest checkpoint in --checkpoint-dir"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="TOML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key, e.g. --set optim.warmup_steps=5 (repeatable)")
    for flag, (_, typ, help_) in FLAGS.items():
        parser.add_argument(flag, type=str, default=None, help=help_)
    for flag, (_, help_) in SWITCHES.items():
        parser.add_argument(flag, action="store_true", default=None, help=help_)


def parser(prog: str) -> argparse.ArgumentParser:
    p = ArgParser(prog=prog, description="The meshscope reference trainer: a GPT-style model under DDP, FSDP2, TP "
                                         "and PP.")
    add_arguments(p)
    return p


def from_args(ns: argparse.Namespace) -> TrainConfig:
    overrides: dict[str, object] = {}
    for item in ns.set:
        key, sep, value = item.partition("=")
        _check(bool(sep) and bool(key), f"--set {item!r} must look like KEY=VALUE")
        overrides[key.strip()] = value.strip()
    for flag, (key, _, _) in FLAGS.items():
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is not None:
            overrides[key] = value
    for flag, (key, _) in SWITCHES.items():
        if getattr(ns, flag[2:].replace("-", "_")):
            overrides[key] = True
    return load(ns.config, overrides)


def dumps(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)
