"""The README tour as a new user runs it: `meshscope train --store runs`, then the commands `train` prints at
its end (report, dashboard), verbatim. No ingest step comes between: each reader takes in the spools no
agent has ingested. The report has the run's numbers, and the dashboard, served over a copy of the store
as it was when `train` ended, opens on the run with every Overview chart drawn in Chromium (the round-one
tour ended on "No runs in the store")."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.support.jobs import trainer_env
from tests.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, NON_EMPTY_PLOT, dashboard_process

pytestmark = pytest.mark.gloo


def _meshscope(argv: list[str], cwd) -> subprocess.CompletedProcess:
    assert argv[0] == "meshscope", argv
    return subprocess.run([sys.executable, "-m", "meshscope.cli", *argv[1:]], cwd=cwd, env=trainer_env(),
                          capture_output=True, text=True, timeout=300)


def test_the_tour_ends_on_charts(tmp_path):
    train = _meshscope(["meshscope", "train", "--nproc", "2", "--steps", "8", "--store", "runs"], cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-2000:]
    run = re.search(r"meshscope train: run '([^']+)' recorded in runs", train.stderr).group(1)
    printed = [line.split("#")[0].strip() for line in train.stderr.splitlines() if line.startswith("  meshscope ")]
    assert [shlex.split(c)[1] for c in printed] == ["report", "dashboard"], printed
    assert not (tmp_path / "runs" / "tables").exists()  # no agent ran: the records are only in spools
    shutil.copytree(tmp_path / "runs", tmp_path / "copy" / "runs")  # for the dashboard, as train left it
    report = _meshscope(shlex.split(printed[0]) + ["--json"], cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "Ingested" in report.stderr and "records from the spools" in report.stderr
    rep = json.loads(report.stdout)
    assert rep["run"] == run and rep["world_size"] == 2 and rep["steps"] == [0, 7]
    assert rep["breakdown"]["mean_over_ranks"]["compute_s"] > 0 and rep["tokens_per_s"] > 0
    assert rep["warmup_steps_excluded"] >= 1  # the run's first step at least

    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import views

    ov = views.overview(views.direct_loader(Store.open(tmp_path / "runs")), run=run, runs=[run], steps=None)
    for name in ("tokens", "mfu", "loss", "breakdown", "heatmap", "cost"):
        fig = ov.figures[name]
        assert any(len(t.x if t.x is not None else []) or len(t.z if t.z is not None else []) for t in fig.data), name

    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Debian chromium not installed at {CHROMIUM} (apt-get install -y chromium)")
    _overview_in_the_browser(shlex.split(printed[1]), cwd=tmp_path / "copy", run=run)


def _overview_in_the_browser(argv: list[str], *, cwd, run: str) -> None:
    from playwright.sync_api import sync_playwright

    with dashboard_process(argv[1:], cwd=cwd, env=trainer_env()) as (url, _):
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1500, "height": 3000})
                page.goto(f"{url}/overview", wait_until="domcontentloaded", timeout=30_000)
                page.wait_for_function(NON_EMPTY_PLOT, timeout=60_000)
                page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"] button')",
                                       timeout=30_000)
                assert page.locator('[data-testid="stException"]').count() == 0
                sidebar = page.locator('[data-testid="stSidebar"]').inner_text()
                assert "records from the spools" in sidebar, sidebar
                main = page.locator('[data-testid="stMain"]').inner_text()
                assert run in main and "No runs in the store" not in main, main[:1000]
                assert page.locator(".js-plotly-plot").count() >= 5
            finally:
                browser.close()
