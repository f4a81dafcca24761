"""The dashboard's configuration: one dataclass, validated at construction, from command-line arguments.

``meshscope dashboard`` (``dashboard.cli``) validates the user's flags and hands ``--store`` (repeatable:
the stores of a multi-node job's agents, read as one) and ``--prometheus`` to the Streamlit script as
script arguments (``streamlit run app.py -- --store A --store B``); the script parses them
again with ``parse_app_args``. There are no environment variables: tests pass the same arguments through
``sys.argv``.
"""

from __future__ import annotations

import argparse
import sys
import urllib.parse
from dataclasses import dataclass


class ConfigError(ValueError):
    """A bad flag; the message is one line for the user."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AppConfig:
    stores: tuple[str, ...]  # one store, or one per node of a multi-node job (read as one)
    prometheus: str | None = None
    refresh_s: float = 5.0  # Live page refresh interval

    def __post_init__(self) -> None:
        if isinstance(self.stores, str):  # a lone path would be read as one store per character
            raise TypeError("AppConfig.stores is a tuple of directories, not a string")
        if not self.stores or not all(self.stores):
            raise ConfigError("--store DIR is required")
        if self.prometheus is not None:
            check_prometheus_url(self.prometheus)
        if not self.refresh_s > 0:
            raise ConfigError(f"--refresh must be > 0 seconds, got {self.refresh_s}")


def check_prometheus_url(url: str) -> None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"--prometheus must be an http(s)://host:port URL, got {url!r}")


def run_command(prog: str, parser: argparse.ArgumentParser, argv: list[str], body) -> int:
    """A dashboard command's shell: ``-h`` prints the help, ``body(parsed args)`` returns the exit code, and
    a ConfigError (bad flags, or raised by ``body``) is one line on stderr and exit 2, never a traceback."""
    if any(x in ("-h", "--help") for x in argv):
        parser.print_help()
        return 0
    try:
        return int(body(parser.parse_args(argv)) or 0)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are one ConfigError line (the dashboard's commands print it and exit 2)."""

    def error(self, message: str):  # argparse would print usage and exit; we want one line
        raise ConfigError(message)


def app_parser(prog: str) -> argparse.ArgumentParser:
    p = ArgParser(prog=prog, add_help=False)
    p.add_argument("--store", action="append", required=True)
    p.add_argument("--prometheus", default=None)
    p.add_argument("--refresh", type=float, default=5.0)
    return p


def parse_app_args(argv: list[str]) -> AppConfig:
    """Arguments the Streamlit script receives after ``--``."""
    a = app_parser("app.py").parse_args(argv)
    return AppConfig(stores=tuple(a.store), prometheus=a.prometheus, refresh_s=a.refresh)
