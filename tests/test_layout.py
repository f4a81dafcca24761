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


def test_version_is_the_installed_distributions(capsys):
    from importlib import metadata

    import meshscope_cli

    assert meshscope_cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"meshscope {metadata.version('meshscope')}"


def test_readme_metric_table_is_generated_from_the_catalog():
    from agent import catalog

    text = (ROOT / "README.md").read_text()
    begin, end = "<!-- metrics:begin -->\n", "<!-- metrics:end -->"
    table = text[text.index(begin) + len(begin): text.index(end)]
    assert table == catalog.markdown_table(), "README metric table is stale: python -m agent.catalog"


def test_readme_shows_exactly_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
    assert "make demo" in (ROOT / "Makefile").read_text() or "demo:" in (ROOT / "Makefile").read_text()
