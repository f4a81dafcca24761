"""``meshscope sweep``'s smallest grid end to end: real torchrun jobs recorded in the store, and the
Scaling page's figures computed from that store agree with the step records themselves."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from agent.collector.store import read_table
from tests.conftest import ROOT, trainer_env

pytestmark = pytest.mark.gloo


def test_smallest_sweep_records_strong_and_weak_scaling(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "meshscope_cli", "sweep", "--store", str(tmp_path), "--world-sizes", "1,2",
         "--strategies", "ddp", "--scaling", "strong,weak", "--steps", "5", "--name", "s"],
        cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    names = {"s-base-single-w1": (1, 8), "s-strong-ddp-w2": (2, 8), "s-weak-ddp-w2": (2, 16)}
    runs = read_table(tmp_path, "run")
    assert set(runs["run"]) == set(names)
    for name, (world, batch) in names.items():
        r = runs[runs["run"] == name]
        assert set(r["world_size"]) == {world} and set(r["global_batch"]) == {batch}
    step = read_table(tmp_path, "step")
    assert len(step) == sum(5 * w for w, _ in names.values())

    # The Scaling page's view over this store.
    from dashboard import views
    from dashboard.store import Store

    view = views.scaling(views.direct_loader(Store.open(tmp_path)), selected=list(names), focus=None)
    table = view.table.set_index("run")
    assert set(table.index) == set(names)
    # Independent truth: tokens/s from the step records (global batch × seq / median of the slowest
    # rank's wall time per step), and the efficiency formulas applied by hand.
    seq = 64

    def tokens_per_s(run: str) -> float:
        s = step[step["run"] == run].groupby("step")["wall_s"].max()
        return names[run][1] * seq / statistics.median(s)

    base = tokens_per_s("s-base-single-w1")
    for run, (world, _) in names.items():
        assert table.loc[run, "tokens_per_s"] == pytest.approx(tokens_per_s(run), rel=1e-6)
        assert table.loc[run, "speedup"] == pytest.approx(tokens_per_s(run) / base, rel=1e-6)
    strong = table.loc["s-strong-ddp-w2"]
    assert strong["strong_efficiency"] == pytest.approx(tokens_per_s("s-strong-ddp-w2") / base / 2, rel=1e-6)
    weak = table.loc["s-weak-ddp-w2"]
    assert weak["weak_efficiency"] == pytest.approx(tokens_per_s("s-weak-ddp-w2") / (2 * base), rel=1e-6)
    assert table["best"].sum() == 1
    assert "speedup" in view.figures and view.fit is not None
    assert "tokens/s" in proc.stdout and "s-weak-ddp-w2" in proc.stdout


def test_sweep_bad_input_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "meshscope_cli", "sweep", "--store", "x", "--strategies", "zz"],
                          cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "meshscope sweep: error: unknown strategy 'zz' (choose from ddp, fsdp, tp, pp, fsdp-tp)"
