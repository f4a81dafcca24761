"""Fleet metrics end to end: meshscope agents -> Prometheus in agent mode (remote_write) -> VictoriaMetrics,
with vmalert evaluating the shipped rules against VictoriaMetrics.

Everything is real and on 127.0.0.1: a 2-rank gloo pipeline-parallel run of the reference trainer (so the
collective and pipeline series exist) writes into a store followed by a ``meshscope agent`` child; a
second, in-process agent with a fake NVML module and a synthetic finished run with device memory stands
for a GPU node (tests/test_alerting_e2e.py's approach: there is no GPU here); Prometheus runs
``grafana/prometheus/prometheus-agent.yml`` rendered with a 1 s scrape interval and this test's ports;
vmalert loads ``grafana/prometheus/rules/meshscope.rules.yml`` as shipped (default profile), reads
VictoriaMetrics, writes the recording rules (which the dashboards use) back into it and notifies a webhook.

The run injects a non-finite loss (``--nan-step``): MeshscopeNonFiniteLoss is the one shipped alert with
``for: 0s`` that a CPU run can trip, so it fires within seconds without a test profile.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import yaml

from meshscope.agent import catalog
from meshscope.agent.collector.agent import Agent, AgentConfig
from meshscope.agent.contract import AnchoredClock
from tests.support.harness import AgentProcess, Job, agent_thread, parse_metrics, poll_until, private_dir
from tests.support.jobs import ROOT
from tests.test_alerting_e2e import RATE_INTERVAL, Prometheus, Webhook, _free_port, fake_nvml, write_gpu_run

sys.path.insert(0, str(ROOT / "grafana" / "tools"))  # grafana/tools is scripts, not a package

import dashgen  # noqa: E402

AGENT_CONFIG = ROOT / "grafana" / "prometheus" / "prometheus-agent.yml"
SCRAPE_CONFIG = ROOT / "grafana" / "prometheus" / "prometheus.yml"
RULES = ROOT / "grafana" / "prometheus" / "rules" / "meshscope.rules.yml"
RUN, NAN_STEP = "fleet", 20
# 120 steps: with the 0.1 s sleep per step on both ranks (the trainer's straggler hook, equal on both, so
# no straggler) about 30 s, which outlasts the assertions, and the ranks leave the cores mostly idle for
# the five servers. Pipeline parallel: the pipeline panels (bubble, send/recv) need it.
TRAIN = ("--model", "tiny", "--device", "cpu", "--log-every", "1000", "--pp", "2", "--microbatches", "4",
         "--steps", "120", "--straggler-ranks", "0,1", "--straggler-seconds", "0.1", "--nan-step", str(NAN_STEP),
         "--set", f"telemetry.run={RUN}")
BINARIES = ("prometheus", "promtool", "victoria-metrics", "vmalert")
STOP_TIMEOUT_S = 10.0
# Catalog samples this setup cannot produce, and why (each is conditional in the catalog: `when`); every
# other catalog sample is asserted.
NOT_PRODUCED = {
    "meshscope_agent_upload_last_success_timestamp_seconds": "only after a part reached an --upload bucket; "
                                                             "this test uploads nowhere",
    "meshscope_agent_otlp_export_errors_total": "only with --otlp-endpoint; this test pushes no OTLP",
    "meshscope_rank_hang_in_collective": "only while a rank's hang watchdog reports a stall; this job does not hang "
                                         "(tests/test_alerting_e2e.py reads it through a real Prometheus)",
}

servers = pytest.mark.skipif(any(shutil.which(b) is None for b in BINARIES),
                             reason="needs Debian's prometheus and victoria-metrics packages")


def _labels(spec: catalog.MetricSpec, sample: str) -> tuple[set[str], set[str]]:
    """(labels a catalog sample must arrive with, labels it may arrive with): its own, the scrape's job and
    instance, le for buckets; info labels may be missing, as Prometheus drops labels with empty values."""
    required = {*spec.labels, "job", "instance"} | ({"le"} if sample.endswith("_bucket") else set())
    return required, required | set(spec.info_labels)


def render_agent_config(workdir: Path, *, targets: list[str], write_url: str) -> Path:
    """The shipped agent config with a 1 s scrape interval, this test's targets file and write URL."""
    cfg = yaml.safe_load(AGENT_CONFIG.read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s")
    for sd in cfg["scrape_configs"][0]["file_sd_configs"]:
        sd.update(files=[str(workdir / "targets" / "*.yml")], refresh_interval="1s")
    (workdir / "targets").mkdir()
    (workdir / "targets" / "agents.yml").write_text(yaml.safe_dump([{"targets": targets}]))
    (write,) = cfg["remote_write"]
    write["url"] = write_url
    write["queue_config"]["batch_send_deadline"] = "1s"
    path = workdir / "prometheus-agent.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class Server:
    """A server binary as a child, its output in a log; ``stop`` terminates it, then kills it."""

    def __init__(self, name: str, argv: list[str], *, workdir: Path, ready_url: str) -> None:
        self.name, self.log = name, workdir / f"{name}.log"
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        poll_until(lambda: self.proc.poll() is not None or _ok(ready_url), timeout_s=30, interval_s=0.2,
                   what=f"{name} ready at {ready_url}")
        assert self.proc.poll() is None, f"{name} exited:\n{self.tail()}"

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _stop_job(job: Job) -> None:
    """SIGTERM to torchrun, which stops its ranks; what is left after the timeout is killed (Job.kill
    reaps the ranks too: they run in sessions of their own)."""
    if job.running():
        ranks = job.ranks()
        os.killpg(job.proc.pid, signal.SIGTERM)
        try:
            job.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        for rank in psutil.wait_procs(ranks, timeout=STOP_TIMEOUT_S)[1]:
            rank.kill()
    job.kill()


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except OSError:
        return False


def _force_flush(vm_url: str, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        try:
            urllib.request.urlopen(f"{vm_url}/internal/force_flush", timeout=5).close()
        except OSError:  # stopping, or busy: the next round flushes
            pass


@pytest.fixture(scope="module")
def fleet():
    with ExitStack() as stack:
        # Not tmp_path: concurrent pytest sessions prune each other's numbered tmp dirs (harness.private_dir).
        tmp = stack.enter_context(private_dir("meshscope-remote-write-"))
        store, gpu_store = tmp / "store", tmp / "gpu-store"
        store.mkdir()
        gpu_store.mkdir()
        write_gpu_run(gpu_store)

        vm_port, prom_port, vmalert_port = _free_port(), _free_port(), _free_port()
        vm_url = f"http://127.0.0.1:{vm_port}"
        # -search.latencyOffset=0s: samples are queryable as soon as they are stored (default: 30 s later);
        # -search.disableCache: no cached query results of the seconds-old data this test looks at.
        vm = Server("victoria-metrics", ["victoria-metrics", f"-storageDataPath={tmp / 'vm-data'}",
                                         f"-httpListenAddr=127.0.0.1:{vm_port}", "-retentionPeriod=1d",
                                         "-search.latencyOffset=0s", "-search.disableCache"],
                    workdir=tmp, ready_url=f"{vm_url}/health")
        stack.callback(vm.stop)
        # VictoriaMetrics 1.79 makes a new series searchable only ~10 s after its first sample (its index
        # is flushed that often; new samples of a known series show within ~1 s). vmalert's chained
        # recording rules (rate -> median -> MAD -> robust z) each wait for the previous link's new series,
        # ~50 s before the last appears. /internal/force_flush makes them searchable at once; production
        # only sees that one-off delay when a run starts.
        flushing = threading.Event()
        flusher = threading.Thread(target=_force_flush, args=(vm_url, flushing), daemon=True)
        flusher.start()
        stack.callback(flusher.join, timeout=10)
        stack.callback(flushing.set)

        gpu_agent = Agent(AgentConfig(store=gpu_store, port=0, gpu_interval_s=1.0), clock=AnchoredClock(),
                          nvml=fake_nvml())
        gpu_port = stack.enter_context(agent_thread(gpu_agent))
        agent = AgentProcess(store, poll_interval=0.5)
        stack.callback(agent.stop, timeout_s=STOP_TIMEOUT_S)
        targets = [f"127.0.0.1:{agent.port}", f"127.0.0.1:{gpu_port}"]

        config = render_agent_config(tmp, targets=targets, write_url=f"{vm_url}/api/v1/write")
        prom = Server("prometheus", ["prometheus", "--enable-feature=agent", f"--config.file={config}",
                                     f"--storage.agent.path={tmp / 'agent-data'}",
                                     f"--web.listen-address=127.0.0.1:{prom_port}"],
                      workdir=tmp, ready_url=f"http://127.0.0.1:{prom_port}/-/ready")
        stack.callback(prom.stop)

        webhook = Webhook()  # vmalert posts Alertmanager's v2 API: a JSON list of alerts per request
        stack.callback(webhook.close)
        vmalert = Server("vmalert", ["vmalert", f"-rule={RULES}", f"-datasource.url={vm_url}",
                                     f"-remoteWrite.url={vm_url}", "-remoteWrite.flushInterval=1s",
                                     "-evaluationInterval=1s",
                                     # vmalert appends /api/v2/alerts; the webhook takes any path.
                                     f"-notifier.url={webhook.url.rsplit('/', 1)[0]}",
                                     f"-httpListenAddr=127.0.0.1:{vmalert_port}"],
                         workdir=tmp, ready_url=f"http://127.0.0.1:{vmalert_port}/health")
        stack.callback(vmalert.stop)

        job = Job(2, *TRAIN, "--store", str(store), log=tmp / "train.log")
        stack.callback(_stop_job, job)
        yield SimpleNamespace(tmp=tmp, job=job, agent=agent, gpu_url=f"http://127.0.0.1:{gpu_port}/metrics",
                              # Prometheus: a client of the Prometheus HTTP API, which both serve.
                              targets=targets, vm=Prometheus(vm_port), vmalert=Prometheus(vmalert_port),
                              webhook=webhook, logs=(vm, prom, vmalert), t0=time.time())


def _logs(fleet) -> str:
    return "\n".join(f"--- {s.name}\n{s.tail(1500)}" for s in fleet.logs) + f"\n--- train\n{fleet.job.tail(1500)}"


def _exposed(fleet) -> set[tuple[str, frozenset]]:
    """Every sample both agents expose now, with the labels Prometheus adds. NaN samples are left out:
    VictoriaMetrics 1.79 drops them on ingestion (a non-finite loss gauge never arrives)."""
    with urllib.request.urlopen(fleet.gpu_url, timeout=10) as resp:
        gpu = parse_metrics(resp.read().decode())
    out = set()
    for target, metrics in zip(fleet.targets, (fleet.agent.scrape(), gpu)):
        for s in metrics.samples:
            if not math.isnan(s.value):
                # An empty label value is no label (Prometheus drops it when it scrapes).
                labels = {**{k: v for k, v in s.labels.items() if v}, "__name__": s.name, "job": "meshscope",
                          "instance": target}
                out.add((s.name, frozenset(labels.items())))
    return out


def _stored(fleet) -> set[tuple[str, frozenset]]:
    series = fleet.vm._get("/api/v1/series", **{"match[]": '{job="meshscope"}', "start": f"{fleet.t0 - 60:.0f}"})
    return {(s["__name__"], frozenset(s.items())) for s in series}


def test_agent_config_is_valid_and_scrapes_like_prometheus_yml():
    cfg, scrape = yaml.safe_load(AGENT_CONFIG.read_text()), yaml.safe_load(SCRAPE_CONFIG.read_text())
    # The same job and discovery: the rules' job="meshscope" and the targets files apply unchanged.
    assert cfg["scrape_configs"] == scrape["scrape_configs"]
    assert not {"rule_files", "alerting", "remote_read"} & set(cfg), "agent mode rejects these"
    (write,) = cfg["remote_write"]
    assert write["url"] == "http://127.0.0.1:8428/api/v1/write"
    assert not write.get("write_relabel_configs"), "labels the rules match on must arrive as scraped"
    if shutil.which("promtool"):
        proc = subprocess.run(["promtool", "check", "config", "--agent", str(AGENT_CONFIG)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@servers
@pytest.mark.server
@pytest.mark.gloo
def test_every_catalog_metric_arrives_with_its_labels(fleet):
    poll_until(lambda: (fleet.agent.scrape().value("meshscope_rank_last_step", run=RUN) or 0) > NAN_STEP,
               timeout_s=90, interval_s=0.5, what=lambda: f"steps of {RUN}\n{_logs(fleet)}")
    # Every series the agents expose arrives, label for label: poll until the store holds a snapshot of
    # them (series an agent creates later, e.g. a new collective op, arrive later and are not awaited).
    exposed = _exposed(fleet)
    missing: set = set()

    def arrived() -> bool:
        nonlocal missing
        missing = exposed - _stored(fleet)
        return not missing
    poll_until(arrived, timeout_s=30, interval_s=1.0,
               what=lambda: f"{len(missing)} series in VictoriaMetrics, e.g. {sorted(missing)[:3]}\n{_logs(fleet)}")

    # Every catalog sample name exists here (the fake NVML supports XID events and ECC, the synthetic GPU
    # run has device memory, the pipeline run has collectives), each series with its catalog labels, and
    # each info label on some series.
    assert all(catalog.spec(name).when for name in NOT_PRODUCED)
    stored: dict[str, list[dict]] = {}
    for name, labels in _stored(fleet):
        stored.setdefault(name, []).append(dict(labels))
    for spec in catalog.CATALOG:
        for sample in set(spec.sample_names()) - set(NOT_PRODUCED):
            assert stored.get(sample), f"{sample} never arrived in VictoriaMetrics"
            required, allowed = _labels(spec, sample)
            for series in stored[sample]:
                assert required <= set(series) - {"__name__"} <= allowed, (sample, series)
            assert set(spec.info_labels) <= {k for series in stored[sample] for k in series}, sample
    assert {s["run"] for s in stored["meshscope_rank_steps_total"]} == {RUN, "gpu-node"}
    assert {s["instance"] for s in stored["meshscope_agent_info"]} == set(fleet.targets)


@servers
@pytest.mark.server
@pytest.mark.gloo
def test_every_panel_query_returns_data_from_victoriametrics(fleet):
    queries = {dashgen.substitute(expr, RATE_INTERVAL): (uid, title) for uid, title, expr in dashgen.panel_queries()}
    assert len(queries) >= 40
    empty = set(queries)

    def all_have_data() -> bool:
        nonlocal empty
        empty = {q for q in empty if not fleet.vm.query(q)}
        return not empty
    # Recording-rule panels (meshscope:...) need vmalert's results written back into VictoriaMetrics (each
    # link of a chain of recordings appears after the previous one: see the fixture's force_flush).
    poll_until(all_have_data, timeout_s=60, interval_s=1.0,
               what=lambda: "panels without data: " + "; ".join(f"{queries[q]}: {q}" for q in sorted(empty)))


@servers
@pytest.mark.server
@pytest.mark.gloo
def test_vmalert_evaluates_the_shipped_rules_and_fires(fleet):
    shipped = [r.get("record") or r["alert"] for r in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]]

    def evaluated() -> list[dict]:
        groups = fleet.vmalert._get("/api/v1/rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        # A rule not evaluated yet has the zero time as its last evaluation.
        return rules if all(not r["lastEvaluation"].startswith("0001") for r in rules) else []
    rules = poll_until(evaluated, timeout_s=30, interval_s=0.5, what=lambda: f"vmalert evaluations\n{_logs(fleet)}")
    assert [r["name"] for r in rules] == shipped  # one group, every rule, in order
    assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok" or r["lastError"]] == []

    def alerts() -> list[dict]:
        return fleet.vmalert._get("/api/v1/alerts")["alerts"] or []  # vmalert 1.79: null when there are none

    def nonfinite() -> list[dict]:
        return [a for a in alerts()
                if a["name"] == "MeshscopeNonFiniteLoss" and a["state"] == "firing" and a["labels"]["run"] == RUN]
    firing = poll_until(nonfinite, timeout_s=60, interval_s=0.5,
                        what=lambda: f"MeshscopeNonFiniteLoss firing for {RUN}\n{_logs(fleet)}")
    labels = firing[0]["labels"]
    assert labels["severity"] == "critical" and labels["job"] == "meshscope" and labels["rank"] in {"0", "1"}
    assert f"Run {RUN} produced a non-finite loss" in firing[0]["annotations"]["summary"]
    # Nothing else fires: the other shipped alerts have a `for:` longer than this test, or no cause here.
    assert {a["name"] for a in alerts() if a["state"] == "firing"} == {"MeshscopeNonFiniteLoss"}
    # Its cause in VictoriaMetrics: the injected step counted once (the NaN loss gauge itself never arrives).
    assert fleet.vm.value(f'max(meshscope_rank_nonfinite_loss_total{{run="{RUN}"}})') == 1
    # Delivered to the notifier, and the alert state written back into VictoriaMetrics as ALERTS.
    poll_until(lambda: any(a["labels"]["alertname"] == "MeshscopeNonFiniteLoss" and a["labels"]["run"] == RUN
                           for payload in list(fleet.webhook.payloads) for a in payload),
               timeout_s=30, interval_s=0.5, what="the notification at the webhook")
    stored = f'ALERTS{{alertname="MeshscopeNonFiniteLoss", alertstate="firing", run="{RUN}"}}'
    poll_until(lambda: fleet.vm.query(stored), timeout_s=30, interval_s=0.5, what="ALERTS in VictoriaMetrics")
