"""The dashboard's configuration: one dataclass, validated at construction, from command-line arguments.

``meshscope dashboard`` (``dashboard.cli``) validates the user's flags and hands ``--store`` (repeatable:
the stores of a multi-node job's agents, read as one) and ``--prometheus`` to the Streamlit script as
script arguments (``streamlit run app.py -- --store A --store B``); the script parses them
again with ``parse_app_args``. There are no environment variables: tests pass the same arguments through
``sys.argv``.
"""

from __future__ import annotations

import argparse
import urllib.parse
from dataclasses import dataclass

from meshscope.agent.cliargs import ArgParser
from meshscope.agent.cliargs import UsageError as ConfigError  # one error type for every command line


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
