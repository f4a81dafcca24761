"""``meshscope sweep``'s smallest grid end to end: real torchrun jobs recorded in the store, and the
Scaling page's numbers computed from that store agree with the step records themselves and with the
table the sweep prints."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from meshscope.agent.store.reader import read_table
from tests.support.jobs import ROOT, trainer_env

pytestmark = pytest.mark.gloo


def test_smallest_sweep_records_strong_and_weak_scaling(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "meshscope.cli", "sweep", "--store", str(tmp_path), "--world-sizes", "1,2",
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
    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import views

    view = views.scaling(views.direct_loader(Store.open(tmp_path)), selected=list(names), focus=None)
    per_run = view.per_run.set_index("run")
    assert set(per_run.index) == set(names)
    # Independent truth: tokens/s from the step records (global batch × seq / median of the slowest
    # rank's wall time over the steps after warm-up: step 0 here, 5 steps), and the formulas by hand.
    seq = 64

    def tokens_per_s(run: str) -> float:
        s = step[(step["run"] == run) & (step["step"] >= 1)].groupby("step")["wall_s"].max()
        return names[run][1] * seq / statistics.median(s)

    for run in names:
        assert per_run.loc[run, "steady_from"] == 1
        assert per_run.loc[run, "tokens_per_s"] == pytest.approx(tokens_per_s(run), rel=1e-6)
    table = view.table.set_index("family")
    assert sorted(table.index.unique()) == ["strong · ddp · global batch 8", "weak · ddp · batch/rank 8"]
    assert set(table["baseline"]) == {"s-base-single-w1"} and set(table["n0"]) == {1}
    base = tokens_per_s("s-base-single-w1")
    for family, run in (("strong · ddp · global batch 8", "s-strong-ddp-w2"),
                        ("weak · ddp · batch/rank 8", "s-weak-ddp-w2")):
        row = view.table[(view.table["family"] == family) & (view.table["run"] == run)].iloc[0]
        assert row["speedup"] == pytest.approx(tokens_per_s(run) / base, rel=1e-6)
        assert row["efficiency"] == pytest.approx(tokens_per_s(run) / base / 2, rel=1e-6)
    assert view.fits["fit"].isna().all()  # two world sizes: no fit, and the page says why
    assert view.fits["note"].str.startswith("No Amdahl fit").all()
    assert per_run["best"].sum() == 1
    # The sweep's printed table shows the page's numbers: the same rows, as printed.
    for r in view.table.itertuples():
        line = f"{r.run:<44} {r.world_size:>5} {r.global_batch:>5.0f} {r.tokens_per_s:>10,.0f} {r.speedup:>8.3f} " \
               f"{r.efficiency:>6.1%}"
        assert line in proc.stdout, (line, proc.stdout)
    for note in view.fits["note"]:
        assert note in proc.stdout


def test_sweep_bad_input_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "meshscope.cli", "sweep", "--store", "x", "--strategies", "zz"],
                          cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "meshscope sweep: error: unknown strategy 'zz' (choose from ddp, fsdp, tp, pp, fsdp-tp)"
