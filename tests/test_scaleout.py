"""Scale-out on loopback: one torchrun job over two "nodes" (two torchrun launchers, static rendezvous,
one rank each), each node with its own run store and its own meshscope agent, one real Prometheus
(``meshscope stack --agent A --agent B``) scraping both agents, and the dashboard reading both stores as
one run.

What it shows: each agent sees only its node's rank (a half-reporting run when looked at alone), while
Prometheus, summing over agents, and the dashboard, reading the union of the stores, see the whole job.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.harness import poll_until, terminate
import yaml

from meshscope.agent import stack
from meshscope.agent.store.reader import Store
from meshscope.dashboard import data, views
from tests.support.jobs import ROOT, trainer_env
from tests.support.harness import free_port as _free_port  # noqa: E402,F401

pytestmark = [
    pytest.mark.gloo,
    pytest.mark.server,
    pytest.mark.skipif(bool(stack.missing_binaries()[1]),
                       reason="prometheus / prometheus-alertmanager not installed "
                              "(Debian: apt-get install prometheus prometheus-alertmanager)"),
]
RUN, STEPS = "two-node", 12
TRAIN = ("--model", "tiny", "--device", "cpu", "--log-every", "1000", "--steps", str(STEPS), "--run-name", RUN)
SERVING = re.compile(r"serving http://127\.0\.0\.1:(\d+)/metrics")
RULES = ROOT / "grafana" / "prometheus" / "rules" / "meshscope.rules.yml"


class Lines:
    """A child's merged stdout/stderr, drained by a thread (a full pipe would block the child)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()

    def text(self) -> str:
        return "".join(self.lines)[-3000:]


def _popen(cmd: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=trainer_env(), stdin=subprocess.DEVNULL, **kw)


def _start_node(tmp: Path, *, node: int, master_port: int, store: Path) -> subprocess.Popen:
    """One node's torchrun (its own process group: ending it ends its rank too)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
           "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(master_port),
           "-m", "meshscope.trainer.train", *TRAIN, "--store", str(store)]
    with open(tmp / f"node{node}.log", "w") as log:
        return _popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _start_agent(store: Path) -> tuple[subprocess.Popen, Lines]:
    # --part-age 1: the store trails /metrics by about a second, so the dashboard check does not wait
    # for the default 30 s flush.
    cmd = [sys.executable, "-m", "meshscope.cli", "agent", "--store", str(store), "--port", "0",
           "--poll-interval", "0.5", "--gpu-interval", "0", "--part-age", "1"]
    proc = _popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, Lines(proc)


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The finished two-node job, its agents still serving, Prometheus having scraped both."""
    tmp = tmp_path_factory.mktemp("scaleout")
    stores = [tmp / "storeA", tmp / "storeB"]
    for s in stores:
        s.mkdir()
    nodes, agents, stack_proc = [], [], None
    t0 = time.monotonic()
    logs = lambda: "\n".join(  # noqa: E731 - the failure message, read when a wait fails
        [f"--- node{i}\n{(tmp / f'node{i}.log').read_text()[-2000:]}" for i in range(2)]
        + [f"--- agent {i}\n{lines.text()}" for i, (_, lines) in enumerate(agents)]
        + ([f"--- stack\n{stack_lines.text()}"] if stack_proc else []))
    try:
        master = _free_port()
        nodes = [_start_node(tmp, node=i, master_port=master, store=s) for i, s in enumerate(stores)]
        agents = [_start_agent(s) for s in stores]
        ports = []
        for proc, lines in agents:
            line = poll_until(lambda: next((m for m in map(SERVING.search, lines.lines) if m), None)
                              or proc.poll() is not None, timeout_s=30, what=lambda: "an agent to serve\n" + logs())
            assert proc.poll() is None, logs()
            ports.append(int(line.group(1)))
        prom_port = _free_port()
        stack_proc = _popen([sys.executable, "-m", "meshscope.cli", "stack",
                             *[arg for p in ports for arg in ("--agent", f"127.0.0.1:{p}")],
                             "--prometheus-port", str(prom_port), "--alertmanager-port", str(_free_port()),
                             "--dir", str(tmp / "stack"), "--interval", "1s"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        stack_lines = Lines(stack_proc)
        poll_until(lambda: "Ctrl-C stops everything" in stack_lines.text() or stack_proc.poll() is not None,
                   timeout_s=30, what=lambda: "meshscope stack to be ready\n" + logs())
        assert stack_proc.poll() is None, logs()
        poll_until(lambda: all(n.poll() is not None for n in nodes), timeout_s=150,
                   what=lambda: f"the two nodes to finish {STEPS} steps\n{logs()}")
        assert [n.returncode for n in nodes] == [0, 0], logs()
        # The agents ingest the last steps and Prometheus scrapes them (first scrape ~5 s after start).
        # The "end" event is each rank's last record (written when its telemetry closes, after the last
        # step), so it can reach Prometheus a scrape later than the last step: wait for both.
        done = f'meshscope_rank_last_step{{run="{RUN}"}} == {STEPS - 1}'
        ended = f'meshscope_run_events_total{{run="{RUN}", kind="end"}}'
        poll_until(lambda: len(query(prom_port, done)) == 2
                   and sum(float(s["value"][1]) for s in query(prom_port, ended)) == 2, timeout_s=30,
                   what=lambda: f"both ranks' last step and end in Prometheus\n{logs()}")
        both = Store.open_many(stores)

        def stored() -> bool:
            t = data.runs_table(both)
            return len(t) == 1 and t.loc[0, "ranks_stepping"] == 2 and t.loc[0, "steps"] == STEPS

        poll_until(stored, timeout_s=30, what=lambda: f"both stores to hold every step\n{logs()}")
        yield SimpleNamespace(stores=stores, agent_ports=ports, prom_port=prom_port, setup_s=time.monotonic() - t0)
    finally:
        for node in nodes:
            terminate(node, group=True, timeout_s=20)
        if stack_proc is not None:
            terminate(stack_proc, sig=signal.SIGINT, timeout_s=20)  # the stack stops Prometheus and Alertmanager itself
        for proc, _ in agents:
            terminate(proc, timeout_s=20)


def test_prometheus_sees_both_ranks_from_two_agents(job):
    port = job.prom_port
    series = poll_until(lambda: len(query(port, 'up{job="meshscope"} == 1')) == 2
                        and len(s := query(port, f'meshscope_rank_last_step{{run="{RUN}"}}')) == 2 and s,
                        timeout_s=30, what="both agents up and both ranks' series")
    by_rank = {s["metric"]["rank"]: s["metric"]["instance"] for s in series}
    assert by_rank == {"0": f"127.0.0.1:{job.agent_ports[0]}", "1": f"127.0.0.1:{job.agent_ports[1]}"}
    assert {float(s["value"][1]) for s in series} == {STEPS - 1}
    # Each agent alone sees half of the job...
    alone = query(port, f'meshscope_run_world_size{{run="{RUN}"}} - meshscope_run_ranks_reporting{{run="{RUN}"}}')
    assert sorted((s["metric"]["instance"], float(s["value"][1])) for s in alone) == sorted(
        (f"127.0.0.1:{p}", 1.0) for p in job.agent_ports)
    # ...and summed over agents the ranks reporting cover the world size.
    assert float(query(port, f'sum(meshscope_run_ranks_reporting{{run="{RUN}"}})')[0]["value"][1]) == 2
    assert float(query(port, f'max(meshscope_run_world_size{{run="{RUN}"}})')[0]["value"][1]) == 2
    assert float(query(port, f'sum(meshscope_rank_steps_total{{run="{RUN}"}})')[0]["value"][1]) == 2 * STEPS
    ends = query(port, f'sum(meshscope_run_events_total{{run="{RUN}", kind="end"}})')
    assert float(ends[0]["value"][1]) == 2
    # The shipped ranks-missing rule aggregates over agents: it finds nothing missing in this run.
    rules = yaml.safe_load(RULES.read_text())["groups"]
    missing = next(r["expr"] for g in rules for r in g["rules"] if r.get("alert") == "MeshscopeRanksMissing")
    assert [s for s in query(port, missing) if s["metric"].get("run") == RUN] == []


def test_the_dashboard_reads_both_stores_as_one_run(job):
    a, b = job.stores
    both = Store.open_many([a, b])
    assert both.runs() == [RUN]
    table = data.runs_table(both)
    row = table.iloc[0]
    assert (row["world_size"], row["ranks_started"], row["ranks_stepping"]) == (2, 2, 2)
    assert (row["first_step"], row["last_step"], row["steps"]) == (0, STEPS - 1, STEPS)
    # Each store alone holds its node's rank only.
    for store, rank in ((a, 0), (b, 1)):
        alone = Store.open(store).query("SELECT DISTINCT rank FROM step", kinds=("step",), runs=[RUN])
        assert alone["rank"].tolist() == [rank]
    view = views.overview(views.direct_loader(both), run=RUN, runs=[RUN], steps=None)
    assert view.series["step"].tolist() == list(range(STEPS)) and (view.series["ranks"] == 2).all()
    assert view.metrics["tokens_per_s"] > 0 and 0 < view.metrics["mfu"] < 1
    d = data.overview_data(both, run=RUN, runs=[RUN], steps=None)
    assert d["breakdown"]["rank"].tolist() == [0, 1] and (d["breakdown"]["steps"] == STEPS).all()
    coll = data.collective_rows(both, run=RUN, steps=None)
    assert set(coll["rank"]) == {0, 1} and set(coll["op"]) >= {"all_reduce"}
    # DDP's all-reduces pair up across the nodes: the same sequence numbers on both ranks.
    seqs = coll[coll["op"] == "all_reduce"].groupby("rank")["seq"].apply(set)
    assert seqs[0] == seqs[1] and len(seqs[0]) >= STEPS


def test_the_overview_page_over_both_stores(job, monkeypatch):
    from streamlit.testing.v1 import AppTest

    a, b = job.stores
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(a), "--store", str(b)])
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=60).run()
    assert not at.exception and not at.error
    caption = " ".join(str(c.value) for c in at.sidebar.caption)
    assert str(a.resolve()) in caption and str(b.resolve()) in caption
    runs = at.dataframe[0].value.set_index("run")
    assert runs.loc[RUN, "ranks with steps"] == 2 and runs.loc[RUN, "status"] == "ok"
    at.switch_page("app_pages/overview.py")
    at.run()
    assert not at.exception and not at.error, [str(e.value) for e in at.error]
    assert len(at.get("plotly_chart")) >= 4  # throughput, MFU, loss, per-rank breakdown, ...
    assert any(m.label == "tokens/s (median)" and m.value not in ("n/a", "nan") for m in at.metric)
