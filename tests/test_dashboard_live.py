"""Live page client: PromQL built from the one metric mapping, parsed per rank; errors as messages.
The ``server`` tests run the queries against a real Prometheus scraping a real exporter, and the page over
a real 2-rank training job seen through ``meshscope agent``: its time series while it runs, then that it
ended."""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from meshscope.dashboard import live
from tests.support.harness import terminate
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
    from meshscope.agent import catalog

    want = {"step": "gauge", "step_t": "gauge", "wall": "counter", "phase": "counter", "mfu": "gauge",
            "steps": "counter", "last_record": "gauge", "world_size": "gauge", "events": "counter"}
    for key, name in live.METRICS.items():
        spec = catalog.BY_NAME[name]
        assert spec.type == want[key], name
        per_run = key in ("last_record", "world_size", "events")  # run-level series: no rank label
        assert ({live.RUN_LABEL} if per_run else {live.RUN_LABEL, live.RANK_LABEL}) <= set(spec.labels), name
    assert "end" in catalog.BY_NAME[live.METRICS["events"]].values["kind"]
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


def test_series_stop_where_the_run_stopped():
    # The agent exports an ended run's gauges for 10 minutes, so Prometheus answers a range query with the
    # last MFU (and a zero step rate) flat on past the end, while the page said "the series stop there".
    now = time.time()
    series = ("steps_per_s", "compute_ratio", "exposed_comm_ratio", "mfu")
    with FakePrometheus(ranks=2, ended_at=now - 180) as prom:
        client = live.PrometheusClient(prom.url)
        assert live.run_status(client, run="live-run", now=now)["state"] == "ended"
        hist = live.history(client, run="live-run", now=now, minutes=10, step_s=5)
    for name in series:
        part = hist[hist["series"] == name]
        assert sorted(part["rank"].unique()) == [0, 1], name
        ends = part.groupby("rank")["t"].max()  # within a point of the range (5 s) of the end
        assert (abs(ends - (now - 180)) <= 5).all(), (name, ends - now)
        assert part["t"].min() <= now - 590  # the minutes before the end are all there
    # The chart's time axis runs to now: the lines visibly end three minutes before its right edge.
    from meshscope.dashboard import figures

    fig = figures.live_series(hist[hist["series"] == "mfu"], title="MFU", percent=True, until=now)
    assert pd.Timestamp(fig.layout.xaxis.range[1]).timestamp() == pytest.approx(now, abs=0.01)
    assert max(pd.Timestamp(x).timestamp() for tr in fig.data for x in tr.x) <= now - 175
    assert fig.layout.yaxis.tickformat == ".0%"  # MFU 40 %; an MFU of 1 % gets a decimal, not "1%, 1%"
    low = figures.live_series(hist[hist["series"] == "mfu"].assign(value=0.011), title="MFU", percent=True)
    assert low.layout.yaxis.tickformat == ".1%"
    with FakePrometheus(ranks=2) as prom:  # a running run: its series reach now
        hist = live.history(live.PrometheusClient(prom.url), run="live-run", now=now, minutes=10, step_s=5)
    assert set(hist["series"]) == set(series) and (hist.groupby(["series", "rank"])["t"].max() >= now - 5).all()
    with FakePrometheus(ranks=2, ended_at=now - 900) as prom:  # ended before the window: nothing to draw
        assert live.history(live.PrometheusClient(prom.url), run="live-run", now=now, minutes=10, step_s=5).empty


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
        terminate(prom)
        server.shutdown()
        worker.join(timeout=5)


def _prometheus(tmp_path: Path, target_port: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: meshscope, static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]}}]\n")
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.server
@pytest.mark.gloo
def test_live_page_over_a_real_job_shows_series_then_its_end(tmp_path, monkeypatch):
    if not shutil.which("prometheus"):
        pytest.skip("prometheus not installed (apt-get install -y prometheus)")
    from streamlit.testing.v1 import AppTest

    from tests.support.jobs import ROOT, torchrun, trainer_env

    store = tmp_path / "store"
    store.mkdir()
    agent_port = free_port()
    agent = subprocess.Popen([sys.executable, "-m", "meshscope.cli", "agent", "--store", str(store), "--port",
                              str(agent_port), "--poll-interval", "0.2", "--gpu-interval", "0", "--part-age", "1"], cwd=ROOT,
                             env=trainer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    prom, prom_port = _prometheus(tmp_path, agent_port)
    try:
        client = live.PrometheusClient(f"http://127.0.0.1:{prom_port}", timeout=2)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # Prometheus up and scraping the agent
            try:
                if client.query("up") and client.query("up")[0][1] == 1:
                    break
            except live.LiveError:
                pass
            time.sleep(0.3)
        # ~6 s of steps (0.15 s added to every step of both ranks): several scrapes while it runs.
        torchrun(2, "--store", str(store), "--run-name", "live-job", "--steps", "40", "--straggler-ranks", "0,1",
                 "--straggler-seconds", "0.15")
        deadline, status = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            status = live.run_status(client, run="live-job", now=time.time())
            if status["state"] == "ended":
                break
            time.sleep(0.5)
        assert status is not None and status["state"] == "ended", status
        assert status["world_size"] == 2 and status["ended_ranks"] == 2 and status["crashes"] == 0
        assert live.live_runs(client) == ["live-job"]
        # The agent still exports the ended run (its gauges for 10 minutes): 10 s of scrapes after the
        # end, the series must stop at each rank's last step, not run on with its last MFU.
        time.sleep(max(0.0, status["last_record"] + 10 - time.time()))
        hist = live.history(client, run="live-job", now=time.time(), minutes=2, step_s=1)
        from meshscope.agent.store.reader import read_table

        records = read_table(store, "step", run="live-job")
        last_step = records.groupby("rank")["t_end"].max()
        for series in ("steps_per_s", "compute_ratio", "exposed_comm_ratio", "mfu"):
            part = hist[hist["series"] == series]
            assert sorted(part["rank"].unique()) == [0, 1], (series, hist)
            over = part.groupby("rank")["t"].max() - last_step  # a scrape (1 s) and a point (1 s) at most
            print(f"{series}: last point after the rank's last step (s) {over.round(2).to_dict()}")
            assert (over <= 2.5).all(), (series, over.to_dict())
        steps = hist[hist["series"] == "steps_per_s"]
        # While the job ran, the step rate is what its step records say: 1 / the median step time.
        truth = 1 / float(records["wall_s"].median())
        running = steps[steps["value"] > 0].groupby("rank")["value"].median()
        print(f"\nsteps/s per rank while running {running.round(2).to_dict()}, store truth {truth:.2f}")
        assert (abs(running / truth - 1) < 0.3).all(), (running.to_dict(), truth)
        ratios = hist[hist["series"].isin(["compute_ratio", "exposed_comm_ratio"])]["value"]
        assert ((ratios >= 0) & (ratios <= 1)).all() and ratios.median() > 0.005

        deadline = time.monotonic() + 20  # the agent's parts (written within its 1 s part age): the sidebar's run
        while not (store / "tables" / "step" / "run=live-job").is_dir() and time.monotonic() < deadline:
            time.sleep(0.3)
        monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(store), "--prometheus",
                                          f"http://127.0.0.1:{prom_port}"])
        at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=60).run()
        at.switch_page("app_pages/live.py")
        at.run()
        assert not at.exception
        assert at.selectbox(key="live.run.live-job").value == "live-job"  # the sidebar's run
        assert any("The run ended: all 2 ranks recorded their end" in s.value for s in at.success)
        assert len(at.get("plotly_chart")) == 4
    finally:
        _stop(prom)
        _stop(agent)
