"""The store's disk fills up during a run (spools and run store alike), then space returns: training
continues, every lost telemetry record is counted and exported, and the agent recovers.

How the disk is made full, without tricks that could harm the machine:

- ``tmpfs`` (preferred, used when this process may mount: root with CAP_SYS_ADMIN, as in the sandbox):
  the store is a 16 MiB tmpfs mounted for the test (always unmounted in ``finally``); a ballast file is
  written until ENOSPC, and deleted to give the space back. A real full file system: ranks' spool
  appends and the agent's Parquet / offsets writes all get ENOSPC.
- ``rlimit`` (fallback, no privilege needed): ``RLIMIT_FSIZE`` of the agent and every rank is lowered to 0
  at run time (``prlimit`` through psutil), so every append to a regular file fails with EFBIG (Python
  ignores SIGXFSZ), and raised back to give the "space" back. ``MESHSCOPE_TEST_FULL_DISK=rlimit`` forces it.

Two outages, each bounded in the spool writer's own terms (agent.transport.writer), not in training steps:

- short: the ranks' records of the outage fit in their in-memory hold (default 8 MiB): not one is lost;
- long: a 64 KiB hold and an outage that produces at least twice as many bytes (measured bytes per step
  before the fill): what is lost is exactly what the ranks counted, the onset of the outage is kept (the
  newest are dropped), and nothing is lost once the space has been back for one retry cap
  (``retry_max_s``): every record made after that is stored and the ranks' drop counters stop growing.

Exact accounting: the DDP run writes, per rank, 1 run record, 2 events (start, end) and per step 1 step
record, 1 memory record and ``n_collectives`` collective records. Records missing from the store must
equal the ``dropped_records_total`` the rank reported in its last step record (and in /metrics), and the
store must hold exactly what reached the spools.
"""

from __future__ import annotations

import errno
import inspect
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from meshscope.agent.store.reader import read_table
from meshscope.agent.transport.frame import REJECT_REASONS
from meshscope.agent.transport.writer import DEFAULT_MAX_HOLD_BYTES, SpoolWriter
from tests.support.harness import (
    AgentProcess, Job, compare_store_to_truth, poll_until, private_dir, spool_sizes_of, spool_truth,
)

pytestmark = pytest.mark.gloo

WORLD, STEPS, RUN = 2, 600, "full"
TMPFS_BYTES = 16 * 2**20


@pytest.fixture
def tmp_path():
    """Not pytest's (concurrent sessions on this machine clean each other's): see harness.private_dir."""
    with private_dir() as d:
        yield d


def _can_mount_tmpfs(probe: Path) -> bool:
    probe.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True)
    if done.returncode != 0:
        return False
    subprocess.run(["umount", str(probe)], check=True)
    return True


class TmpfsDisk:
    name = "tmpfs"

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0755", "tmpfs", str(path)],
                       check=True, capture_output=True)
        self.ballast = path / "ballast"

    def fill(self, pids: list[int]) -> None:
        chunk = b"\0" * (1 << 16)
        with open(self.ballast, "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
        with open(self.ballast, "ab", buffering=0) as fh:  # the last few bytes too
            try:
                while True:
                    fh.write(b"\0" * 512)
            except OSError:
                pass

    def free(self, pids: list[int]) -> None:
        self.ballast.unlink()

    def close(self) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], check=True)  # a straggling reader: detach


class RlimitDisk:
    name = "rlimit"

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()

    def fill(self, pids: list[int]) -> None:
        for pid in pids:
            psutil.Process(pid).rlimit(psutil.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))

    def free(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                psutil.Process(pid).rlimit(psutil.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            except psutil.NoSuchProcess:
                pass

    def close(self) -> None:
        pass


@pytest.fixture
def disk(tmp_path):
    # MESHSCOPE_TEST_FULL_DISK=rlimit runs the fallback where tmpfs would be available (to check it).
    use_tmpfs = os.environ.get("MESHSCOPE_TEST_FULL_DISK") != "rlimit" and _can_mount_tmpfs(tmp_path / "probe")
    d = TmpfsDisk(tmp_path / "store") if use_tmpfs else RlimitDisk(tmp_path / "store")
    try:
        yield d
    finally:
        d.close()


# The writer's retry cap (SpoolWriter's default): the bound on recovery once the space is back.
RETRY_MAX_S = inspect.signature(SpoolWriter).parameters["retry_max_s"].default
LONG_HOLD_BYTES = 64 * 1024


def _outage(disk, tmp_path, *, hold_bytes: int | None, min_outage_s: float, hold_factor: float):
    """One job with one outage: the disk fills once 30 steps are ingested and is freed after at least
    ``min_outage_s`` and after the ranks have made ``hold_factor`` x ``hold_bytes`` of records (from the
    spool bytes per step measured before the fill; ``hold_factor`` < 1: at most that much). Returns what
    the test asserts on."""
    store = disk.path
    hold = hold_bytes if hold_bytes is not None else DEFAULT_MAX_HOLD_BYTES
    extra = ("--set", f"telemetry.spool_hold_bytes={hold_bytes}") if hold_bytes is not None else ()
    agent = AgentProcess(store, "--part-age", "0.5", poll_interval=0.2)
    job = Job(WORLD, "--steps", STEPS, "--log-every", 1, "--store", store, "--run-name", RUN, *extra,
              log=tmp_path / "job.log")
    seen: dict = {}
    try:
        poll_until(lambda: (agent.scrape().value("meshscope_rank_last_step", run=RUN, rank="0") or 0) >= 30,
                   timeout_s=120, what="30 steps ingested")
        pids = [agent.pid] + [p.pid for p in job.ranks()]
        # The agent must hold records it has not written yet when the disk fills, or it has nothing to
        # fail on (both CI failures of this test: the fill came just after the agent had written
        # everything, and the ranks could no longer add to their spools). Pause it while the spools grow;
        # the growth also gives the spool bytes per training step.
        agent.signal(signal.SIGSTOP)
        try:
            sizes0, step0 = spool_sizes_of(store, RUN), max(job.printed_steps())
            poll_until(lambda: all(spool_sizes_of(store, RUN)[k] > v for k, v in sizes0.items())
                       and max(job.printed_steps()) >= step0 + 10, timeout_s=30,
                       what="every rank's spool grew over 10 steps while the agent was paused")
            sizes1, step1 = spool_sizes_of(store, RUN), max(job.printed_steps())
            bytes_per_step = max(sizes1[k] - sizes0[k] for k in sizes0) / (step1 - step0)
            disk.fill(pids)
            t_fill = time.time()
        finally:
            agent.signal(signal.SIGCONT)
        full_at_step = max(job.printed_steps())

        # The outage bites on both sides: the agent fails to write the store, the ranks' spools stop
        # growing, and training goes on (rank 0 keeps printing steps).
        poll_until(lambda: (agent.scrape().value("meshscope_agent_store_write_errors_total") or 0) > 0,
                   timeout_s=30, what="agent store write errors")
        sizes = spool_sizes_of(store, RUN)
        outage_steps = max(1, int(hold_factor * hold / bytes_per_step)) if hold_factor >= 1 else 0
        poll_until(lambda: time.time() - t_fill >= min_outage_s
                   and max(job.printed_steps()) >= full_at_step + outage_steps + 3,
                   timeout_s=120, what=f"an outage of {min_outage_s} s and {outage_steps} steps")
        assert spool_sizes_of(store, RUN) == sizes, "spools grew on a full disk"
        assert job.running(), "the job ended during the outage: raise STEPS\n" + job.tail()
        freed_at_step = max(job.printed_steps())
        disk.free(pids)
        t_free = time.time()

        assert job.wait(timeout_s=240) == 0, job.tail()
        assert job.printed_steps()[-1] == STEPS - 1

        def recovered():
            m = agent.scrape()
            last = m.by("meshscope_rank_last_step", "rank", run=RUN)
            dropped = m.by("meshscope_rank_dropped_records_total", "rank", run=RUN)
            ok = (last == {str(r): STEPS - 1.0 for r in range(WORLD)} and len(dropped) == WORLD
                  and m.value("meshscope_agent_backlog_bytes") == 0)
            return m if ok else None

        m = poll_until(recovered, timeout_s=60, what="agent ingests the rest of the run")
        seen["write_errors"] = m.value("meshscope_agent_store_write_errors_total")
        seen["dropped"] = {int(r): int(v) for r, v in
                           m.by("meshscope_rank_dropped_records_total", "rank", run=RUN).items()}
        seen["rejected"] = sum(m.value("meshscope_agent_frames_rejected_total", reason=r) for r in REJECT_REASONS)
        assert agent.alive()
        assert agent.stop() == 0, agent.stderr
    finally:
        job.kill()
        agent.kill()

    step = read_table(store, "step", run=RUN)
    n_coll = set(step["n_collectives"])
    assert len(n_coll) == 1, n_coll  # DDP: the same collectives every step
    per_step = 2 + n_coll.pop()  # step + memory + collectives
    stored = {r: 0 for r in range(WORLD)}
    for kind in ("run", "step", "collective", "memory", "event", "span"):
        for rank, n in read_table(store, kind, run=RUN).groupby("rank").size().items():
            stored[rank] += n
    expected = 1 + 2 + STEPS * per_step
    last = step.sort_values("step").groupby("rank").tail(1).set_index("rank")["dropped_records_total"]
    lost = {r: expected - stored[r] for r in range(WORLD)}
    report = compare_store_to_truth(store, RUN, spool_truth(store, RUN))
    print(f"\nfull disk ({disk.name}, hold {hold} B, {bytes_per_step:.0f} spool B/step) from step ~{full_at_step} "
          f"to ~{freed_at_step} ({t_free - t_fill:.1f} s): lost per rank {lost}, reported in the last step record "
          f"{last.to_dict()}, in /metrics {seen['dropped']}; agent store write errors {seen['write_errors']:.0f}, "
          f"frames rejected {seen['rejected']:.0f}; store vs spool {report}")
    assert lost == {int(r): int(v) for r, v in last.items()} == seen["dropped"]
    assert seen["write_errors"] > 0 and seen["rejected"] == 0
    assert all(r["lost"] == 0 and r["duplicated"] == 0 for r in report.values()), report
    return {"step": step, "lost": lost, "t_fill": t_fill, "t_free": t_free, "bytes_per_step": bytes_per_step}


def test_short_full_disk_within_the_hold_loses_nothing(disk, tmp_path):
    out = _outage(disk, tmp_path, hold_bytes=None, min_outage_s=2.0, hold_factor=0.0)
    step = out["step"]
    made = (step["t_start"] >= out["t_fill"]) & (step["t_start"] < out["t_free"])
    # The outage was within the hold: the records the ranks made during it are far below it.
    assert made.groupby(step["rank"]).sum().min() * out["bytes_per_step"] < DEFAULT_MAX_HOLD_BYTES / 4
    assert made.groupby(step["rank"]).sum().min() > 0
    assert out["lost"] == {r: 0 for r in range(WORLD)}
    assert sorted(zip(step["rank"], step["step"])) == [(r, s) for r in range(WORLD) for s in range(STEPS)]


def test_long_full_disk_loses_exactly_what_is_counted_and_nothing_after_one_retry_cap(disk, tmp_path):
    out = _outage(disk, tmp_path, hold_bytes=LONG_HOLD_BYTES, min_outage_s=2.0, hold_factor=2.0)
    step, lost = out["step"], out["lost"]
    assert all(v > 0 for v in lost.values()), lost  # the outage outgrew the hold
    settled = out["t_free"] + RETRY_MAX_S  # once the space has been back for one retry cap
    for rank in range(WORLD):
        mine = step[step["rank"] == rank].sort_values("step")
        missing = sorted(set(range(STEPS)) - set(mine["step"]))
        # The onset of the outage is kept by the hold; its newest records were dropped. (Not always one
        # gap: a "full" file system still takes a small write into the spool's last, partly used page,
        # and what that frees in the hold admits newer records. Seen in a fresh-clone run: 107-123 and
        # 135-179 lost, 124-134 kept.)
        kept_in_outage = mine[(mine["t_start"] > out["t_fill"]) & (mine["step"] < missing[0])]
        assert len(kept_in_outage) > 0, "the hold kept nothing of the outage's onset"
        after = mine[mine["t_start"] >= settled]
        assert len(after) >= 10, f"rank {rank}: too few steps after {RETRY_MAX_S} s of recovery to judge"
        # Every step made after that is stored (all losses come before it), and no record was dropped
        # after it (the counter that each step record carries stops growing).
        assert missing[-1] < after["step"].min(), (missing[-5:], int(after["step"].min()))
        assert after["step"].tolist() == list(range(int(after["step"].min()), STEPS))
        assert set(after["dropped_records_total"]) == {lost[rank]}, (rank, set(after["dropped_records_total"]))
