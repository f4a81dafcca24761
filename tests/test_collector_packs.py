"""Node packs (``agent.store.packs``): a run's final parts merged across ranks into one file per kind,
exactly once across crashes at every point of a pass, read back as the parts were."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshscope.agent.store import packs, parts
from meshscope.agent.collector.ingest import IngestConfig, Ingestor
from meshscope.agent.store.reader import read_table
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.contract import StepRecord
from meshscope.agent.contract import part_name as parts_name
from test_collector_ingest import Clock, Crash, coll_rows, step_rows, writer

RANKS = 4


def ingestor(store, clock, **cfg) -> Ingestor:
    return Ingestor(store=store, state=MetricsState(), clock=clock, config=IngestConfig(max_part_age_s=0, **cfg))


def files(store, pattern: str, kind: str = "") -> list:
    return sorted((store / "tables" / kind).rglob(pattern))


def feed(store, ing, *, rounds: int, first: int = 0, writers=None):
    """``rounds`` polls, each after every rank wrote 10 collectives and one step."""
    writers = writers or [writer(store, rank=r) for r in range(RANKS)]
    for i in range(first, first + rounds):
        for r, w in enumerate(writers):
            w.submit("collective", coll_rows(r, 10, start=10 * i))
            w.submit("step", [step_rows(i + 1)[i]])
            w.flush()
        ing.poll()
    return writers


def check_once(store, *, rounds: int) -> None:
    coll = read_table(store, "collective", all_attempts=True)
    assert len(coll) == RANKS * 10 * rounds and not coll.duplicated(["rank", "seq"]).any()
    step = read_table(store, "step", all_attempts=True)
    assert sorted(zip(step["rank"], step["step"])) == [(r, s) for r in range(RANKS) for s in range(rounds)]


def test_final_parts_become_one_pack_per_kind_sorted_by_step(tmp_path):
    clock = Clock()
    ing = ingestor(tmp_path, clock)
    feed(tmp_path, ing, rounds=3)
    assert files(tmp_path, "part-*.parquet") == []
    for kind in ("collective", "step"):
        pack_files = files(tmp_path, "pack-*.parquet", kind)
        assert len(pack_files) == 3  # one per pass (merged once 8 gather)
        table = pq.read_table(pack_files[-1], partitioning=None)
        assert {"rank", packs.STREAM_COLUMN} <= set(table.column_names)
        steps = table.column("step").to_pylist()
        assert steps == sorted(steps)
        ranges = packs.manifest(pack_files[-1])
        assert {r for r, *_ in ranges} == set(range(RANKS))
    check_once(tmp_path, rounds=3)


def test_small_packs_merge_and_the_run_reads_the_same(tmp_path):
    clock = Clock()
    ing = ingestor(tmp_path, clock, pack_merge_min=4)
    feed(tmp_path, ing, rounds=10)
    pack_files = files(tmp_path, "pack-*.parquet", "collective")
    assert len(pack_files) < 4  # merged as they gathered
    merged = max(pack_files, key=lambda p: p.stat().st_size)
    assert len(packs.manifest(merged)) == RANKS  # each rank's ranges joined into one
    check_once(tmp_path, rounds=10)


@pytest.mark.parametrize("crash_on", [1, 3])
def test_crash_between_pack_and_source_deletion_reads_once_and_cleans_up(tmp_path, monkeypatch, crash_on):
    """crash_on=1: after a new pack is written, before its parts are deleted; 3: after a merged pack is
    written, before the small packs it merged are deleted (pack_merge_min=2: the second pass merges)."""
    clock = Clock()
    ing = ingestor(tmp_path, clock, pack_merge_min=2)
    writers = feed(tmp_path, ing, rounds=1)
    real_unlink, calls = packs.Path.unlink, []

    def unlink(self, missing_ok=False):
        calls.append(self)
        if len(calls) >= crash_on and (crash_on == 1) == self.name.startswith("part-"):
            raise Crash()
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(packs.Path, "unlink", unlink)
    with pytest.raises(Crash):
        feed(tmp_path, ing, rounds=1, first=1, writers=writers)
    monkeypatch.undo()
    check_once(tmp_path, rounds=2)  # the leftovers are superseded: every record once
    restarted = ingestor(tmp_path, clock, pack_merge_min=2)  # start-up cleanup deletes them
    if crash_on == 1:  # the crash came packing "collective" (kinds go in order): its parts were in a pack
        assert files(tmp_path, "part-*.parquet", "collective") == []
    else:
        assert len(files(tmp_path, "pack-*.parquet", "collective")) == 1
    feed(tmp_path, restarted, rounds=2, first=2, writers=writers)
    check_once(tmp_path, rounds=4)


def test_lost_offsets_resume_after_what_packs_hold(tmp_path):
    clock = Clock()
    ing = ingestor(tmp_path, clock)
    writers = feed(tmp_path, ing, rounds=3)
    (tmp_path / "agent" / "offsets.json").unlink()
    restarted = ingestor(tmp_path, clock)
    feed(tmp_path, restarted, rounds=2, first=3, writers=writers)
    check_once(tmp_path, rounds=5)


def test_resume_point_is_past_gaps_in_what_packs_hold(tmp_path):
    # A chunk of rejected frames writes no part, and retention deletes old packs: packed ranges have gaps,
    # yet all below the furthest packed end was committed. Resuming inside a gap would ingest ranges that
    # overlap later packs without lying inside them: rows twice.
    run_dir = tmp_path / "tables" / "step" / "run=r1"
    packs.write_tables(packs.packs_dir(run_dir), kind="step",
                       tables=[packs.ranked(pa.table({"step": [0]}), rank=0, stream="s")],
                       ranges=[(0, "s", 0, 10), (0, "s", 20, 30), (1, "s", 0, 99)])
    assert packs.covered_end([run_dir], rank=0, stream="s", start=0) == 30
    assert packs.covered_end([run_dir], rank=0, stream="other", start=5) == 5


def test_a_part_written_again_after_it_was_packed_is_not_packed_twice(tmp_path):
    # E.g. a GPU part whose write is retried after its first copy was already packed.
    run_dir = tmp_path / "tables" / "gpu" / "run=r1"

    def part(start: int) -> None:
        parts.write_part(run_dir / "rank=-1", pa.table({"t": [float(start)]}), kind="gpu", stream="gpuh",
                         start=start, end=start + 1, source="test")

    for i in range(2):
        part(i)
    packs.pack_run(run_dir, kind="gpu", final=lambda s, e: True, merge_min=2, small_bytes=1 << 20)
    part(0)  # again
    part(2)
    packs.pack_run(run_dir, kind="gpu", final=lambda s, e: True, merge_min=2, small_bytes=1 << 20)
    assert sorted(read_table(tmp_path, "gpu", run="r1")["t"]) == [0.0, 1.0, 2.0]
    (pack,) = packs.list_packs(packs.packs_dir(run_dir))
    assert pq.read_metadata(pack).num_rows == 3


def test_an_unreadable_part_is_counted_and_never_stops_the_agent(tmp_path):
    clock = Clock()
    ing = ingestor(tmp_path, clock)
    writers = feed(tmp_path, ing, rounds=1)
    bad = tmp_path / "tables" / "step" / "run=r1" / "rank=0" / parts_name("gpubad", 0, 1)  # a GPU-like stream: final at once
    bad.write_bytes(b"PAR1 not parquet")
    ing._touched.add(("step", bad.parent))
    feed(tmp_path, ing, rounds=2, first=1, writers=writers)  # packing that run fails each time: no raise
    assert ing.state.store_write_errors >= 1
    step = read_table(tmp_path, "step", run="r1", all_attempts=True)  # the bad file is skipped, named
    assert sorted(zip(step["rank"], step["step"])) == [(r, s) for r in range(RANKS) for s in range(3)]


def test_restarted_rank_in_packs_keeps_the_newest_attempt(tmp_path):
    """Attempt 1 re-executes steps 2..4 after a restart from a step-2 checkpoint: the reader keeps the
    newest attempt's rows of those steps, from packs as from parts."""
    clock = Clock()
    ing = ingestor(tmp_path, clock)
    old, new = writer(tmp_path, attempt=0), writer(tmp_path, attempt=1)
    old.submit("step", step_rows(5))
    old.flush()
    ing.poll()
    rows = [r._replace(t_start=r.t_start + 100, t_end=r.t_end + 100, loss=9.0) for r in step_rows(5)[2:]]
    new.submit("step", [StepRecord(*r) for r in rows])
    new.flush()
    ing.poll()
    assert files(tmp_path, "part-*.parquet") == []
    step = read_table(tmp_path, "step", run="r1").sort_values("step")
    assert step["step"].tolist() == [0, 1, 2, 3, 4]
    assert step["loss"].tolist()[2:] == [9.0, 9.0, 9.0] and step["loss"].tolist()[0] != 9.0
    assert len(read_table(tmp_path, "step", run="r1", all_attempts=True)) == 8


def test_superseded_rule():
    P = packs.PartRef
    a = ("A", ((0, "s", 0, 100), (1, "t", 0, 50)))
    b = ("B", ((0, "s", 0, 200), (1, "t", 0, 80)))  # a merge that holds all of A
    c = ("C", ((0, "s", 200, 300),))
    parts = [P("p1", 0, "s", 100, 150), P("p2", 0, "s", 250, 300), P("p3", 0, "s", 300, 310), P("p4", 2, "s", 0, 9)]
    assert packs.superseded(parts, [a, b, c]) == {"A", "p1", "p2"}
    same = ("A2", a[1])  # the same pack in two stores: one is read
    assert packs.superseded([], [a, same]) == {"A2"}
    assert packs.superseded([], [a, ("X", None)]) == set()


def _close(a, b, path=""):
    """Equal JSON, floats within 1e-9 relative (a pack sums rows in another order than the parts)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, nan_ok=True), path
    else:
        assert a == b, path


def test_the_report_reads_a_store_of_packs_as_the_same_store_of_parts(tmp_path):
    # What the user reads (``meshscope report``: straggler, bubble, breakdown, MFU) must not depend on the
    # layout: the same synthetic job (a throttled straggler, pp=2 x fsdp=8, 2 hosts) written as per-rank
    # parts and as one pack per host and kind.
    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import report, views
    from tests.support.store import Straggler, SyntheticConfig, write_store

    reports = {}
    for layout in ("parts", "packs"):
        cfg = SyntheticConfig(run="r1", mesh={"pp": 2, "fsdp": 8}, steps=30, layout=layout,
                              straggler=Straggler(rank=11, factor=1.3, cause="throttle"))
        write_store(tmp_path / layout, config=cfg)
        reports[layout] = report.build(views.direct_loader(Store.open(tmp_path / layout)), run="r1")
    assert len(files(tmp_path / "packs", "pack-*.parquet")) == 7 * 2  # 7 kinds x 2 hosts
    assert not files(tmp_path / "packs", "part-*.parquet")
    assert [s["rank"] for s in reports["parts"]["stragglers"]] == [11], reports["parts"]["stragglers"]
    assert "throttling" in reports["parts"]["stragglers"][0]["cause"]
    _close(reports["parts"], reports["packs"])


def test_the_agent_packs_by_default_and_no_pack_keeps_parts(tmp_path):
    from meshscope.agent.collector import cli

    def ingest_config(*extra):
        args = cli._build_parser("meshscope agent", agent=True).parse_args(["--store", str(tmp_path), *extra])
        return cli._config(args, agent=True).ingest

    assert ingest_config().pack and not ingest_config("--no-pack").pack
    assert cli._config(cli._build_parser("meshscope ingest", agent=False).parse_args(["--store", str(tmp_path)]),
                       agent=False).ingest.pack
