"""``meshscope train``: the one-node convenience around ``torch.distributed.run``.

It validates the whole configuration for the world it is about to launch *before* starting any process
(so a bad value gets one clear line, not a traceback from every rank), names the run once for all ranks,
then runs ``torchrun -m meshscope.trainer.train`` with the same flags.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from meshscope.agent.cliargs import ArgParser
from meshscope.trainer import config
from meshscope.trainer.config import ConfigError


def _launcher_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="meshscope train", add_help=False)
    p.add_argument("--nproc", type=int, default=1, help="processes (ranks) on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of failed workers")
    return p


def _help() -> str:
    full = config.parser("meshscope train")
    for action in _launcher_parser()._actions:
        full._add_action(action)
    return full.format_help()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(_help())
        return 0
    try:
        launch, rest = _launcher_parser().parse_known_args(argv)
        for name in ("nproc", "nnodes", "max_restarts"):
            value = getattr(launch, name)
            if value < (0 if name == "max_restarts" else 1):
                raise ConfigError(f"--{name.replace('_', '-')}={value} must be >= {0 if name == 'max_restarts' else 1}")
        cfg = config.from_args(config.parser("meshscope train").parse_args(rest))
        cfg.resolve(launch.nproc * launch.nnodes)
    except ConfigError as e:
        print(f"meshscope train: error: {e}", file=sys.stderr)
        return 2
    # torchrun's own parser would take --run for an abbreviation of its --run-path: forward --run-name.
    rest = ["--run-name" if a == "--run" else ("--run-name=" + a[6:] if a.startswith("--run=") else a) for a in rest]
    if cfg.telemetry.store and not cfg.telemetry.run and launch.nnodes > 1:
        # Each node runs its own launcher: a timestamp taken here could differ between nodes and split
        # one job into several runs.
        print("meshscope train: error: --run NAME is required with --store when --nnodes > 1 "
              "(every node must use the same name)", file=sys.stderr)
        return 2
    run_name = cfg.telemetry.run
    if cfg.telemetry.store and not run_name:
        run_name = f"{cfg.parallel.strategy.replace('+', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
        rest += ["--run-name", run_name]
    if cfg.telemetry.store:
        print(f"meshscope train: run {run_name!r}, store {cfg.telemetry.store}", file=sys.stderr)

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    targs = ["--nproc_per_node", str(launch.nproc), "--max_restarts", str(launch.max_restarts)]
    if launch.nnodes == 1:
        targs.append("--standalone")
    else:
        targs += ["--nnodes", str(launch.nnodes), "--node_rank", str(launch.node_rank),
                  "--master_addr", launch.master_addr, "--master_port", str(launch.master_port)]
    targs += ["-m", "meshscope.trainer.train", *rest]
    if launch.max_restarts > 0:
        # torchrun's shared rendezvous TCP store has no per-attempt prefix: a restarted attempt can meet
        # the previous attempt's keys and fail to connect its gloo mesh. One store per attempt avoids it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        run(get_args_parser().parse_args(targs))
    except ChildFailedError as e:
        first = min(e.failures.items(), key=lambda kv: kv[1].timestamp) if e.failures else None
        where = f"rank {first[0]} exited with code {first[1].exitcode}" if first else "a worker failed"
        print(f"meshscope train: error: {where} (its output is above)", file=sys.stderr)
        _next_steps(cfg.telemetry.store, run_name)
        return 1
    _next_steps(cfg.telemetry.store, run_name)
    return 0


def _next_steps(store: str | None, run: str | None) -> None:
    """Where the records are and the commands that show them. Both read the spools an agent has not
    ingested yet (``agent.collector.catchup``), so no ingest step comes between."""
    if not store:
        return
    q = shlex.quote
    print(f"meshscope train: run {run!r} recorded in {store}. Next:\n"
          f"  meshscope report --store {q(store)} --run {q(run or '')}\n"
          f"  meshscope dashboard --store {q(store)}", file=sys.stderr)
