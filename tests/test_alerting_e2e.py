"""Alerting end to end with real servers on 127.0.0.1: `meshscope stack` starts Prometheus, Alertmanager
and the node agent over a run store; real torchrun CPU runs of the reference trainer write telemetry into
it; a webhook receiver in this test gets what Alertmanager delivers.

The rules are the very rules of grafana/rules/source.yaml rendered with its `e2e` profile (rate windows
20 s, staleness 15 s, short `for:`; thresholds unchanged - tests/test_rules.py checks that), and the stack
runs with a 1 s scrape/evaluation interval and a 1 s Alertmanager group_wait.

A second, in-process agent (the real Agent class) stands for a GPU node: an injected fake NVML module
(there is no GPU here) and a short synthetic run with device memory, so that the GPU dashboard's panels
have data too. Prometheus discovers both agents from the file_sd targets file, like a two-node job.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from tests.support.harness import agent_thread, poll_until, terminate
import yaml

from meshscope.agent import stack
from meshscope.agent.collector.agent import Agent, AgentConfig
from meshscope.agent.contract import SCHEMAS, AnchoredClock, spool_path
from meshscope.agent.transport.frame import encode_data_frame, encode_file_header
from tests.support.spools import run_table, step_table
from tests.support.jobs import trainer_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "grafana" / "tools"))  # grafana/tools is scripts, not a package

import dashgen  # noqa: E402
import rulegen  # noqa: E402
from tests.support.harness import free_port as _free_port  # noqa: E402,F401

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(bool(stack.missing_binaries()[1]), reason="prometheus / prometheus-alertmanager not installed"),
]
RATE_INTERVAL = "10s"  # what $__rate_interval would be at a 1 s scrape interval (4 x scrape, rounded up)
TRAIN = ("--model", "tiny", "--device", "cpu", "--log-every", "1000")


class Prometheus:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def _get(self, path: str, **params) -> dict:
        url = f"{self.base}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self._get("/api/v1/query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def firing(self) -> list[dict]:
        return [a for a in self._get("/api/v1/alerts")["alerts"] if a["state"] == "firing"]

    def rule_errors(self) -> list[str]:
        """Rules whose last evaluation failed (e.g. many-to-many matching), which would silence them."""
        groups = self._get("/api/v1/rules")["groups"]
        return [f"{r['name']}: {r.get('lastError')}" for g in groups for r in g["rules"] if r["health"] == "err"]

    def targets_up(self) -> bool:
        targets = self._get("/api/v1/targets")["activeTargets"]
        return len(targets) == 2 and all(t["health"] == "up" for t in targets)


class Webhook:
    """Alertmanager's webhook receiver: records every notification posted to it."""

    def __init__(self) -> None:
        self.payloads: list[dict] = []
        received = self.payloads

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server API)
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):  # keep test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def find(self, alertname: str, **labels) -> dict | None:
        for payload in list(self.payloads):
            for alert in payload["alerts"]:
                lab = alert["labels"]
                if alert["status"] == "firing" and lab["alertname"] == alertname and all(
                        lab.get(k) == v for k, v in labels.items()):
                    return alert
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fake_nvml():
    """A healthy two-GPU node: the pynvml calls agent/collector/gpu.py makes."""
    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's names
        pass

    class NVMLError_Timeout(NVMLError):  # noqa: N801
        pass

    def no_event(_set, _timeout_ms):
        raise NVMLError_Timeout()

    return SimpleNamespace(
        NVMLError=NVMLError, NVMLError_NotSupported=NVMLError_NotSupported, NVMLError_Timeout=NVMLError_Timeout,
        NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        nvmlEventTypeXidCriticalError=8, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetIndex=lambda h: h,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h:04d}", nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMaxClockInfo=lambda h, clk: 1980, nvmlDeviceGetClockInfo=lambda h, clk: 1755,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=92, memory=45),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=61 * 2**30, total=80 * 2**30, free=19 * 2**30),
        nvmlDeviceGetPowerUsage=lambda h: 610_000, nvmlDeviceGetTemperature=lambda h, s: 66,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0b100,  # software power cap: routine, not alerted
        nvmlDeviceGetTotalEccErrors=lambda h, *_: 0, nvmlEventSetCreate=lambda: "set",
        nvmlDeviceRegisterEvents=lambda h, kind, s: None, nvmlEventSetWait_v2=no_event,
        nvmlEventSetFree=lambda s: None,
    )


def write_gpu_run(store: Path, *, run: str = "gpu-node", world_size: int = 2) -> None:
    """A short finished run with device memory (the CPU trainer has none): ten steps, then an end event."""
    now = time.time()
    t0 = now - 30
    for rank in range(world_size):
        path = spool_path(store, run=run, rank=rank, attempt=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        steps = np.arange(10)
        n = len(steps)
        gib = 2**30
        memory = {"step": steps, "t": t0 + steps + 1.0, "rss_bytes": [3 * gib] * n, "rss_peak_bytes": [3 * gib] * n,
                  "allocated_bytes": [40 * gib] * n, "allocated_peak_bytes": [52 * gib] * n,
                  "reserved_bytes": [56 * gib] * n, "reserved_peak_bytes": [60 * gib] * n,
                  "active_bytes": [40 * gib] * n, "active_peak_bytes": [52 * gib] * n, "alloc_retries": [0] * n,
                  "ooms": [0] * n, "device_free_bytes": [19 * gib] * n, "device_total_bytes": [80 * gib] * n,
                  "param_bytes": [-1] * n, "grad_bytes": [-1] * n, "optimizer_bytes": [-1] * n}
        events = {"t": [t0, now - 5], "step": [0, 9], "kind": ["start", "end"], "message": ["", "finished"]}
        with open(path, "wb") as fh:
            fh.write(encode_file_header(run=run, rank=rank, attempt=0, host="gpu-node", stream_id=secrets.token_hex(8),
                                        created=t0))
            fh.write(encode_data_frame("run", run_table(rank=rank, world_size=world_size, t0=t0)))
            fh.write(encode_data_frame("step", step_table(steps=steps, t0=t0, rank=rank,
                                                          rng=np.random.default_rng(rank))))
            fh.write(encode_data_frame("memory", pa.Table.from_pydict(memory, schema=SCHEMAS["memory"])))
            fh.write(encode_data_frame("event", pa.Table.from_pydict(events, schema=SCHEMAS["event"])))


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("alerting")
    store, gpu_store = tmp / "store", tmp / "gpu-store"
    store.mkdir()
    gpu_store.mkdir()
    write_gpu_run(gpu_store)
    rules = tmp / "e2e.rules.yml"
    rules.write_text(rulegen.dump(rulegen.prometheus_rules(rulegen.load_source(), "e2e"), what="profile e2e"))
    webhook = Webhook()
    gpu_agent = Agent(AgentConfig(store=gpu_store, port=0, gpu_interval_s=1.0), clock=AnchoredClock(),
                      nvml=fake_nvml())
    agents = ExitStack()
    gpu_port = agents.enter_context(agent_thread(gpu_agent))
    ports = SimpleNamespace(agent=_free_port(), prometheus=_free_port(), alertmanager=_free_port())
    cmd = [sys.executable, "-m", "meshscope.agent.stack", "--store", str(store), "--agent-port", str(ports.agent),
           "--agent", f"127.0.0.1:{gpu_port}", "--prometheus-port", str(ports.prometheus),
           "--alertmanager-port", str(ports.alertmanager), "--dir", str(tmp / "stack"), "--interval", "1s",
           "--rules", str(rules), "--webhook", webhook.url, "--group-wait", "1s"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    ctx = SimpleNamespace(tmp=tmp, store=store, stack=proc, stack_lines=lines, ports=ports, webhook=webhook,
                          prom=Prometheus(ports.prometheus), trainers=[])
    try:
        poll_until(lambda: any("Ctrl-C stops everything" in line for line in lines) or proc.poll() is not None,
                   timeout_s=60, what="meshscope stack to be ready")
        assert proc.poll() is None, "".join(lines)
        poll_until(ctx.prom.targets_up, timeout_s=30, what="both agents scraped (file_sd discovery)")
        yield ctx
    finally:
        for trainer in ctx.trainers:
            stop_trainer(trainer)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        agents.close()
        webhook.close()


def launch(e2e, nproc: int, run: str, *args: str) -> subprocess.Popen:
    """A torchrun job of the reference trainer writing into the stack's store (its own process group, so
    it can be ended as a whole)."""
    log = open(e2e.tmp / f"{run}.log", "w")
    # The run name goes through --set: torchrun's own parser takes "--run" for an abbreviation of --run-path.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "meshscope.trainer.train", *TRAIN, "--store", str(e2e.store), "--set", f"telemetry.run={run}", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=trainer_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    e2e.trainers.append(proc)
    return proc


def stop_trainer(proc: subprocess.Popen) -> None:
    terminate(proc, group=True, timeout_s=20)


def _log(e2e, run: str) -> str:
    return (e2e.tmp / f"{run}.log").read_text()[-3000:]


def test_clean_run_raises_no_alert_and_every_panel_has_data(e2e):
    run = "e2e-clean"
    # Pipeline parallel, so the pipeline panels (bubble, send/recv) have real data as well.
    proc = launch(e2e, 2, run, "--pp", "2", "--microbatches", "4", "--steps", "200")
    prom = e2e.prom
    poll_until(lambda: (prom.value(f'min(meshscope_rank_last_step{{run="{run}"}})') or 0) >= 10, timeout_s=150,
               what=f"steps of {run}\n{_log(e2e, run)}")
    queries = {dashgen.substitute(expr, RATE_INTERVAL): (uid, title)
               for uid, title, expr in dashgen.panel_queries()}
    assert len(queries) >= 40
    empty = set(queries)
    deadline = time.monotonic() + 60
    while empty and time.monotonic() < deadline:  # not bounded by the run: its series outlive its end
        empty = {q for q in empty if not prom.query(q)}
        assert prom.firing() == [], "an alert fired during a clean run"
        time.sleep(0.5)
    assert not empty, "panels without data: " + "; ".join(f"{queries[q]}: {q}" for q in sorted(empty))
    assert proc.wait(timeout=180) == 0, _log(e2e, run)
    poll_until(lambda: prom.value(f'sum(meshscope_run_events_total{{run="{run}", kind="end"}})') == 2,
               timeout_s=30, what="the end events")
    # Nothing may fire after the end either (no-progress must know the run ended): watch until the last
    # step is older than the e2e staleness limit plus the longest e2e `for:`, an evaluation and group_wait.
    last_step_t = prom.value(f'max(meshscope_rank_last_step_timestamp_seconds{{run="{run}"}})')
    stale_s = float(rulegen.params_for(rulegen.load_source(), "e2e")["stale_s"])
    while time.time() < last_step_t + stale_s + 6:
        assert prom.firing() == [], "an alert fired after a clean run ended"
        time.sleep(0.5)
    assert e2e.webhook.payloads == []
    assert prom.rule_errors() == []
    # Every provisioned Grafana rule query runs on this Prometheus (a bad one would be an HTTP 400).
    for rule in yaml.safe_load(rulegen.GRAFANA_RULES.read_text())["groups"][0]["rules"]:
        assert isinstance(prom.query(rule["data"][0]["model"]["expr"]), list), rule["title"]


def test_straggler_then_hang_are_delivered(e2e):
    run = "e2e-straggler-hang"
    proc = launch(e2e, 3, run, "--batch-size", "6", "--steps", "100000", "--straggler-ranks", "1",
                  "--straggler-seconds", "0.5", "--hang-rank", "2", "--hang-step", "40")
    try:
        alert = poll_until(lambda: e2e.webhook.find("MeshscopeStragglerRank", run=run), timeout_s=150,
                           what=f"the straggler notification\n{_log(e2e, run)}")
        assert alert["labels"]["rank"] == "1" and alert["labels"]["severity"] == "warning"
        assert "rank 1" in alert["annotations"]["summary"]
        assert "Per-rank breakdown" in alert["annotations"]["description"]
        assert not e2e.webhook.find("MeshscopeStragglerRank", run=run, rank="0")
        assert not e2e.webhook.find("MeshscopeStragglerRank", run=run, rank="2")
        # The provisioned Grafana rule (same PromQL, wrapped) selects the same rank.
        grafana = yaml.safe_load(rulegen.GRAFANA_RULES.read_text())["groups"][0]["rules"]
        expr = next(r for r in grafana if r["title"] == "MeshscopeStragglerRank")["data"][0]["model"]["expr"]
        result = e2e.prom.query(expr)
        assert [(r["metric"]["run"], r["metric"]["rank"], r["value"][1]) for r in result
                if r["metric"]["run"] == run] == [(run, "1", "1")]

        # The hang's culprit, named by the ranks' watchdogs (rank 2 stops before step 40; its peers wait)
        culprit = poll_until(lambda: e2e.webhook.find("MeshscopeRankHang", run=run), timeout_s=120,
                             what=f"the hang's culprit notification\n{_log(e2e, run)}")
        assert culprit["labels"]["rank"] == "2" and "rank 2 holds" in culprit["annotations"]["summary"]
        assert not e2e.webhook.find("MeshscopeRankHang", run=run, rank="0")
        assert not e2e.webhook.find("MeshscopeRankHang", run=run, rank="1")
        alert = poll_until(lambda: e2e.webhook.find("MeshscopeRunNoProgress", run=run), timeout_s=120,
                           what=f"the no-progress notification\n{_log(e2e, run)}")
        assert alert["labels"]["severity"] == "critical"
        assert e2e.prom.value(f'max(meshscope_rank_last_step{{run="{run}"}})') == 39  # stuck before step 40
        hang = _e2e_rule("MeshscopeRunNoProgress")
        assert [r["metric"]["run"] for r in e2e.prom.query(rulegen.grafana_expr(hang))] == [run]
        assert not e2e.webhook.find("MeshscopeRanksMissing", run=run)
        assert e2e.prom.rule_errors() == []
    finally:
        stop_trainer(proc)


def test_crashed_rank_raises_ranks_missing(e2e):
    run = "e2e-crash"
    proc = launch(e2e, 2, run, "--steps", "100000", "--crash-rank", "1", "--crash-step", "8")
    try:
        alert = poll_until(lambda: e2e.webhook.find("MeshscopeRanksMissing", run=run), timeout_s=150,
                           what=f"the ranks-missing notification\n{_log(e2e, run)}")
        assert alert["labels"]["reason"] == "crashed" and alert["labels"]["severity"] == "critical"
        assert proc.wait(timeout=60) != 0  # torchrun reports the failed rank
        missing = _e2e_rule("MeshscopeRanksMissing")
        assert {r["metric"].get("reason") for r in e2e.prom.query(rulegen.grafana_expr(missing))
                if r["metric"]["run"] == run} >= {"crashed"}
        assert e2e.prom.rule_errors() == []
    finally:
        stop_trainer(proc)


def test_ctrl_c_stops_what_the_stack_started(e2e):
    urls = [f"http://127.0.0.1:{port}/{path}" for port, path in (
        (e2e.ports.prometheus, "-/ready"), (e2e.ports.alertmanager, "-/ready"), (e2e.ports.agent, "metrics"))]
    assert all(stack._ready(url) for url in urls)
    e2e.stack.send_signal(signal.SIGINT)
    assert e2e.stack.wait(timeout=30) == 0, "".join(e2e.stack_lines)
    assert not any(stack._ready(url) for url in urls)
    out = "".join(e2e.stack_lines)
    for name in ("agent", "prometheus", "alertmanager"):
        assert f"meshscope stack: {name}" in out


def _e2e_rule(name: str) -> str:
    rules = rulegen.prometheus_rules(rulegen.load_source(), "e2e")["groups"][0]["rules"]
    return next(r["expr"] for r in rules if r.get("alert") == name)
