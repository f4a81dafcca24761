"""Agent ingest: spools → Parquet run store, exactly once, batched, and read back with read_table (which the
ingest path itself never loads)."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from meshscope.agent.store import parts as partio
from meshscope.agent.collector.ingest import IngestConfig, Ingestor
from meshscope.agent.store.reader import list_runs, read_table
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.contract import (
    SCHEMAS, CollectiveRecord, EventRecord, GpuRecord, SpanRecord, StepRecord, spool_path,
)
from meshscope.agent.transport.writer import SpoolWriter


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


class Crash(BaseException):
    """Stands in for SIGKILL inside the process: nothing after it runs."""


def writer(store, *, run="r1", rank=0, attempt=0, **kw) -> SpoolWriter:
    return SpoolWriter(path=spool_path(store, run=run, rank=rank, attempt=attempt), run=run, rank=rank,
                       attempt=attempt, host="node0", start=False, **kw)


def coll_rows(rank: int, n: int, start: int = 0) -> list[CollectiveRecord]:
    return [CollectiveRecord(step=i // 10, op="all_reduce" if i % 2 else "all_gather", dim="fsdp", group="g0",
                             group_size=4, seq=i, bytes=1000 + i, t_start=10.0 + i, t_end=10.5 + i, duration_s=0.5,
                             wait_s=0.1, algbw=2000.0, busbw=3000.0, peer=-1, source="c10d", mesh_dim="dp_shard")
            for i in range(start, start + n)]


def step_rows(n: int) -> list[StepRecord]:
    return [StepRecord(step=i, t_start=10.0 + i, t_end=11.0 + i, wall_s=1.0, compute_s=0.6, exposed_comm_s=0.2,
                       bubble_s=0.1, other_s=0.1, data_s=0.01, forward_s=0.2, backward_s=0.4, optimizer_s=0.02,
                       tokens=4096, flops=1e12, mfu=0.4, loss=3.0 - i / 100, loss_nonfinite=False, grad_norm=1.0,
                       lr=3e-4, skipped=i == 3, n_collectives=40, dropped_records_total=0, cpu_s=0.7, cpu_wait_s=0.0)
            for i in range(n)]


def start_event(t: float) -> EventRecord:
    return EventRecord(t=t, step=0, kind="start", message="")


def ingestor(store, clock=None, **cfg) -> Ingestor:
    return Ingestor(store=store, state=MetricsState(), clock=clock or Clock(), config=IngestConfig(**cfg))


def all_parts(store) -> list:
    return sorted((store / "tables").rglob("part-*.parquet"))


def test_round_trip_equals_what_was_submitted(tmp_path):
    submitted = {}
    for rank in range(3):
        w = writer(tmp_path, rank=rank)
        rows = {"collective": coll_rows(rank, 25), "step": step_rows(5),
                "event": [EventRecord(t=12.0, step=2, kind="nonfinite_loss", message=f"rank {rank}")],
                "span": [SpanRecord(step=1, stage=0, microbatch=m, kind="forward", t_start=1.0 + m, t_end=1.5 + m)
                         for m in range(4)]}
        for kind, kind_rows in rows.items():
            w.submit(kind, kind_rows)
            submitted.setdefault(kind, []).extend((rank, row) for row in kind_rows)
        w.flush()
        assert w.close()
    ing = ingestor(tmp_path)
    ing.ingest_all()
    assert list_runs(tmp_path) == ["r1"]
    for kind, rows in submitted.items():
        df = read_table(tmp_path, kind, run="r1")
        names = SCHEMAS[kind].names
        expected = pd.DataFrame([dict(row._asdict(), rank=rank, run="r1") for rank, row in rows])
        sort = ["rank"] + [c for c in ("seq", "step", "microbatch") if c in names]
        got = df.sort_values(sort).reset_index(drop=True)
        exp = expected.sort_values(sort).reset_index(drop=True)[list(got.columns)]
        assert list(got.columns) == names + ["run", "rank"]
        pd.testing.assert_frame_equal(got, exp, check_dtype=False)
    assert ing.state.ingested["collective"] == 75 and ing.state.ingested["step"] == 15


def test_read_table_filters_and_empty_results_are_typed(tmp_path):
    w = writer(tmp_path, rank=1)
    w.submit("step", step_rows(10))
    w.flush()
    ingestor(tmp_path).ingest_all()
    df = read_table(tmp_path, "step", run="r1", ranks=[1], steps=(3, 6), columns=["step", "rank"])
    assert df["step"].tolist() == [3, 4, 5] and set(df["rank"]) == {1}
    empty = read_table(tmp_path, "collective", run="r1")
    assert empty.empty and list(empty.columns) == SCHEMAS["collective"].names + ["run", "rank"]
    assert str(empty["bytes"].dtype) == "int64" and str(empty["t_start"].dtype) == "float64"
    assert read_table(tmp_path, "step", run="r1", ranks=[]).empty
    assert read_table(tmp_path / "nothing-here", "span").empty
    with pytest.raises(ValueError, match="unknown record kind"):
        read_table(tmp_path, "nope")
    with pytest.raises(ValueError, match="no column"):
        read_table(tmp_path, "step", columns=["nope"])


def test_many_small_frames_make_few_parts(tmp_path):
    w = writer(tmp_path)
    for i in range(200):
        w.submit("collective", coll_rows(0, 5, start=5 * i))
        w.flush()  # 200 separate frames
    ingestor(tmp_path, pack=False).ingest_all()
    assert len(all_parts(tmp_path)) == 1
    assert len(read_table(tmp_path, "collective")) == 1000


def test_size_and_age_bound_parts_and_offsets_advance(tmp_path):
    clock = Clock()
    w = writer(tmp_path)
    ing = ingestor(tmp_path, clock, part_target_bytes=20_000, max_part_age_s=10, read_chunk_bytes=8_000, pack=False)
    for i in range(20):
        w.submit("collective", coll_rows(0, 50, start=50 * i))
        w.flush()
    while ing.poll():
        pass
    n_size = len(all_parts(tmp_path))
    assert n_size >= 2  # flushed on size, a few frames per part
    w.submit("collective", coll_rows(0, 1, start=5000))
    w.flush()
    ing.poll()
    assert len(all_parts(tmp_path)) == n_size  # small remainder buffered...
    clock.t += 11
    ing.poll()
    assert len(all_parts(tmp_path)) == n_size + 1  # ...until it is old enough
    saved = json.loads((tmp_path / "agent" / "offsets.json").read_text())["files"]
    assert saved["spool/r1/rank-0.a0.spool"]["offset"] == w.path.stat().st_size
    assert len(read_table(tmp_path, "collective")) == 1001


def _three_chunks(store) -> int:
    w = writer(store)
    for i in range(3):
        w.submit("collective", coll_rows(0, 10, start=10 * i))
        w.submit("step", step_rows(1))
        w.flush()
    return 30


def _counts(store) -> tuple[int, int]:
    return len(read_table(store, "collective")), len(read_table(store, "step"))


def test_crash_after_parts_before_offsets_is_exactly_once(tmp_path, monkeypatch):
    _three_chunks(tmp_path)
    ing = ingestor(tmp_path, read_chunk_bytes=1)  # one frame per poll
    ing.poll(final=True)
    monkeypatch.setattr(ing.offsets, "save", lambda entries: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        ing.poll(final=True)  # parts of the next range are written, the offsets never are
    monkeypatch.undo()
    restarted = ingestor(tmp_path)
    restarted.ingest_all()
    assert _counts(tmp_path) == (30, 3)


def test_crash_between_the_parts_of_one_range_is_exactly_once(tmp_path, monkeypatch):
    _three_chunks(tmp_path)
    real = partio.write_part
    calls = []

    def dying_write(*args, **kw):
        calls.append(kw["kind"])
        if len(calls) == 4:  # range 2: its collective part is in place, its step part is not
            raise Crash()
        return real(*args, **kw)

    ing = ingestor(tmp_path, read_chunk_bytes=600)
    monkeypatch.setattr(partio, "write_part", dying_write)
    with pytest.raises(Crash):
        for _ in range(10):
            ing.poll(final=True)
    monkeypatch.undo()
    restarted = ingestor(tmp_path)
    restarted.ingest_all()
    assert _counts(tmp_path) == (30, 3)


def test_crash_inside_a_part_write_leaves_no_trace(tmp_path, monkeypatch):
    _three_chunks(tmp_path)

    def torn_write(directory, table, **kw):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f".{partio.part_name(kw['stream'], kw['start'], kw['end'])}.1.tmp").write_bytes(b"torn")
        raise Crash()

    monkeypatch.setattr(partio, "write_part", torn_write)
    with pytest.raises(Crash):
        ingestor(tmp_path).ingest_all()
    monkeypatch.undo()
    ingestor(tmp_path).ingest_all()
    assert _counts(tmp_path) == (30, 3) and not list((tmp_path / "tables").rglob("*.tmp"))


def test_compaction_merges_small_parts_and_survives_a_crash(tmp_path, monkeypatch):
    clock = Clock()
    w = writer(tmp_path)
    ing = ingestor(tmp_path, clock, max_part_age_s=0, compact_min_parts=4, compact_interval_s=1e9, pack=False)
    for i in range(12):
        w.submit("collective", coll_rows(0, 10, start=10 * i))
        w.flush()
        ing.poll()
    assert len(all_parts(tmp_path)) == 12
    real_unlink = partio._unlink
    monkeypatch.setattr(partio, "_unlink", lambda path: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        ing.poll(final=True)  # merged part written, sources not yet deleted: duplicates on disk
    monkeypatch.setattr(partio, "_unlink", real_unlink)
    restarted = ingestor(tmp_path, clock, compact_min_parts=4)
    assert len(all_parts(tmp_path)) == 1  # the start-up cleanup removed the merged sources
    restarted.ingest_all()
    df = read_table(tmp_path, "collective")
    assert len(df) == 120 and df["seq"].is_unique


def test_store_write_failure_is_counted_and_retried_on_the_same_range(tmp_path):
    clock = Clock()
    w = writer(tmp_path)
    w.submit("collective", coll_rows(0, 10))
    w.submit("step", step_rows(2))
    w.flush()
    (tmp_path / "tables").mkdir()
    (tmp_path / "tables" / "step").write_text("in the way")  # the step part fails, the collective one not
    ing = ingestor(tmp_path, clock, retry_first_s=5, retry_max_s=5, pack=False)
    ing.poll(final=True)
    assert ing.state.store_write_errors == 1 and ing.state.ingested["collective"] == 10
    w.submit("collective", coll_rows(0, 10, start=10))
    w.flush()
    ing.poll(final=True)  # backing off: the failed range is kept whole, nothing more is read
    assert ing.state.ingested["collective"] == 10 and ing.state.store_write_errors == 1
    (tmp_path / "tables" / "step").unlink()
    clock.t += 6
    ing.poll(final=True)
    ing.poll(final=True)
    assert _counts(tmp_path) == (20, 2)
    assert len(list((tmp_path / "tables" / "collective").rglob("part-*"))) == 2


def test_new_files_damage_and_bad_headers(tmp_path):
    ing = ingestor(tmp_path)
    ing.poll()
    w = writer(tmp_path, run="late", rank=4)
    w.submit("event", [start_event(1.0)])
    w.flush()
    with open(w.path, "ab") as fh:
        fh.write(b"\x00" * 100)
    bad = spool_path(tmp_path, run="late", rank=5, attempt=0)
    bad.write_bytes(b"this is no spool file at all" * 4)
    ing.ingest_all()
    assert read_table(tmp_path, "event", run="late")["rank"].tolist() == [4]
    assert ing.state.rejected["bad_magic"] == 1 and ing.state.rejected["bad_file_header"] == 1


def test_damaged_offsets_file_recovers_from_parts(tmp_path):
    _three_chunks(tmp_path)
    ingestor(tmp_path, read_chunk_bytes=1).ingest_all()
    (tmp_path / "agent" / "offsets.json").write_text("{ torn")
    again = ingestor(tmp_path)
    assert "offsets.json" in again.load_error
    again.ingest_all()
    assert _counts(tmp_path) == (30, 3)


def test_gpu_rows_go_to_active_runs_under_rank_minus_one(tmp_path):
    clock = Clock()
    w = writer(tmp_path, run="busy")
    w.submit("event", [start_event(clock.t)])
    w.flush()
    ing = ingestor(tmp_path, clock)
    ing.poll()
    row = GpuRecord(t=clock.t, host="node0", gpu=0, uuid="GPU-1", name="H100", util_ratio=0.5, mem_util_ratio=0.25,
                    mem_used_bytes=10, mem_total_bytes=100, power_watts=300.0, temperature_celsius=60.0,
                    sm_clock_hz=1.4e9, sm_clock_max_hz=1.98e9, throttle_reasons=0, xid_errors_total=0,
                    ecc_errors_total=0)
    ing.add_gpu_rows([row, row._replace(gpu=1)])
    ing.poll(final=True)
    df = read_table(tmp_path, "gpu", run="busy")
    assert sorted(df["gpu"]) == [0, 1] and set(df["rank"]) == {-1}


def test_null_values_from_a_rank_do_not_stop_the_agent(tmp_path):
    w = writer(tmp_path)
    w.submit("step", [step_rows(1)[0]._replace(step=None), step_rows(2)[1]])  # one step without its number
    w.submit("collective", [coll_rows(0, 1)[0]._replace(step=None, op=None, dim=None)] + coll_rows(0, 3))
    w.flush()
    ing = ingestor(tmp_path)
    ing.ingest_all()
    assert ing.state.metric_errors == 0 and ing.state.ingested["collective"] == 4
    assert ing.state.runs["r1"].ranks[0].steps == 1 and ing.state.runs["r1"].ranks[0].last_step == 1
    assert len(read_table(tmp_path, "step")) == 2 and read_table(tmp_path, "step")["step"].isna().sum() == 1


def test_the_ingest_path_does_not_load_the_store_reader(tmp_path):
    """The store's one reader (``agent.store.reader``) loads DuckDB and pandas; the agent's ingest path
    writes the same store and must not pay for them (memory on every node, start-up time). ``meshscope
    ingest`` in a fresh interpreter, over a real spool: importing the command loads neither, and running
    it never loads DuckDB or the reader. (pandas does load while ingesting: pyarrow's ``to_numpy`` of a
    chunked column, in the metric state, imports it.)"""
    from tests.support.spools import write_run

    write_run(tmp_path, run="r1", world_size=2, steps=4, collectives_per_step=3)
    reader = ("duckdb", "meshscope.agent.store.reader")
    code = ("import sys; from meshscope.agent.collector import cli; "
            f"print(sorted(m for m in {(*reader, 'pandas')!r} if m in sys.modules)); "
            "rc = cli.ingest_main(['--store', sys.argv[1]]); "
            f"print(rc, sorted(m for m in {reader!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert (lines[0], lines[-1]) == ("[]", "0 []"), out.stdout + out.stderr
    assert len(read_table(tmp_path, "step", run="r1")) == 2 * 4  # it did ingest


def test_a_spool_directory_the_run_name_rule_refuses_is_counted_once_and_never_a_run(tmp_path):
    """No writer makes such a directory (the spool path applies the rule); one that appears anyway (copied,
    hand-made) is rejected by the same rule, once, and the store gets no partition for it."""
    w = writer(tmp_path, run="ok")
    w.submit("event", [start_event(1.0)])
    w.flush()
    bad_dir = tmp_path / "spool" / "bad run-ü"
    bad_dir.mkdir()
    (bad_dir / w.path.name).write_bytes(w.path.read_bytes())
    ing = ingestor(tmp_path)
    ing.ingest_all()
    ing.ingest_all()
    assert list_runs(tmp_path) == ["ok"]
    assert ing.state.rejected["bad_run_name"] == 1
    assert not any("bad run" in str(p) for p in (tmp_path / "tables").rglob("*"))
