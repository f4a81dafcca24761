"""What meshscope installs and where it comes from: the layout's folders under the ``meshscope`` namespace."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, folder", [
    ("meshscope.agent", "agent"), ("meshscope.trainer", "trainer"), ("meshscope.dashboard", "dashboard"),
    ("meshscope.grafana", "grafana"), ("meshscope.cli", "meshscope"),
])
def test_namespaced_packages_are_this_checkouts_folders(name, folder):
    path = Path(importlib.import_module(name).__file__).resolve()
    assert path.parent == ROOT / folder, f"{name} imported from {path}, not from {ROOT / folder}"


def test_the_generic_names_are_not_installed(tmp_path):
    """Outside the checkout (no cwd on sys.path), ``agent``, ``trainer`` and ``dashboard`` are not
    meshscope's: the installed distribution only provides ``meshscope.*``."""
    code = ("import importlib.util, json; print(json.dumps({n: (s.origin if (s := importlib.util.find_spec(n)) "
            "else None) for n in ('agent', 'trainer', 'dashboard', 'streamlit_app', 'meshscope_cli')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    import json

    found = {k: v for k, v in json.loads(out.stdout).items() if v and str(ROOT) in v}
    assert found == {}, f"meshscope installs generic top-level names: {found}"


def test_import_meshscope_is_light_and_lazy():
    """``import meshscope`` (what ``meshscope agent`` and the CLI load first) never imports torch; the
    public names load their module on first use."""
    code = ("import sys, meshscope; assert 'torch' not in sys.modules, 'torch'; "
            "t = meshscope.Telemetry; assert t.__module__ == 'meshscope.agent.instrument.telemetry'; "
            "print(meshscope.version())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_cli_dispatches_known_commands(capsys):
    import meshscope.cli

    assert meshscope.cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("train", "agent", "export-trace", "dashboard"):
        assert cmd in out
    assert meshscope.cli.main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


def test_version_is_the_installed_distributions(capsys):
    from importlib import metadata

    import meshscope.cli

    assert meshscope.cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"meshscope {metadata.version('meshscope')}"


def test_metrics_doc_table_is_generated_from_the_catalog():
    from meshscope.agent import catalog

    text = (ROOT / "docs" / "metrics.md").read_text()
    begin, end = "<!-- metrics:begin -->\n", "<!-- metrics:end -->"
    table = text[text.index(begin) + len(begin): text.index(end)]
    assert table == catalog.markdown_table(), "docs/metrics.md metric table is stale: python -m meshscope.agent.catalog"


def test_readme_shows_exactly_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
    assert "make demo" in (ROOT / "Makefile").read_text() or "demo:" in (ROOT / "Makefile").read_text()
