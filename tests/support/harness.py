"""Harness of the fault tests (``tests/test_faults_*.py``): real agent and torchrun processes, bounded waits.

- :class:`AgentProcess`: ``meshscope agent`` as a child process (port 0, its URL read from its first
  stdout line), /metrics parsed into samples, signals, RSS.
- :class:`Job`: a torchrun job of the reference trainer in its own session, so that killing it takes its
  ranks too (killing torchrun alone orphans them).
- :func:`spool_truth`: every record the ranks wrote, read straight from their spool files with the
  transport's own reader: the ground truth a store is compared with (rank and attempt from each file's
  header, so re-executed steps of a restarted run stay apart).
- :func:`poll_until`: a condition with a deadline; never a fixed sleep where a condition exists.
- :func:`private_dir`: the fault tests' temporary directories (see there why not ``tmp_path``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pandas as pd
import psutil
import pyarrow as pa
from prometheus_client.parser import text_string_to_metric_families

from meshscope.agent.store.reader import read_table
from meshscope.agent.contract import KINDS, SCHEMAS, SPOOL_NAME
from meshscope.agent.contract.storelayout import StoreLayout
from meshscope.agent.transport.reader import SpoolReader

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def env() -> dict[str, str]:
    out = dict(os.environ)
    out.setdefault("OMP_NUM_THREADS", "1")
    out["PYTHONUNBUFFERED"] = "1"
    return out


@contextmanager
def private_dir(prefix: str = "meshscope-faults-") -> Iterator[Path]:
    """A temporary directory outside ``/tmp/pytest-of-<user>``, removed afterwards.

    Where several pytest sessions run at once on one machine (engineers sharing a checkout), each new
    session removes the older numbered ``pytest-N`` directories beyond the newest three, files of a
    still-running test included: a spool deleted under a running rank was seen here. The fault tests run
    real jobs for tens of seconds, so they keep their files apart."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield d
    finally:
        if not os.environ.get("MESHSCOPE_KEEP_DIRS"):  # set it to keep a failed run's store for a post-mortem
            shutil.rmtree(d, ignore_errors=True)


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on right now (the kernel's pick)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_until(predicate: Callable[[], T], *, timeout_s: float, interval_s: float = 0.1,
               what: str | Callable[[], str] = "") -> T:
    """Call ``predicate`` until it returns something truthy (returned), failing after ``timeout_s``
    (``what``, or what it returns, says what was awaited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout_s:.0f} s: {(what() if callable(what) else what) or predicate}")
        time.sleep(interval_s)


# ------------------------------------------------------------------------------------------------- agent

def terminate(proc: subprocess.Popen, *, timeout_s: float = 10.0, group: bool = False,
              sig: int = signal.SIGTERM) -> None:
    """``sig`` (SIGTERM), then SIGKILL if it has not exited within ``timeout_s``; reaped either way.
    ``group``: to its process group (a child started with ``start_new_session=True``: torchrun and its
    ranks, Streamlit and what it started), not only to it; when it has already exited, SIGKILL to what is
    left of its group."""
    def send(s: int) -> None:
        try:
            os.killpg(proc.pid, s) if group else proc.send_signal(s)
        except ProcessLookupError:  # exited meanwhile
            pass

    if proc.poll() is not None:
        if group:  # the leader is gone: what it started in its group may not be (ranks, servers)
            send(signal.SIGKILL)
        return
    send(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(timeout=timeout_s)


@contextmanager
def agent_thread(agent) -> Iterator[int]:
    """An in-process ``Agent`` serving /metrics and polling on a thread of its own; yields its port, and
    stops and closes it on exit."""
    port = agent.serve()
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join(timeout=10)
        agent.close()


@dataclass
class Metrics:
    """One scrape: ``value(name, **labels)`` for a sample, ``by(name, label)`` for a label -> value map."""

    samples: list  # prometheus_client Sample(name, labels, value, ...)
    text: str

    def value(self, name: str, **labels: str) -> float | None:
        for s in self.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        return None

    def by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        return {s.labels[label]: s.value for s in self.samples
                if s.name == name and label in s.labels and all(s.labels.get(k) == v for k, v in labels.items())}


def parse_metrics(text: str) -> Metrics:
    return Metrics([s for fam in text_string_to_metric_families(text) for s in fam.samples], text)


class AgentProcess:
    """``meshscope agent --store STORE --port 0 --gpu-interval 0 *extra`` as a child process."""

    def __init__(self, store: Path, *extra: str, poll_interval: float = 0.2, preexec_fn=None,
                 ssl_context: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None) -> None:
        self.store = Path(store)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshscope.cli", "agent", "--store", str(store), "--port", "0",
             "--poll-interval", str(poll_interval), "--gpu-interval", "0", *extra],
            cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
        # stderr is drained all the time: an agent blocked writing to a full pipe (Arrow prints warnings
        # from C++) would stall with its state lock held, and every scrape with it.
        self._err: list[str] = []
        self._drainer = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drainer.start()
        line = self.proc.stdout.readline()  # "meshscope agent: serving http://127.0.0.1:PORT/metrics, ..."
        if "serving " not in line:
            self.proc.kill()
            self.proc.wait(timeout=20)
            self._drainer.join(timeout=10)
            raise AssertionError(f"agent did not start: {line!r} {''.join(self._err)}")
        self.url = line.split("serving ")[1].split(",")[0]
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        self.ssl_context = ssl_context
        self.auth = auth
        self.stderr = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def scrape(self, *, timeout_s: float = 10.0) -> Metrics:
        req = urllib.request.Request(self.url)
        if self.auth is not None:
            import base64

            token = base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        with urllib.request.urlopen(req, timeout=timeout_s, context=self.ssl_context) as resp:
            return parse_metrics(resp.read().decode())

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=20)
        self._drain()

    def stop(self, *, timeout_s: float = 60.0) -> int:
        """SIGTERM (the agent writes what it buffered to the store) and wait; returns the exit status."""
        self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.alive():
                self.proc.kill()
                self.proc.wait(timeout=20)
            self._drain()

    def rss_bytes(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def cpu_seconds(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def _drain_stderr(self) -> None:
        for line in iter(self.proc.stderr.readline, ""):
            if len(self._err) < 10_000:
                self._err.append(line)

    def _drain(self) -> None:
        self._drainer.join(timeout=10)
        self.stderr = "".join(self._err)


def committed_bytes(store: Path) -> int:
    """Spool bytes the agent has durably committed to the store (sum of its saved offsets)."""
    try:
        files = json.loads(Path(StoreLayout.of(store).offsets).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return 0
    return sum(entry["offset"] for entry in files.values())


# --------------------------------------------------------------------------------------------------- job

class Job:
    """``torchrun --standalone --nproc_per_node=N [torchrun_args] <target> *args`` in its own session.

    ``target`` is ``-m meshscope.trainer.train`` by default, or a script path (``tests/workers/faults_train.py``).
    Rank 0 prints ``step=N ...`` lines (``--log-every``) to ``stdout_path``.
    """

    def __init__(self, nproc: int, *args: str, log: Path, torchrun_args: tuple[str, ...] = (),
                 script: str | None = None, preexec_fn=None, extra_env: dict[str, str] | None = None) -> None:
        target = [script] if script else ["-m", "meshscope.trainer.train"]
        self.log = Path(log)
        self._out = open(self.log, "w")
        # Output goes through a pipe that this process copies to the log: a rank whose file writes fail
        # (a full disk, RLIMIT_FSIZE) can still print.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
             *torchrun_args, *target, *map(str, args)],
            cwd=ROOT, env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec_fn)
        self._copier = threading.Thread(target=self._copy, daemon=True)
        self._copier.start()

    def _copy(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self._out.write(line.decode(errors="replace"))
            self._out.flush()
        self._out.close()

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, *, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
            self._copier.join(timeout=10)  # the last lines
            return code
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not finish within {timeout_s:.0f} s:\n{self.tail()}") from None

    def kill(self) -> None:
        """SIGKILL torchrun and every rank.

        torch 2.13's elastic agent starts each worker with ``start_new_session=True``: the ranks are NOT in
        torchrun's process group, so ``os.killpg(torchrun)`` alone leaves them running (orphaned, and a
        hung one for ever). Snapshot the tree first, then kill torchrun's group and each rank's group."""
        tree = self.ranks()
        groups = {self.proc.pid}
        for p in tree:
            try:
                groups.add(os.getpgid(p.pid))
            except ProcessLookupError:
                pass
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)
        psutil.wait_procs(tree, timeout=30)
        self._copier.join(timeout=10)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP every rank (and torchrun) for the block, SIGCONT after: time spent in the block is not
        spent in training steps."""
        tree = [psutil.Process(self.proc.pid), *self.ranks()] if self.running() else []
        for p in tree:
            try:
                p.suspend()
            except psutil.NoSuchProcess:
                pass
        try:
            yield
        finally:
            for p in tree:
                try:
                    p.resume()
                except psutil.NoSuchProcess:
                    pass

    def ranks(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def printed_steps(self) -> list[int]:
        steps = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("step="):
                steps.append(int(line.split()[0].split("=")[1]))
        return steps

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


# ---------------------------------------------------------------------------------------- ground truth

def spool_files(store: Path, run: str) -> list[Path]:
    d = Path(StoreLayout.of(store).spool) / run
    return sorted(p for p in d.iterdir() if SPOOL_NAME.match(p.name)) if d.is_dir() else []


def spool_sizes_of(store: Path, run: str) -> dict[str, int]:
    return {p.name: os.stat(p).st_size for p in spool_files(store, run)}


def spool_truth(store: Path, run: str) -> dict[str, pd.DataFrame]:
    """Every record in the run's spool files, per kind, with ``rank`` and ``attempt`` columns (from each
    file's header) and ``run``. Complete frames only: a frame still being written is not a record yet."""
    tables: dict[str, list[pa.Table]] = {kind: [] for kind in KINDS}
    for path in spool_files(store, run):
        reader = SpoolReader(path, max_read_bytes=1 << 30)
        res = reader.read(0)
        header = next(f.header for f in res.frames if f.header is not None)
        for frame in res.frames:
            if frame.table is None:
                continue
            t = frame.table
            if "attempt" not in t.column_names:  # (``run`` records carry it themselves)
                t = t.append_column("attempt", pa.array([header["attempt"]] * t.num_rows, pa.int32()))
            if "rank" not in t.column_names:
                t = t.append_column("rank", pa.array([header["rank"]] * t.num_rows, pa.int32()))
            tables[frame.kind].append(t)
    out = {}
    for kind, parts in tables.items():
        if parts:
            df = pa.concat_tables(parts).to_pandas()
        else:
            df = SCHEMAS[kind].empty_table().to_pandas()
            if "attempt" not in df:
                df["attempt"] = pd.Series(dtype="int32")
            if "rank" not in df:
                df["rank"] = pd.Series(dtype="int32")
        df["run"] = run
        out[kind] = df
    return out


def canonical(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Rows as a sorted, index-free frame of ``columns`` (for multiset comparison)."""
    return df[columns].sort_values(columns, kind="stable").reset_index(drop=True)


def compare_store_to_truth(store: Path, run: str, truth: dict[str, pd.DataFrame]) -> dict[str, dict[str, int]]:
    """Per kind: records in the spools, in the store, lost (in spools, not in store) and duplicated (in the
    store more often than in the spools), matching whole rows. Attempt is not a stored column, so rows are
    compared without it. Every stored row counts (``all_attempts``): this checks what the agent wrote, not
    the reader's newest-attempt view of a restarted run."""
    report = {}
    for kind in KINDS:
        if kind == "gpu":
            continue
        stored = read_table(store, kind, run=run, all_attempts=True)
        want = truth[kind]
        cols = [c for c in SCHEMAS[kind].names if c != "rank"] + ["rank"]
        key = lambda df: _row_keys(df[cols]).value_counts()  # noqa: E731
        a, b = (key(want) if len(want) else pd.Series(dtype=int)), (key(stored) if len(stored) else pd.Series(dtype=int))
        joined = pd.concat([a.rename("spool"), b.rename("store")], axis=1).fillna(0)
        report[kind] = {
            "spool": int(joined["spool"].sum()), "store": int(joined["store"].sum()),
            "lost": int((joined["spool"] - joined["store"]).clip(lower=0).sum()),
            "duplicated": int((joined["store"] - joined["spool"]).clip(lower=0).sum()),
        }
    return report


def _row_keys(df: pd.DataFrame) -> pd.Series:
    """One string per row, equal for equal rows (NaN included; int32 vs int64 alike)."""
    text = [df[c].astype(object).map(str) for c in df.columns]
    out = text[0]
    for col in text[1:]:
        out = out + "\x1f" + col
    return out


def newest_attempt(step: pd.DataFrame, run: pd.DataFrame) -> pd.DataFrame:
    """An independent statement of the rule for restarted runs, to check the store reader's by: attribute
    each step record to the attempt whose ``run`` record (same rank) started last before it (an as-of join
    on ``t_start``), then keep, per (rank, step), the record of the newest attempt. Works on every stored
    record (``read_table(..., all_attempts=True)``; there is no attempt column)."""
    starts = run[["rank", "attempt", "t_start"]].rename(columns={"t_start": "attempt_start"})
    starts = starts.sort_values("attempt_start")
    s = step.sort_values("t_start")
    tagged = pd.merge_asof(s, starts, left_on="t_start", right_on="attempt_start", by="rank",
                           direction="backward")
    tagged = tagged.sort_values(["rank", "step", "attempt"])
    return tagged.drop_duplicates(["rank", "step"], keep="last").reset_index(drop=True)


def self_signed(directory: Path, *, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed certificate for ``host`` (IP SAN) and its key, as PEM files (``cryptography``)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = Path(directory) / "cert.pem", Path(directory) / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
