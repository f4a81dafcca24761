"""The generic top-level names (agent, trainer, dashboard exist on PyPI) must resolve to this project."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["agent", "trainer", "dashboard", "meshscope_cli"])
def test_imported_package_is_this_project(name):
    mod = importlib.import_module(name)
    path = Path(mod.__file__).resolve()
    assert ROOT in path.parents, f"{name} imported from {path}, not from {ROOT}"


def test_cli_dispatches_known_commands(capsys):
    import meshscope_cli

    assert meshscope_cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("train", "agent", "export-trace", "dashboard"):
        assert cmd in out
    assert meshscope_cli.main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err
