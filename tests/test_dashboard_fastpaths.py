"""The Overview's cheaper reads agree with the ones they replace: collective instances aggregated in SQL
(``data.collective_links``) against ``analysis.collective_instances`` on the raw rows, the GPU join
through the runs table's host map against the SQL join over the ``run`` records, and a page's loads on
threads (``views.background``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from meshscope.agent.store.reader import Store
from meshscope.dashboard import analysis, data, views
from tests.support.store import Straggler, SyntheticConfig, write_store


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    root = tmp_path_factory.mktemp("fast")
    write_store(root, config=SyntheticConfig(run="link", mesh={"dp": 2, "fsdp": 8}, steps=8,
                                             straggler=Straggler(rank=3, factor=1.5, cause="link")))
    write_store(root, config=SyntheticConfig(run="hot", mesh={"pp": 2, "dp": 2, "tp": 2}, steps=6, gpus_per_host=4,
                                             straggler=Straggler(rank=6, cause="throttle"), t0=1.9e9))
    return Store.open(root)


@pytest.mark.parametrize(("run", "steps"), [("link", None), ("link", (5, 7)), ("hot", None)])
def test_collective_links_match_the_raw_rows(store, run, steps):
    rows = data.collective_rows(store, run=run, steps=steps)
    coll = rows[rows["peer"] < 0]
    want = analysis.collective_instances(coll).sort_values(["group", "seq"]).reset_index(drop=True)
    got = data.collective_links(store, run=run, steps=steps)
    inst = analysis.instance_busbw(got["instances"])
    pd.testing.assert_frame_equal(inst[want.columns], want, check_dtype=False)
    members = coll[["rank", "dim", "group"]].drop_duplicates()
    assert len(got["members"]) == len(members)
    assert set(map(tuple, got["members"].to_numpy())) == set(map(tuple, members.to_numpy()))
    old_ranks, old_groups = analysis.link_ratios(analysis.collective_instances(coll), members=coll)
    new_ranks, new_groups = analysis.link_ratios(inst, members=got["members"])
    pd.testing.assert_frame_equal(new_ranks, old_ranks,
                                  check_dtype=False)
    key = ["dim", "group"]
    pd.testing.assert_frame_equal(new_groups.sort_values(key).reset_index(drop=True),
                                  old_groups.sort_values(key).reset_index(drop=True), check_dtype=False)


def test_collective_links_of_an_empty_window(store):
    got = data.collective_links(store, run="link", steps=(10_000, 10_001))
    assert got["instances"].empty and got["members"].empty
    ranks, groups = analysis.link_ratios(analysis.instance_busbw(got["instances"]), members=got["members"])
    assert ranks.empty and groups.empty


@pytest.mark.parametrize("run", ["link", "hot"])
def test_gpu_through_the_runs_table_equals_the_sql_join(store, run):
    meta = views.meta_of(data.runs_table(store), run)
    window = (0.0, 3e9) if run == "hot" else None
    want = data.gpu_by_rank(store, run=run, window=window)
    got = analysis.gpu_ranks(data.gpu_by_device(store, run=run, window=window),
                             hosts=data.rank_hosts(meta.get("rank_hosts")))
    pd.testing.assert_frame_equal(got, want, check_dtype=False)
    if run == "hot":
        assert got.set_index("rank")["clock_ratio"].idxmin() == 6


def test_rank_hosts_without_run_records():
    assert data.rank_hosts(None).empty and data.rank_hosts("not json").empty
    t = data.rank_hosts('{"rank": [0, 1], "host": ["a", null], "local_rank": [0, 1]}')
    assert t.to_dict("list") == {"rank": [0], "host": ["a"], "local_rank": [0]}


def test_overview_with_loads_on_threads_equals_one_at_a_time(store, monkeypatch):
    load = views.direct_loader(store)
    threaded = views.overview(load, run="link", runs=["link", "hot"], steps=None)

    class Inline:  # the same view with every "background" load run in place
        def __init__(self, load, name, kwargs):
            self.value = load(name, **kwargs)

        def wait(self):
            pass

        def result(self):
            return self.value

    monkeypatch.setattr(views, "Pending", Inline)
    inline = views.overview(load, run="link", runs=["link", "hot"], steps=None)
    pd.testing.assert_frame_equal(threaded.stragglers, inline.stragglers)
    assert sorted(threaded.stragglers["rank"]) == [3, 11]
    assert threaded.metrics == pytest.approx(inline.metrics, nan_ok=True)


def test_background_reraises_in_the_caller_and_binds_the_thread():
    bound = []

    def load(name, **kw):
        raise ValueError(f"{name} {kw}")

    load.bind_thread = bound.append
    pending = views.background(load, "thing", x=1)
    with pytest.raises(ValueError, match="thing {'x': 1}"):
        pending.result()
    assert len(bound) == 1 and not bound[0].is_alive()


def test_first_file_of_an_older_agent_reads_by_name(tmp_path):
    write_store(tmp_path, config=SyntheticConfig(run="r", mesh={"dp": 2}, steps=3))
    f = tmp_path / "tables" / "step" / "run=r" / "rank=0" / "part-00000.parquet"
    pq.write_table(pq.read_table(f).drop(["mfu"]), f)
    s = Store.open(tmp_path)
    df = s.query("SELECT rank, mfu FROM step ORDER BY rank, step", kinds=("step",), runs=["r"])
    assert df[df["rank"] == 0]["mfu"].isna().all() and np.isfinite(df[df["rank"] == 1]["mfu"]).all()
