"""The node agent SIGKILLed three times during a 4-rank training run, restarted each time: the run store
holds every record the ranks wrote exactly once.

Truth is twofold: the ranks' own accounting (every (rank, step) once, ``n_collectives`` collective records
per step, per-group sequence numbers 1..N without gaps or repeats, nothing dropped) and the spool files
themselves (every complete frame read back with the transport's reader and compared row for row with
the store). The agent commits a part per poll (``--part-age 0``, small parts) so that each SIGKILL lands
somewhere in a write / rename / offset-save cycle.
"""

from __future__ import annotations

import random
import time

import pytest

from meshscope.agent.store.reader import read_table
from tests.support.harness import (
    AgentProcess, Job, committed_bytes, compare_store_to_truth, poll_until, private_dir, spool_truth,
)

pytestmark = pytest.mark.gloo

WORLD, STEPS, RUN = 4, 200, "kill"
AGENT_ARGS = ("--part-age", "0", "--part-bytes", "16000")


@pytest.fixture
def tmp_path():
    """Not pytest's (concurrent sessions on this machine clean each other's): see harness.private_dir."""
    with private_dir() as d:
        yield d


def test_agent_sigkilled_three_times_store_holds_every_record_once(tmp_path):
    rnd = random.Random(20261121)
    job = Job(WORLD, "--steps", STEPS, "--log-every", 1, "--store", tmp_path, "--run-name", RUN,
              log=tmp_path / "job.log")
    agent = AgentProcess(tmp_path, *AGENT_ARGS, poll_interval=0.05)
    kills = []
    try:
        for _ in range(3):
            before = committed_bytes(tmp_path)
            # Let this incarnation ingest and commit ~20 steps of all ranks (~1.2 kB per rank and step).
            poll_until(lambda: committed_bytes(tmp_path) > before + WORLD * 20 * 1200, timeout_s=120,
                       interval_s=0.05, what="agent commits new data")
            assert job.running(), "the run ended before the third kill: raise STEPS"
            time.sleep(rnd.uniform(0.0, 0.2))  # jitter: land anywhere in a write/rename/offset-save cycle
            agent.kill()
            kills.append(max(job.printed_steps(), default=-1))
            # The next agent's start (a new interpreter and its imports: seconds under load) is time, the
            # run is steps: the ranks wait while it starts, so the third kill still lands during training
            # however slow the start.
            with job.paused():
                agent = AgentProcess(tmp_path, *AGENT_ARGS, poll_interval=0.05)
        assert job.wait(timeout_s=240) == 0, job.tail()
        assert kills[-1] < STEPS - 1, f"kills at steps {kills} did not all happen during training"

        def caught_up():
            m = agent.scrape()
            last = m.by("meshscope_rank_last_step", "rank", run=RUN)
            return m if last == {str(r): STEPS - 1 for r in range(WORLD)} and \
                m.value("meshscope_agent_backlog_bytes") == 0 else None

        poll_until(caught_up, timeout_s=60, what="the last agent ingests the whole run")
        assert agent.stop() == 0, agent.stderr
    finally:
        job.kill()
        agent.kill()

    # 1. The ranks' own accounting.
    step = read_table(tmp_path, "step", run=RUN)
    assert sorted(zip(step["rank"], step["step"])) == [(r, s) for r in range(WORLD) for s in range(STEPS)]
    assert (step["dropped_records_total"] == 0).all()
    coll = read_table(tmp_path, "collective", run=RUN)
    per_step = coll.groupby(["rank", "step"]).size()
    want = step.set_index(["rank", "step"])["n_collectives"]
    assert (want > 0).all() and per_step.reindex(want.index).fillna(0).astype(int).equals(want.astype(int))
    for (_, _), seqs in coll.groupby(["rank", "group"])["seq"]:
        assert sorted(seqs) == list(range(1, len(seqs) + 1))
    memory = read_table(tmp_path, "memory", run=RUN)
    assert not memory.duplicated(["rank", "step"]).any() and len(memory) == WORLD * STEPS
    assert sorted(read_table(tmp_path, "run", run=RUN)["rank"]) == list(range(WORLD))
    events = read_table(tmp_path, "event", run=RUN)
    assert events.groupby("kind").size().to_dict() == {"start": WORLD, "end": WORLD}

    # 2. The spools, row for row: nothing lost, nothing duplicated, for every kind.
    report = compare_store_to_truth(tmp_path, RUN, spool_truth(tmp_path, RUN))
    print(f"kills after steps {kills}; per kind {report}")
    for kind, r in report.items():
        assert r["lost"] == 0 and r["duplicated"] == 0 and r["spool"] == r["store"], (kind, r)
    assert report["collective"]["store"] == int(want.sum())
