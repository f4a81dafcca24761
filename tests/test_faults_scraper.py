"""Prometheus down, slow or stuck: no effect on training or on the agent.

The ranks never talk to the agent or to Prometheus, and the agent's ingest loop never waits on HTTP;
what a bad scraper can still do is hold the agent's HTTP side. These tests hold it every way a client
can and check that scrapes by others, ingest and training go on:

- clients that connect and send nothing (a hung Prometheus, a half-open connection, a port scanner),
  a slowloris that sends its request a byte at a time, clients that send a request and never read the
  response, and a TLS client that never sends its ClientHello (prometheus-client's own TLS server does
  the handshake in its accept loop, so one such client blocks every later scrape: the agent's server
  does it in the connection's thread, under the connection timeout);
- more connections than the agent admits at once (they are closed at once, no thread each);
- "Prometheus down" is the default in every other test (nobody scrapes); here the agent is also
  scraped while a real training job runs, with the abusive clients connected in the middle third.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
import urllib.request
from contextlib import ExitStack

import pandas as pd
import psutil
import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from meshscope.agent.collector.server import WebConfig, serve_metrics
from meshscope.agent.store.reader import read_table
from tests.support.harness import (
    AgentProcess, Job, compare_store_to_truth, poll_until, private_dir, self_signed, spool_truth,
)

# serial: a scrape's latency against a deadline, and the training's step times while scraped against calm ones
pytestmark = pytest.mark.serial


@pytest.fixture
def tmp_path():
    """Not pytest's (concurrent sessions on this machine clean each other's): see harness.private_dir."""
    with private_dir() as d:
        yield d


WORLD, RUN = 2, "scrape"


class Big:
    """A collector whose exposition is large (~600 kB): a client that does not read it fills the
    socket buffers, so the server's write blocks."""

    def collect(self):
        g = GaugeMetricFamily("big", "padding", labels=["i"])
        for i in range(20_000):
            g.add_metric([f"{i:08d}"], float(i))
        yield g


def registry(big: bool = False) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    g = GaugeMetricFamily("alive", "x", value=1.0)
    reg.register(type("C", (), {"collect": lambda self: [g]})())
    if big:
        reg.register(Big())
    return reg


def scrape(url: str, *, context: ssl.SSLContext | None = None, timeout: float = 2.0) -> float:
    """Seconds a full scrape takes (raises on failure)."""
    t = time.monotonic()
    with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
        resp.read()
    return time.monotonic() - t


def idle(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def non_reader(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    return s


def closed_by_server(s: socket.socket, *, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True
    except (TimeoutError, socket.timeout):
        return False
    except (ConnectionResetError, OSError):
        return True


# -------------------------------------------------------------------------------- the server in-process

def test_stuck_clients_do_not_block_scrapes_and_are_dropped_after_the_timeout():
    """A scrape served while 14 connections are stuck takes far less than the connection timeout: it
    never waited for a stuck one to time out. (Not a latency bound: the four non-readers each render the
    600 kB exposition at the same moment, so on a loaded 2-core CI machine the first scrape, competing
    with them for the GIL, once took 1.1 s against 0.12 s for the next two.)"""
    timeout_s = 4.0
    srv = serve_metrics(registry(big=True), host="127.0.0.1", port=0,
                        web=WebConfig(connection_timeout_s=timeout_s))
    url = f"http://127.0.0.1:{srv.port}/metrics"
    try:
        with ExitStack() as stack:
            held = [stack.enter_context(idle(srv.port)) for _ in range(10)]
            held += [stack.enter_context(non_reader(srv.port)) for _ in range(4)]
            time.sleep(0.3)
            took = [scrape(url, timeout=2 * timeout_s) for _ in range(3)]
            assert max(took) < timeout_s / 2, took  # a 600 kB scrape, while 14 connections are stuck
            # The timeout frees the idle connections (and their threads).
            assert all(closed_by_server(s, within_s=timeout_s + 2.0) for s in held[:10])
    finally:
        srv.close()


def test_a_slowloris_is_cut_off_at_the_connection_deadline():
    """A request dribbled a byte every 0.1 s never trips the 1.5 s socket timeout; the deadline ends it."""
    srv = serve_metrics(registry(), host="127.0.0.1", port=0,
                        web=WebConfig(connection_timeout_s=1.5, connection_deadline_s=1.5))
    url = f"http://127.0.0.1:{srv.port}/metrics"
    stop = threading.Event()
    try:
        t0 = time.monotonic()  # before the connect: the deadline counts from the connection's admission
        with idle(srv.port) as slow:
            def dribble():
                for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"y" * 100:
                    if stop.wait(0.1):
                        return
                    try:
                        slow.send(bytes([byte]))
                    except OSError:
                        return

            t = threading.Thread(target=dribble, daemon=True)
            t.start()
            assert scrape(url) < 1.0  # served meanwhile
            assert closed_by_server(slow, within_s=5.0)
            # Not before the 1.5 s deadline, and within it plus a reaper tick (0.375 s) and scheduling.
            assert 1.5 <= time.monotonic() - t0 < 4.0
            # The reaper counts after its shutdown() returns, which is also when this thread can see the
            # close: give it a moment (seen 0 once on a loaded CI machine).
            deadline = time.monotonic() + 2.0
            while srv.stats["reaped"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert srv.stats["reaped"] >= 1
    finally:
        stop.set()
        srv.close()


def test_connections_beyond_the_limit_are_closed_at_once_and_service_resumes():
    srv = serve_metrics(registry(), host="127.0.0.1", port=0,
                        web=WebConfig(connection_timeout_s=1.0, max_connections=4))
    url = f"http://127.0.0.1:{srv.port}/metrics"
    try:
        with ExitStack() as stack:
            [stack.enter_context(idle(srv.port)) for _ in range(4)]
            extra = stack.enter_context(idle(srv.port))
            assert closed_by_server(extra, within_s=1.0)  # no slot: closed at once, no thread
            assert srv.stats["refused_busy"] >= 1
            poll_until(lambda: _ok(url), timeout_s=5, what="slots freed by the timeout")
    finally:
        srv.close()


def _ok(url: str) -> bool:
    try:
        scrape(url, timeout=1.0)
        return True
    except OSError:
        return False


def test_tls_client_that_never_says_hello_does_not_block_scrapes(tmp_path):
    cert, key = self_signed(tmp_path)
    timeout_s = 3.0  # a scrape that waited for a silent client would take at least this long
    srv = serve_metrics(registry(), host="127.0.0.1", port=0,
                        web=WebConfig(tls_cert=cert, tls_key=key, connection_timeout_s=timeout_s))
    ctx = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{srv.port}/metrics"
    try:
        with ExitStack() as stack:
            silent = [stack.enter_context(idle(srv.port)) for _ in range(5)]  # TCP only, no ClientHello
            time.sleep(0.2)
            assert scrape(url, context=ctx, timeout=2 * timeout_s) < timeout_s / 2
            assert all(closed_by_server(s, within_s=timeout_s + 2.0) for s in silent)
    finally:
        srv.close()


# ------------------------------------------------------------------- a real agent during a training run

@pytest.mark.gloo
def test_abusive_scrapers_during_a_run_leave_training_and_ingest_alone(tmp_path):
    agent = AgentProcess(tmp_path, "--part-age", "1")
    job = Job(WORLD, "--steps", 100_000, "--log-every", 1000, "--store", tmp_path, "--run-name", RUN,
              log=tmp_path / "job.log")
    marks, latencies, progress = {}, [], []
    try:
        poll_until(lambda: agent.scrape().value("meshscope_rank_last_step", run=RUN, rank="0") is not None,
                   timeout_s=120, what="first steps ingested")
        me = psutil.Process(agent.pid)

        def scraped_window(progress: list) -> float:
            """Six scrapes a second apart; the agent's CPU share of a core over the window."""
            t0, cpu0 = time.time(), sum(me.cpu_times()[:2])
            for _ in range(6):  # the agent keeps serving and ingesting meanwhile
                time.sleep(1.0)
                t = time.monotonic()
                m = agent.scrape(timeout_s=5)
                latencies.append(time.monotonic() - t)
                progress.append(m.value("meshscope_rank_last_step", run=RUN, rank="0"))
            return (sum(me.cpu_times()[:2]) - cpu0) / (time.time() - t0)

        cpu_calm = scraped_window([])  # the same ingest and scrapes, nobody stuck: warm-up steps too
        with ExitStack() as stack:
            marks["abuse"] = time.time()
            stuck = [stack.enter_context(idle(agent.port)) for _ in range(30)]
            stuck += [stack.enter_context(non_reader(agent.port)) for _ in range(5)]
            cpu = scraped_window(progress)
            marks["calm"] = time.time()
            assert len(stuck) == 35
        time.sleep(5.0)  # unbothered window after
        marks["end"] = time.time()
        assert job.running(), job.tail()
    finally:
        job.kill()
        code = agent.stop()  # SIGTERM; kills an agent that does not exit, so none is left behind
    assert code == 0, agent.stderr

    step = read_table(tmp_path, "step", run=RUN)
    pace = step.groupby("step").agg(t=("t_start", "min"), wall=("wall_s", "max"))
    before = pace[pace.t < marks["abuse"]].iloc[20:]["wall"]  # warm-up steps excluded
    during = pace[(pace.t >= marks["abuse"]) & (pace.t < marks["calm"])]["wall"]
    after = pace[pace.t >= marks["calm"]]["wall"]
    ratio = during.median() / pd.concat([before, after]).median()
    # Against the slower calm window: the machine's own drift between the windows (13.8 % in one
    # fresh-clone run: 26.8 ms before, 31.1 after, 36.4 during) is not the scrapers' doing.
    worst_calm_ratio = during.median() / max(before.median(), after.median())
    resolution = abs(before.median() / after.median() - 1)  # drift of this machine's load, as in the stall test
    report = compare_store_to_truth(tmp_path, RUN, spool_truth(tmp_path, RUN))
    print(f"\nscrape latency with 35 stuck clients: max {max(latencies) * 1e3:.0f} ms; agent CPU meanwhile "
          f"{100 * cpu:.2f} % of a core (ingest + 6 scrapes) against {100 * cpu_calm:.2f} % with nobody "
          f"stuck; last step seen {progress}; "
          f"median step {during.median() * 1e3:.2f} ms during vs {before.median() * 1e3:.2f} before and "
          f"{after.median() * 1e3:.2f} after "
          f"(ratio {ratio:.3f}, {worst_calm_ratio:.3f} to the slower calm window, resolution "
          f"{100 * resolution:.1f} %); store vs spool {report}")
    # Far below the agent's 10 s connection timeout: no scrape waited on a stuck client. (Not a latency
    # bound: the training job and the five non-readers' renders share this machine's two cores.)
    assert max(latencies) < 3.0
    # Stuck connections cost threads blocked in recv, not CPU: against the same window with nobody stuck
    # (ingest and scrapes alone read 4-6 % of a core; 6.2 % once on CI with the absolute 5 % bound this
    # replaces), what is left is the five non-readers' renders.
    assert cpu - cpu_calm < 0.03
    assert progress == sorted(progress) and progress[-1] > progress[0] + 15  # ingest went on
    # The wall-clock ratio is a figure, not the proof (see test_faults_agent_stall): on this shared machine
    # its noise is ~±10-15 %. The bound only catches a gross regression (training waiting on the agent);
    # the CPU bound above is what shows the effect is small.
    assert worst_calm_ratio < 1.25
    assert all(r["lost"] == 0 and r["duplicated"] == 0 for r in report.values()), report
