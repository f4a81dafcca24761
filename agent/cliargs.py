"""The one shape of every meshscope command line: a user's mistake (a bad flag, path, run name or URL) is
one line on stderr naming the value, and exit status 2, never a usage dump or a traceback.

Every command parses with :class:`ArgParser` and raises :class:`UsageError` for what it checks itself;
:func:`run_command` turns that into the line and the exit status. The trainer's and the dashboard's
``ConfigError`` is this class, so a config dataclass validated at construction reports the same way."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


class UsageError(ValueError):
    """A user's mistake; the message is one line that names the bad value."""


class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are a :class:`UsageError` (argparse would print the usage and exit itself)."""

    def error(self, message: str):
        raise UsageError(message)


def run_command(*, prog: str, parser: argparse.ArgumentParser, argv: list[str] | None,
                body: Callable[[argparse.Namespace], int | None]) -> int:
    """A command's shell: ``-h`` prints the help, ``body(parsed args)`` returns the exit code, and a
    UsageError (from the flags, or raised by ``body``) is ``<prog>: error: <message>`` and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(x in ("-h", "--help") for x in argv):
        parser.print_help()
        return 0
    try:
        return int(body(parser.parse_args(argv)) or 0)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
