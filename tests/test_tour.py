"""The README tour as a new user runs it: `meshscope train --store runs`, then the commands `train` prints at
its end (ingest, report, dashboard), verbatim. The run's records reach the store and every chart of the
Overview has data (the round-one tour ended on "No runs in the store")."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import trainer_env

pytestmark = pytest.mark.gloo


def _meshscope(argv: list[str], cwd) -> subprocess.CompletedProcess:
    assert argv[0] == "meshscope", argv
    return subprocess.run([sys.executable, "-m", "meshscope_cli", *argv[1:]], cwd=cwd, env=trainer_env(),
                          capture_output=True, text=True, timeout=300)


def test_the_tour_ends_on_charts(tmp_path):
    train = _meshscope(["meshscope", "train", "--nproc", "2", "--steps", "8", "--store", "runs"], cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-2000:]
    run = re.search(r"meshscope train: run '([^']+)' recorded in runs", train.stderr).group(1)
    printed = [line.split("#")[0].strip() for line in train.stderr.splitlines() if line.startswith("  meshscope ")]
    assert [shlex.split(c)[1] for c in printed] == ["ingest", "report", "dashboard"], printed
    ingest = _meshscope(shlex.split(printed[0]), cwd=tmp_path)
    assert ingest.returncode == 0, ingest.stderr
    report = _meshscope(shlex.split(printed[1]) + ["--json"], cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    rep = json.loads(report.stdout)
    assert rep["run"] == run and rep["world_size"] == 2 and rep["steps"] == [0, 7]
    assert rep["breakdown"]["mean_over_ranks"]["compute_s"] > 0 and rep["tokens_per_s"] > 0
    assert rep["warmup_steps_excluded"] >= 1  # the run's first step at least

    from dashboard import views
    from dashboard.store import Store

    ov = views.overview(views.direct_loader(Store.open(tmp_path / "runs")), run=run, runs=[run], steps=None)
    for name in ("tokens", "mfu", "loss", "breakdown", "heatmap", "cost"):
        fig = ov.figures[name]
        assert any(len(t.x if t.x is not None else []) or len(t.z if t.z is not None else []) for t in fig.data), name
