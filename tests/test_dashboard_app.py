"""Every dashboard page under Streamlit's AppTest: a synthetic store, an empty one, a partial and corrupt
one, a missing one, and the Live page against a Prometheus-compatible HTTP server."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from meshscope.dashboard import live
from tests.support.store import Straggler, SyntheticConfig, write_store
from fake_prometheus import FakePrometheus

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
PAGES = ["runs", "overview", "pipeline", "communication", "memory", "scaling", "compare", "whatif", "gpu", "live"]
TIMEOUT = 60  # seconds per script run; a run here takes well under one


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    write_store(root, config=SyntheticConfig(run="ddp-4", mesh={"dp": 4}, steps=8, t0=1.8e9))
    write_store(root, config=SyntheticConfig(run="pp-8", mesh={"pp": 2, "fsdp": 2, "tp": 2}, steps=8,
                                             straggler=Straggler(rank=5, cause="throttle"), t0=1.8e9 + 3600))
    return root


def _app(monkeypatch, *args: str) -> AppTest:
    monkeypatch.setattr(sys, "argv", ["app.py", *args])  # what `streamlit run ... -- args` passes
    return AppTest.from_file(str(APP), default_timeout=TIMEOUT)


def _visit(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"app_pages/{page}.py")
    return at.run()


def _texts(elements) -> str:
    return " ".join(str(e.value) for e in elements)


def test_every_page_on_a_synthetic_store(monkeypatch, synthetic):
    at = _app(monkeypatch, "--store", str(synthetic)).run()
    assert not at.exception
    for page in PAGES:
        _visit(at, page)
        assert not at.exception, (page, at.exception)
        assert not at.error, (page, _texts(at.error))
        if page != "live":
            assert len(at.get("plotly_chart")) >= 1, page
    assert "Live view is off" in _texts(at.info)


def test_pages_show_what_they_found(monkeypatch, synthetic):
    at = _app(monkeypatch, "--store", str(synthetic)).run()
    # The newest run is the default focus: the pipeline run with a throttled rank 5.
    assert at.sidebar.selectbox[0].value == "pp-8"
    _visit(at, "overview")
    stragglers = at.dataframe[0].value
    assert stragglers["Rank"].tolist() == [5] and stragglers["Cause"].iloc[0].startswith("GPU throttling")
    assert any("Straggler: rank 5 (GPU throttling" in w.value for w in at.warning)
    assert any(c.value.startswith("A rank is a straggler when") for c in at.caption)
    _visit(at, "pipeline")
    assert len(at.get("plotly_chart")) == 3  # Gantt, bubble per stage, bubble trend
    assert any(m.value == "20.0%" for m in at.metric)  # theory (p-1)/(m+p-1) = 1/5 for p = 2, m = 4
    _visit(at, "scaling")
    table = at.dataframe[0].value  # human headers: "tokens/s", not tokens_per_s
    best = table.loc[table["tokens/s"].idxmax(), "run"]
    assert table["best"].sum() == 1 and table.loc[table["best"], "run"].item() == best
    assert any(m.label == "best configuration" and m.value == best for m in at.metric)


def test_every_page_on_a_store_written_by_the_agent(monkeypatch, tmp_path):
    # The agent's own path: rank spools -> `meshscope ingest` -> Parquet parts (its naming, encodings,
    # the run kind without its rank column, nullable columns for CPU memory).
    from meshscope.agent.collector.cli import ingest_main
    from tests.support.spools import write_run

    write_run(tmp_path, run="agent-run", world_size=8, steps=20, slow_rank=3)
    assert ingest_main(["--store", str(tmp_path)]) == 0
    at = _app(monkeypatch, "--store", str(tmp_path)).run()
    for page in PAGES:
        _visit(at, page)
        assert not at.exception, (page, at.exception)
    _visit(at, "overview")
    assert at.dataframe[0].value["Rank"].tolist() == [3]


def test_run_selection_is_shared_across_pages(monkeypatch, synthetic):
    at = _app(monkeypatch, "--store", str(synthetic)).run()
    at.multiselect(key="meshscope.runs_widget").set_value(["ddp-4"]).run()
    _visit(at, "overview")
    assert at.title[0].value == "Overview · ddp-4"
    _visit(at, "pipeline")
    assert "No pipeline spans" in _texts(at.info)
    _visit(at, "runs")
    assert at.multiselect(key="meshscope.runs_widget").value == ["ddp-4"]


def test_step_range_follows_a_growing_run(monkeypatch, tmp_path):
    import streamlit as st

    write_store(tmp_path, config=SyntheticConfig(run="live", mesh={"dp": 2}, steps=10))
    at = _app(monkeypatch, "--store", str(tmp_path)).run()
    assert at.sidebar.slider[0].value == (0, 9)
    write_store(tmp_path, config=SyntheticConfig(run="live", mesh={"dp": 2}, steps=20))  # the run went on
    st.cache_data.clear()  # as the cache's TTL would
    assert at.run().sidebar.slider[0].value == (0, 19)  # a range at the newest step keeps following it
    at.sidebar.slider[0].set_value((3, 12)).run()
    write_store(tmp_path, config=SyntheticConfig(run="live", mesh={"dp": 2}, steps=30))
    st.cache_data.clear()
    assert at.run().sidebar.slider[0].value == (3, 12)  # a range the user chose stays
    assert not at.exception


def test_every_page_on_an_empty_store(monkeypatch, tmp_path):
    at = _app(monkeypatch, "--store", str(tmp_path)).run()
    for page in PAGES:
        _visit(at, page)
        assert not at.exception, page
        expected = "Live view is off" if page == "live" else "No runs in the store"
        assert expected in _texts(at.info), page


def test_partial_and_corrupt_store(monkeypatch, tmp_path, synthetic):
    shutil.copytree(synthetic, tmp_path, dirs_exist_ok=True)
    tables = tmp_path / "tables"
    bad = tables / "step" / "run=pp-8" / "rank=1" / "part-00000.parquet"
    bad.write_bytes(bad.read_bytes()[:64])
    (tables / "collective" / "run=pp-8" / "rank=2" / "part-00001.parquet").write_bytes(b"not parquet")
    for kind in ("memory", "gpu"):
        shutil.rmtree(tables / kind / "run=pp-8")
    shutil.copytree(tables / "step" / "run=ddp-4" / "rank=0", tables / "step" / "run=stub" / "rank=0")
    at = _app(monkeypatch, "--store", str(tmp_path)).run()
    for page in PAGES:
        _visit(at, page)
        assert not at.exception, (page, at.exception)
        if page not in ("live",):
            assert "Skipped" in _texts(at.warning), page
    _visit(at, "memory")
    assert "No memory samples in run `pp-8`" in _texts(at.info)
    _visit(at, "gpu")
    assert "No GPU samples in run `pp-8`" in _texts(at.info)
    _visit(at, "runs")
    assert "partial: no run records" in at.dataframe[0].value["status"].tolist()


def test_missing_store_and_bad_arguments(monkeypatch, tmp_path):
    at = _app(monkeypatch, "--store", str(tmp_path / "nope")).run()
    assert not at.exception and "store directory not found" in _texts(at.sidebar.error)
    at = _app(monkeypatch).run()
    assert not at.exception and "--store" in _texts(at.error)


def test_live_page_reads_prometheus(monkeypatch, synthetic):
    with FakePrometheus(ranks=4) as prom:
        at = _app(monkeypatch, "--store", str(synthetic), "--prometheus", prom.url).run()
        _visit(at, "live")
        assert not at.exception
        assert len(at.get("plotly_chart")) == 4  # steps/s, compute, exposed comm, MFU over the last minutes
        assert any(m.value == "103" for m in at.metric)  # latest step = 100 + highest rank
        assert "Running: last record 1 s ago" in _texts(at.caption)
        expected = set(live.queries(run="live-run").values()) | set(live.series_queries(run="live-run").values())
        assert expected <= set(prom.queries)


def test_live_page_without_a_reachable_prometheus(monkeypatch, synthetic):
    at = _app(monkeypatch, "--store", str(synthetic), "--prometheus", "http://127.0.0.1:9").run()
    _visit(at, "live")
    assert not at.exception and "not reachable" in _texts(at.warning)


def test_the_run_and_step_range_are_in_the_url(monkeypatch, synthetic):
    at = _app(monkeypatch, "--store", str(synthetic))
    at.query_params["run"], at.query_params["steps"] = "ddp-4", "2:5"
    at.run()
    assert not at.exception
    assert at.sidebar.selectbox[0].value == "ddp-4" and at.sidebar.slider[0].value == (2, 5)
    at.sidebar.slider[0].set_value((3, 6)).run()
    assert at.query_params["run"] in ("ddp-4", ["ddp-4"]) and at.query_params["steps"] in ("3:6", ["3:6"])
    # A link to a run the store lacks opens the default run.
    other = _app(monkeypatch, "--store", str(synthetic))
    other.query_params["run"] = "nope"
    other.run()
    assert not other.exception and other.sidebar.selectbox[0].value == "pp-8"


def test_compare_takes_a_baseline_and_several_runs(monkeypatch, tmp_path):
    for k, straggler in enumerate((None, Straggler(rank=2, cause="throttle"), None)):
        write_store(tmp_path, config=SyntheticConfig(run=f"ddp-{k}", mesh={"dp": 4}, steps=12, seed=k,
                                                     straggler=straggler, t0=1.8e9 + 3600 * k))
    at = _app(monkeypatch, "--store", str(tmp_path)).run()
    _visit(at, "compare")
    at.selectbox(key="meshscope.compare_a").set_value("ddp-0").run()
    at.multiselect(key="meshscope.compare_bs").set_value(["ddp-1", "ddp-2"]).run()
    assert not at.exception and not at.error, (at.exception, _texts(at.error))
    several = at.dataframe[0].value
    assert several["run"].tolist() == ["ddp-1", "ddp-2"]
    # the straggler's run is the one significantly slower, and what carries it is named
    slow = several.set_index("run").loc["ddp-1"]
    assert slow["B − A (%)"] > 0 and slow["interval excludes 0"] and slow["carried by"] != "—", several
    assert any(s.value.startswith("2 runs against ddp-0") for s in at.subheader)
    assert len(at.get("plotly_chart")) >= 2 + 3  # several: parts and distributions; detail: waterfall, comm, dist
    at.selectbox(key="meshscope.compare_detail").set_value("ddp-2").run()
    assert any(s.value == "ddp-2 against ddp-0" for s in at.subheader)
    assert not at.exception and not at.error
