"""The store reader and the SQL data layer: confinement, partial and corrupt stores, and agreement of
the SQL aggregates with the pandas analyses on the raw rows."""

from __future__ import annotations

import os
import shutil

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshscope.agent.store.reader import SKIPPED, Store, StoreError, read_table
from meshscope.agent.contract import SCHEMAS
from meshscope.dashboard import analysis, data
from tests.support.store import Straggler, SyntheticConfig, write_store


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    root = tmp_path_factory.mktemp("store")
    write_store(root, config=SyntheticConfig(run="pp", mesh={"pp": 2, "dp": 2, "tp": 2}, steps=10,
                                             straggler=Straggler(rank=6, cause="throttle"), t0=1.8e9))
    write_store(root, config=SyntheticConfig(run="ddp", mesh={"dp": 4}, steps=5, t0=1.7e9))
    return Store.open(root)


def _raw(store: Store, kind: str, run: str) -> pd.DataFrame:
    return pd.concat([pq.read_table(f).to_pandas().assign(rank=int(f.parent.name.split("=")[1]))
                      for f in store.files(kind, runs=[run])], ignore_index=True)


# --------------------------------------------------------------------------------------- listing
def test_open_and_list(store, tmp_path):
    assert store.runs() == ["ddp", "pp"]
    assert len(store.files("step", runs=["pp"])) == 8
    assert store.files("step", runs=["nope"]) == []
    with pytest.raises(ValueError, match="unknown record kind"):
        store.files("secrets", runs=["pp"])
    with pytest.raises(StoreError, match="store directory not found"):
        Store.open(tmp_path / "missing")
    assert Store.open(tmp_path).runs() == []


def test_a_partition_the_run_name_rule_refuses_is_not_a_run(tmp_path):
    """The reader lists runs by the same rule every writer applies: a hand-made ``run=`` directory with a
    name no writer accepts is not listed (so never offered on a page), and reading it is a clear error."""
    import shutil

    write_store(tmp_path, config=SyntheticConfig(run="ok", mesh={"dp": 2}, steps=3, t0=1.7e9))
    shutil.copytree(tmp_path / "tables" / "step" / "run=ok", tmp_path / "tables" / "step" / "run=bad run-ü")
    store = Store.open(tmp_path)
    assert store.runs() == ["ok"]
    with pytest.raises(ValueError, match="run name 'bad run-ü'"):
        read_table(store, "step", run="bad run-ü")


def test_reads_stay_inside_the_root(tmp_path):
    outside = tmp_path / "outside"
    write_store(outside, config=SyntheticConfig(run="secret", mesh={"dp": 2}, steps=2))
    root = tmp_path / "store"
    write_store(root, config=SyntheticConfig(run="mine", mesh={"dp": 2}, steps=2))
    step = root / "tables" / "step"
    os.symlink(outside / "tables" / "step" / "run=secret", step / "run=linked")  # a run dir leading out
    os.symlink(outside / "tables" / "step" / "run=secret" / "rank=0" / "part-00000.parquet",
               step / "run=mine" / "rank=0" / "part-99999.parquet")  # a file leading out
    s = Store.open(root)
    assert "linked" not in s.runs()
    files = s.files("step", runs=["mine", "linked", "../../outside/tables/step/run=secret"])
    assert len(files) == 2 and all(f.resolve().is_relative_to(s.root) for f in files)
    assert data.runs_table(s)["run"].tolist() == ["mine"]


# ------------------------------------------------------------------------------ partial / corrupt
def test_missing_kind_is_an_empty_typed_view(tmp_path):
    write_store(tmp_path, config=SyntheticConfig(run="r", mesh={"dp": 2}, steps=2))
    s = Store.open(tmp_path)
    df = s.query("SELECT * FROM span", kinds=("span",), runs=["r"])
    assert df.empty and list(df.columns) == [f.name for f in SCHEMAS["span"]] + ["run", "rank"]
    assert data.pipeline_data(s, run="r", steps=None, gantt_step=1)["bubble"].empty


def test_files_from_an_older_agent_lacking_columns(tmp_path):
    write_store(tmp_path, config=SyntheticConfig(run="r", mesh={"dp": 2}, steps=3))
    f = tmp_path / "tables" / "step" / "run=r" / "rank=1" / "part-00000.parquet"
    pq.write_table(pq.read_table(f).drop(["mfu", "loss"]), f)
    s = Store.open(tmp_path)
    df = s.query("SELECT rank, mfu, loss, wall_s FROM step ORDER BY rank, step", kinds=("step",), runs=["r"])
    assert len(df) == 6 and df.attrs[SKIPPED] == []
    assert df[df["rank"] == 1]["mfu"].isna().all() and df[df["rank"] == 0]["mfu"].notna().all()
    # When no file has a column, it is a typed NULL.
    for g in (tmp_path / "tables" / "step" / "run=r").glob("rank=*/*.parquet"):
        pq.write_table(pq.read_table(g).drop(["grad_norm"]), g)
    assert s.query("SELECT max(grad_norm) AS g FROM step", kinds=("step",), runs=["r"])["g"].isna().all()


def test_corrupt_and_mistyped_files_are_skipped_and_reported(tmp_path):
    write_store(tmp_path, config=SyntheticConfig(run="r", mesh={"dp": 4}, steps=3))
    base = tmp_path / "tables" / "step" / "run=r"
    truncated = base / "rank=1" / "part-00000.parquet"
    truncated.write_bytes(truncated.read_bytes()[:50])
    (base / "rank=2" / "part-00001.parquet").write_bytes(b"")
    mistyped = pq.read_table(base / "rank=3" / "part-00000.parquet")
    mistyped = mistyped.set_column(0, "step", pa.array([str(x) for x in mistyped["step"].to_pylist()]))
    pq.write_table(mistyped, base / "rank=3" / "part-00000.parquet")
    s = Store.open(tmp_path)
    df = s.query("SELECT DISTINCT rank FROM step ORDER BY rank", kinds=("step",), runs=["r"])
    assert df["rank"].tolist() == [0, 2]
    assert sorted(df.attrs[SKIPPED]) == ["tables/step/run=r/rank=1/part-00000.parquet",
                                          "tables/step/run=r/rank=2/part-00001.parquet",
                                          "tables/step/run=r/rank=3/part-00000.parquet"]
    table = data.runs_table(s)
    assert table.loc[0, "ranks_stepping"] == 2 and len(table.attrs[SKIPPED]) == 3


def test_a_part_deleted_by_compaction_is_listed_again(tmp_path, monkeypatch):
    write_store(tmp_path, config=SyntheticConfig(run="r", mesh={"dp": 2}, steps=3))
    listed, real = [], Store.files

    def racing(self, kind, *, runs):  # the first listing still names a source compaction then removed
        files = real(self, kind, runs=runs)
        listed.append(kind)
        return files + [files[0].with_name("part-compacted-away.parquet")] if len(listed) == 1 else files

    monkeypatch.setattr(Store, "files", racing)
    df = Store.open(tmp_path).query("SELECT count(*) AS n FROM step", kinds=("step",), runs=["r"])
    assert df["n"].iloc[0] == 6 and df.attrs[SKIPPED] == [] and len(listed) == 2


def test_a_bug_in_our_sql_is_not_mistaken_for_corruption(store):
    with pytest.raises(duckdb.ParserException):
        store.query("SELEC nonsense", kinds=("step",), runs=["pp"])


def test_materialized_kind_keeps_only_the_requested_rows_and_columns(store):
    n, cols = store.query_all(
        [("SELECT count(*) AS n FROM step", None), ("DESCRIBE step", None)], kinds=("step",), runs=["pp"],
        materialize={"step": ("step BETWEEN ? AND ?", [2, 3], ("rank", "step", "wall_s"))})
    assert n["n"].iloc[0] == 2 * 8
    assert cols["column_name"].tolist() == ["rank", "step", "wall_s"]


# --------------------------------------------------------------------------- SQL against pandas
def test_runs_table(store, tmp_path):
    t = data.runs_table(store).set_index("run")
    assert t.index.tolist() == ["pp", "ddp"]  # newest first
    assert t.loc["pp", "world_size"] == 8 and t.loc["pp", "strategy"] == "pp+ddp+tp"
    assert (t.loc["pp", "first_step"], t.loc["pp", "last_step"], t.loc["pp", "steps"]) == (0, 9, 10)
    raw = _raw(store, "step", "pp")
    assert t.loc["pp", "collectives_per_step"] == pytest.approx(raw["n_collectives"].sum() / 10)


def test_partial_run_without_run_records_is_listed(tmp_path):
    write_store(tmp_path, config=SyntheticConfig(run="r", mesh={"dp": 2}, steps=2))
    shutil.rmtree(tmp_path / "tables" / "run" / "run=r")
    t = data.runs_table(Store.open(tmp_path))
    assert t["run"].tolist() == ["r"] and pd.isna(t.loc[0, "world_size"]) and t.loc[0, "steps"] == 2


def test_overview_data_matches_pandas(store):
    d = data.overview_data(store, run="pp", runs=["pp", "ddp"], steps=(2, 7), max_ranks=4, max_steps=3)
    raw = _raw(store, "step", "pp")
    raw = raw[raw["step"].between(2, 7)]
    bd = analysis.breakdown(raw).set_index("rank")
    got = analysis.breakdown(d["breakdown"]).set_index("rank")
    assert np.allclose(got[list(analysis.BREAKDOWN)], bd[list(analysis.BREAKDOWN)])
    rs = d["rank_steps"].sort_values(["step", "rank"]).reset_index(drop=True)
    want = raw.sort_values(["step", "rank"])[["rank", "step", "wall_s", "compute_s", "exposed_comm_s", "bubble_s",
                                                   "other_s", "cpu_s", "cpu_wait_s"]].reset_index(drop=True)
    pd.testing.assert_frame_equal(rs, want, check_dtype=False)
    # Over the budget: the latest steps whose rows fit.
    small = data.overview_data(store, run="pp", runs=["pp"], steps=(2, 7), budget=3 * raw["rank"].nunique())
    assert sorted(small["rank_steps"]["step"].unique()) == [5, 6, 7]
    series = d["series"]
    assert set(series["run"]) == {"pp", "ddp"} and series[series["run"] == "pp"]["step"].tolist() == list(range(2, 8))
    assert np.allclose(series[series["run"] == "pp"]["step_time_s"], raw.groupby("step")["wall_s"].max())
    # 8 ranks into at most 4 rows of 2; 6 steps into at most 3 columns of 2; max over ranks of step means.
    hm = d["heatmap"]
    assert (hm["rank_width"].iloc[0], hm["step_width"].iloc[0]) == (2, 2) and len(hm) == 12
    cell = raw[raw["rank"].isin([6, 7]) & raw["step"].isin([2, 3])].groupby("rank")["compute_s"].mean().max()
    assert hm.set_index(["rank_bin", "step_bin"]).loc[(6, 2), "compute_s"] == pytest.approx(cell)
    # One step per column (the query's shortcut): each cell is the max over its ranks of that step's value.
    one = data.overview_data(store, run="pp", runs=["pp"], steps=(2, 7), max_ranks=4, max_steps=200)["heatmap"]
    want = raw.assign(rank_bin=raw["rank"] // 2 * 2).groupby(["rank_bin", "step"])["compute_s"].max()
    assert (one["rank_width"] == 2).all() and (one["step_width"] == 1).all() and len(one) == len(want) == 24
    assert np.allclose(one.set_index(["rank_bin", "step_bin"])["compute_s"].sort_index(), want.sort_index())
    w = d["window"].iloc[0]
    assert (w["t_start"], w["t_end"]) == pytest.approx((raw["t_start"].min(), raw["t_end"].max()))


def test_gpu_by_rank_joins_host_and_local_rank(store):
    g = data.gpu_by_rank(store, run="pp", window=None).set_index("rank")
    assert len(g) == 8
    assert g["clock_ratio"].idxmin() == 6 and g.loc[6, "throttle_share"] > 0.5
    assert analysis.decode_throttle(int(g.loc[6, "reasons"])) == ["SW power cap", "SW thermal", "HW thermal"]


def test_pipeline_data_matches_pandas(store):
    d = data.pipeline_data(store, run="pp", steps=(0, 9), gantt_step=4)
    spans = _raw(store, "span", "pp")
    cols = ["bubble", "imbalance", "schedule_bubble"]
    want = analysis.measured_bubble(spans).groupby(["step", "stage"])[cols].mean()  # the pipeline's extent
    got = d["bubble"].set_index(["step", "stage"])[cols]
    assert np.allclose(got.sort_index(), want.sort_index())
    replayed = d["replay_spans"]  # every span of the steps in range (10 <= data.REPLAY_STEPS)
    assert len(replayed) == int(spans["step"].between(0, 9).sum()) and set(replayed["step"]) == set(range(10))
    assert (got["imbalance"] > 0).any()  # the synthetic stages are not equally loaded
    # The Gantt step: one rank per pipeline position (lowest rank), all its spans, and its step window.
    assert sorted(d["spans"]["rank"].unique()) == [0, 4] and set(d["spans"]["step"]) == {4}
    assert len(d["spans"]) == 2 * 2 * 4 and sorted(d["windows"]["rank"]) == [0, 4]


def test_collective_rows_window(store):
    rows = data.collective_rows(store, run="pp", steps=(8, 9))
    raw = _raw(store, "collective", "pp")
    assert len(rows) == int(raw["step"].between(8, 9).sum()) and set(rows["step"]) == {8, 9}


def test_memory_and_gpu_data(store):
    m = data.memory_data(store, run="pp", steps=None)
    raw = _raw(store, "memory", "pp")
    peaks = raw.groupby("rank")["allocated_peak_bytes"].max()
    assert np.allclose(m["per_rank"].set_index("rank")["allocated_peak"], peaks)
    assert (m["per_rank"]["capacity"] == 80 * 2**30).all() and len(m["per_step"]) == 10
    g = data.gpu_data(store, run="pp", bins=4)
    assert len(g["summary"]) == 8 and set(g["series"]["bin"]) <= {0, 1, 2, 3}


def test_run_summaries(store):
    s = data.run_summaries(store, runs=["pp", "ddp"]).set_index("run")
    raw = _raw(store, "step", "ddp")
    assert s.loc["ddp", "step_time_s"] == pytest.approx(raw.groupby("step")["wall_s"].max().median())
    assert s.loc["ddp", "comm_fraction"] == pytest.approx(raw["exposed_comm_s"].sum() / raw["wall_s"].sum())


@pytest.mark.parametrize(("steps", "rate", "budget", "window"), [
    ((0, 999), 20_000, 200_000, (990, 999)), ((0, 999), 100, 200_000, (0, 999)), ((0, 999), None, 10, (0, 999)),
    ((500, 999), 1e9, 10, (999, 999))])
def test_budget_window(steps, rate, budget, window):
    assert data.budget_window(steps, rows_per_step=rate, budget=budget) == window


# ------------------------------------------------------------------------- several stores as one
def _split(full, a, b) -> None:
    """Copy a store into two node stores, as one agent per node writes them: ranks 0-1 and the GPU
    samples of host node0000 to ``a``, the rest to ``b`` (two GPUs per host)."""
    for f in full.rglob("*.parquet"):
        rank = int(f.parent.name.split("=")[1])
        first = f.name == "part-node0000.parquet" if rank == -1 else rank < 2
        dst = (a if first else b) / f.relative_to(full)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dst)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """(full store, node store A, node store B): run "r" (4 ranks) split over the nodes; run "solo" only
    in A."""
    tmp = tmp_path_factory.mktemp("nodes")
    full, a, b = tmp / "full", tmp / "a", tmp / "b"
    write_store(full, config=SyntheticConfig(run="r", mesh={"dp": 4}, steps=6, gpus_per_host=2, t0=1.8e9,
                                             straggler=Straggler(rank=3, cause="throttle")))
    _split(full, a, b)
    write_store(a, config=SyntheticConfig(run="solo", mesh={"dp": 2}, steps=3, t0=1.7e9))
    return full, a, b


def test_a_run_split_over_two_stores_is_one_run_with_every_rank(nodes):
    full, a, b = nodes
    one, both = Store.open(full), Store.open_many([a, b])
    assert both.roots == (a.resolve(), b.resolve())
    assert both.runs() == ["r", "solo"]
    files = both.files("step", runs=["r"])
    assert [f.parent.name for f in files] == ["rank=0", "rank=1", "rank=2", "rank=3"]
    assert {f.parents[4] for f in files} == {a.resolve(), b.resolve()}  # <root>/tables/step/run=r/rank=k/f
    table = data.runs_table(both)
    r = table.set_index("run").loc["r"]
    assert (r["world_size"], r["ranks_started"], r["ranks_stepping"], r["steps"]) == (4, 4, 4, 6)
    # Each node's store alone sees half of the run (the Runs page calls it partial).
    assert data.runs_table(Store.open(a)).set_index("run").loc["r", "ranks_stepping"] == 2
    # Every aggregate over the union equals the one over the undivided store.
    pd.testing.assert_frame_equal(table[table["run"] == "r"].reset_index(drop=True), data.runs_table(one),
                                  check_dtype=False)
    got, want = (data.overview_data(s, run="r", runs=["r"], steps=None) for s in (both, one))
    for key in ("series", "breakdown", "heatmap", "rank_steps", "window"):
        pd.testing.assert_frame_equal(got[key], want[key], check_dtype=False)
    rs = got["rank_steps"]
    assert rs.loc[rs.groupby("step")["compute_s"].idxmax(), "rank"].eq(3).all()
    g = data.gpu_by_rank(both, run="r", window=None).set_index("rank")  # GPU samples of both hosts
    assert g.index.tolist() == [0, 1, 2, 3] and g["clock_ratio"].idxmin() == 3
    assert len(data.collective_rows(both, run="r", steps=None)) == len(data.collective_rows(one, run="r", steps=None))


def test_a_run_in_only_one_of_the_stores(nodes):
    _, a, b = nodes
    both = Store.open_many([a, b])
    assert all(f.is_relative_to(a.resolve()) for f in both.files("step", runs=["solo"]))
    t = data.runs_table(both).set_index("run")
    assert t.loc["solo", "ranks_stepping"] == 2 and t.loc["solo", "steps"] == 3
    s = data.run_summaries(both, runs=["solo"])
    assert s["run"].tolist() == ["solo"] and s["steps_used"].iloc[0] == 3
    assert Store.open(b).runs() == ["r"]


def test_reads_stay_inside_every_root(tmp_path, nodes):
    _, a, b = nodes
    outside = tmp_path / "outside"
    write_store(outside, config=SyntheticConfig(run="secret", mesh={"dp": 2}, steps=2))
    b2 = tmp_path / "b2"
    shutil.copytree(b, b2)
    step = b2 / "tables" / "step"
    os.symlink(outside / "tables" / "step" / "run=secret", step / "run=linked")
    os.symlink(outside / "tables" / "step" / "run=secret" / "rank=0" / "part-00000.parquet",
               step / "run=r" / "rank=2" / "part-99999.parquet")
    s = Store.open_many([a, b2])
    assert "linked" not in s.runs() and "secret" not in s.runs()
    files = s.files("step", runs=["r", "linked", "secret", "../../outside/tables/step/run=secret"])
    assert len(files) == 4
    assert all(any(f.resolve().is_relative_to(root) for root in s.roots) for f in files)
    assert data.runs_table(s)["run"].tolist() == ["r", "solo"]


def test_opening_several_stores_checks_each(tmp_path, nodes):
    _, a, b = nodes
    with pytest.raises(StoreError, match=f"store directory not found: {tmp_path / 'missing'}$"):
        Store.open_many([a, tmp_path / "missing"])
    with pytest.raises(StoreError, match="no store directory given"):
        Store.open_many([])
    os.symlink(a, tmp_path / "a-again")
    same = Store.open_many([a, tmp_path / "a-again", a])  # one directory by two names: read once
    assert same.roots == (a.resolve(),) and same.root == a.resolve()
    with pytest.raises(ValueError, match="reads 2 roots"):
        Store.open_many([a, b]).root
    # DuckDB takes key=value directory names for partition keys; mismatched ones cannot be combined.
    keyed, plain, keyed2 = tmp_path / "node=x" / "s", tmp_path / "plain" / "s", tmp_path / "node=y" / "s"
    for root in (keyed, plain, keyed2):
        shutil.copytree(b, root)
    with pytest.raises(StoreError, match="cannot be read together.*node"):
        Store.open_many([plain, keyed])
    assert data.runs_table(Store.open_many([keyed, keyed2])).loc[0, "ranks_stepping"] == 2


def test_skipped_files_name_their_store(tmp_path, nodes):
    _, a, b = nodes
    b2 = tmp_path / "b2"
    shutil.copytree(b, b2)
    bad = b2 / "tables" / "step" / "run=r" / "rank=3" / "part-00000.parquet"
    bad.write_bytes(bad.read_bytes()[:50])
    df = Store.open_many([a, b2]).query("SELECT DISTINCT rank FROM step WHERE run = 'r' ORDER BY rank",
                                        kinds=("step",), runs=["r"])
    assert df["rank"].tolist() == [0, 1, 2]
    assert df.attrs[SKIPPED] == [f"{b2.resolve()}/tables/step/run=r/rank=3/part-00000.parquet"]


# ------------------------------------------------------------------------------------- restarts

def _write_kind(root, kind: str, *, run: str, rank: int, stream: str, start: int, rows: list[dict]) -> None:
    """One part file as the agent names it (``part-<stream>-<start>-<end>``), schema defaults elsewhere."""
    schema = pa.schema([f for f in SCHEMAS[kind] if f.name not in ("run", "rank")])
    default = {pa.string(): "", pa.bool_(): False}
    cols = {f.name: [r.get(f.name, default.get(f.type, 0)) for r in rows] for f in schema}
    d = root / "tables" / kind / f"run={run}" / f"rank={rank}"
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols, schema=schema), d / f"part-{stream}-{start:016d}-{start + 1:016d}.parquet")


def _attempt(root, *, rank: int, stream: str, steps: range, t0: float, aborted: int | None = None) -> None:
    """One attempt of rank ``rank``: a step record per step (``wall_s`` tags the attempt) and two
    collectives per step, plus the collectives of an ``aborted`` step that has no step record."""
    step_rows = [{"step": s, "t_start": t0 + s, "t_end": t0 + s + 0.5, "wall_s": 0.5, "compute_s": t0 / 1e3,
                  "n_collectives": 2} for s in steps]
    coll = [{"step": s, "op": "all_reduce", "dim": "dp", "group": "g", "group_size": 2, "bytes": 8, "seq": i,
             "t_start": t0 + s + 0.1 * (i + 1), "t_end": t0 + s + 0.1 * (i + 1) + 0.05, "peer": -1}
            for s in [*steps, *([aborted] if aborted is not None else [])] for i in range(2)]
    _write_kind(root, "step", run="r", rank=rank, stream=stream, start=0, rows=step_rows)
    _write_kind(root, "collective", run="r", rank=rank, stream=stream, start=0, rows=coll)


def test_restarted_ranks_count_each_reexecuted_step_once(tmp_path):
    # Attempt 0 ran steps 0-11 and aborted in step 12; attempt 1 resumed at the step-10 checkpoint.
    for rank in range(2):
        _attempt(tmp_path, rank=rank, stream="a0a0", steps=range(12), t0=100.0, aborted=12)
        _attempt(tmp_path, rank=rank, stream="b1b1", steps=range(10, 15), t0=200.0)
    store = Store.open(tmp_path)
    frames = data.overview_data(store, run="r", runs=["r"], steps=None)
    assert frames["breakdown"].set_index("rank")["steps"].to_dict() == {0: 15, 1: 15}
    series = frames["series"].set_index("step")
    assert list(series.index) == list(range(15)) and (series["ranks"] == 2).all()
    kept = store.query("SELECT step, rank, t_start, compute_s FROM step ORDER BY rank, step", kinds=("step",),
                       runs=["r"])
    # Steps 0-9 from attempt 0 (never re-executed), 10-14 from attempt 1.
    assert (kept["compute_s"] == np.where(kept["step"] < 10, 0.1, 0.2)).all()
    coll = data.collective_rows(store, run="r", steps=None)
    assert len(coll) == 2 * 15 * 2  # ranks x steps x collectives, the aborted step's from attempt 1 only
    assert (coll[coll["step"] >= 10]["t_start"] > 200).all() and (coll[coll["step"] < 10]["t_start"] < 200).all()
    runs = data.runs_table(store).set_index("run").loc["r"]
    assert (runs["steps"], runs["collectives_per_step"]) == (15, 4)


def test_one_stream_per_rank_is_read_as_is(tmp_path):
    # Compaction leaves several parts of one stream: not a restart, nothing is dropped (even equal steps).
    _attempt(tmp_path, rank=0, stream="a0a0", steps=range(3), t0=100.0)
    _write_kind(tmp_path, "step", run="r", rank=0, stream="a0a0", start=5, rows=[{"step": 2, "t_start": 150.0}])
    store = Store.open(tmp_path)
    assert len(store.query("SELECT * FROM step", kinds=("step",), runs=["r"])) == 4


def test_a_rank_restarted_on_another_node_is_counted_once(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _attempt(a, rank=0, stream="a0a0", steps=range(6), t0=100.0)
    _attempt(b, rank=0, stream="b1b1", steps=range(4, 8), t0=200.0)
    frames = data.overview_data(Store.open_many([a, b]), run="r", runs=["r"], steps=None)
    assert frames["breakdown"]["steps"].tolist() == [8]
