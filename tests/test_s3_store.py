"""The run store on S3 (``meshscope agent --upload s3://...``, readers with ``--store s3://...``) against a
real HTTP S3 endpoint on 127.0.0.1: moto's server mode, behind a TCP proxy that can be taken down.

Truth: the spools the ranks wrote (read back frame by frame with the transport's reader), compared row for
row with what the bucket holds, and the same run's local store read by the same reader.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time

import pytest
from streamlit.testing.v1 import AppTest

import pyarrow as pa

from meshscope.agent.store import objectstore, parts
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.collector.upload import Uploader, UploadConfig
from meshscope.agent.store.reader import Store, StoreError, read_table
from meshscope.agent.contract import pack_name, part_name
from tests.support.harness import (
    ROOT, AgentProcess, Job, compare_store_to_truth, poll_until, private_dir, spool_truth,
)
from tests.support.s3 import Proxy, moto_server, s3_env

pytestmark = [pytest.mark.server, pytest.mark.gloo]

BUCKET = "runs"
APP = ROOT / "dashboard" / "app.py"


@pytest.fixture(scope="module")
def s3():
    with moto_server() as moto:
        moto.create_bucket(BUCKET)
        proxy = Proxy(("127.0.0.1", int(moto.endpoint.rsplit(":", 1)[1])))
        yield moto, proxy
        proxy.down()


@pytest.fixture
def work(s3, monkeypatch):
    """A private directory, the AWS variables pointing at the proxy (the agent and report subprocesses
    inherit them) and a reader cache of its own."""
    _, proxy = s3
    with private_dir("meshscope-s3-") as d:
        for k, v in s3_env(proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("MESHSCOPE_CACHE_DIR", str(d / "cache"))
        yield d


def _uploaded(agent: AgentProcess) -> float:
    return agent.scrape().value("meshscope_agent_upload_parts_total") or 0.0


def _drained(agent: AgentProcess, run: str, last_step: int, world: int):
    m = agent.scrape()
    done = m.by("meshscope_rank_last_step", "rank", run=run) == {str(r): last_step for r in range(world)}
    return m if done and m.value("meshscope_agent_backlog_bytes") == 0 and \
        m.value("meshscope_agent_upload_pending_parts") == 0 else None


def _exactly_once(store_dir, url: str, run: str, world: int, steps: int) -> dict:
    """The bucket against the spools: every record once, every (rank, step) once."""
    step = read_table(url, "step", run=run, all_attempts=True)
    assert sorted(zip(step["rank"], step["step"])) == [(r, s) for r in range(world) for s in range(steps)]
    report = compare_store_to_truth(url, run, spool_truth(store_dir, run))
    for kind, r in report.items():
        assert r["lost"] == 0 and r["duplicated"] == 0 and r["spool"] == r["store"], (kind, r)
    return report


def _report(store: str, run: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "meshscope", "report", "--store", store, "--run", run, "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# ---------------------------------------------------------------------------------------------- units
@pytest.mark.parametrize("url, message", [
    ("s3://Bad_Bucket/x", "not a valid S3 bucket name"),
    ("s3://ok-bucket/a/../b", "prefix component '..'"),
    ("s3://ok-bucket/a b", "prefix component 'a b'"),
    ("http://ok-bucket/x", "not an s3:// URL"),
])
def test_bad_urls_are_named(url, message):
    with pytest.raises(ValueError, match=message):
        objectstore.parse_url(url)
    assert objectstore.parse_url("s3://ok-bucket//a/b/") == objectstore.S3Url("ok-bucket", "a/b")


@pytest.mark.parametrize("text, said", [
    # A lost connection while uploading a part whose byte offsets read "...403...": not "access denied"
    # (the agent once said so during the 30 s outage test).
    ("When uploading part for key 'o/tables/step/run=r/rank=0/part-s0-1240352-1403190.parquet' in bucket 'runs': "
     "AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7, Couldn't connect to server", "cannot reach"),
    ("When uploading object with key 'o/part-s-0-403.parquet' in bucket 'runs': AWS Error ACCESS_DENIED during "
     "PutObject operation: Access Denied", "denied"),
    ("When reading information for key 'x' in bucket 'runs': AWS Error UNKNOWN (HTTP status 403) during HeadObject "
     "operation: No response body.", "denied"),
    ("AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2 operation: The AWS Access Key Id you provided does not "
     "exist", "denied"),
    ("NO_SUCH_BUCKET: bucket 'runs' not found", "does not exist"),
    ("When listing objects under key 'o/tables/' in bucket 'runs': AWS Error NO_SUCH_BUCKET during ListObjectsV2 "
     "operation: The specified bucket does not exist", "does not exist"),
])
def test_s3_errors_are_said_by_their_code_not_by_digits_in_the_key(text, said, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    line = objectstore.describe_error(OSError(text), url=objectstore.parse_url("s3://runs/o"))
    assert said in line, line


def test_keys_outside_the_layout_are_ignored_and_superseded_parts_found():
    ok = f"tables/step/run=r1/rank=0/{part_name('s1', 0, 100)}"
    assert objectstore.table_part(ok, 5).end == 100
    for bad in ("tables/nokind/run=r1/rank=0/part-s1-0-1.parquet", "tables/step/run=../rank=0/part-s1-0-1.parquet",
                "tables/step/run=r1/rank=x/part-s1-0-1.parquet", "tables/step/run=r1/rank=0/../../etc.parquet",
                "other/step/run=r1/rank=0/part-s1-0-1.parquet"):
        assert objectstore.table_part(bad, 5) is None, bad
    parts = [objectstore.table_part(f"tables/step/run=r1/rank=0/{part_name(s, a, b)}", 1)
             for s, a, b in (("s1", 0, 10), ("s1", 10, 20), ("s1", 0, 20), ("s1", 20, 30), ("s2", 0, 10))]
    assert objectstore.superseded(parts, {}) == {parts[0].rel, parts[1].rel}
    # a pack (agent.store.packs) supersedes the parts its manifest holds; unknown manifests nothing
    pack = objectstore.table_part(f"tables/step/run=r1/packs/{pack_name('a' * 24)}", 7)
    assert pack.pack and pack.run_dir == "tables/step/run=r1" and pack.size == 7
    assert objectstore.table_part("tables/step/run=r1/packs/part-s1-0-1.parquet", 1) is None
    assert objectstore.superseded([*parts, pack], {pack.rel: ((0, "s1", 20, 30), (0, "s2", 0, 10))}) == {
        parts[0].rel, parts[1].rel, parts[3].rel, parts[4].rel}
    assert objectstore.superseded([*parts, pack], {pack.rel: None}) == {parts[0].rel, parts[1].rel}


# ------------------------------------------------------------------------------ agent and bucket
@pytest.fixture(scope="module")
def killed_run(s3):
    """A 2-rank run (rank 1 a straggler) whose agent is SIGKILLed three times while uploading. Small parts
    every poll (``--part-age 0``) keep uploads in flight all the time, so each kill lands in a list / PUT /
    delete cycle; the restarted agent lists the bucket and uploads what is missing."""
    _, proxy = s3
    world, steps, run = 2, 320, "s3kill"  # long enough for three rounds of uploads on a loaded 2-core machine
    url = f"s3://{BUCKET}/kill"
    rnd = random.Random(20261125)
    args = ("--part-age", "0", "--part-bytes", "16000", "--upload", url)
    with private_dir("meshscope-s3-") as work, pytest.MonkeyPatch.context() as mp:
        for k, v in s3_env(proxy.endpoint).items():
            mp.setenv(k, v)
        mp.setenv("MESHSCOPE_CACHE_DIR", str(work / "cache"))
        job = Job(world, "--steps", steps, "--log-every", 1, "--store", work, "--run-name", run,
                  "--straggler-ranks", "1", "--straggler-seconds", "0.03", log=work / "job.log")
        agent = AgentProcess(work, *args, poll_interval=0.05)
        try:
            for _ in range(3):
                before = _uploaded(agent)
                poll_until(lambda: _uploaded(agent) >= before + 10, timeout_s=120, interval_s=0.05,
                           what="the agent uploads new parts")
                assert job.running(), "the run ended before the third kill: raise steps"
                time.sleep(rnd.uniform(0.0, 0.2))
                agent.kill()
                with job.paused():
                    agent = AgentProcess(work, *args, poll_interval=0.05)
            assert job.wait(timeout_s=240) == 0, job.tail()
            poll_until(lambda: _drained(agent, run, steps - 1, world), timeout_s=90,
                       what="the last agent uploads all")
            assert agent.stop() == 0, agent.stderr
        finally:
            job.kill()
            agent.kill()
        yield work, url, run, world, steps


def test_agent_killed_mid_upload_three_times_bucket_holds_every_record_once(killed_run):
    work, url, run, world, steps = killed_run
    _exactly_once(work, url, run, world, steps)


def test_report_over_the_bucket_says_what_it_says_over_the_local_store(killed_run):
    work, url, run, _, _ = killed_run
    local, remote = _report(str(work), run), _report(url, run)
    assert remote == local
    assert [s["rank"] for s in remote["stragglers"]] == [1], remote["stragglers"]


def test_diff_compares_a_run_in_the_bucket_with_one_in_a_local_store(killed_run):
    """``meshscope diff --store s3://... --store-b DIR``: A read from the bucket, B from the local store. The
    same run's records on both sides: every part's difference is exactly 0 and nothing changed."""
    work, url, run, _, _ = killed_run
    proc = subprocess.run([sys.executable, "-m", "meshscope", "diff", "--store", url, "--store-b", str(work), run, run,
                           "--json", "--fail-above", "0"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    c = json.loads(proc.stdout)
    assert c["unit"] == "step" and c["changes"] == [] and c["gate"]["failed"] is False
    assert c["steps"][0] == c["steps"][1] > 100
    assert all(p["diff_s"] == 0 and p["a_s"] == p["b_s"] for p in c["parts"]), c["parts"]
    assert c["verdict"].startswith("no significant difference")


def test_dashboard_over_the_bucket_shows_what_it_shows_over_the_local_store(killed_run, monkeypatch):
    work, url, run, _, _ = killed_run

    def pages(store: str) -> dict[str, list[str]]:
        monkeypatch.setattr(sys, "argv", ["app.py", "--store", store])
        at = AppTest.from_file(str(APP), default_timeout=60).run()
        out = {}
        for page in ("overview", "communication", "pipeline", "memory"):
            at.switch_page(f"app_pages/{page}.py")
            at.run()
            assert not at.exception and not at.error, (store, page, at.exception, at.error)
            out[page] = [str(e.value) for kind in ("markdown", "metric", "warning", "info", "success")
                         for e in at.get(kind)]
        return out

    local, remote = pages(str(work)), pages(url)
    assert remote == local
    assert any("rank 1" in text.lower() for text in remote["overview"]), remote["overview"]


def test_endpoint_down_30s_training_unaffected_uploads_catch_up(s3, work):
    _, proxy = s3
    world, run, url = 2, "s3outage", f"s3://{BUCKET}/outage"
    # ~0.06 s steps: the run outlasts the outage with room on both sides.
    job = Job(world, "--steps", 900, "--log-every", 1, "--store", work, "--run-name", run,
              "--straggler-ranks", "0,1", "--straggler-seconds", "0.05", log=work / "job.log")
    agent = AgentProcess(work, "--part-age", "1", "--upload", url, poll_interval=0.1)
    try:
        poll_until(lambda: _uploaded(agent) >= 4, timeout_s=120, what="uploads start")
        t0, s0 = time.monotonic(), max(job.printed_steps())
        time.sleep(5)
        rate_before = (max(job.printed_steps()) - s0) / (time.monotonic() - t0)
        proxy.down()
        try:
            t_down, s_down = time.monotonic(), max(job.printed_steps())
            # A response already read when the proxy went down is counted a moment later: settle first.
            poll_until(lambda: agent.scrape().value("meshscope_agent_upload_errors_total") > 0, timeout_s=20,
                       what="the outage seen")
            up_at_down = _uploaded(agent)
            time.sleep(30 - (time.monotonic() - t_down))
            m = agent.scrape()  # /metrics keeps answering, and keeps up with the ranks
            steps_in_outage = max(job.printed_steps()) - s_down
            rate_during = steps_in_outage / (time.monotonic() - t_down)
            assert m.value("meshscope_agent_upload_errors_total") > 0
            assert m.value("meshscope_agent_upload_parts_total") == up_at_down
            assert m.value("meshscope_agent_upload_pending_parts") > 0
            seen = m.by("meshscope_rank_last_step", "rank", run=run)
            assert min(seen.values()) >= s_down + 0.5 * steps_in_outage, (seen, s_down, steps_in_outage)
        finally:
            proxy.up()
        assert job.running(), "the run ended during the outage: raise --steps"
        # Training unaffected: its pace during the outage within noise of its pace before.
        assert rate_during >= 0.7 * rate_before, (rate_before, rate_during)
        assert job.wait(timeout_s=240) == 0, job.tail()
        poll_until(lambda: _drained(agent, run, 899, world), timeout_s=60, what="uploads catch up")
        assert agent.stop() == 0, agent.stderr
    finally:
        proxy.up() if proxy._listener is None else None
        job.kill()
        agent.kill()
    lines = [line for line in agent.stderr.splitlines() if "upload failed" in line]
    assert len(lines) == 1 and "cannot reach" in lines[0], agent.stderr
    assert "uploads to" in agent.stderr and "resumed" in agent.stderr
    _exactly_once(work, url, run, world, 900)


@pytest.mark.parametrize("case", ["missing bucket", "bad credentials"])
def test_missing_bucket_or_bad_credentials_one_line_agent_keeps_serving(case, s3, work, monkeypatch):
    moto, _ = s3
    url = f"s3://no-such-bucket-{random.randrange(10**6)}/x" if case == "missing bucket" else f"s3://{BUCKET}/x"
    if case == "bad credentials":
        ctx = moto_server(auth_free_requests=4)
        auth = ctx.__enter__()
        auth.add_user("agent")
        auth.create_bucket(BUCKET)
        for k, v in s3_env(auth.endpoint, key="AKIAWRONGKEY0000", secret="wrong").items():
            monkeypatch.setenv(k, v)
    job = Job(2, "--steps", 30, "--log-every", 1, "--store", work, "--run-name", "s3bad", log=work / "job.log")
    agent = AgentProcess(work, "--part-age", "0", "--upload", url, poll_interval=0.1)
    try:
        assert job.wait(timeout_s=240) == 0, job.tail()
        poll_until(lambda: (agent.scrape().value("meshscope_agent_upload_errors_total") or 0) >= 3, timeout_s=60,
                   what="several failed upload passes")
        m = agent.scrape()
        assert m.by("meshscope_rank_last_step", "rank", run="s3bad") == {"0": 29, "1": 29}
        assert m.value("meshscope_agent_upload_parts_total") == 0
        assert agent.stop() == 0
    finally:
        job.kill()
        agent.kill()
        if case == "bad credentials":
            ctx.__exit__(None, None, None)
    lines = [line for line in agent.stderr.splitlines() if line.strip()]
    failed = [line for line in lines if "upload failed" in line]
    want = "does not exist" if case == "missing bucket" else "denied: check the AWS credentials"
    assert len(failed) == 1 and want in failed[0], agent.stderr
    assert "Traceback" not in agent.stderr


def test_reader_on_a_missing_bucket_is_one_line(s3, work):
    with pytest.raises(StoreError, match="bucket 'absent-bucket' does not exist"):
        Store.open("s3://absent-bucket/x")
    proc = subprocess.run([sys.executable, "-m", "meshscope", "report", "--store", "s3://absent-bucket/x", "--run", "r",
                           "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "absent-bucket" in proc.stderr, proc.stderr


class _Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def now(self) -> float:
        return self.t


def test_uploader_compaction_retention_and_restart(s3, work):
    """In process, one pass at a time: a compacted part replaces its sources in the bucket; local parts go
    only once acknowledged, past --keep-local and below the durable offset; a restarted uploader lists
    the bucket and uploads nothing twice."""
    moto, proxy = s3
    url = f"s3://{BUCKET}/unit"
    rank_dir = work / "tables" / "step" / "run=u1" / "rank=0"
    for start, end in ((0, 10), (10, 20)):
        parts.write_part(rank_dir, pa.table({"step": [start]}), kind="step", stream="s1", start=start, end=end,
                         source="test")
    clock, state = _Clock(), MetricsState()
    config = UploadConfig(url=url, keep_local_s=100)
    up = Uploader(store=work, config=config, state=state, clock=clock)
    s3fs = objectstore.filesystem()

    def bucket() -> list[str]:
        return sorted(rel.rsplit("/", 1)[1] for rel in objectstore.list_parts(s3fs, objectstore.parse_url(url)))

    assert up.run_pass() == 2 and bucket() == [part_name("s1", 0, 10), part_name("s1", 10, 20)]
    assert (state.upload_parts, state.upload_pending_parts) == (2, 0) and state.upload_bytes > 0
    written, _ = parts.compact_partition(rank_dir, kind="step", durable=lambda s: math.inf, small_bytes=1 << 20,
                                         target_bytes=1 << 20, min_parts=2)
    assert written == 1
    assert up.run_pass() == 1 and bucket() == [part_name("s1", 0, 20)]  # the sources' objects are gone

    clock.t += 50
    assert up.retain(durable=lambda s: math.inf) == 0  # acknowledged, but not for --keep-local yet
    clock.t += 100
    assert up.retain(durable=lambda s: 10) == 0  # the part reaches past the durable offset
    assert up.retain(durable=lambda s: 20) == 1 and not any(rank_dir.iterdir())
    assert bucket() == [part_name("s1", 0, 20)]

    parts.write_part(rank_dir, pa.table({"step": [20]}), kind="step", stream="s1", start=20, end=30, source="test")
    again = Uploader(store=work, config=config, state=MetricsState(), clock=clock)  # an agent restart
    assert again.run_pass() == 1 and again.run_pass() == 0
    assert bucket() == [part_name("s1", 0, 20), part_name("s1", 20, 30)]


def test_uploader_and_reader_cache_with_packs(s3, work):
    """Packs (agent.store.packs) in the bucket: a pack replaces the parts it holds, a merged pack the
    packs it merged (their objects deleted once it is up); the reader's cache holds each row once; an
    object deleted between a reader's listing and its GET (a merge's source) is skipped, not an error."""
    from meshscope.agent.store import packs, remote

    url = f"s3://{BUCKET}/packed"
    run_dir = work / "tables" / "step" / "run=p1"
    clock, state = _Clock(), MetricsState()
    up = Uploader(store=work, config=UploadConfig(url=url, keep_local_s=100), state=state, clock=clock)
    s3fs, parsed = objectstore.filesystem(), objectstore.parse_url(url)

    def bucket() -> list[str]:
        return sorted(rel.split("/", 3)[3] for rel in objectstore.list_parts(s3fs, parsed))

    def write(i: int) -> None:
        for rank in (0, 1):
            parts.write_part(run_dir / f"rank={rank}", pa.table({"step": [i]}), kind="step", stream=f"s{rank}",
                             start=10 * i, end=10 * i + 10, source="test")

    write(0)
    assert up.run_pass() == 2 and len(bucket()) == 2  # the parts, before packing
    packs.pack_run(run_dir, kind="step", final=lambda s, e: True, merge_min=2, small_bytes=1 << 20)
    assert up.run_pass() == 1 and [b.split("/")[0] for b in bucket()] == ["packs"]  # the parts' objects gone
    write(1)
    packs.pack_run(run_dir, kind="step", final=lambda s, e: True, merge_min=2, small_bytes=1 << 20)  # + merge
    assert len(packs.list_packs(packs.packs_dir(run_dir))) == 1
    assert up.run_pass() == 1 and len(bucket()) == 1  # the merged pack; both sources deleted
    step = read_table(url, "step", run="p1")
    assert sorted(zip(step["rank"], step["step"])) == [(0, 0), (0, 1), (1, 0), (1, 1)]

    listed = objectstore.list_parts(s3fs, parsed)
    (only,) = listed.values()
    s3fs.delete_file(parsed.path(only.rel))  # gone after the listing
    assert remote._download(s3fs, parsed, only, work / "cache-x") == 0


def test_dashboard_sync_reads_the_cache_and_lists_in_the_background_and_says_a_failure(s3, work, monkeypatch):
    """A page over a bucket (``Store.open(url, background_sync=True)``, the dashboard) waits for the first
    sync only; later it reads the cache while a listing runs on a thread, and an endpoint that went
    away is said at the next page load, not hidden behind the cache."""
    from meshscope.agent.store import remote

    _, proxy = s3
    url = f"s3://{BUCKET}/bg"
    run_dir = work / "tables" / "step" / "run=b1"
    up = Uploader(store=work, config=UploadConfig(url=url, keep_local_s=100), state=MetricsState(), clock=_Clock())

    def put(i: int) -> None:
        parts.write_part(run_dir / "rank=0", pa.table({"step": [i]}), kind="step", stream="s0", start=10 * i,
                         end=10 * i + 10, source="test")
        assert up.run_pass() == 1

    def steps() -> list[int]:
        store = Store.open(url, background_sync=True)
        return sorted(read_table(store, "step", run="b1")["step"])

    put(0)
    assert steps() == [0]  # the first load in a process syncs before it reads
    put(1)
    monkeypatch.setattr(remote, "BACKGROUND_INTERVAL_S", 3600.0)
    assert steps() == [0]  # synced moments ago: the cache as it is, no listing
    monkeypatch.setattr(remote, "BACKGROUND_INTERVAL_S", 0.0)
    assert steps() in ([0], [0, 1])  # the cache as it is; step 1 comes with the listing this one started
    poll_until(lambda: steps() == [0, 1], timeout_s=30, what="the background sync brings step 1")
    monkeypatch.setattr(remote, "BACKGROUND_INTERVAL_S", 3600.0)
    poll_until(lambda: not remote._syncing, timeout_s=60, what="the last background sync ends")
    monkeypatch.setattr(remote, "BACKGROUND_INTERVAL_S", 0.0)
    proxy.down()
    try:
        steps()  # starts a sync that fails on its thread
        poll_until(lambda: not remote._syncing, timeout_s=60, what="the failed background sync ends")
        for _ in range(2):  # every load while it lasts, not every other one
            with pytest.raises(StoreError, match="cannot read the store"):
                steps()  # the next load syncs in the foreground and says why
    finally:
        proxy.up()
    assert steps() == [0, 1]


@pytest.mark.parametrize("argv, message", [
    (["agent", "--store", "s3://b-1/x"], "the agent writes a local store directory; give the bucket as --upload"),
    (["agent", "--store", "DIR", "--upload", "s3://B/x"], "'B' is not a valid S3 bucket name"),
    (["sweep", "--store", "s3://b-1/x"], "the sweep's jobs write a local store directory"),
    (["export-trace", "--store", "s3://B/x", "--run", "r", "--out", "t.json"], "'B' is not a valid S3 bucket name"),
])
def test_urls_where_a_directory_is_written_are_one_line(argv, message, tmp_path):
    argv = [str(tmp_path / "store") if a == "DIR" else a for a in argv]
    proc = subprocess.run([sys.executable, "-m", "meshscope", *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "s3:").exists()


def test_telemetry_refuses_a_url_as_its_store():
    from meshscope.agent.instrument.config import TelemetryConfig

    with pytest.raises(ValueError, match="store='s3://b-1/x' is a URL"):
        TelemetryConfig(store="s3://b-1/x", run="r")
