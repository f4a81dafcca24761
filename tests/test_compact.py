"""Reader-side compaction (``agent.store.compact``): a segment in the reader's cache stands in for a
run's packs and reads exactly as they do — what ``meshscope report`` says included — while an agent keeps
adding and merging packs, across a restart, with a damaged pack, and under the dashboard."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from meshscope.agent.store import compact, packs
from meshscope.agent.store.reader import SKIPPED, Store
from meshscope.agent.contract import KINDS, StepRecord
from tests.support.store import Straggler, SyntheticConfig, write_store
from test_collector_ingest import Clock, step_rows, writer
from test_collector_packs import RANKS, _close, feed, ingestor


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MESHSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compact, "MIN_PACKS", 2)  # a segment from two packs: small stores exercise it
    monkeypatch.setattr(compact, "STALE_AFTER_S", 0.0)
    monkeypatch.setattr(compact, "_failed", {})
    return tmp_path / "cache"


def rows(store: Store, kind: str, **kw):
    return store.query(f"SELECT * FROM {kind} ORDER BY ALL", kinds=[kind], runs=store.runs(), **kw)


def segments(cache: Path) -> list[Path]:
    return sorted((cache / "compact").rglob("pack-*.parquet"))


def in_cache(files, cache: Path) -> list[Path]:
    return [f for f in files if f.is_relative_to(cache)]


WRITTEN = tuple(k for k in KINDS if k != "hang")  # a healthy run has no watchdog record of a stall


def synthetic(root: Path) -> Path:
    # pp=2 x fsdp=8 on 2 hosts: two packs per kind; a throttled straggler for the report to find.
    write_store(root, config=SyntheticConfig(run="r1", mesh={"pp": 2, "fsdp": 8}, steps=30, layout="packs",
                                             straggler=Straggler(rank=11, factor=1.3, cause="throttle")))
    return root


def test_a_segment_reads_as_its_packs_and_the_report_says_the_same(tmp_path, cache):
    from meshscope.dashboard import report, views

    root = synthetic(tmp_path / "s")
    off, now = Store.open(root, compaction="off"), Store.open(root, compaction="now")
    for kind in WRITTEN:
        sources = off.files(kind, runs=["r1"])
        assert len(sources) == 2
        (seg,) = now.files(kind, runs=["r1"])
        assert seg.is_relative_to(cache) and compact.sources(seg) == {p.name for p in sources}
        assert packs.manifest(seg) == packs.merge_ranges(r for p in sources for r in packs.manifest(p))
        if "step" in pq.read_schema(seg).names:  # sorted by step: a step window reads few row groups
            steps = pq.read_table(seg, columns=["step"]).column("step").to_pylist()
            assert steps == sorted(steps)
        a, b = rows(off, kind), rows(Store.open(root), kind)  # the default mode reads what is there
        assert len(a) > 0 and a.equals(b), kind
    assert len(segments(cache)) == len(WRITTEN)
    said = {mode: report.build(views.direct_loader(Store.open(root, compaction=mode)), run="r1")
            for mode in ("off", "use")}
    assert [s["rank"] for s in said["use"]["stragglers"]] == [11]
    _close(said["off"], said["use"])


def test_use_builds_nothing_and_background_builds_once_packs_settle(tmp_path, cache, monkeypatch):
    root = synthetic(tmp_path / "s")
    assert len(Store.open(root).files("step", runs=["r1"])) == 2 and not segments(cache)
    bg = Store.open(root, compaction="background")
    assert len(bg.files("step", runs=["r1"])) == 2  # just written: not settled, nothing submitted
    assert compact.wait_idle(1) and not segments(cache)
    monkeypatch.setattr(compact, "SETTLE_S", 0.0)
    assert len(bg.files("step", runs=["r1"])) == 2  # the build runs on the worker; packs read meanwhile
    assert compact.wait_idle(60)
    (seg,) = bg.files("step", runs=["r1"])
    assert seg.is_relative_to(cache)
    assert rows(bg, "step").equals(rows(Store.open(root, compaction="off"), "step"))


def test_while_the_agent_adds_and_merges_packs_every_row_is_read_once(tmp_path, cache, monkeypatch):
    # A store whose own path has a "key=value" component, which the segments' paths lack: packs and
    # segments then read as two groups (agent.store.tableview).
    store = tmp_path / "job=5" / "store"
    clock = Clock()
    ing = ingestor(store, clock)
    writers = feed(store, ing, rounds=3)  # a pack per pass: 3 per kind
    now, off = Store.open(store, compaction="now"), Store.open(store, compaction="off")

    def check(rounds: int) -> None:
        for reader in (Store.open(store), now):
            coll = rows(reader, "collective", all_attempts=True)
            assert len(coll) == RANKS * 10 * rounds and not coll.duplicated(["rank", "seq"]).any()
            assert coll.equals(rows(off, "collective", all_attempts=True))
            step = rows(reader, "step")
            assert sorted(zip(step["rank"], step["step"])) == [(r, s) for r in range(RANKS) for s in range(rounds)]

    first = in_cache(now.files("collective", runs=["r1"]), cache)
    assert len(first) == 1 and len(compact.sources(first[0])) == 3
    check(3)
    feed(store, ing, rounds=1, first=3, writers=writers)  # one new pack beside the segment
    listed = Store.open(store).files("collective", runs=["r1"])
    assert len(in_cache(listed, cache)) == 1 and len(listed) == 2
    check(4)
    feed(store, ing, rounds=1, first=4, writers=writers)  # two new: now builds a second segment of them
    listed = now.files("collective", runs=["r1"])
    assert len(listed) == 2 and len(in_cache(listed, cache)) == 2
    check(5)
    feed(store, ing, rounds=3, first=5, writers=writers)  # the 8th small pack: the agent merges them all
    assert len(off.files("collective", runs=["r1"])) == 1
    monkeypatch.setattr(compact, "STALE_AFTER_S", 3600.0)
    check(8)  # both segments stale: never read beside the merged pack that holds their rows,
    assert len(segments(cache)) >= 2  # and left while young (a reader with a newer listing may have built them)
    monkeypatch.setattr(compact, "STALE_AFTER_S", 0.0)
    check(8)
    assert segments(cache) == []  # then deleted


def test_a_restarted_rank_keeps_its_newest_attempt_through_a_segment(tmp_path, cache):
    clock = Clock()
    ing = ingestor(tmp_path / "s", clock)
    old, new = writer(tmp_path / "s", attempt=0), writer(tmp_path / "s", attempt=1)
    old.submit("step", step_rows(5))
    old.flush()
    ing.poll()
    redo = [r._replace(t_start=r.t_start + 100, t_end=r.t_end + 100, loss=9.0) for r in step_rows(5)[2:]]
    new.submit("step", [StepRecord(*r) for r in redo])
    new.flush()
    ing.poll()
    now = Store.open(tmp_path / "s", compaction="now")
    assert len(in_cache(now.files("step", runs=["r1"]), cache)) == 1
    step = now.query("SELECT * FROM step ORDER BY step", kinds=["step"], runs=["r1"])
    assert step["step"].tolist() == [0, 1, 2, 3, 4] and step["loss"].tolist()[2:] == [9.0] * 3
    assert len(now.query("SELECT * FROM step", kinds=["step"], runs=["r1"], all_attempts=True)) == 8


def test_a_damaged_pack_fails_the_build_once_and_is_skipped_as_before(tmp_path, cache):
    root = synthetic(tmp_path / "s")
    bad = Store.open(root, compaction="off").files("step", runs=["r1"])[0]
    bad.write_bytes(b"PAR1 not parquet")
    before = compact.failures
    now = Store.open(root, compaction="now")
    assert not in_cache(now.files("step", runs=["r1"]), cache)
    assert not in_cache(now.files("step", runs=["r1"]), cache) and compact.failures == before + 1  # not retried
    df = rows(now, "step")
    assert len(df) == 30 * 8 and any(bad.name in s for s in df.attrs[SKIPPED])  # the other host's ranks


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="compaction must be one of"):
        Store(roots=(Path("/"),), compaction="always")


def test_the_dashboard_compacts_in_the_background(tmp_path, cache, monkeypatch):
    from streamlit.testing.v1 import AppTest

    root = synthetic(tmp_path / "s")
    monkeypatch.setattr(compact, "SETTLE_S", 0.0)
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(root)])
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py"),
                           default_timeout=60).run()
    at.switch_page("app_pages/overview.py")
    at.run()
    assert not at.exception
    assert any("Straggler: rank 11" in w.value for w in at.warning)
    assert compact.wait_idle(60)
    assert {s.parent.parent.parent.name for s in segments(cache)} >= {"run", "step"}

