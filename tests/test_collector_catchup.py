"""A reader's catch-up (agent.collector.catchup): the spools' records reach the tables exactly once when no
agent runs, nothing is written while one holds the store, and what happened is one sentence."""

from __future__ import annotations

import fcntl
import os

from meshscope.agent.collector.catchup import catch_up, lock_store, pending_bytes
from meshscope.agent.store.reader import read_table
from tests.support.spools import write_run


def test_spools_reach_the_tables_once(tmp_path):
    counts = write_run(tmp_path, run="r", world_size=2, steps=5, collectives_per_step=4, frame_rows=4)
    assert pending_bytes(tmp_path) > 0
    first = catch_up(tmp_path)
    assert first.outcome == "ingested" and first.records == sum(counts.values())
    assert "Ingested" in first.message() and str(tmp_path) in first.message()
    assert pending_bytes(tmp_path) == 0
    again = catch_up(tmp_path)  # nothing new: nothing written, nothing said
    assert again.outcome == "current" and again.message() is None
    steps = read_table(tmp_path, "step", run="r")
    assert len(steps) == counts["step"] and not steps.duplicated(["rank", "step"]).any()


def test_a_held_store_is_left_to_its_writer(tmp_path):
    write_run(tmp_path, run="r", world_size=2, steps=3, collectives_per_step=4, frame_rows=4)
    (tmp_path / "agent").mkdir(exist_ok=True)
    with open(tmp_path / "agent" / "agent.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a running agent
        res = catch_up(tmp_path)
        assert res.outcome == "agent" and res.pending_bytes > 0 and "agent" in res.message()
        assert not (tmp_path / "tables").exists()  # the reader wrote nothing
        assert lock_store(tmp_path, wait_s=0.2) is None
    fd = lock_store(tmp_path)  # released with the holder
    assert fd is not None
    os.close(fd)


def test_a_store_without_spools_is_current(tmp_path):
    res = catch_up(tmp_path)
    assert res.outcome == "current" and res.message() is None and not (tmp_path / "agent").exists()


def test_a_read_only_store_says_who_can_ingest(tmp_path):
    write_run(tmp_path, run="r", world_size=1, steps=2, collectives_per_step=2, frame_rows=4)
    os.chmod(tmp_path, 0o555)
    try:
        if os.access(tmp_path, os.W_OK) and os.geteuid() == 0:  # root writes anyway: make the lock unopenable
            os.chmod(tmp_path, 0o755)
            (tmp_path / "agent").mkdir()
            (tmp_path / "agent" / "agent.lock").mkdir()  # open() of a directory for writing fails
        res = catch_up(tmp_path)
    finally:
        os.chmod(tmp_path, 0o755)
    assert res.outcome == "unwritable" and "meshscope ingest --store" in res.message()
