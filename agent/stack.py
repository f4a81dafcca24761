"""``meshscope stack``: Prometheus and Alertmanager on 127.0.0.1 with meshscope's configs, pointed at the
local agent(s).

    meshscope stack [--store DIR] [--agent HOST:PORT ...] [--agent-port 9477]
                    [--prometheus-port 9090] [--alertmanager-port 9093] [--dir WORKDIR]
                    [--interval 15s] [--rules FILE] [--webhook URL] [--group-wait 30s]

``--store`` also starts a node agent over that store (on ``--agent-port``); each ``--agent`` adds an agent
that already runs (a multi-node job lists all of its agents). The configs under ``grafana/`` are rendered
into WORKDIR (default ``./.meshscope-stack``) with the ports, intervals and paths of this invocation;
Prometheus discovers the agents through a file_sd targets file there, and runs with exemplar storage on.
Ctrl-C (or SIGTERM) stops exactly the processes this command started. Bad input and missing Debian
packages give one error line and exit status 2. Grafana is not started (no Debian package): provision it
from ``grafana/provisioning`` (see grafana/README.md).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

import meshscope.grafana
from meshscope.agent.cliargs import ArgParser, UsageError

# The shipped configs: the checkout's grafana/ folder, installed as package data (meshscope.grafana).
GRAFANA = Path(meshscope.grafana.__file__).resolve().parent
PROMETHEUS_CONFIG = GRAFANA / "prometheus" / "prometheus.yml"
ALERTMANAGER_CONFIG = GRAFANA / "alertmanager" / "alertmanager.yml"
DEFAULT_RULES = GRAFANA / "prometheus" / "rules" / "meshscope.rules.yml"
HOST = "127.0.0.1"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_DURATION = re.compile(r"^[1-9][0-9]*(ms|s|m|h)$")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="meshscope stack", description="Run Prometheus + Alertmanager (+ an agent) locally.")
    p.add_argument("--store", type=Path, help="run store: also start a node agent over it")
    p.add_argument("--agent", action="append", default=[], metavar="HOST:PORT",
                   help="an agent that already runs (repeatable)")
    p.add_argument("--agent-port", type=int, default=9477, help="port of the agent started for --store")
    p.add_argument("--prometheus-port", type=int, default=9090)
    p.add_argument("--alertmanager-port", type=int, default=9093)
    p.add_argument("--dir", type=Path, default=Path(".meshscope-stack"), metavar="WORKDIR",
                   help="rendered configs, data and logs (default ./.meshscope-stack)")
    p.add_argument("--interval", default="15s", help="scrape and rule evaluation interval (default 15s)")
    p.add_argument("--rules", type=Path, default=DEFAULT_RULES, help="Prometheus rule file to load")
    p.add_argument("--webhook", help="URL the Alertmanager webhook receiver posts to")
    p.add_argument("--group-wait", help="Alertmanager group_wait for every route (default: the config's)")
    return p


def duration_s(text: str) -> float:
    m = _DURATION.match(text)
    if not m:
        raise UsageError(f"duration {text!r} must look like 500ms, 1s, 15s, 2m or 1h")
    return float(text[: -len(m.group(1))]) * _SECONDS[m.group(1)]


def _host_port(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--agent {text!r} must be HOST:PORT (e.g. 127.0.0.1:9477)")
    return text


def _port(flag: str, port: int) -> int:
    """A free port on 127.0.0.1 (0 picks one)."""
    if not 0 <= port < 65536:
        raise UsageError(f"{flag} {port} must be in 0..65535")
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            raise UsageError(f"{flag} {port}: {HOST}:{port} is in use") from None
        return s.getsockname()[1]


def missing_binaries() -> tuple[dict[str, str], list[str]]:
    """({role: path}, [missing package names])."""
    found, missing = {}, []
    for role, names, package in (("prometheus", ("prometheus",), "prometheus"),
                                 ("alertmanager", ("prometheus-alertmanager", "alertmanager"),
                                  "prometheus-alertmanager")):
        path = next((p for p in map(shutil.which, names) if p), None)
        if path:
            found[role] = path
        else:
            missing.append(package)
    return found, missing


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything validated: what to start and where."""
    workdir: Path
    store: Path | None
    agents: tuple[str, ...]  # all scrape targets, the started agent's first
    agent_port: int | None
    prometheus_port: int
    alertmanager_port: int
    interval: str
    rules: Path
    webhook: str | None
    group_wait: str | None
    binaries: dict[str, str]


def plan(argv: list[str] | None) -> Plan:
    args = _parser().parse_args(argv)
    if args.store is None and not args.agent:
        raise UsageError("nothing to scrape: give --store DIR (starts an agent) and/or --agent HOST:PORT")
    if args.store is not None and not args.store.is_dir():
        raise UsageError(f"store directory {str(args.store)!r} does not exist")
    agents = [_host_port(a) for a in args.agent]
    duration_s(args.interval)
    if args.group_wait is not None:
        duration_s(args.group_wait)
    if not args.rules.is_file():
        raise UsageError(f"rule file {str(args.rules)!r} does not exist")
    if args.webhook is not None and not re.match(r"^https?://[^/\s]+", args.webhook):
        raise UsageError(f"--webhook {args.webhook!r} must be an http(s) URL")
    for path in (PROMETHEUS_CONFIG, ALERTMANAGER_CONFIG):
        if not path.is_file():
            raise UsageError(f"{path} is missing (meshscope stack runs from a source checkout)")
    binaries, missing = missing_binaries()
    if missing:
        raise UsageError(f"not installed: {', '.join(missing)} (Debian: apt-get install {' '.join(missing)})")
    agent_port = _port("--agent-port", args.agent_port) if args.store is not None else None
    if agent_port is not None:
        agents.insert(0, f"{HOST}:{agent_port}")
    prometheus_port = _port("--prometheus-port", args.prometheus_port)
    alertmanager_port = _port("--alertmanager-port", args.alertmanager_port)
    if len({agent_port, prometheus_port, alertmanager_port} - {None}) < 2 + (agent_port is not None):
        raise UsageError("--agent-port, --prometheus-port and --alertmanager-port must differ")
    return Plan(workdir=args.dir.resolve(), store=args.store.resolve() if args.store else None,
                agents=tuple(agents), agent_port=agent_port, prometheus_port=prometheus_port,
                alertmanager_port=alertmanager_port, interval=args.interval, rules=args.rules.resolve(),
                webhook=args.webhook, group_wait=args.group_wait, binaries=binaries)


def render_configs(p: Plan) -> tuple[Path, Path]:
    """Write prometheus.yml, targets/agents.yml and alertmanager.yml into the work directory."""
    (p.workdir / "targets").mkdir(parents=True, exist_ok=True)
    prom = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    g = prom["global"]
    g["scrape_interval"] = g["evaluation_interval"] = p.interval
    # Prometheus rejects a scrape timeout longer than the interval.
    if duration_s(p.interval) < duration_s(g.get("scrape_timeout", "10s")):
        g["scrape_timeout"] = p.interval
    prom["rule_files"] = [str(p.rules)]
    prom["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [f"{HOST}:{p.alertmanager_port}"]}]}]
    for job in prom["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(p.workdir / "targets" / "*.yml")]
    (p.workdir / "targets" / "agents.yml").write_text(yaml.safe_dump([{"targets": list(p.agents)}]))
    prom_path = p.workdir / "prometheus.yml"
    prom_path.write_text(yaml.safe_dump(prom, sort_keys=False))

    am = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    if p.webhook:
        for receiver in am["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = p.webhook
    if p.group_wait:
        routes = [am["route"]]
        while routes:
            route = routes.pop()
            if route is am["route"] or "group_wait" in route:
                route["group_wait"] = p.group_wait
            routes.extend(route.get("routes", []))
    am_path = p.workdir / "alertmanager.yml"
    am_path.write_text(yaml.safe_dump(am, sort_keys=False))
    return prom_path, am_path


def commands(p: Plan, prom_cfg: Path, am_cfg: Path) -> list[tuple[str, list[str], str]]:
    """(name, argv, readiness URL) of each process to start, in start order."""
    out = []
    if p.store is not None:
        out.append(("agent", [sys.executable, "-m", "meshscope.agent.collector.cli", "--store", str(p.store),
                              "--host", HOST, "--port", str(p.agent_port)],
                    f"http://{HOST}:{p.agent_port}/metrics"))
    out.append(("alertmanager", [p.binaries["alertmanager"], f"--config.file={am_cfg}",
                                 f"--storage.path={p.workdir / 'alertmanager-data'}",
                                 f"--web.listen-address={HOST}:{p.alertmanager_port}", "--cluster.listen-address="],
                f"http://{HOST}:{p.alertmanager_port}/-/ready"))
    out.append(("prometheus", [p.binaries["prometheus"], f"--config.file={prom_cfg}",
                               f"--storage.tsdb.path={p.workdir / 'prometheus-data'}",
                               f"--web.listen-address={HOST}:{p.prometheus_port}",
                               "--enable-feature=exemplar-storage"],
                f"http://{HOST}:{p.prometheus_port}/-/ready"))
    return out


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


class Processes:
    """The children this command started; ``stop`` ends exactly those (by their own pid)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.running: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, name: str, argv: list[str]) -> None:
        log = self.workdir / f"{name}.log"
        env = dict(os.environ)
        with open(log, "wb") as fh:
            # Own session: the terminal's Ctrl-C reaches only us, and we stop the children in order.
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        self.running.append((name, proc, log))

    def wait_ready(self, name: str, url: str, *, timeout_s: float = READY_TIMEOUT_S) -> str | None:
        """None when ready, else why not."""
        _, proc, log = next(item for item in self.running if item[0] == name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"{name} exited with status {proc.returncode}: {_log_tail(log)}"
            if _ready(url):
                return None
            time.sleep(0.1)
        return f"{name} not ready after {timeout_s:.0f}s (log: {log})"

    def dead(self) -> str | None:
        for name, proc, log in self.running:
            if proc.poll() is not None:
                return f"{name} exited with status {proc.returncode}: {_log_tail(log)}"
        return None

    def stop(self) -> None:
        for _, proc, _ in reversed(self.running):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for _, proc, _ in reversed(self.running):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    prog = "meshscope stack"
    try:
        p = plan(argv)
        p.workdir.mkdir(parents=True, exist_ok=True)
        prom_cfg, am_cfg = render_configs(p)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{prog}: error: cannot write the work directory {str(p.workdir)!r}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    procs = Processes(p.workdir)
    try:
        for name, argv_, url in commands(p, prom_cfg, am_cfg):
            procs.start(name, argv_)
            problem = procs.wait_ready(name, url)
            if problem:
                print(f"{prog}: error: {problem}", file=sys.stderr)
                return 1
        if p.store is not None:
            print(f"{prog}: agent        http://{HOST}:{p.agent_port}/metrics (store {p.store})")
        print(f"{prog}: prometheus   http://{HOST}:{p.prometheus_port} (scraping {', '.join(p.agents)})")
        print(f"{prog}: alertmanager http://{HOST}:{p.alertmanager_port}"
              + (f" (webhook {p.webhook})" if p.webhook else ""))
        print(f"{prog}: grafana      not started; provision it from {GRAFANA / 'provisioning'}")
        print(f"{prog}: configs, data and logs in {p.workdir}; Ctrl-C stops everything", flush=True)
        while not stop.wait(0.5):
            problem = procs.dead()
            if problem:
                print(f"{prog}: error: {problem}", file=sys.stderr)
                return 1
        return 0
    finally:
        procs.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
