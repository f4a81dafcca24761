"""Page views end to end on synthetic stores: the injected straggler is found with the right cause, the
budgeted windows say which steps they used, and every figure has data."""

from __future__ import annotations

import numpy as np
import pytest

from meshscope.agent.store.reader import Store
from meshscope.dashboard import data, views
from tests.support.store import Straggler, SyntheticConfig, write_store


def _load(root, **runs) -> tuple[Store, views.Loader]:
    for name, cfg in runs.items():
        write_store(root, config=cfg)
    store = Store.open(root)
    return store, views.direct_loader(store)


def _has_data(fig) -> bool:
    return any(len(t.x if t.x is not None else []) or len(t.z if t.z is not None else []) for t in fig.data)


@pytest.mark.parametrize(("cause", "cause_text"), [("compute", "compute"), ("throttle", "GPU throttling")])
def test_compute_and_throttle_stragglers(tmp_path, cause, cause_text):
    cfg = SyntheticConfig(run="r", mesh={"dp": 8}, steps=12, straggler=Straggler(rank=5, factor=1.3, cause=cause))
    _, load = _load(tmp_path, r=cfg)
    ov = views.overview(load, run="r", runs=["r"], steps=None)
    assert ov.stragglers["rank"].tolist() == [5]
    assert ov.stragglers["cause"].iloc[0].startswith(cause_text)
    # The others wait for it at their gradient sync each step: ~30 % of their compute (the generator
    # models that wait), which is what the job loses.
    assert ov.metrics["cost_s"] == pytest.approx(0.3 * ov.stragglers["peers_compute_s"].iloc[0], rel=0.15)
    assert ov.stragglers["cost_s_per_step"].iloc[0] == pytest.approx(ov.metrics["cost_s"], rel=0.05)
    comm = views.communication(load, run="r", steps=None)
    assert comm.skew.iloc[0]["rank"] == 5  # the late arriver made the others wait the most
    assert comm.slow_groups.empty
    for fig in [*ov.figures.values(), *comm.figures.values()]:
        assert _has_data(fig)
    x = comm.figures["busbw"].layout.xaxis  # bytes in SI with a B: "500MB", not plotly's "0.5B" (billions)
    assert (x.type, x.tickformat, x.ticksuffix) == ("log", "~s", "B")
    if cause == "throttle":  # the throttled GPU is the one the warning names (its peers run at 89 %)
        (w,) = [w for w in ov.warnings if w.startswith("Throttled GPU clocks")]
        assert "rank 5 " in w and "more ranks" not in w and w.count("rank ") == 1
    else:
        assert not any(w.startswith("Throttled GPU clocks") for w in ov.warnings)


def test_link_straggler_is_found_by_its_group(tmp_path):
    # dp groups pair ranks across the two hosts; rank 3's slow NIC slows its dp group {3, 11}.
    cfg = SyntheticConfig(run="r", mesh={"dp": 2, "fsdp": 8}, steps=12,
                          straggler=Straggler(rank=3, factor=1.5, cause="link"))
    _, load = _load(tmp_path, r=cfg)
    ov = views.overview(load, run="r", runs=["r"], steps=None)
    assert sorted(ov.stragglers["rank"]) == [3, 11]
    assert all(c.startswith("link (group dp:3") for c in ov.stragglers["cause"])
    comm = views.communication(load, run="r", steps=None)
    assert comm.slow_groups["group"].tolist() == ["dp:3"]
    assert comm.slow_groups["busbw_ratio"].iloc[0] == pytest.approx(1 / 1.5, rel=0.1)


def test_no_straggler_no_flags(tmp_path):
    _, load = _load(tmp_path, r=SyntheticConfig(run="r", mesh={"pp": 2, "dp": 2, "tp": 2}, steps=10))
    assert views.overview(load, run="r", runs=["r"], steps=None).stragglers.empty
    assert views.communication(load, run="r", steps=None).slow_groups.empty


def test_budgets_bound_the_steps_read_and_say_so(tmp_path, monkeypatch):
    _, load = _load(tmp_path, r=SyntheticConfig(run="r", mesh={"pp": 2, "dp": 2}, steps=20))
    rows_per_step = load("runs_table").iloc[0]["collectives_per_step"]
    monkeypatch.setattr(data, "RAW_BUDGET", int(5 * rows_per_step))
    # The pipeline page estimates spans per step as world 4 x microbatches 4 x 3: budget 6 steps of them.
    monkeypatch.setattr(data, "ROW_BUDGET", 4 * 4 * 3 * 6)
    comm = views.communication(load, run="r", steps=(0, 19))
    assert comm.steps == (15, 19)
    assert comm.summary["ops_per_step"].sum() == pytest.approx(rows_per_step / 4)  # per rank and step
    pipe = views.pipeline(load, run="r", steps=(0, 19))
    assert pipe.steps == (14, 19) and sorted(pipe.per_step_stage["step"].unique()) == list(range(14, 20))
    assert pipe.gantt_spans == 2 * 2 * 4 and _has_data(pipe.figures["gantt"])
    p2p = [t for t in pipe.figures["gantt"].data if t.name == "P2P wait"]  # drawn inside the idle time
    assert len(p2p) == 1 and len(p2p[0].x) > 0 and min(p2p[0].x) > 0
    assert set(pipe.gantt_bubble) == {0, 1} and all(0 < b < 1 for b in pipe.gantt_bubble.values())
    # The bubble split the page and report show: imbalance + schedule share; the schedule share into the
    # replay's fill & drain, transfers and host gaps, and the rest (every step of the window replayed).
    sp = pipe.stages
    assert sorted(sp["stage"]) == [0, 1] and sp["schedule_idle"].notna().all()
    assert np.allclose(sp["bubble"], sp["imbalance"] + sp["schedule_share"])
    assert np.allclose(sp["schedule_share"], sp["schedule_idle"] + sp["p2p_share"] + sp["unexplained"])
    assert (sp["unexplained"].abs() < 0.01).all()  # synthetic spans come from the same simulator


def test_memory_gpu_scaling_views(tmp_path):
    _, load = _load(tmp_path, a=SyntheticConfig(run="a", mesh={"dp": 4}, steps=6, t0=1.7e9),
                    b=SyntheticConfig(run="b", mesh={"dp": 8}, steps=6, t0=1.8e9))
    mem = views.memory(load, run="b", steps=None)
    assert mem.label == "device allocator" and set(mem.model["component"]) == {
        "parameters", "gradients", "optimizer state", "DDP gradient buckets", "activations"}
    gpu = views.gpu(load, run="b")
    assert len(gpu.summary) == 8 and len(gpu.worst) == 8
    sc = views.scaling(load, selected=["b"], focus="b")  # fewer than two selected: all runs of the model
    assert sc.runs == ["b", "a"] and sc.table["world_size"].tolist() == [4, 8]
    # 2 replicas' worth of batch each (8 and 16 sequences): one weak-scaling family, baseline a (4 ranks).
    assert set(sc.table["family"]) == {"weak · ddp · batch/rank 2"} and set(sc.table["baseline"]) == {"a"}
    assert sc.fits["fit"].tolist() == [None] and sc.fits["note"].iloc[0].startswith("No Amdahl fit")
    for fig in [*mem.figures.values(), *gpu.figures.values(), *sc.figures.values()]:
        assert _has_data(fig)


def test_warm_up_is_left_out_of_means_and_colour_scale(tmp_path):
    # Step 0 nine times a steady step (the case): the Overview's mean step time is the steady median.
    _, load = _load(tmp_path, r=SyntheticConfig(run="r", mesh={"dp": 4}, steps=20, warmup=9.0))
    ov = views.overview(load, run="r", runs=["r"], steps=None)
    wall = load("overview_data", run="r", runs=["r"], steps=None)["series"].set_index("step")["step_time_s"]
    assert wall.loc[0] > 8 * wall.loc[1:].median()
    assert ov.first_steady_step == 1
    assert ov.breakdown["wall_s"].mean() == pytest.approx(wall.loc[1:].median(), rel=0.10)
    heat = ov.figures["heatmap"].data[0]
    assert heat.zmax < 2 * wall.loc[1:].median()  # the steady cells span the colour scale


def test_gpu_page_at_scale_draws_the_lowest_clock_gpus_and_the_picked_ones(tmp_path, monkeypatch):
    # 16,384 GPUs x 120 bins would be 2 M heatmap cells: beyond GPU_HEATMAP_ROWS the page draws the GPUs
    # with the lowest mean SM clock (the throttled straggler first) and says so, and any GPU picked.
    cfg = SyntheticConfig(run="r", mesh={"dp": 16}, steps=12, straggler=Straggler(rank=9, factor=1.3, cause="throttle"))
    store, load = _load(tmp_path, r=cfg)
    monkeypatch.setattr(views, "GPU_HEATMAP_ROWS", 4)
    full = data.gpu_data(store, run="r", lowest=16)
    order = full["summary"].assign(id=full["summary"]["host"] + ":" + full["summary"]["gpu"].astype(str))
    lowest = order.sort_values("clock_ratio")["id"].tolist()
    gpu = views.gpu(load, run="r")
    assert gpu.worst == lowest[:8]
    (heat,) = gpu.figures["heatmap"].data
    assert sorted(heat.y) == sorted(lowest[:4]) and "the 4 GPUs with the lowest mean SM clock of 16" in (
        gpu.figures["heatmap"].layout.title.text)
    assert set(gpu.series["gpu"]) == set(lowest[:8])  # the 8 default lines have their data
    assert all(len(fig.data) == 8 and all(len(t.x) for t in fig.data) for name, fig in gpu.figures.items()
               if name != "heatmap")
    picked = views.gpu(load, run="r", pick=[lowest[-1]])
    assert set(picked.series["gpu"]) == set(lowest[:8]) | {lowest[-1]}
    want = full["series"][full["series"]["gpu"].isin(set(picked.series["gpu"]))].reset_index(drop=True)
    assert picked.series.reset_index(drop=True).equals(want)  # the same bins and values as with every GPU


def test_gpu_page_with_tied_clocks_draws_the_gpus_it_loaded(tmp_path, monkeypatch):
    # GPUs at full clock all have a ratio of exactly 1.0: the GPUs the page draws (lowest clock, ties by
    # host and GPU) must be the ones whose series were loaded, with data in every default line.
    import pyarrow as pa

    from meshscope.agent.store import parts
    from meshscope.agent.contract import SCHEMAS

    n, slow = 12, 7
    rows = [{"t": 1.8e9 + i, "host": "h", "gpu": g, "uuid": f"u{g}", "name": "H100", "util_ratio": 0.9,
             "mem_util_ratio": 0.5, "mem_used_bytes": 1, "mem_total_bytes": 2, "power_watts": 500.0,
             "temperature_celsius": 60.0, "sm_clock_hz": 9e8 if g == slow else 1.98e9, "sm_clock_max_hz": 1.98e9,
             "throttle_reasons": 0, "xid_errors_total": 0, "ecc_errors_total": 0} for i in range(6) for g in range(n)]
    parts.write_part(tmp_path / "tables" / "gpu" / "run=r" / "rank=-1", pa.Table.from_pylist(rows, SCHEMAS["gpu"]),
                     kind="gpu", stream="s", start=0, end=1, source="test")
    monkeypatch.setattr(views, "GPU_HEATMAP_ROWS", 4)
    gpu = views.gpu(views.direct_loader(Store.open(tmp_path)), run="r")
    assert gpu.worst == ["h:7", "h:0", "h:1", "h:2", "h:3", "h:4", "h:5", "h:6"]  # ties in GPU order
    assert sorted(gpu.figures["heatmap"].data[0].y) == ["h:0", "h:1", "h:2", "h:7"]
    for name, fig in gpu.figures.items():
        if name != "heatmap":
            assert [t.name for t in fig.data] == gpu.worst and all(len(t.x) == 6 for t in fig.data), name


def test_compute_heatmap_rank_labels_stay_readable_at_scale():
    # 128 bins of 128 ranks (16,384 ranks): labels at bin starts, at most HEATMAP_TICKS of them, whole
    # ranks; a small job keeps one label per rank.
    import pandas as pd

    from meshscope.dashboard import figures

    def heat(ranks: int, width: int):
        bins = range(0, ranks, width)
        hm = pd.DataFrame([{"rank_bin": r, "step_bin": s, "compute_s": 1.0} for r in bins for s in range(3)])
        return figures.compute_heatmap(hm, rank_width=width, step_width=1).layout.yaxis

    big = heat(16384, 128)
    assert big.dtick % 128 == 0 and 16384 / big.dtick <= figures.HEATMAP_TICKS and big.tick0 == 0
    assert heat(8, 1).dtick == 1


def test_breakdown_at_scale_is_one_path_per_part_with_every_rank():
    import pandas as pd

    from meshscope.dashboard import analysis, figures

    def fig(ranks: int):
        bd = pd.DataFrame({"rank": range(ranks), **{c: [0.1] * ranks for c in analysis.BREAKDOWN}})
        bd.loc[ranks // 3, "compute_s"] = 0.5  # a straggler stays visible as its own step
        return figures.breakdown_bars(bd)

    small, big = fig(64), fig(16384)
    assert [t.type for t in small.data] == ["bar"] * 4
    assert [t.type for t in big.data] == ["scatter"] * 4 and all(len(t.x) == 16384 for t in big.data)
    compute = next(t for t in big.data if t.name == figures.LABELS["compute_s"])
    assert compute.stackgroup == "parts" and max(compute.y) == 0.5 and list(compute.y).index(0.5) == 16384 // 3
    # The other per-rank charts (Memory, Communication's skew): one path per series at scale too.
    n = 16384
    mem = figures.memory_by_rank(pd.DataFrame({"rank": range(n), "peak": [2.0**30] * n, "cur": [2.0**29] * n,
                                               "capacity": [2.0**36] * n}), current="cur", peak="peak", label="x")
    skew = figures.skew_by_rank(pd.DataFrame({"rank": range(n), "mean_skew_s": [0.001] * n, "caused_wait_s": [0.0] * n}))
    for f in (mem, skew):
        assert [t.type for t in f.data] == ["scatter", "scatter"] and all(t.mode == "lines" and len(t.x) == n
                                                                          for t in f.data)
    assert [t.type for t in figures.skew_by_rank(pd.DataFrame(
        {"rank": [0, 1], "mean_skew_s": [0.0, 0.001], "caused_wait_s": [0.0, 0.1]})).data] == ["bar", "scatter"]


def _runs_table(n: int, *, apart_s: float = 3.0):
    """A runs table (``data.runs_table``'s columns the timeline reads) of ``n`` runs that started ``apart_s``
    seconds apart and ran 40 s each: a sweep's runs, back to back or overlapping. Newest first, as stored."""
    import pandas as pd

    t0 = 1.8e9
    return pd.DataFrame({"run": [f"sweep-tiny-ddp-w{i}" for i in range(n)],
                         "strategy": [("ddp", "fsdp", "tp")[i % 3] for i in range(n)],
                         "world_size": [2.0 ** (i % 3) for i in range(n)], "ranks_stepping": 2.0, "steps": 10.0,
                         "t_start": [t0 + i * apart_s for i in range(n)],
                         "t_end": [t0 + i * apart_s + 40 for i in range(n)]}).iloc[::-1].reset_index(drop=True)


@pytest.mark.parametrize("n", [2, 20])
def test_runs_timeline_gives_every_run_a_row_of_its_own(n):
    # Runs that started seconds apart printed their names over each other (text beside markers at the
    # same x and world size). Now each run has a row of the y axis, its name the row's label, nothing
    # printed inside the plot, and a row is tall enough for a line of text.
    from meshscope.dashboard import figures

    runs = _runs_table(n)
    fig = figures.runs_timeline(runs)
    assert all("text" not in (tr.mode or "") for tr in fig.data) and not fig.layout.annotations
    row_of: dict[str, set] = {}
    for tr in fig.data:
        for x, y in zip(tr.x, tr.y):
            if y is not None:
                row_of.setdefault(y, set()).add(tr.name)
    assert sorted(row_of) == sorted(runs["run"])  # a row per run, and each row holds one run only
    assert all(len(strategies) == 1 for strategies in row_of.values())
    axis = fig.layout.yaxis
    oldest_first = runs.sort_values("t_start")["run"].tolist()
    assert axis.type == "category" and list(axis.categoryarray) == oldest_first  # the newest at the top
    assert list(axis.tickvals) == oldest_first and len(set(axis.ticktext)) == n
    assert axis.ticktext[-1] == f"{oldest_first[-1]} ({runs['world_size'].iloc[0]:.0f} ranks)"
    assert fig.layout.height >= 20 * n + 100  # at least 20 px per row: a 12 px label cannot reach the next


def test_runs_timeline_keeps_the_newest_rows_and_draws_partial_runs():
    import numpy as np

    from meshscope.dashboard import figures

    runs = _runs_table(figures.TIMELINE_LANES + 5)
    runs.loc[0, ["strategy", "world_size", "ranks_stepping", "steps", "t_end"]] = [None, np.nan, np.nan, np.nan,
                                                                                  np.nan]
    fig = figures.runs_timeline(runs)
    shown = [y for tr in fig.data for y in tr.y if y is not None]
    assert len(set(shown)) == figures.TIMELINE_LANES and runs.loc[0, "run"] in shown
    assert runs["run"].iloc[-1] not in shown  # the oldest left out, and the title says so
    assert f"newest {figures.TIMELINE_LANES} of {len(runs)} runs" in fig.layout.title.text
    partial = next(tr for tr in fig.data if tr.name == "no run record")
    assert list(partial.y[:2]) == [runs.loc[0, "run"]] * 2 and partial.x[0] == partial.x[1]  # a dot at its start
    assert fig.layout.yaxis.ticktext[-1] == runs.loc[0, "run"]  # no world size known: the name alone
