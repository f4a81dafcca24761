"""The agent as a real process: /metrics on 127.0.0.1 checked by promtool, and exactly-once ingest
across SIGKILLs."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshscope.agent import catalog
from meshscope.agent.store.reader import read_table
from meshscope.agent.contract import CollectiveRecord, spool_path
from meshscope.agent.transport.writer import SpoolWriter
from tests.support.harness import committed_bytes, poll_until
from tests.support.spools import ALL_OPS_DIMS, write_run

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def start_agent(store: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshscope.cli", "agent", "--store", str(store), "--port", "0",
         "--poll-interval", "0.05", "--gpu-interval", "0", *extra],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # "meshscope agent: serving http://127.0.0.1:PORT/metrics, ..."
    assert "serving http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, int(line.split("127.0.0.1:")[1].split("/")[0])


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make install-servers)")
def test_metrics_endpoint_passes_promtool_and_stays_in_budget(tmp_path):
    world = 8
    proc, port = start_agent(tmp_path)
    try:
        assert {c.laddr.ip for c in psutil.Process(proc.pid).net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN} == {"127.0.0.1"}
        write_run(tmp_path, run="multi", world_size=world, steps=30, collectives_per_step=60, frame_rows=500,
                  ops_dims=ALL_OPS_DIMS, slow_rank=5)

        def all_ranks_in():
            text = fetch(port)
            last = [f'meshscope_rank_last_step{{rank="{r}",run="multi"}} 29.0' for r in range(world)]
            return text if all(line in text for line in last) else None

        text = poll_until(all_ranks_in, timeout_s=20, interval_s=0.05, what="every rank's series")
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        names = {s.name for s in samples}
        assert names <= catalog.sample_names(), names - catalog.sample_names()
        assert not any(n.endswith("_created") for n in names)
        per_rank: dict[str, int] = {}
        for s in samples:
            if "rank" in s.labels:
                per_rank[s.labels["rank"]] = per_rank.get(s.labels["rank"], 0) + 1
        assert len(per_rank) == world and max(per_rank.values()) <= catalog.SERIES_PER_RANK_MAX
        assert 'meshscope_agent_records_ingested_total{kind="collective"} 14400.0' in text
        assert 'meshscope_run_world_size{run="multi"} 8.0' in text
    finally:
        assert stop(proc) == 0
    # SIGTERM wrote everything buffered to the store before exiting.
    assert len(read_table(tmp_path, "collective", run="multi")) == world * 30 * 60


def _feed(store: Path, stop_event: threading.Event, counts: dict) -> None:
    """Two ranks writing 50-row frames steadily, like training would."""
    writers = [SpoolWriter(path=spool_path(store, run="kill", rank=r, attempt=0), run="kill", rank=r, attempt=0,
                           host="h", start=False) for r in range(2)]
    seq = 0
    while not stop_event.is_set():
        for r, w in enumerate(writers):
            rows = [CollectiveRecord(step=i // 40, op="all_reduce", dim="dp", group="dp0", group_size=2, seq=i, bytes=8,
                                     t_start=1.0, t_end=2.0, duration_s=1.0, wait_s=0.1, algbw=8.0, busbw=8.0, peer=-1,
                                     source="c10d", mesh_dim="")
                    for i in range(seq, seq + 50)]
            w.submit("collective", rows)
            w.flush()
            counts[r] = counts.get(r, 0) + 50
        seq += 50
        time.sleep(0.005)
    for w in writers:
        assert w.close() and w.dropped_records == 0


def test_exactly_once_across_sigkill(tmp_path):
    rnd = random.Random(7)
    counts: dict[int, int] = {}
    halt = threading.Event()
    feeder = threading.Thread(target=_feed, args=(tmp_path, halt, counts), daemon=True)
    feeder.start()
    try:
        for _ in range(3):
            proc, _ = start_agent(tmp_path, "--part-age", "0", "--part-bytes", "20000")
            before = committed_bytes(tmp_path)
            poll_until(lambda: committed_bytes(tmp_path) > before + 50_000, timeout_s=20, interval_s=0.05,
                       what="the agent to commit 50 kB more")  # it ingests and commits
            time.sleep(rnd.uniform(0.0, 0.1))  # land somewhere in a write/rename/offset-save cycle
            proc.kill()
            proc.wait(timeout=10)
    finally:
        halt.set()
        feeder.join(timeout=20)
    done = subprocess.run([sys.executable, "-m", "meshscope.cli", "ingest", "--store", str(tmp_path)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    df = read_table(tmp_path, "collective", run="kill")
    assert df.groupby("rank").size().to_dict() == counts
    assert not df.duplicated(["rank", "seq"]).any()
