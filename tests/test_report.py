"""``meshscope report``: the pages' verdicts in the terminal, from the same views (synthetic stores; the real
runs' verdicts are checked in tests/test_verdicts_e2e.py and tests/test_telemetry_e2e.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshscope.agent.store.reader import Store
from meshscope.dashboard import report, views
from tests.support.store import Straggler, SyntheticConfig, write_store
from tests.support.jobs import ROOT


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    base = tmp_path_factory.mktemp("report")
    write_store(base, config=SyntheticConfig(run="pp", mesh={"pp": 2, "dp": 2}, steps=12, schedule="1F1B"))
    write_store(base, config=SyntheticConfig(run="slow", mesh={"dp": 4}, steps=12,
                                      straggler=Straggler(rank=2, factor=1.6, cause="compute")))
    return base


def test_report_is_what_the_pages_compute(store):
    load = views.direct_loader(Store.open(store))
    rep = report.build(load, run="slow")
    ov = views.overview(load, run="slow", runs=["slow"], steps=None)
    assert [s["rank"] for s in rep["stragglers"]] == ov.stragglers["rank"].tolist() == [2]
    assert rep["straggler_cost_s_per_step"] == pytest.approx(ov.metrics["cost_s"])
    assert rep["breakdown"]["per_rank"][2]["compute_s"] == pytest.approx(ov.breakdown["compute_s"].iloc[2])
    assert rep["pipeline"] is None and rep["world_size"] == 4
    pp = report.build(load, run="pp")
    pipe = views.pipeline(load, run="pp", steps=None)
    assert pp["pipeline"]["theory"] == pytest.approx(pipe.theory) and pp["pipeline"]["p"] == 2
    assert [s["schedule_share"] for s in pp["pipeline"]["stages"]] == pytest.approx(pipe.stages["schedule_share"].tolist())
    assert pp["straggler_verdict"] and rep["straggler_verdict"]  # pp x dp: two ranks per stage
    assert "fill & drain" in report.format_text(pp) and "STRAGGLER rank 2" in report.format_text(rep)


def test_cli_json_and_one_line_errors(store):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "meshscope.cli", "report", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    ok = cli("--store", str(store), "--run", "slow", "--json", "--steps", "3:11")
    assert ok.returncode == 0, ok.stderr
    rep = json.loads(ok.stdout)
    assert rep["steps"] == [3, 11] and {"run", "world_size", "warmup_steps_excluded", "stragglers", "pipeline",
                                        "breakdown", "mfu", "warnings"} <= set(rep)
    for args, needle in [(("--store", str(store), "--run", "nope"), "no run 'nope'"),
                         (("--store", str(store / "missing"), "--run", "slow"), "missing"),
                         (("--store", str(store), "--run", "slow", "--steps", "9:3"), "--steps"),
                         (("--run", "slow"), "--store")]:
        bad = cli(*args)
        assert bad.returncode == 2 and needle in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def test_a_short_run_gets_no_straggler_verdict_and_events_are_reported(store):
    load = views.direct_loader(Store.open(store))
    rep = report.build(load, run="slow", steps=(5, 7))
    assert rep["verdict_steps"] == 3 and any(w.startswith("Only 3 steps") for w in rep["warnings"])
    assert "no straggler verdict: only 3 steps" in report.format_text({**rep, "stragglers": []})
    assert rep["events"] == {"counts": {}, "key_event": None} and rep["attempts"] == 1
