"""The Scaling verdict (docs/formulas.md, Scaling): families kept apart, the baseline stated, a fit only
from enough world sizes, and one computation for the Scaling page and ``meshscope sweep``'s table."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from meshscope.agent.store.reader import Store, read_table
from meshscope.dashboard import views
from meshscope.dashboard import figures
from meshscope.dashboard.scaling import (MIN_FIT_SIZES, amdahl_fits, family_runs, no_family_reason, run_throughput,
                                         scaling_table)
from tests.support.store import SyntheticConfig, write_store
from meshscope.dashboard import sweep


def _runs(rows: list[tuple]) -> pd.DataFrame:
    """Per-run frames as ``run_throughput`` returns them: (run, strategy, world size, global batch, tokens/s)."""
    t = pd.DataFrame(rows, columns=["run", "strategy", "world_size", "global_batch", "tokens_per_s"])
    return t.assign(model="m", seq_len=64, schedule="", microbatches=0, virtual_stages=1)


def _amdahl(n: int, *, c: float, t1: float = 1e-3) -> float:
    return 1.0 / (t1 * (c + (1 - c) / n))


def test_amdahl_fit_recovers_a_known_serial_fraction():
    # Throughput from Amdahl's law with c = 0.2 at n = 1, 2, 4, 8, with ±1 % measurement noise.
    noise = {1: 1.01, 2: 0.99, 4: 1.01, 8: 0.99}
    rows = [("one", "single", 1, 8, _amdahl(1, c=0.2) * noise[1])]
    rows += [(f"ddp-w{n}", "ddp", n, 8, _amdahl(n, c=0.2) * noise[n]) for n in (2, 4, 8)]
    table = scaling_table(_runs(rows))
    assert table["family"].unique().tolist() == ["strong · ddp · global batch 8"]
    fits = amdahl_fits(table)
    fit = fits["fit"].iloc[0]
    assert fit.c == pytest.approx(0.2, abs=0.02)
    assert 0.99 < fit.r2 <= 1 and fits["rmse_rel"].iloc[0] < 0.02
    assert fits["note"].iloc[0].startswith(f"Amdahl c = {fit.c:.3f} from world sizes 1, 2, 4, 8 (R² ")
    # Exact data: exact c, R² = 1.
    exact = scaling_table(_runs([(f"w{n}", "ddp", n, 8, _amdahl(n, c=0.2)) for n in (2, 4, 8)]))
    assert amdahl_fits(exact)["fit"].iloc[0].c == pytest.approx(0.2)
    assert amdahl_fits(exact)["r2"].iloc[0] == pytest.approx(1.0)


def test_no_fit_from_two_world_sizes_and_the_reason_is_said():
    table = scaling_table(_runs([("one", "single", 1, 8, 1000.0), ("ddp-w2", "ddp", 2, 8, 370.0)]))
    fits = amdahl_fits(table)
    assert fits["fit"].iloc[0] is None and np.isnan(fits["c"].iloc[0])
    assert fits["note"].iloc[0] == (f"No Amdahl fit: 2 world sizes (1, 2); a two-parameter curve passes through "
                                    f"any two points, so a fit needs ≥ {MIN_FIT_SIZES} to say anything.")
    # The baseline is the smallest world size of the family, stated, and speedup is relative to it.
    t = table.set_index("run")
    assert t["n0"].tolist() == [1, 1] and set(t["baseline"]) == {"one"}
    assert t.loc["ddp-w2", "speedup"] == pytest.approx(0.37) and t.loc["ddp-w2", "efficiency"] == pytest.approx(0.185)


def test_a_throughput_that_falls_gets_a_sentence_not_a_fit():
    # The user's `meshscope sweep --strategies ddp --world-sizes 1,2,4` on a 2-core machine: 4 ranks on 2 cores
    # are slower than 2. Before, c was clipped to 1 and R² read 0.000, a number that looked like a fit.
    measured = [("w1", "single", 1, 8, 12974.0), ("w2", "ddp", 2, 8, 13579.0), ("w4", "ddp", 4, 8, 5818.0)]
    fits = amdahl_fits(scaling_table(_runs(measured)))
    assert fits["fit"].iloc[0] is None and np.isnan(fits["c"].iloc[0]) and np.isnan(fits["r2"].iloc[0])
    assert fits["note"].iloc[0] == (
        "No Amdahl fit: throughput does not rise with the world size beyond n=2 (speedup 1.05 at n=2, 0.45 at n=4 "
        "against n=1); Amdahl's law has it rise towards a plateau, so a fit would describe nothing measured.")
    # Never above the baseline: no "beyond".
    flat = amdahl_fits(scaling_table(_runs([("w1", "single", 1, 8, 1000.0), ("w2", "ddp", 2, 8, 990.0),
                                            ("w4", "ddp", 4, 8, 700.0)])))
    assert flat["note"].iloc[0].startswith("No Amdahl fit: throughput does not rise with the world size (speedup 0.99")
    # A plateau within noise (a 2 % dip at the largest size) still fits: Amdahl's law levels off too.
    plateau = [(f"w{n}", "ddp", n, 8, _amdahl(n, c=0.5) * (0.98 if n == 16 else 1.0)) for n in (1, 2, 4, 8, 16)]
    assert amdahl_fits(scaling_table(_runs(plateau)))["fit"].iloc[0] is not None


def test_clean_runs_only_unless_asked():
    rows = _runs([("w1", "single", 1, 8, 1000.0), ("w2", "ddp", 2, 8, 1800.0), ("w2-slow", "ddp", 2, 8, 900.0),
                  ("w4", "ddp", 4, 8, 3000.0)])
    rows = rows.assign(clean=[True, True, False, True],
                       reason=["", "", "fault injected (straggler rank 1, +0.05 s/step)", ""])
    used, left = family_runs(rows)
    assert used["run"].tolist() == ["w1", "w2", "w4"] and left["run"].tolist() == ["w2-slow"]
    every, none = family_runs(rows, include_unclean=True)
    assert len(every) == 4 and none.empty
    assert family_runs(rows.drop(columns="clean"))[0]["run"].tolist() == rows["run"].tolist()
    # Fewer than MIN_FIT_SIZES clean world sizes: a sentence that says they are the clean ones.
    two = amdahl_fits(scaling_table(used[used["world_size"] < 4]), clean=True)
    assert two["note"].iloc[0].startswith("No Amdahl fit: 2 clean world sizes (1, 2); a two-parameter curve")


def test_log_axis_labels_read_without_their_decade():
    assert figures.log_ticks(0.08, 6.0) == [0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
    assert figures.log_ticks(0.35, 4.6) == [0.5, 1.0, 2.0]
    narrow = figures.log_ticks(0.9, 1.3)  # 1-2-5 leaves one tick: finer steps
    assert len(narrow) >= 3 and 1.0 in narrow and all(0.9 <= t <= 1.3 for t in narrow)


def test_the_amdahl_line_runs_through_the_points_it_fits():
    # No 1-rank run: the family's baseline is n0 = 2, and speedup is relative to it; the line must be too.
    noise = {2: 1.02, 4: 0.99, 8: 1.01, 16: 1.0}
    rows = [(f"w{n}", "ddp", n, 8, _amdahl(n, c=0.1) * e) for n, e in noise.items()]
    table = scaling_table(_runs(rows))
    fits = amdahl_fits(table)
    fig = figures.scaling_speedup(table, fits=fits)
    line = next(t for t in fig.data if t.name and t.name.startswith("Amdahl fit c = "))
    points = next(t for t in fig.data if t.mode == "markers" and t.name == table["family"].iloc[0])
    on_line = np.interp(np.log(np.asarray(points.x, dtype=float)), np.log(np.asarray(line.x, dtype=float)), line.y)
    assert np.allclose(on_line, points.y, rtol=0.03)  # within the 2 % noise, at every world size
    assert min(line.x) == 2 and max(line.x) == 16
    y = fig.layout.yaxis
    assert y.type == "log" and list(y.ticktext) == [f"{v:g}" for v in y.tickvals]
    assert set(y.tickvals) <= {0.5, 1.0, 2.0, 5.0, 10.0} and {1.0, 2.0, 5.0} <= set(y.tickvals)
    x = fig.layout.xaxis
    assert list(x.tickvals) == [2.0, 4.0, 8.0, 16.0] and list(x.ticktext) == ["2", "4", "8", "16"]


def test_strong_and_weak_runs_are_not_mixed():
    rows = [("base", "single", 1, 8, 1000.0),
            ("strong-w2", "ddp", 2, 8, 1800.0), ("strong-w4", "ddp", 4, 8, 3000.0),
            ("weak-w2", "ddp", 2, 16, 1900.0), ("weak-w4", "ddp", 4, 32, 3600.0),
            ("fsdp-w2", "fsdp", 2, 8, 1500.0), ("fsdp-w4", "fsdp", 4, 8, 2500.0)]
    table = scaling_table(_runs(rows))
    members = {f: sorted(g["run"]) for f, g in table.groupby("family")}
    assert members == {"strong · ddp · global batch 8": ["base", "strong-w2", "strong-w4"],
                       "weak · ddp · batch/rank 8": ["base", "weak-w2", "weak-w4"],
                       "strong · fsdp · global batch 8": ["base", "fsdp-w2", "fsdp-w4"]}
    weak = table[table["kind"] == "weak"].set_index("run")
    # Weak efficiency is the per-rank throughput ratio against the baseline's.
    assert weak.loc["weak-w4", "efficiency"] == pytest.approx((3600 / 4) / (1000 / 1))
    assert weak.loc["weak-w2", "speedup"] == pytest.approx(1.9)
    fits = amdahl_fits(table).set_index("family")
    assert fits.loc["weak · ddp · batch/rank 8", "fit"] is None
    assert fits.loc["weak · ddp · batch/rank 8", "note"].startswith("No Amdahl fit: Amdahl's law is for a fixed")
    assert fits.loc["strong · ddp · global batch 8", "fit"] is not None


def test_no_one_rank_run_no_family_and_no_false_baseline():
    # The demo: every strategy at 2 ranks. No configuration at two world sizes: nothing is a baseline.
    per_run = _runs([("ddp", "ddp", 2, 8, 5000.0), ("fsdp", "fsdp", 2, 8, 4000.0), ("tp", "tp", 2, 8, 3000.0)])
    assert scaling_table(per_run).empty and amdahl_fits(scaling_table(per_run)).empty
    assert no_family_reason(per_run).startswith("No scaling verdict: no two world sizes share a configuration")
    # Without a 1-rank run the family's smallest world size is the baseline: speedup 1 there, not n0.
    t = scaling_table(_runs([("w2", "ddp", 2, 8, 5000.0), ("w4", "ddp", 4, 8, 8000.0)])).set_index("run")
    assert t.loc["w2", ["n0", "speedup", "efficiency"]].tolist() == [2, 1.0, 1.0]
    assert t.loc["w4", "speedup"] == pytest.approx(1.6) and t.loc["w4", "efficiency"] == pytest.approx(0.8)


def test_throughput_leaves_warm_up_out():
    series = pd.DataFrame({"run": "r", "step": range(8), "step_time_s": [5.0, 1.0, 1.1, 0.9, 1.0, 1.0, 1.2, 1.0],
                           "tokens_mean": 256.0})
    runs = pd.DataFrame({"run": ["r"], "world_size": [4], "mesh": ['{"dp": 2, "tp": 2}']})
    t = run_throughput(series, runs=runs).iloc[0]
    assert t["steady_from"] == 1 and t["steps_used"] == 7
    assert t["tokens_per_s"] == pytest.approx(256 * 2 / 1.0)  # replica tokens × dp / median steady step time
    assert t["tokens_per_s_per_device"] == pytest.approx(512 / 4)


SYNTHETIC = {  # run: (mesh, global batch); llama-1b, seq 2048
    "base": ({"dp": 1}, 8), "strong-w2": ({"dp": 2}, 8), "strong-w4": ({"dp": 4}, 8), "strong-w8": ({"dp": 8}, 8),
    "weak-w2": ({"dp": 2}, 16), "weak-w4": ({"dp": 4}, 32)}


@pytest.fixture(scope="module")
def synthetic_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling")
    for i, (run, (mesh, batch)) in enumerate(SYNTHETIC.items()):
        write_store(root, config=SyntheticConfig(run=run, mesh=mesh, global_batch=batch, steps=8, t0=1.8e9 + 600 * i))
    return root


def test_sweep_table_and_page_compute_the_same_numbers(synthetic_store):
    page = views.scaling(views.direct_loader(Store.open(synthetic_store)), selected=list(SYNTHETIC), focus=None)
    rep = sweep.report(synthetic_store, list(SYNTHETIC))
    cols = ["family", "run", "world_size", "tokens_per_s", "n0", "baseline", "speedup", "efficiency"]
    key = ["family", "run"]
    pd.testing.assert_frame_equal(page.table[cols].sort_values(key).reset_index(drop=True),
                                  rep["table"][cols].sort_values(key).reset_index(drop=True))
    assert sorted(page.table["family"].unique()) == ["strong · ddp · global batch 8", "weak · ddp · batch/rank 8"]
    pd.testing.assert_frame_equal(page.fits.drop(columns="fit"), rep["fits"].drop(columns="fit"))
    assert page.fits.set_index("family").loc["strong · ddp · global batch 8", "fit"] is not None
    # The printed table carries those numbers (rounded as printed).
    text = sweep.format_report(rep)
    for r in page.table.itertuples():
        assert f"{r.tokens_per_s:>10,.0f} {r.speedup:>8.3f} {r.efficiency:>6.1%}" in text, r.run
    # Independent truth for the throughput: global batch × seq / median over steps 1.. (step 0 is the
    # warm-up) of the slowest rank's wall time, from the raw step records.
    steps = read_table(synthetic_store, "step", columns=["run", "rank", "step", "wall_s"])
    per_run = page.per_run.set_index("run")
    for run, (_, batch) in SYNTHETIC.items():
        wall = steps[(steps["run"] == run) & (steps["step"] >= 1)].groupby("step")["wall_s"].max()
        assert per_run.loc[run, "tokens_per_s"] == pytest.approx(batch * 2048 / float(np.median(wall)), rel=1e-9)
        assert per_run.loc[run, "steady_from"] == 1
