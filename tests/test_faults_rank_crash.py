"""A rank crashes (``--crash-rank``): the other ranks' records stay intact and visible, the run records what
happened; and under torchrun restarts (``--max_restarts 1``, resume from a DCP checkpoint) the restart is
in the run's timeline and re-executed steps can be counted once.

Two real runs, each shared by the tests below it (module-scoped fixtures):

- ``crashed``: 3 ranks, rank 1 exits (status 13) at step 12; torchrun then stops the others.
- ``restarted``: 2 ranks, rank 1 exits at step 12 of attempt 0 (checkpoints every 5 steps), torchrun
  restarts both and attempt 1 resumes at step 10 (the crash flags are dropped for attempt 1 by
  ``tests/workers/faults_train.py``), so steps 10 and 11 run twice.

Known gaps are strict xfails naming the file to fix: they fail loudly (XPASS) once fixed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from meshscope.agent.store.reader import read_table
from tests.support.harness import (
    AgentProcess, Job, Metrics, compare_store_to_truth, newest_attempt, poll_until, private_dir, spool_files,
    spool_truth,
)

pytestmark = pytest.mark.gloo

CRASH_RANK, CRASH_STEP = 1, 12


@dataclass
class Outcome:
    store: object
    run: str
    world: int
    returncode: int
    metrics: Metrics
    log: str


def _run(store, *, run: str, world: int, args: tuple, torchrun_args=(), script=None, extra_env=None) -> Outcome:
    agent = AgentProcess(store, "--part-age", "1")
    job = Job(world, "--store", store, "--run-name", run, "--log-every", 1, *args, log=store / "job.log",
              torchrun_args=torchrun_args, script=script, extra_env=extra_env)
    try:
        code = job.wait(timeout_s=240)
        ended = time.time()  # every rank has exited: the spools are final

        def settled():
            m = agent.scrape()
            polled = m.value("meshscope_agent_last_poll_timestamp_seconds") or 0
            return m if polled > ended + 0.5 and m.value("meshscope_agent_backlog_bytes") == 0 else None

        metrics = poll_until(settled, timeout_s=30, what="the agent has read the final spools")
        assert agent.stop() == 0, agent.stderr
    finally:
        job.kill()
        agent.kill()
    return Outcome(store, run, world, code, metrics, job.tail(60000))


@pytest.fixture(scope="module")
def crashed():
    with private_dir() as store:
        yield _run(store, run="crash", world=3,
                   args=("--steps", 40, "--batch-size", 12, "--crash-rank", CRASH_RANK, "--crash-step", CRASH_STEP))


@pytest.fixture(scope="module")
def restarted():
    with private_dir() as store:
        yield _restart(store)


def _restart(store):
    ckpt = store / "ckpt"
    # torch 2.13 torchrun shares its rendezvous TCPStore with the workers without a per-attempt key prefix:
    # attempt 1 can read attempt 0's gloo addresses and fail with "Gloo connectFullMesh ... Connection
    # refused" (seen under load). A store per attempt avoids it.
    return _run(store, run="restart", world=2, torchrun_args=("--max_restarts", "1"),
                script="tests/workers/faults_train.py", extra_env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                args=("--steps", 25, "--crash-rank", CRASH_RANK, "--crash-step", CRASH_STEP,
                      "--checkpoint-dir", ckpt, "--checkpoint-every", 5, "--resume"))


# ------------------------------------------------------------------------------------------- one crash

def test_crash_other_ranks_records_intact_and_the_run_records_the_crash(crashed):
    o = crashed
    assert o.returncode != 0, o.log
    step = read_table(o.store, "step", run=o.run)
    coll = read_table(o.store, "collective", run=o.run)
    per_step = coll.groupby(["rank", "step"]).size()
    for rank in range(o.world):
        mine = step[step["rank"] == rank]
        assert not mine.duplicated("step").any()
        done = mine[mine["step"] < CRASH_STEP]
        # Every step before the crash, with all of its collectives, on every rank.
        assert sorted(done["step"]) == list(range(CRASH_STEP)), rank
        for row in done.itertuples():
            assert per_step.get((rank, row.step), 0) == row.n_collectives > 0
    assert set(step[step["rank"] == CRASH_RANK]["step"]) == set(range(CRASH_STEP))
    for _, seqs in coll.groupby(["rank", "group"])["seq"]:
        assert sorted(seqs) == list(range(1, len(seqs) + 1))

    # The crash is in the run's timeline, with the step and the rank.
    events = read_table(o.store, "event", run=o.run)
    crash = events[events["kind"] == "crash"]
    assert len(crash) == 1 and crash.iloc[0]["rank"] == CRASH_RANK and crash.iloc[0]["step"] == CRASH_STEP
    assert "injected crash of rank 1 at step 12" in crash.iloc[0]["message"]
    assert not (events["kind"] == "end").any()

    # And in /metrics: the crash counter (MeshscopeRanksMissing reason=crashed) and the crashed rank's
    # last step one behind its peers (reason=behind_peers once stale).
    m = o.metrics
    assert m.value("meshscope_run_events_total", run=o.run, kind="crash") == 1
    assert m.value("meshscope_run_world_size", run=o.run) == o.world
    assert m.value("meshscope_run_ranks_reporting", run=o.run) == o.world
    last = m.by("meshscope_rank_last_step", "rank", run=o.run)
    assert last[str(CRASH_RANK)] == CRASH_STEP - 1 <= min(last.values()), last

    report = compare_store_to_truth(o.store, o.run, spool_truth(o.store, o.run))
    print(f"\ncrash: store vs spool {report}")
    assert all(r["lost"] == 0 and r["duplicated"] == 0 for r in report.values()), report


def test_report_and_overview_name_the_crash_not_the_peers_aborts(crashed, monkeypatch):
    """What a user reads first about a failed run: `report` and the Overview's banner give the crash (rank,
    step, message) as the key event, though the survivors' aborted steps are newer."""
    import json
    import sys
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from meshscope.dashboard import report

    o = crashed
    events = read_table(o.store, "event", run=o.run)
    assert (events["kind"] == "aborted_step").any()  # the peers' aborts are there, and newer than the crash
    rep = report.build(report.views.direct_loader(report.Store.open(o.store)), run=o.run)
    key = rep["events"]["key_event"]
    assert (key["kind"], key["rank"], key["step"]) == ("crash", CRASH_RANK, CRASH_STEP), json.dumps(rep["events"])

    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(o.store)])
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py"), default_timeout=60).run()
    at.switch_page("app_pages/overview.py")
    at.run()
    assert not at.exception
    banner = " ".join(w.value for w in at.warning if "This run had failures" in w.value)
    assert f"Key event: rank {CRASH_RANK} at step {CRASH_STEP}, crash: injected crash of rank 1 at step 12" in banner, banner
    assert "crash ×1" in banner and "aborted step ×" in banner


def test_crash_survivors_do_not_record_the_aborted_step(crashed):
    o = crashed
    step = read_table(o.store, "step", run=o.run)
    assert set(step["step"]) == set(range(CRASH_STEP))
    assert not step["loss_nonfinite"].any()
    assert all(v == 0 for v in o.metrics.by("meshscope_rank_nonfinite_loss_total", "rank", run=o.run).values())


# -------------------------------------------------------------------------------- restart under torchrun

def test_restart_shows_in_the_timeline_and_the_store_keeps_both_attempts(restarted):
    o = restarted
    assert o.returncode == 0, o.log
    names = sorted(p.name for p in spool_files(o.store, o.run))
    # On failure say what the store holds: a missing spool (seen once in ~25 loaded runs, rank 0 of
    # attempt 0, cause not found yet) is then diagnosable from CI's tail of the output.
    assert names == ["rank-0.a0.spool", "rank-0.a1.spool", "rank-1.a0.spool", "rank-1.a1.spool"], (
        f"{names}\nevents:\n{read_table(o.store, 'event', run=o.run).to_string(max_colwidth=80)}\n"
        f"job log head:\n{o.log[:3000]}")
    runs = read_table(o.store, "run", run=o.run)
    assert sorted(zip(runs["rank"], runs["attempt"])) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    events = read_table(o.store, "event", run=o.run).sort_values("t")
    kinds = events.groupby("kind").size().to_dict()
    # The survivor's step that failed when its peer died is an aborted step, not a completed one.
    assert kinds == {"start": 4, "crash": 1, "aborted_step": 1, "restart": 2, "end": 2}, kinds
    restart = events[events["kind"] == "restart"]
    assert set(restart["step"]) == {10} and restart["message"].str.contains("resumed from step-10").all()
    crash = events[events["kind"] == "crash"].iloc[0]
    assert (crash["rank"], crash["step"]) == (CRASH_RANK, CRASH_STEP)
    # Timeline order: attempt 0 starts, the crash, attempt 1 starts, restarts, ends.
    attempt1 = runs[runs["attempt"] == 1]["t_start"].min()
    assert runs[runs["attempt"] == 0]["t_start"].max() < crash["t"] < attempt1 < restart["t"].min()

    m = o.metrics
    assert m.value("meshscope_run_events_total", run=o.run, kind="restart") == 2
    assert m.value("meshscope_run_events_total", run=o.run, kind="crash") == 1
    assert o.metrics.by("meshscope_rank_last_step", "rank", run=o.run) == {"0": 24.0, "1": 24.0}
    assert {s.labels["attempt"] for s in m.samples if s.name == "meshscope_rank_info" and s.labels["run"] == o.run} == {"1"}

    # Every record of both attempts is in the store exactly once (attempts told apart by spool file).
    truth = spool_truth(o.store, o.run)
    report = compare_store_to_truth(o.store, o.run, truth)
    print(f"\nrestart: store vs spool {report}")
    assert all(r["lost"] == 0 and r["duplicated"] == 0 for r in report.values()), report
    per_attempt = truth["step"].groupby(["rank", "attempt"])["step"].agg(list).to_dict()
    for rank in range(o.world):
        assert per_attempt[rank, 1] == list(range(10, 25))  # resumed at the checkpoint, ran to the end
        assert per_attempt[rank, 0][:CRASH_STEP] == list(range(CRASH_STEP))


def test_restart_newest_attempt_rule_counts_each_step_once(restarted):
    """The store has no attempt column; the rule of ``harness.newest_attempt`` (as-of join of step
    records to the rank's ``run`` records, newest attempt per (rank, step)) recovers one record per step,
    and the store reader's own rule (newest spool stream per (rank, step)) keeps exactly those records."""
    o = restarted
    step = read_table(o.store, "step", run=o.run, all_attempts=True)
    runs = read_table(o.store, "run", run=o.run)
    rows = step.groupby("rank").size().to_dict()
    once = newest_attempt(step, runs)
    assert once.groupby("rank")["step"].agg(sorted).to_dict() == {r: list(range(25)) for r in range(o.world)}
    assert set(once[once["step"].between(10, 11)]["attempt"]) == {1}
    truth = spool_truth(o.store, o.run)["step"]
    want = truth[truth["attempt"] == 1].set_index(["rank", "step"])["t_start"]
    got = once.set_index(["rank", "step"]).loc[want.index, "t_start"]
    assert (got == want).all()  # the kept rows are exactly attempt 1's
    print(f"\nstep records per rank in the store {rows} for 25 distinct steps")
    assert all(n > 25 for n in rows.values())  # re-executed (and aborted) steps are stored twice
    key = ["rank", "step", "t_start"]
    view = read_table(o.store, "step", run=o.run)
    assert sorted(view[key].itertuples(index=False, name=None)) == sorted(once[key].itertuples(index=False, name=None))


def test_restart_export_trace_has_each_rank_step_once_from_the_newest_attempt(restarted):
    """``meshscope export-trace`` of the restarted run: one step slice per (rank, step); steps 10 and 11,
    run by both attempts, are attempt 1's (their start times), and each (rank, step) has exactly the
    collectives its newest attempt recorded (checkpoint steps included, whose saves add collectives)."""
    import json

    from meshscope.agent.trace import main

    o = restarted
    out = o.store / "restart-trace.json"
    assert main(["--store", str(o.store), "--run", o.run, "--out", str(out)]) == 0
    trace = json.loads(out.read_text())
    t0, events = trace["metadata"]["t0_unix_s"], trace["traceEvents"]
    steps = [e for e in events if e.get("cat") == "step"]
    assert sorted((e["pid"], e["args"]["step"]) for e in steps) == [(r, s) for r in range(o.world) for s in range(25)]
    truth = spool_truth(o.store, o.run)
    attempt1 = truth["step"][truth["step"]["attempt"] == 1].set_index(["rank", "step"])["t_start"]
    for e in steps:
        if e["args"]["step"] in (10, 11):
            assert t0 + e["ts"] / 1e6 == pytest.approx(attempt1[e["pid"], e["args"]["step"]], abs=1e-5), e
    coll = truth["collective"]
    assert (coll.groupby(["rank", "step"])["attempt"].nunique() > 1).any()  # the spools hold both attempts'
    newest = coll[coll["attempt"] == coll.groupby(["rank", "step"])["attempt"].transform("max")]
    want = {(int(r), int(s)): n for (r, s), n in newest.groupby(["rank", "step"]).size().items()}
    comm: dict[tuple[int, int], int] = {}
    for e in events:
        if e.get("cat", "").startswith("comm"):
            comm[e["pid"], e["args"]["step"]] = comm.get((e["pid"], e["args"]["step"]), 0) + 1
    assert comm == want


def test_restart_dashboard_does_not_double_count_reexecuted_steps(restarted):
    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import data

    o = restarted
    store = Store.open(o.store)
    frames = data.overview_data(store, run=o.run, runs=[o.run], steps=None)
    assert frames["breakdown"].set_index("rank")["steps"].to_dict() == {0: 25, 1: 25}
    assert (frames["series"]["ranks"] == o.world).all()
    runs = data.runs_table(store).set_index("run").loc[o.run]
    assert runs["steps"] == 25 and runs["ranks_stepping"] == o.world


def test_restart_metrics_count_each_step_once(restarted):
    o = restarted
    steps = o.metrics.by("meshscope_rank_steps_total", "rank", run=o.run)
    assert steps == {"0": 25.0, "1": 25.0}, steps
