"""A NaN loss is never hidden: real runs whose loss goes NaN (the reference trainer's ``--nan-step``, one step
NaN and training goes on; a plain script under ``meshscope run`` whose loss is NaN from a step on) say so in
``report`` (a warning, "loss non-finite (NaN)", never "loss n/a"), on the Overview (a red mark at each
non-finite step) and to the existing alert (its counter, under promtool)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pyarrow as pa
import pytest
import yaml
from prometheus_client.registry import CollectorRegistry

from meshscope.agent.collector.exposition import MeshscopeCollector
from meshscope.agent.store.reader import Store, read_table
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.contract import SCHEMAS
from meshscope.dashboard import views
from tests.support.jobs import ROOT, losses, single
from tests.test_zerocode import ingest, meshscope_run, printed_losses

STEPS, NAN_STEP = 8, 3
# A plain loop whose loss turns NaN at step NAN_STEP and stays so (a diverged job): no meshscope in it.
DIVERGES = ("import torch\ntorch.manual_seed(0)\nm = torch.nn.Linear(8, 8)\n"
            "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            f"for i in range({STEPS}):\n    loss = m(torch.randn(4, 8)).pow(2).mean()\n"
            f"    if i >= {NAN_STEP}:\n        loss = loss * float('nan')\n"
            "    loss.backward()\n    opt.step()\n    opt.zero_grad()\n    print(f'step {i} loss {loss.item():.6f}')\n")


@pytest.fixture(scope="module")
def nan_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("nan")
    trainer = single("--steps", str(STEPS), "--nan-step", str(NAN_STEP), "--store", str(root), "--run-name", "nan-once")
    job = meshscope_run(root, "--store", str(root), "--run", "nan-on", "--", sys.executable, "-c", DIVERGES)
    assert job.returncode == 0, job.stderr[-3000:]
    ingest(root)
    return root, losses(trainer.stdout), printed_losses(job.stdout)


def report(store, run: str, *flags: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "meshscope", "report", "--store", str(store), "--run", run, *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_a_diverged_job_is_reported_non_finite_never_n_a(nan_store):
    store, _, printed = nan_store
    bad = [s for s, v in printed.items() if math.isnan(v)]  # the job's own account
    assert bad == list(range(NAN_STEP, STEPS))
    rep = json.loads(report(store, "nan-on", "--json").stdout)
    assert rep["loss"] is None and rep["loss_last"] is None
    assert rep["loss_nonfinite"] == {"rank_steps": len(bad), "of_rank_steps": STEPS, "first_step": bad[0],
                                     "nan": True, "last": True}
    assert f"Loss non-finite (NaN) on {len(bad)} of {STEPS} rank-steps from step {bad[0]}." in rep["warnings"]
    text = report(store, "nan-on").stdout
    assert "loss non-finite (NaN)" in text and "loss n/a" not in text
    assert f"WARNING Loss non-finite (NaN) on {len(bad)} of {STEPS} rank-steps from step {bad[0]}." in text


def test_one_nan_step_of_the_trainer_is_warned_and_marked_red_on_the_overview(nan_store):
    store, printed, _ = nan_store
    assert [s for s, v in printed.items() if math.isnan(v)] == [NAN_STEP]  # the trainer's own log
    rep = json.loads(report(store, "nan-once", "--json").stdout)
    # training went on: the last loss is finite and is the trainer's own last one
    assert rep["loss"] == pytest.approx(printed[STEPS - 1], rel=1e-3)
    assert rep["loss_nonfinite"] == {"rank_steps": 1, "of_rank_steps": STEPS, "first_step": NAN_STEP, "nan": True,
                                     "last": False}
    assert any(w.startswith(f"Loss non-finite (NaN) on 1 of {STEPS} rank-steps from step {NAN_STEP}")
               for w in rep["warnings"])
    ov = views.overview(views.direct_loader(Store.open(store)), run="nan-once", runs=["nan-once"], steps=None)
    assert ov.warnings[0].startswith("Loss non-finite (NaN)")  # the page shows the view's warnings first
    fig = ov.figures["loss"]
    (mark,) = [t for t in fig.data if t.name == "loss NaN"]
    assert list(mark.x) == [NAN_STEP] and mark.marker.color == "#d50000"
    (line,) = [t for t in fig.data if t.name == "nan-once"]
    assert NAN_STEP not in list(line.x) and len(line.x) == STEPS - 1
    assert [a.text for a in fig.layout.annotations] == [f"loss NaN on 1 rank-step from step {NAN_STEP}"]


def _counter_series(store, run: str) -> list[float]:
    """``meshscope_rank_nonfinite_loss_total`` of rank 0 as the agent exposes it, scraped after each step's
    record is folded in (the agent's own state and exposition, fed the run's stored step rows)."""
    rows = read_table(store, "step", run=run).sort_values("step")
    state, values = MetricsState(), []
    for i in range(len(rows)):
        one = rows.iloc[[i]][list(SCHEMAS["step"].names)]
        state.observe("step", pa.Table.from_pandas(one, schema=SCHEMAS["step"], preserve_index=False),
                      run=run, rank=0, attempt=0, now=1e9 + i)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(MeshscopeCollector(state, host="n0", version="test"))
        values.append(registry.get_sample_value("meshscope_rank_nonfinite_loss_total", {"run": run, "rank": "0"}))
    return values


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_the_existing_alert_fires_on_the_runs_counter(nan_store, tmp_path):
    store, _, _ = nan_store
    counts = _counter_series(store, "nan-once")
    assert counts == [0] * NAN_STEP + [1] * (STEPS - NAN_STEP)
    rules = ROOT / "grafana" / "prometheus" / "tests" / "rules" / "labels-only.rules.yml"
    labels = 'run="nan-once",rank="0",instance="n0:9477",job="meshscope"'
    spec = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": f"meshscope_rank_nonfinite_loss_total{{{labels}}}",
                          "values": " ".join(str(int(c)) for c in counts)}],
        "alert_rule_test": [
            {"eval_time": f"{NAN_STEP - 1}m", "alertname": "MeshscopeNonFiniteLoss"},  # quiet before
            {"eval_time": f"{NAN_STEP}m", "alertname": "MeshscopeNonFiniteLoss", "exp_alerts": [{"exp_labels": {
                "severity": "critical", "run": "nan-once", "rank": "0", "instance": "n0:9477", "job": "meshscope"}}]},
        ]}]}
    path = tmp_path / "nan.yml"
    path.write_text(yaml.safe_dump(spec))
    out = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_non_finite_loss_is_one_event_per_streak(nan_store):
    """The trainer's one NaN step and the script's NaN from step 3 on: each streak is one event, at its first
    step (a diverged job is not an event a step)."""
    store, _, _ = nan_store
    for run in ("nan-once", "nan-on"):
        events = read_table(store, "event", run=run)
        bad = events[events["kind"] == "nonfinite_loss"]
        assert bad["step"].tolist() == [NAN_STEP], (run, events[["kind", "step", "message"]])
        assert "nan" in bad["message"].iloc[0].lower()


def test_the_overview_page_says_non_finite_and_why_charts_are_absent(nan_store, monkeypatch):
    from streamlit.testing.v1 import AppTest

    store, _, _ = nan_store
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(store)])
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=60).run()
    assert at.sidebar.selectbox[0].value == "nan-on"  # the newest run is the focus
    at.switch_page("app_pages/overview.py")
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any(w.value.startswith("Loss non-finite (NaN) on 5 of 8 rank-steps from step 3") for w in at.warning)
    assert {m.label: m.value for m in at.metric}["loss (last)"] == "non-finite (NaN)"
    # A float-input model: no tokens, so neither throughput nor MFU; each says why in one line, no empty axes.
    notes = [i.value for i in at.info]
    assert any(n.startswith("Throughput n/a: no step recorded its tokens") for n in notes), notes
    assert any(n.startswith("MFU n/a: ") for n in notes), notes
    ov = views.overview(views.direct_loader(Store.open(store)), run="nan-on", runs=["nan-on"], steps=None)
    assert set(ov.notes) == {"tokens", "mfu"} and set(ov.figures) >= {"loss"}
    (mark,) = [t for t in ov.figures["loss"].data if t.name == "loss NaN"]
    assert list(mark.x) == list(range(NAN_STEP, STEPS))
