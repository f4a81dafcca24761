"""export-trace: a valid Chrome-trace JSON with ranks as processes, steps, spans and collectives."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from meshscope.agent.collector.ingest import Ingestor
from meshscope.agent.store.reader import read_table
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.contract import CollectiveRecord, EventRecord, RunRecord, SpanRecord, StepRecord, spool_path
from meshscope.agent.trace import main, parse_steps
from meshscope.agent.transport.writer import SpoolWriter
from tests.support.spools import write_run


class Clock:
    def now(self) -> float:
        return 2_000_000_000.0


T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = tmp_path_factory.mktemp("trace")
    for rank in range(2):
        w = SpoolWriter(path=spool_path(store, run="pp", rank=rank, attempt=0), run="pp", rank=rank, attempt=0,
                        host=f"node{rank}", start=False)
        steps, spans, colls = [], [], []
        for s in range(6):
            t = T0 + s
            steps.append(StepRecord(
                step=s, t_start=t, t_end=t + 0.9, wall_s=0.9, compute_s=0.5, exposed_comm_s=0.2, bubble_s=0.1,
                other_s=0.1, data_s=0.05, forward_s=0.15, backward_s=0.3, optimizer_s=0.05, tokens=1024, flops=1e12,
                mfu=0.3, loss=float("nan") if s == 4 else 2.0, loss_nonfinite=s == 4, grad_norm=1.0, lr=1e-4,
                skipped=False, n_collectives=3, dropped_records_total=0, cpu_s=0.3, cpu_wait_s=0.0))
            for m in range(2):
                spans.append(SpanRecord(step=s, stage=rank, microbatch=m, kind="forward", t_start=t + 0.1 + 0.1 * m,
                                        t_end=t + 0.15 + 0.1 * m))
                spans.append(SpanRecord(step=s, stage=rank, microbatch=m, kind="backward", t_start=t + 0.4 + 0.2 * m,
                                        t_end=t + 0.5 + 0.2 * m))
            # two overlapping all-gathers (prefetch) and a send on another dim
            fsdp = dict(step=s, op="all_gather", dim="fsdp", group="fsdp0", group_size=2, bytes=4_000_000, peer=-1,
                        source="fsdp_comm")
            colls.append(CollectiveRecord(**fsdp, seq=3 * s, t_start=t + 0.1, t_end=t + 0.3, duration_s=0.2,
                                          wait_s=0.05, algbw=2e7, busbw=1e7, mesh_dim=""))
            colls.append(CollectiveRecord(**fsdp, seq=3 * s + 1, t_start=t + 0.2, t_end=t + 0.35, duration_s=0.15,
                                          wait_s=0.0, algbw=2.7e7, busbw=1.3e7, mesh_dim=""))
            colls.append(CollectiveRecord(step=s, op="send", dim="pp", group="pp0", group_size=2, seq=3 * s + 2,
                                          bytes=1000, t_start=t + 0.6, t_end=t + 0.61, duration_s=0.01, wait_s=0.0,
                                          algbw=1e5, busbw=1e5, peer=1 - rank, source="c10d", mesh_dim=""))
        w.submit("step", steps)
        w.submit("span", spans)
        w.submit("collective", colls)
        w.submit("event", [EventRecord(t=T0 + 4.5, step=4, kind="nonfinite_loss", message="loss is nan")])
        w.submit("run", [RunRecord(
            rank=rank, world_size=2, local_rank=rank, host=f"node{rank}", pid=100 + rank, attempt=0, t_start=T0,
            strategy="pp", mesh='{"pp": 2}', coords="{}", schedule="1f1b", microbatches=2, virtual_stages=1,
            model="tiny", n_params=1, n_params_nonembedding=1, n_layers=1, d_model=1, seq_len=1, global_batch=1,
            flops_per_token=1.0, peak_flops=1.0, peak_source="override", device="cpu", backend="gloo", dtype="fp32",
            torch_version="2.13", meshscope_version="0.1", python_version="3.11", config="{}", flops_method="",
            environment="{}")])
        w.flush()
        assert w.close()
    Ingestor(store=store, state=MetricsState(), clock=Clock()).ingest_all()
    return store


def export(store, tmp_path, *extra) -> dict:
    out = tmp_path / "t.json"
    assert main(["--store", str(store), "--run", "pp", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_trace_structure(store, tmp_path):
    trace = export(store, tmp_path, "--steps", "2:5")
    ev = trace["traceEvents"]
    assert trace["metadata"]["run"] == "pp" and trace["metadata"]["ranks"] == 2
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "rank 0 (node0)", 1: "rank 1 (node1)"}
    threads = {(e["pid"], e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(0, "steps"), (0, "phases"), (0, "pp stage 0"), (1, "pp stage 1"), (0, "comm fsdp"),
            (0, "comm fsdp #2"), (0, "comm pp"), (0, "events")} <= threads
    steps = [e for e in ev if e.get("cat") == "step"]
    assert sorted((e["pid"], e["args"]["step"]) for e in steps) == [(r, s) for r in (0, 1) for s in (2, 3, 4)]
    nan_step = next(e for e in steps if e["args"]["step"] == 4)
    assert nan_step["args"]["loss"] is None and nan_step["dur"] == pytest.approx(0.9e6)
    coll = [e for e in ev if e.get("cat", "").startswith("comm")]
    assert len(coll) == 2 * 3 * 3
    ag = next(e for e in coll if e["args"]["seq"] == 6 and e["pid"] == 0)
    assert ag["name"] == "all_gather" and ag["args"]["bytes"] == 4_000_000 and ag["args"]["busbw_GBps"] == 0.01
    assert ag["dur"] == pytest.approx(0.2e6)
    spans = [e for e in ev if e.get("cat") == "pipeline"]
    assert {e["name"] for e in spans} == {"F0", "F1", "B0", "B1"} and len(spans) == 2 * 3 * 4
    events = sorted((e["pid"], e["name"]) for e in ev if e.get("cat") == "event")
    assert events == [(0, "nonfinite_loss"), (1, "nonfinite_loss")]
    assert min(e["ts"] for e in ev if e["ph"] == "X") == 0


def test_slices_nest_within_each_thread(store, tmp_path):
    ev = export(store, tmp_path)["traceEvents"]
    by_thread = defaultdict(list)
    for e in ev:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for slices in by_thread.values():
        slices.sort()
        for (_, end), (start, _) in zip(slices, slices[1:]):
            assert start >= end - 1e-3  # no partial overlap on one track


@pytest.mark.parametrize("args, needle", [
    (["--run", "nope"], "unknown run 'nope'"),
    (["--run", "pp", "--steps", "50:60"], "has no steps in 50:60 (steps 0..5)"),
    (["--run", "pp", "--steps", "5:2"], "is empty"),
    (["--run", "pp", "--steps", "a:b"], "is not A:B"),
])
def test_user_errors_are_one_line(store, tmp_path, capsys, args, needle):
    assert main(["--store", str(store), "--out", str(tmp_path / "x.json"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_an_out_path_in_a_missing_directory_is_one_line_and_creates_nothing(store, tmp_path, capsys):
    out = tmp_path / "nonexistent" / "dir" / "x.json"
    assert main(["--store", str(store), "--run", "pp", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and str(out.parent) in err[0], err
    assert not (tmp_path / "nonexistent").exists()


def test_parse_steps():
    assert parse_steps("3:7") == (3, 7) and parse_steps("3:") == (3, None) and parse_steps(":7") == (None, 7)
    assert parse_steps("4") == (4, 5) and parse_steps(None) == (None, None)


def test_a_restarted_run_has_each_rank_step_once_from_the_newest_attempt(tmp_path):
    """Two attempts through the real ingest path: attempt 0 ran steps 0-11, attempt 1 (100 s later) ran
    steps 0-7 again. The trace has one slice per (rank, step): steps 0-7 from attempt 1, 8-11 from
    attempt 0 (never re-executed), each step with its own attempt's collectives only."""
    world, per_step, later = 2, 6, 100.0
    write_run(tmp_path, run="rs", world_size=world, steps=12, collectives_per_step=per_step, frame_rows=24,
              attempt=0, t0=T0)
    write_run(tmp_path, run="rs", world_size=world, steps=8, collectives_per_step=per_step, frame_rows=24,
              attempt=1, t0=T0 + later, seed=1)
    Ingestor(store=tmp_path, state=MetricsState(), clock=Clock()).ingest_all()
    # The store holds both attempts' records: the trace's dedup is the reader's, not the ingest's.
    assert len(read_table(tmp_path, "step", run="rs", all_attempts=True)) == world * (12 + 8)

    out = tmp_path / "t.json"
    assert main(["--store", str(tmp_path), "--run", "rs", "--out", str(out)]) == 0
    trace = json.loads(out.read_text())
    t0 = trace["metadata"]["t0_unix_s"]
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    assert sorted((e["pid"], e["args"]["step"]) for e in steps) == [(r, s) for r in range(world) for s in range(12)]
    for e in steps:
        newer = e["args"]["step"] < 8  # re-executed: attempt 1's slice, started after the restart
        assert (t0 + e["ts"] / 1e6 >= T0 + later) == newer, e
    comm = Counter((e["pid"], e["args"]["step"]) for e in trace["traceEvents"] if e.get("cat", "").startswith("comm"))
    assert comm == {(r, s): per_step for r in range(world) for s in range(12)}
