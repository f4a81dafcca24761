"""``meshscope demo`` (what ``make demo`` runs): every strategy instrumented, then the dashboard.

Starts a node agent on a store, runs short CPU jobs of the reference trainer for DDP, FSDP2, TP, PP
(1F1B and GPipe) and one 2-D layout (FSDP2×TP) with a progress bar per job, starts Prometheus and
Alertmanager when they are installed (``meshscope stack``), then serves the dashboard on 127.0.0.1 and
prints its URL. Ctrl-C or SIGTERM stops everything it started. Everything runs as child processes through
the ``meshscope`` command line, the way a user would run it, and every file it writes is under the store
(the stack's configs and data in ``<store>/stack``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from meshscope.agent.cliargs import ArgParser, UsageError, run_command

JOBS: list[tuple[str, int, list[str]]] = [
    ("ddp", 2, []),
    ("fsdp2", 2, ["--fsdp"]),
    ("tp", 2, ["--tp", "2"]),
    ("pp-1f1b", 2, ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"]),
    ("pp-gpipe", 2, ["--pp", "2", "--schedule", "gpipe", "--microbatches", "4"]),
    ("fsdp2xtp", 4, ["--fsdp", "--tp", "2"]),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshscope.cli", *args]


def run_job(name: str, nproc: int, extra: list[str], *, store: Path, steps: int, prefix: str,
            procs: list[subprocess.Popen]) -> bool:
    """One training job with a progress bar; the job is in ``procs`` while it runs, so a signal stops it."""
    cmd = _cli("train", "--nproc", str(nproc), "--steps", str(steps), "--store", str(store),
               "--run", f"{prefix}-{name}", *extra)
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    procs.append(proc)
    with tqdm(total=steps, desc=f"  {name:<9}", unit="step", file=sys.stdout, dynamic_ncols=True) as bar:
        for line in proc.stdout:
            if line.startswith("step="):
                fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
                bar.update(int(fields["step"]) + 1 - bar.n)
                bar.set_postfix_str(f"loss {float(fields['loss']):.3f}")
        err = proc.stderr.read()
        ok = proc.wait() == 0
        if not ok:
            bar.set_postfix_str("FAILED")
    procs.remove(proc)
    if not ok:
        print(err[-2000:], file=sys.stderr)
    return ok


def _wait_http(url: str, *, timeout_s: float) -> bool:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(0.3)
    return False


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in reversed(procs):
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = ArgParser(prog="meshscope demo", description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=".runs/demo", help="run store (default .runs/demo)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--port", type=int, default=8501, help="dashboard port")
    ap.add_argument("--no-serve", action="store_true", help="run the jobs, print the summary, exit")
    return run_command(prog="meshscope demo", parser=ap, argv=argv, body=_demo)


def _demo(ns: argparse.Namespace) -> int:
    if ns.steps < 1:
        raise UsageError(f"--steps={ns.steps} must be >= 1")
    t0 = time.monotonic()
    store = Path(ns.store)
    store.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    # SIGTERM (kill, a container stop) stops everything the way Ctrl-C does: through the finally below.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        agent_port = _free_port()
        agent = subprocess.Popen(_cli("agent", "--store", str(store), "--port", str(agent_port),
                                      "--poll-interval", "0.5"), env=_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(agent)
        print(f"meshscope demo: agent on http://127.0.0.1:{agent_port}/metrics, store {store}")
        prom_url = None
        if shutil.which("prometheus") and shutil.which("prometheus-alertmanager"):
            prom_port = _free_port()
            prom_url = f"http://127.0.0.1:{prom_port}"
            stack = subprocess.Popen(_cli("stack", "--agent", f"127.0.0.1:{agent_port}", "--interval", "5s",
                                          "--prometheus-port", str(prom_port),
                                          "--alertmanager-port", str(_free_port()),
                                          "--dir", str(store / "stack")),
                                     env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
            procs.append(stack)
            print(f"meshscope demo: Prometheus on {prom_url} + Alertmanager (meshscope stack)")
        else:
            print("meshscope demo: Prometheus/Alertmanager not installed: live metrics and alerts skipped "
                  "(apt-get install prometheus prometheus-alertmanager)")
        prefix = f"demo-{time.strftime('%H%M%S')}"
        print(f"meshscope demo: training {len(JOBS)} jobs ({ns.steps} steps each, CPU/gloo):")
        failed = [name for name, nproc, extra in JOBS
                  if not run_job(name, nproc, extra, store=store, steps=ns.steps, prefix=prefix, procs=procs)]
        if failed:
            print(f"meshscope demo: error: job(s) failed: {', '.join(failed)}", file=sys.stderr)
            return 1
        if ns.no_serve:
            return 0
        dash = subprocess.Popen(_cli("dashboard", "--store", str(store), "--port", str(ns.port),
                                     *(["--prometheus", prom_url] if prom_url else [])),
                                env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        procs.append(dash)
        url = f"http://127.0.0.1:{ns.port}"
        if not _wait_http(f"{url}/_stcore/health", timeout_s=60):
            print("meshscope demo: error: the dashboard did not come up", file=sys.stderr)
            return 1
        print(f"\nmeshscope demo: dashboard ready at {url}  (time to served dashboard: "
              f"{time.monotonic() - t0:.0f}s). Ctrl-C stops everything.")
        while all(p.poll() is None for p in procs):
            time.sleep(1.0)
        return 0
    except KeyboardInterrupt:
        print("\nmeshscope demo: stopping")
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        _stop(procs)
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
