"""``meshscope agent`` and ``meshscope ingest``.

    meshscope agent --store DIR [--port 9477] [--host 127.0.0.1] [--poll-interval 1] [--once]
    meshscope ingest --store DIR

Bad input (missing or unwritable store, bad port, unparsable numbers) gives one error line naming the
value and exit status 2. The agent binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from agent.collector.agent import Agent, AgentConfig
from agent.collector.gpu import load_nvml
from agent.collector.ingest import IngestConfig
from agent.instrument.recorder import AnchoredClock


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump, no traceback
        raise UsageError(message)


def _build_parser(prog: str, *, agent: bool) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Follow rank spools under a store, serve /metrics, write the run store."
                if agent else "Ingest every spool under a store once into the run store, then exit.")
    p.add_argument("--store", required=True, type=Path, help="the run store directory (must exist)")
    if agent:
        p.add_argument("--port", type=int, default=9477, help="HTTP port for /metrics (0: any free port)")
        p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        p.add_argument("--poll-interval", type=float, default=1.0, metavar="S", help="seconds between polls")
        p.add_argument("--once", action="store_true", help="ingest what is there, write the store, exit")
        p.add_argument("--run-ttl", type=float, default=600.0, metavar="S",
                       help="drop a run's series this long after its last record")
        p.add_argument("--gpu-interval", type=float, default=5.0, metavar="S",
                       help="seconds between NVML samples (0: no GPU sampling)")
        p.add_argument("--part-age", type=float, default=30.0, metavar="S",
                       help="write buffered records to the store at least this often")
        p.add_argument("--part-bytes", type=int, default=IngestConfig().part_target_bytes, metavar="N",
                       help="spool bytes per Parquet part")
    return p


def _check_store(store: Path) -> None:
    if not store.exists():
        raise UsageError(f"store directory {str(store)!r} does not exist")
    if not store.is_dir():
        raise UsageError(f"store {str(store)!r} is not a directory")
    try:  # a real write: as root os.access() says yes even on a read-only mount
        (store / "agent").mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=store / "agent", prefix=".probe-"):
            pass
    except OSError as exc:
        raise UsageError(f"store directory {str(store)!r} is not writable ({exc.strerror or exc})") from None


def _lock_store(store: Path) -> int:
    """One agent per store: a second one would race the first on parts and offsets. The kernel drops
    the lock when the process dies, SIGKILL included."""
    fd = os.open(store / "agent" / "agent.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(f"another meshscope agent or ingest is already writing store {str(store)!r}") from None
    return fd


def _config(args: argparse.Namespace, *, agent: bool) -> AgentConfig:
    if not agent:
        return AgentConfig(store=args.store, gpu_interval_s=0)
    try:
        return AgentConfig(
            store=args.store, host=args.host, port=args.port, poll_interval_s=args.poll_interval,
            gpu_interval_s=args.gpu_interval, run_ttl_s=args.run_ttl,
            ingest=IngestConfig(max_part_age_s=args.part_age, part_target_bytes=args.part_bytes),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _main(argv: list[str] | None, *, prog: str, agent: bool) -> int:
    try:
        args = _build_parser(prog, agent=agent).parse_args(argv)
        config = _config(args, agent=agent)
        _check_store(args.store)
        lock_fd = _lock_store(args.store)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args, config, prog=prog, once=not agent or args.once)
    finally:
        os.close(lock_fd)


def _run(args: argparse.Namespace, config: AgentConfig, *, prog: str, once: bool) -> int:
    nvml = None
    if config.gpu_interval_s > 0:
        nvml, reason = load_nvml()
        if nvml is None:
            print(f"{prog}: no GPU sampling: {reason}", file=sys.stderr)
    app = Agent(config, clock=AnchoredClock(), nvml=nvml)
    if app.ingestor.load_error:
        print(f"{prog}: warning: offsets file unreadable, recovering from parts: {app.ingestor.load_error}",
              file=sys.stderr)
    try:
        if once:
            app.run_once()
            print(f"{prog}: ingested {sum(app.state.ingested.values())} records into {args.store}", flush=True)
            return 0
        try:
            port = app.serve()
        except OSError as exc:
            print(f"{prog}: error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
        print(f"{prog}: serving http://{config.host}:{port}/metrics, store {args.store}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        app.run(stop)
        return 0
    finally:
        app.close()


def agent_main(argv: list[str] | None = None) -> int:
    return _main(argv, prog="meshscope agent", agent=True)


def ingest_main(argv: list[str] | None = None) -> int:
    return _main(argv, prog="meshscope ingest", agent=False)


if __name__ == "__main__":
    sys.exit(agent_main())
