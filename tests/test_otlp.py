"""``meshscope agent --otlp-endpoint``: the catalog's metrics pushed over OTLP/HTTP, checked by a receiver in
the test that decodes the protobuf (no OpenTelemetry Collector here): every catalog metric with its labels,
types and values as /metrics says them; a real agent process; bad URLs; a receiver that fails."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from meshscope.agent import catalog
from meshscope.agent.collector.agent import Agent, AgentConfig
from meshscope.agent.collector.cli import agent_main
from meshscope.agent.collector.exposition import MeshscopeCollector
from meshscope.agent.collector.otlp import UNITS, OtlpConfig, OtlpPusher, StartTimes, endpoint_url
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.contract import AnchoredClock, GpuRecord
from tests.support.spools import run_table, write_run
from tests.test_collector_metrics import coll, ev, hang, mem, step, table
from tests.test_collector_process import fetch, poll_until

ROOT = Path(__file__).resolve().parents[1]
CUMULATIVE = AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE


class Receiver:
    """An OTLP/HTTP metrics receiver on 127.0.0.1: decodes every request, answers ``status`` (200 with an
    empty ExportMetricsServiceResponse, as a Collector does)."""

    def __init__(self, *, status: int = 200) -> None:
        self.status = status
        self.requests: list[tuple[float, str, dict, ExportMetricsServiceRequest]] = []  # (arrival, path, headers, body)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # the SDK's session keeps the connection

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportMetricsServiceRequest.FromString(body)
                headers = {k.lower(): v for k, v in self.headers.items()}
                receiver.requests.append((time.monotonic(), self.path, headers, request))
                reply = ExportMetricsServiceResponse().SerializeToString() if receiver.status == 200 else b""
                self.send_response(receiver.status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def last(self) -> ExportMetricsServiceRequest | None:
        return self.requests[-1][3] if self.requests else None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


def metrics_of(request: ExportMetricsServiceRequest) -> dict:
    return {m.name: m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def attrs(point) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in point.attributes}


def populated_state() -> MetricsState:
    """Records that make every catalog metric appear (the device memory and ECC ones included)."""
    st = MetricsState()
    st.observe("run", run_table(rank=0, world_size=2, t0=1.0, mesh={"dp": 2}), run="r", rank=0, attempt=0, now=1.0)
    st.observe("step", table("step", [step(0, wall=0.3, compute=0.2), step(1, wall=2.0, compute=1.2)]), run="r",
               rank=0, attempt=0, now=2.0)
    device = dict(allocated_bytes=3, allocated_peak_bytes=4, reserved_bytes=5, reserved_peak_bytes=6)
    st.observe("memory", table("memory", [mem(0, t=1.0, rss_bytes=10, rss_peak_bytes=20, ooms=1, **device)]),
               run="r", rank=0, attempt=0, now=2.0)
    st.observe("collective", table("collective", [coll(1, nbytes=64), coll(2, op="all_gather", dim="fsdp")]),
               run="r", rank=0, attempt=0, now=2.0)
    st.observe("event", table("event", [ev(2.0, 1, "crash", "x")]), run="r", rank=0, attempt=0, now=2.0)
    st.observe("hang", table("hang", [hang(1e3, in_collective=False)]), run="r", rank=0, attempt=0, now=2.0)
    st.gpus[0] = GpuRecord(t=1.0, host="node0", gpu=0, uuid="GPU-x", name="H100", util_ratio=0.5,
                           mem_util_ratio=0.1, mem_used_bytes=1, mem_total_bytes=2, power_watts=300.0,
                           temperature_celsius=60.0, sm_clock_hz=1.9e9, sm_clock_max_hz=2e9, throttle_reasons=4,
                           xid_errors_total=0, ecc_errors_total=0)._asdict()
    st.lag_s, st.poll_duration_s, st.last_poll_t = 0.5, 0.01, 3.0
    st.upload_last_success = 3.0  # agent.collector.upload's gauge, present after a first upload
    return st


def test_every_catalog_metric_arrives_with_its_labels_types_and_the_values_of_metrics(receiver):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MeshscopeCollector(populated_state(), host="node0", version="test"))
    clock = FakeClock(1000.0)
    pusher = OtlpPusher(registry, config=OtlpConfig(endpoint=receiver.base), host="node0", version="9.9",
                        clock=clock, warn=pytest.fail)
    clock.t = 1015.0
    try:
        assert pusher.push() and pusher.errors == 0
    finally:
        pusher.stop()
    assert len(receiver.requests) == 1  # stop() of a pusher never started makes no push
    _, path, _, request = receiver.requests[0]
    assert path == "/v1/metrics"
    resource = {kv.key: kv.value.string_value for kv in request.resource_metrics[0].resource.attributes}
    assert resource["service.name"] == "meshscope-agent" and resource["service.version"] == "9.9"
    assert resource["host.name"] == "node0"

    got = metrics_of(request)
    assert set(got) == {s.name for s in catalog.CATALOG}, "every catalog metric, nothing else"
    # What /metrics says, by (sample name, labels).
    scraped = {(s.name, frozenset(s.labels.items())): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert {name for name, _ in scraped} == catalog.sample_names(), "the fixture lacks a catalog metric"
    seen = set()
    for spec in catalog.CATALOG:
        m = got[spec.name]
        assert (m.description, m.unit) == (spec.help, UNITS[spec.unit]), spec.name
        kind = m.WhichOneof("data")
        assert kind == {"counter": "sum", "gauge": "gauge", "info": "gauge", "histogram": "histogram"}[spec.type]
        points = getattr(m, kind).data_points
        assert points, spec.name
        for p in points:
            labels = attrs(p)
            assert set(labels) == {*spec.labels, *spec.info_labels}, (spec.name, labels)
            assert p.time_unix_nano == 1015 * 10**9
            if kind == "histogram":
                key = frozenset(labels.items())
                assert p.count == scraped[(spec.name + "_count", key)]
                assert p.sum == pytest.approx(scraped[(spec.name + "_sum", key)])
                assert list(p.explicit_bounds) == list(catalog.STEP_BUCKETS)
                cumulative = [sum(p.bucket_counts[:i + 1]) for i in range(len(p.bucket_counts))]
                les = [*map(repr, p.explicit_bounds), "+Inf"]
                assert cumulative == [scraped[(spec.name + "_bucket", key | {("le", le)})] for le in les]
                # The exemplars name the slowest rank and step of each bucket, as /metrics' OpenMetrics does.
                exemplars = {({kv.key: kv.value.string_value for kv in x.filtered_attributes}["step"], x.as_double)
                             for x in p.exemplars}
                assert exemplars == ({("0", 0.3), ("1", 2.0)} if spec.name == "meshscope_step_wall_seconds"
                                     else {("0", 0.2), ("1", 1.2)})
                seen.update({(spec.name + suffix, key) for suffix in ("_count", "_sum")})
                seen.update((spec.name + "_bucket", key | {("le", le)}) for le in les)
                continue
            value = p.as_double
            expected = scraped[(spec.name, frozenset(labels.items()))]
            assert value == expected or (math.isnan(value) and math.isnan(expected)), (spec.name, labels)
            seen.add((spec.name, frozenset(labels.items())))
            if spec.type == "info":
                assert value == 1.0
        if kind in ("sum", "histogram"):
            data = getattr(m, kind)
            assert data.aggregation_temporality == CUMULATIVE
            assert all(p.start_time_unix_nano == 1000 * 10**9 for p in points)  # the pusher's start
            if kind == "sum":
                assert data.is_monotonic
    assert seen == set(scraped), "every series of /metrics, once"


def test_start_times_follow_new_and_reset_series():
    starts = StartTimes(100)
    assert starts.start(("c", "a"), value=5.0) == 100
    starts.commit(200)
    assert starts.start(("c", "a"), value=7.0) == 100  # same series, still counting
    assert starts.start(("c", "b"), value=1.0) == 200  # born after the first push
    starts.commit(300)
    assert starts.start(("c", "a"), value=2.0) == 300  # went backwards: a reset
    starts.commit(400)
    assert starts.start(("c", "b"), value=9.0) == 400  # gone from the last push: a new series


@pytest.mark.parametrize("given, url", [
    ("http://collector:4318", "http://collector:4318/v1/metrics"),
    ("https://collector:4318/", "https://collector:4318/v1/metrics"),
    ("http://10.0.0.1:4318/otlp/v1/metrics", "http://10.0.0.1:4318/otlp/v1/metrics"),
    ("http://[::1]:4318", "http://[::1]:4318/v1/metrics"),
])
def test_a_url_without_a_path_gets_the_metrics_path(given, url):
    assert endpoint_url(given) == url


def start_agent(store: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshscope.cli", "agent", "--store", str(store), "--port", "0",
         "--poll-interval", "0.05", "--gpu-interval", "0", *extra],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # "meshscope agent: serving http://127.0.0.1:PORT/metrics, ..."
    assert "serving http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, int(line.split("127.0.0.1:")[1].split("/")[0])


def test_a_real_agent_pushes_and_pushes_once_more_on_sigterm(tmp_path, receiver):
    write_run(tmp_path, run="r", world_size=2, steps=3, collectives_per_step=4, frame_rows=4)
    proc, port = start_agent(tmp_path, "--otlp-endpoint", receiver.base, "--otlp-interval", "1",
                             env={"OTEL_EXPORTER_OTLP_HEADERS": "x-meshscope-token=s3cret"})
    try:
        assert proc.stdout.readline().strip() == (
            f"meshscope agent: pushing OTLP to {receiver.base}/v1/metrics every 1 s")

        def all_steps_pushed():
            request = receiver.last()
            steps = request and metrics_of(request).get("meshscope_rank_last_step")
            return steps and sorted((attrs(p)["rank"], p.as_double) for p in steps.gauge.data_points) == [
                ("0", 2.0), ("1", 2.0)]

        poll_until(all_steps_pushed, timeout_s=30)
        _, path, headers, request = receiver.requests[-1]
        assert path == "/v1/metrics" and headers.get("x-meshscope-token") == "s3cret"
        assert headers["content-type"] == "application/x-protobuf"
        assert 'meshscope_rank_steps_total{rank="1",run="r"} 3.0' in fetch(port)
        totals = metrics_of(request)["meshscope_rank_steps_total"].sum.data_points
        assert {attrs(p)["rank"]: p.as_double for p in totals} == {"0": 3.0, "1": 3.0}
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert receiver.requests[-1][0] >= signalled, "no last push on shutdown"
    assert metrics_of(receiver.last())["meshscope_agent_otlp_export_errors_total"].sum.data_points[0].as_double == 0
    assert "Traceback" not in proc.stderr.read()


@pytest.mark.parametrize("url", ["ftp://collector:4318", "collector:4318", "http://", "http://collector:99999",
                                 "http://collector :4318"])
def test_a_bad_url_is_one_line_and_exit_2(tmp_path, capsys, url):
    store = tmp_path / "new"
    assert agent_main(["--store", str(store), "--otlp-endpoint", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshscope agent: error: ") and repr(url) in err[0], err
    assert not store.exists(), "checked before anything started"


def test_bad_otlp_flags_from_the_shell(tmp_path):
    out = subprocess.run([sys.executable, "-m", "meshscope.cli", "agent", "--store", str(tmp_path),
                          "--otlp-endpoint", "udp://collector:4317"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("meshscope agent: error: OTLP endpoint 'udp://collector:4317' must be an http:// "
                                  "or https:// URL with a host (e.g. http://collector:4318)")
    assert agent_main(["--store", str(tmp_path), "--otlp-interval", "5"]) == 2  # ignored silently otherwise
    assert agent_main(["--store", str(tmp_path), "--otlp-endpoint", "http://c:4318", "--otlp-interval", "0"]) == 2


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("failure", ["500", "down"])
def test_a_failing_receiver_is_counted_and_metrics_keeps_serving(tmp_path, capsys, failure):
    failing = Receiver(status=500) if failure == "500" else None
    base = failing.base if failing else f"http://127.0.0.1:{_closed_port()}"
    config = AgentConfig(store=tmp_path, port=0, poll_interval_s=0.05, gpu_interval_s=0,
                         otlp=OtlpConfig(endpoint=base, interval_s=0.1, timeout_s=0.5))
    agent = Agent(config, clock=AnchoredClock())
    stop = threading.Event()
    loop = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    try:
        port = agent.serve()
        loop.start()
        write_run(tmp_path, run="r", world_size=1, steps=2, collectives_per_step=4, frame_rows=4)

        def errors_and_steps():
            text = fetch(port)
            errors = next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                           if s.name == "meshscope_agent_otlp_export_errors_total"), 0)
            return errors >= 3 and 'meshscope_rank_last_step{rank="0",run="r"} 1.0' in text

        poll_until(errors_and_steps, timeout_s=30)
        if failing:  # it was sent, decodable, and carried the count of the pushes before it
            counts = [metrics_of(r)["meshscope_agent_otlp_export_errors_total"].sum.data_points[0].as_double
                      for *_, r in failing.requests]
            assert counts[:3] == [0.0, 1.0, 2.0]
    finally:
        stop.set()
        loop.join(20)
        agent.close()
        if failing:
            failing.close()
    assert not loop.is_alive(), "shutdown waited on the receiver"
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "OTLP push" in ln]
    assert len(warnings) == 1, "at most one warning a minute"
    assert warnings[0].startswith(f"meshscope agent: warning: OTLP push to {base}/v1/metrics failed")
    assert agent.otlp.errors >= 3


def test_the_sdk_loads_only_with_an_endpoint():
    # The agent's CLI imports the pusher's module; the SDK waits for an --otlp-endpoint. (The instrumentation
    # never imports the module at all: the next test.)
    code = ("import sys, meshscope.agent.collector.cli, meshscope.agent.collector.otlp;"
            "print(sorted({m for m in sys.modules if m.startswith('opentelemetry')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_instrumentation_never_imports_the_pusher():
    from tests.test_imports import GRAPH

    reached, todo = set(), [m for m in GRAPH if m.startswith(("meshscope.agent.instrument", "meshscope.agent.zerocode",
                                                              "meshscope.agent.transport"))]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(GRAPH[module])
    assert "meshscope.agent.collector.otlp" not in reached
