"""Live page client: PromQL built from the one metric mapping, parsed per rank; errors as messages.
The ``server`` test runs the queries against a real Prometheus scraping a real exporter."""

from __future__ import annotations

import math
import shutil
import subprocess
import threading
import time

import pytest

from dashboard import live
from fake_prometheus import FakePrometheus, free_port


def test_queries_use_the_metric_mapping():
    q = live.queries(run=None)
    wall = "sum by (rank) (rate(meshscope_rank_step_wall_seconds_total[1m]))"
    assert q["step"] == "max by (rank) (meshscope_rank_last_step)"
    assert q["compute_ratio"] == (
        f'sum by (rank) (rate(meshscope_rank_step_phase_seconds_total{{phase="compute"}}[1m])) / {wall}')
    assert 'phase="exposed_comm"' in q["exposed_comm_ratio"]
    assert q["mfu"] == "avg by (rank) (meshscope_rank_mfu_ratio)"
    assert live.queries(run='a"b')["mfu"] == 'avg by (rank) (meshscope_rank_mfu_ratio{run="a\\"b"})'
    # A newline or a backslash in a run name cannot end the string literal or the query early.
    assert live.queries(run="a\nb\\")["mfu"] == 'avg by (rank) (meshscope_rank_mfu_ratio{run="a\\nb\\\\"})'


def test_metric_names_and_types_are_the_agents_catalog():
    from agent import catalog

    want = {"step": "gauge", "wall": "counter", "phase": "counter", "mfu": "gauge"}
    for key, name in live.METRICS.items():
        spec = catalog.BY_NAME[name]
        assert spec.type == want[key], name
        assert {live.RUN_LABEL, live.RANK_LABEL} <= set(spec.labels), name
    phase = catalog.BY_NAME[live.METRICS["phase"]]
    assert live.PHASE_LABEL in phase.labels and {"compute", "exposed_comm"} <= set(phase.values["phase"])


def test_snapshot_per_rank():
    with FakePrometheus(ranks=3) as prom:
        client = live.PrometheusClient(prom.url)
        client.check()
        snap = live.snapshot(client, run="live-run")
        assert live.live_runs(client) == ["live-run"]
    assert snap["rank"].tolist() == [0, 1, 2]
    assert snap["step"].tolist() == [100.0, 101.0, 102.0]
    assert snap["compute_ratio"].tolist() == pytest.approx([0.5, 0.51, 0.52])
    assert snap["mfu"].tolist() == pytest.approx([0.4] * 3)


def test_unreachable_and_rejected_queries_are_live_errors():
    with pytest.raises(live.LiveError, match="not reachable"):
        live.PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout=1).check()
    with FakePrometheus() as prom:
        with pytest.raises(live.LiveError, match="rejected the query \\(404\\)"):
            live.PrometheusClient(prom.url + "/prefix").check()
    with pytest.raises(ValueError, match="http"):
        live.PrometheusClient("file:///etc/passwd")


# ------------------------------------------------------------------------------- real Prometheus
@pytest.mark.server
def test_queries_against_a_real_prometheus(tmp_path):
    if not shutil.which("prometheus"):
        pytest.skip("prometheus not installed (apt-get install -y prometheus)")
    from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

    registry = CollectorRegistry()
    labels = ["run", "rank"]
    family = lambda name: name.removesuffix("_total")  # noqa: E731  (prometheus_client adds _total)
    step = Gauge(live.METRICS["step"], "last step", labels, registry=registry)
    wall = Counter(family(live.METRICS["wall"]), "wall seconds", labels, registry=registry)
    phase = Counter(family(live.METRICS["phase"]), "phase seconds", [*labels, "phase"], registry=registry)
    mfu = Gauge(live.METRICS["mfu"], "MFU", labels, registry=registry)
    exporter_port, prom_port = free_port(), free_port()
    server, _ = start_http_server(exporter_port, addr="127.0.0.1", registry=registry)
    stop = threading.Event()

    def train() -> None:  # four ranks, busy 60 % computing and 10 % waiting on communication
        n, last = 0, time.monotonic()
        while not stop.wait(0.1):
            now = time.monotonic()
            n += 1
            for r in range(4):
                step.labels("r1", str(r)).set(n)
                wall.labels("r1", str(r)).inc(now - last)
                phase.labels("r1", str(r), "compute").inc(0.6 * (now - last))
                phase.labels("r1", str(r), "exposed_comm").inc(0.1 * (now - last))
                mfu.labels("r1", str(r)).set(0.4)
            last = now

    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: meshscope, static_configs: [{{targets: ['127.0.0.1:{exporter_port}']}}]}}]\n")
    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = live.PrometheusClient(f"http://127.0.0.1:{prom_port}", timeout=2)
        # A 5 s rate window (the page uses 1 m): rate() under-reads a counter younger than its window.
        deadline, snap = time.monotonic() + 45, None
        while time.monotonic() < deadline:
            try:
                snap = live.snapshot(client, run="r1", window="5s")
                if len(snap) == 4 and (abs(snap["compute_ratio"] - 0.6) < 0.09).all():
                    break
            except live.LiveError:
                pass  # not ready yet
            time.sleep(0.5)
        assert snap is not None and len(snap) == 4, snap
        assert live.live_runs(client) == ["r1"]
        assert snap["compute_ratio"].tolist() == pytest.approx([0.6] * 4, rel=0.15)
        assert snap["exposed_comm_ratio"].tolist() == pytest.approx([0.1] * 4, rel=0.15)
        assert snap["mfu"].tolist() == pytest.approx([0.4] * 4)
        assert not any(math.isnan(x) for x in snap["step"])
    finally:
        stop.set()
        prom.terminate()
        try:
            prom.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(timeout=10)
        server.shutdown()
        worker.join(timeout=5)
