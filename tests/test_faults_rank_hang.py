"""A rank hangs (``--hang-rank``): the hang is visible in /metrics and in the store while the job is stuck.

3 ranks (DDP), rank 1 stops before step 10 (``trainer.faults``: it sleeps until killed); ranks 0 and 2
enter step 10 and block in its first all-reduce. What the telemetry shows, and what it cannot show yet:

- progress stops: every rank's last completed step and its timestamp freeze (MeshscopeRunNoProgress
  fires on this), while the job is alive and has not ended;
- the last completed collective per rank and group: ``meshscope_rank_collective_last_seq{dim}`` in
  /metrics equals the highest ``seq`` per (rank, group) in the store;
- which rank is missing: the hung rank's last step and last completed collective are the same as its
  peers' (they finished step 9 together, and an op is only recorded when it completes), so the telemetry's
  hang watchdog says where each training thread is stuck: the peers "in a collective" (or in backward,
  where DDP's reducer waits), the missing rank "not in a collective".
"""

from __future__ import annotations

import time

import pytest

from meshscope.agent.store.reader import read_table
from tests.support.harness import AgentProcess, Job, poll_until, private_dir

pytestmark = pytest.mark.gloo

WORLD, RUN, HANG_RANK, HANG_STEP = 3, "hang", 1, 10


@pytest.fixture(scope="module")
def hung():
    with private_dir() as store:
        yield from _hang(store)


def _hang(store):
    agent = AgentProcess(store, "--part-age", "0.5")
    job = Job(WORLD, "--steps", 100, "--batch-size", 12, "--log-every", 1, "--store", store, "--run-name", RUN,
              "--hang-rank", HANG_RANK, "--hang-step", HANG_STEP, "--set", "telemetry.hang_after_s=2",
              log=store / "job.log")
    try:
        def stuck():
            m = agent.scrape()
            last = m.by("meshscope_rank_last_step", "rank", run=RUN)
            return m if len(last) == WORLD and set(last.values()) == {HANG_STEP - 1} else None

        first = poll_until(stuck, timeout_s=120, what=f"every rank at step {HANG_STEP - 1}")
        time.sleep(4.0)  # the hang goes on: nothing may move in these seconds
        later = agent.scrape()
        assert job.running(), job.tail()
        ranks = job.ranks()
        yield {"store": store, "first": first, "later": later, "ranks_alive": len(ranks), "now": time.time()}
    finally:
        job.kill()
        agent.stop()
        agent.kill()


def test_hang_progress_stops_and_last_collective_per_rank_and_group_is_visible(hung):
    first, later, store = hung["first"], hung["later"], hung["store"]
    # Progress stops: last step and its timestamp frozen on every rank, and getting old.
    for name in ("meshscope_rank_last_step", "meshscope_rank_last_step_timestamp_seconds",
                 "meshscope_rank_steps_total"):
        assert first.by(name, "rank", run=RUN) == later.by(name, "rank", run=RUN), name
    stamps = later.by("meshscope_rank_last_step_timestamp_seconds", "rank", run=RUN)
    assert hung["now"] - max(stamps.values()) > 4.0
    assert later.value("meshscope_run_events_total", run=RUN, kind="end") == 0
    assert hung["ranks_alive"] >= WORLD  # the job is stuck, not gone

    # The last completed collective per rank and dim (/metrics) matches the store per rank and group.
    seq = later.by("meshscope_rank_collective_last_seq", "rank", run=RUN, dim="dp")
    coll = read_table(store, "collective", run=RUN)
    stored = coll.groupby(["rank", "group"])["seq"].max()
    assert {str(r): float(v) for (r, _), v in stored.items()} == seq
    assert coll.groupby("rank")["step"].max().to_dict() == {r: HANG_STEP - 1 for r in range(WORLD)}
    step = read_table(store, "step", run=RUN)
    assert step.groupby("rank")["step"].max().to_dict() == {r: HANG_STEP - 1 for r in range(WORLD)}
    print(f"\nhang: last step {later.by('meshscope_rank_last_step', 'rank', run=RUN)}, last seq (dp) {seq}, "
          f"last step age {hung['now'] - max(stamps.values()):.1f} s")


def test_hang_the_missing_rank_is_identifiable(hung):
    # The telemetry watchdog (hang_after_s=2 here) reports where each rank's training thread is stuck.
    def all_reported():
        events = read_table(hung["store"], "event", run=RUN)
        # The stall's own reports: at the hang step (the hung rank) or between steps after the one before
        # it. A healthy rank descheduled for hang_after_s earlier (start-up on a loaded machine) would
        # report an earlier step, and is not what this test is about.
        hang = events[(events["kind"] == "hang") & (events["step"] >= HANG_STEP - 1)]
        return [hang] if set(hang["rank"]) == set(range(WORLD)) else None

    (hang,) = poll_until(all_reported, timeout_s=30, what="a hang event from every rank")
    idle = hang[hang["message"].str.startswith("not in a collective")]
    assert set(idle["rank"]) == {HANG_RANK}
