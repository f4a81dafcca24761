"""``meshscope dashboard --store DIR [--store DIR2 ...] [--prometheus URL] [--port P] [--host 127.0.0.1]``:
serve the Streamlit dashboard over a run store (``streamlit run dashboard/app.py -- --store DIR ...``),
headless, bound to localhost unless told otherwise. Several ``--store`` read as one store: a multi-node
job's agents each write their node's ranks into their own store, and a run found in several is one run
with all of their ranks."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from meshscope.agent.cliargs import ArgParser, run_command
from meshscope.agent.store.reader import Store, StoreError
from meshscope.dashboard.config import ConfigError, check_prometheus_url

# Streamlit's entry file, beside the pages it names by relative path (app_pages/...).
APP = Path(__file__).resolve().parent / "app.py"


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="meshscope dashboard", description=(
        "Serve the Streamlit dashboard over a run store, headless, bound to localhost unless told otherwise. "
        "Several --store read as one store (a multi-node job's agents each write their own)."))
    p.add_argument("--store", action="append", required=True, metavar="DIR",
                   help="run store directory (the agent's --store) or s3://bucket/prefix (the agent's --upload); "
                        "repeat for the stores of several nodes")
    p.add_argument("--prometheus", default=None, help="Prometheus base URL for the Live page")
    p.add_argument("--port", default="8501", help="port to serve on (default 8501)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    p.add_argument("--refresh", default="5", help="Live page refresh interval, seconds (default 5)")
    return p


def build_command(argv: list[str]) -> list[str]:
    """Validate the flags and return the ``streamlit run`` command line. Raises ConfigError."""
    a = _parser().parse_args(argv)
    try:  # the reader's own checks (missing directory, stores that cannot be read together)
        stores = Store.open_many(a.store).sources
    except StoreError as e:
        raise ConfigError(str(e)) from None
    if not a.port.isdigit() or not 1 <= int(a.port) <= 65535:
        raise ConfigError(f"--port must be an integer in 1..65535, got {a.port!r}")
    try:
        refresh = float(a.refresh)
    except ValueError:
        raise ConfigError(f"--refresh must be a number of seconds, got {a.refresh!r}") from None
    if not refresh > 0:
        raise ConfigError(f"--refresh must be > 0 seconds, got {a.refresh!r}")
    if a.prometheus is not None:
        check_prometheus_url(a.prometheus)
    script_args = [arg for store in stores for arg in ("--store", str(store))] + ["--refresh", str(refresh)]
    if a.prometheus:
        script_args += ["--prometheus", a.prometheus]
    return [sys.executable, "-m", "streamlit", "run", str(APP),
            "--server.address", a.host, "--server.port", str(int(a.port)), "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
            "--client.toolbarMode", "viewer",  # no developer toolbar ("Deploy") for the people reading the pages
            "--", *script_args]


def main(argv: list[str] | None = None) -> int:
    def serve(_args: argparse.Namespace) -> int:
        cmd = build_command(argv)
        # Become the Streamlit server rather than start it as a child: a supervisor that stops this process
        # by its PID then stops the server too, instead of leaving an orphan holding the port.
        os.execv(cmd[0], cmd)
        raise AssertionError("unreachable: execv returned")

    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(prog="meshscope dashboard", parser=_parser(), argv=argv, body=serve)
