"""Every dashboard page under AppTest on a store produced by small real training runs of the reference
trainer (a pipeline run and a DDP run, written by the real spool → agent path), not a synthetic one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from tests.test_telemetry_e2e import run_job

pytestmark = pytest.mark.gloo
APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
PAGES = ["runs", "overview", "pipeline", "communication", "memory", "scaling", "whatif", "gpu", "live"]


@pytest.fixture(scope="module")
def real_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("real")
    run_job(root, "ddp-real", 2, "--steps", "5")
    run_job(root, "pp-real", 2, "--steps", "5", "--pp", "2", "--schedule", "1f1b", "--microbatches", "4")
    return root


def every_page_renders(monkeypatch, store: Path, *, focus: str) -> dict[str, int]:
    """Every page under AppTest on ``store`` with ``focus`` as the sidebar's run: no exception, no error
    box; the number of charts each page draws."""
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(store)])
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not at.exception
    assert at.sidebar.selectbox[0].value == focus  # the newest run is the focus
    charts = {}
    for page in PAGES:
        at.switch_page(f"app_pages/{page}.py")
        at.run()
        assert not at.exception, (page, at.exception)
        assert not at.error, (page, [e.value for e in at.error])
        charts[page] = len(at.get("plotly_chart"))
    return charts


def test_every_page_on_a_real_training_store(monkeypatch, real_store):
    charts = every_page_renders(monkeypatch, real_store, focus="pp-real")
    # The pages that have data in a CPU pipeline run draw it (no GPU samples on CPU, no Prometheus here).
    for page in ("overview", "pipeline", "communication", "memory"):
        assert charts[page] >= 1, (page, charts)
