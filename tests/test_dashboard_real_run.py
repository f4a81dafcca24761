"""Every dashboard page under AppTest on a store produced by real training runs of the reference trainer (the
session's DDP and 1F1B pipeline reference runs, written by the real spool → agent path), not a synthetic one."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from meshscope.agent.store.reader import Store, read_table
from meshscope.dashboard import analysis, report, views
from tests.support.jobs import REFERENCE_STEPS as STEPS

pytestmark = pytest.mark.gloo
APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
PAGES = ["runs", "overview", "pipeline", "communication", "memory", "scaling", "compare", "whatif", "gpu", "live"]


@pytest.fixture(scope="module")
def real_store(reference_runs, tmp_path_factory) -> Path:
    return reference_runs.store_of("ddp", "pp-1f1b", into=tmp_path_factory.mktemp("real"))


def every_page_renders(monkeypatch, store: Path, *, focus: str, linked: bool = False) -> dict[str, int]:
    """Every page under AppTest on ``store`` with ``focus`` as the sidebar's run (the newest run, or the one a
    shared link ``?run=`` names when ``linked``): no exception, no error box; the number of charts each page
    draws."""
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(store)])
    at = AppTest.from_file(str(APP), default_timeout=60)
    if linked:
        at.query_params["run"] = focus
    at.run()
    assert not at.exception
    assert at.sidebar.selectbox[0].value == focus
    charts = {}
    for page in PAGES:
        at.switch_page(f"app_pages/{page}.py")
        at.run()
        assert not at.exception, (page, at.exception)
        assert not at.error, (page, [e.value for e in at.error])
        charts[page] = len(at.get("plotly_chart"))
    return charts


def test_every_page_on_a_real_training_store(monkeypatch, real_store):
    charts = every_page_renders(monkeypatch, real_store, focus="pp-1f1b", linked=True)
    # The pages that have data in a CPU pipeline run draw it (no GPU samples on CPU, no Prometheus here).
    for page in ("overview", "pipeline", "communication", "memory"):
        assert charts[page] >= 1, (page, charts)


def test_report_overview_and_communication_state_one_set_of_step_figures(real_store):
    """On a real DDP run: the headline step time is named (median and mean), the breakdown is means that sum to
    the mean, and the Communication page's exposed communication is the same figure as ``report``'s; each
    checked against the raw records, read without the views."""
    load = views.direct_loader(Store.open(real_store))
    rep = report.build(load, run="ddp")
    raw = read_table(real_store, "step", run="ddp")
    first = rep["first_steady_step"]
    steady = raw[raw["step"] >= first]
    assert rep["figures_steps"] == [first, int(raw["step"].max())]
    assert rep["figures_rank_steps"] == len(steady) == 2 * (STEPS - first)  # 2 ranks, steps first..STEPS-1
    assert rep["step_time_s_median"] == rep["step_time_s"] == pytest.approx(float(np.median(steady["wall_s"])))
    assert rep["step_time_s_mean"] == pytest.approx(float(steady["wall_s"].mean()))
    means = rep["breakdown"]["mean_per_rank_step"]
    for part in analysis.BREAKDOWN:
        assert means[part] == pytest.approx(float(steady[part].mean()))
    assert sum(means[p] for p in analysis.BREAKDOWN) == pytest.approx(rep["step_time_s_mean"], rel=1e-9)
    assert means["sum_s"] == rep["step_time_s_mean"]
    ov = views.overview(load, run="ddp", runs=["ddp"], steps=None)
    assert (ov.metrics["step_time_s"], ov.metrics["step_time_s_mean"]) == (rep["step_time_s_median"],
                                                                           rep["step_time_s_mean"])
    comm = views.communication(load, run="ddp", steps=None)
    assert comm.step_time == ov.step_time  # one function, one set of rows: the same figures, exactly
    assert comm.step_time["exposed_comm_s"] == means["exposed_comm_s"]
    # The page's per-op table: the collective records' waits over the same steady steps, per rank-step.
    coll = read_table(real_store, "collective", run="ddp")
    coll = coll[coll["step"] >= first]
    assert comm.op_steps == (first, int(raw["step"].max()))
    assert comm.summary["exposed_s"].sum() == pytest.approx(coll["wait_s"].sum() / len(steady))
    text = report.format_text(rep)
    assert " median, " in text and " mean · " in text and "tokens/s (median)" in text
    assert "= " in text.split("per step (mean over rank-steps): ")[1] and "the mean step time" in text
