"""Security of the agent's endpoint and of the dashboard's file access.

- The agent and the dashboard bind 127.0.0.1 by default (listening sockets of the real processes).
- /metrics over TLS with HTTP basic auth (``--tls-cert/--tls-key``, ``--basic-auth-file``): a
  self-signed certificate made in the test, 401 with ``WWW-Authenticate`` without or with wrong
  credentials, and a real Prometheus scraping it with ``tls_config`` + ``basic_auth``.
- Bad TLS / auth files are one-line usage errors (exit 2) before anything binds.
- The store reader's access (the dashboard's, export-trace's) stays under the store root: run names like
  ``../../etc``, symlinks out of the store at every level.
- ``agent.security.promql_label_value`` makes any string a PromQL literal that Prometheus parses back to
  the same value (quotes, backslashes, newlines, control characters, Unicode).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshscope.agent.collector.cli import agent_main
from meshscope.agent.security import Credentials, hash_password, promql_label_value, promql_regex_value, verify_password
from tests.support.harness import (
    ROOT, AgentProcess, env, free_port, parse_metrics, poll_until, private_dir, self_signed,
)

USER, PASSWORD = "prometheus", "s3cret:with colon ü"


@pytest.fixture
def tmp_path():
    """Not pytest's (concurrent sessions on this machine clean each other's): see harness.private_dir."""
    with private_dir() as d:
        yield d


def listening_ips(pid: int) -> set[str]:
    """Addresses the process tree of ``pid`` listens on (TCP)."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    out = set()
    for p in procs:
        try:
            out |= {c.laddr.ip for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def secured(tmp_path):
    """An agent serving /metrics over TLS with basic auth; yields (agent, CA context, certificate path)."""
    cert, key = self_signed(tmp_path)
    auth = tmp_path / "web-users"
    auth.write_text(f"# meshscope agent users\n{USER}:{hash_password(PASSWORD, rounds=20_000)}\n")
    ctx = ssl.create_default_context(cafile=str(cert))
    store = tmp_path / "store"
    store.mkdir()
    agent = AgentProcess(store, "--tls-cert", str(cert), "--tls-key", str(key), "--basic-auth-file", str(auth),
                         ssl_context=ctx, auth=(USER, PASSWORD))
    try:
        yield agent, ctx, cert
    finally:
        agent.stop()
        agent.kill()


# ------------------------------------------------------------------------------------------ binding

def test_agent_binds_localhost_by_default(tmp_path):
    agent = AgentProcess(tmp_path)
    try:
        assert listening_ips(agent.pid) == {"127.0.0.1"}
        assert agent.url.startswith("http://127.0.0.1:")
    finally:
        agent.stop()
        agent.kill()


def test_dashboard_binds_localhost_by_default(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "meshscope.cli", "dashboard", "--store", str(tmp_path),
                             "--port", str(port)], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        poll_until(lambda: listening_ips(proc.pid), timeout_s=90, interval_s=0.5, what="the dashboard listens")
        time.sleep(1.0)  # every listener up (Streamlit may open more than one)
        ips = listening_ips(proc.pid)
        assert ips == {"127.0.0.1"}, ips
    finally:
        tree = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        os.killpg(proc.pid, signal.SIGTERM)
        psutil.wait_procs(tree, timeout=20)
        for p in tree:
            if p.is_running():
                p.kill()
        proc.wait(timeout=20)


# ------------------------------------------------------------------------------------- TLS and auth

def _get(url: str, *, ctx: ssl.SSLContext | None, auth: tuple[str, str] | None = None):
    req = urllib.request.Request(url)
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


def test_metrics_need_tls_and_basic_auth_when_configured(secured):
    agent, ctx, _ = secured
    assert agent.url.startswith("https://127.0.0.1:")
    assert listening_ips(agent.pid) == {"127.0.0.1"}
    url = agent.url
    for auth in (None, (USER, "wrong"), ("nobody", PASSWORD), (USER, "")):
        status, headers, body = _get(url, ctx=ctx, auth=auth)
        assert status == 401, auth
        assert headers["WWW-Authenticate"] == 'Basic realm="meshscope", charset="UTF-8"'
        assert "meshscope_" not in body
    # A malformed Authorization header is a 401 too, not a 500.
    req = urllib.request.Request(url, headers={"Authorization": "Basic !!!notbase64"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10, context=ctx)
    assert err.value.code == 401
    status, _, body = _get(url, ctx=ctx, auth=(USER, PASSWORD))
    assert status == 200 and parse_metrics(body).value("meshscope_agent_runs") == 0
    # Plain HTTP on the TLS port gets no metrics.
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(url.replace("https://", "http://"), timeout=5).read()
    # And a client that does not trust the certificate refuses it.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5, context=ssl.create_default_context())
    assert agent.alive()


@pytest.mark.server
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (make install-servers)")
def test_prometheus_scrapes_the_agent_over_tls_with_basic_auth(secured, tmp_path):
    agent, _, cert = secured
    (tmp_path / "password").write_text(PASSWORD)
    (tmp_path / "wrong").write_text("nope")
    jobs = []
    for job, password_file in (("meshscope", "password"), ("meshscope-wrong-password", "wrong")):
        jobs.append(f"""
  - job_name: {job}
    scheme: https
    tls_config:
      ca_file: {cert}
    basic_auth:
      username: {USER}
      password_file: {tmp_path / password_file}
    static_configs:
      - targets: ["127.0.0.1:{agent.port}"]""")
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:" + "".join(jobs) + "\n")
    port = free_port()
    prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        def targets():
            try:
                with urllib.request.urlopen(f"{api}/targets", timeout=2) as resp:
                    active = json.load(resp)["data"]["activeTargets"]
            except OSError:
                return None
            health = {t["labels"]["job"]: (t["health"], t["lastError"]) for t in active}
            seen["health"] = health
            # A first scrape slower than the 1 s scrape timeout (TLS handshake, PBKDF2) is "not yet".
            settled = len(health) == 2 and all(h != "unknown" and "deadline exceeded" not in e
                                               for h, e in health.values())
            return health if settled and health["meshscope"][0] == "up" else None

        seen: dict = {}
        health = poll_until(targets, timeout_s=40, interval_s=0.5,
                            what=lambda: f"Prometheus scraped both jobs: {seen.get('health')}")
        assert health["meshscope"] == ("up", ""), health
        assert health["meshscope-wrong-password"][0] == "down" and "401" in health["meshscope-wrong-password"][1]
        q = urllib.parse.quote('meshscope_agent_info{job="meshscope"}')
        with urllib.request.urlopen(f"{api}/query?query={q}", timeout=5) as resp:
            assert len(json.load(resp)["data"]["result"]) == 1
    finally:
        prom.terminate()
        prom.wait(timeout=20)


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("make, needle", [
    (lambda d: ["--tls-cert", str(d / "cert.pem")], "--tls-cert and --tls-key go together"),
    (lambda d: ["--tls-cert", str(d / "missing.pem"), "--tls-key", str(d / "key.pem")], "cannot load TLS certificate"),
    (lambda d: ["--tls-cert", str(d / "key.pem"), "--tls-key", str(d / "cert.pem")], "cannot load TLS certificate"),
    (lambda d: ["--basic-auth-file", str(d / "missing")], "cannot read basic-auth file"),
    (lambda d: ["--basic-auth-file", _write(d / "plain", "u:hunter2\n")], "line 1: unsupported hash"),
    (lambda d: ["--basic-auth-file", _write(d / "sha1", "# x\nu:{SHA}W6ph5Mm5Pz8GgiULbPgzG37mj9g=\n")],
     "line 2: unsupported hash"),
    (lambda d: ["--basic-auth-file", _write(d / "bad", "u:$pbkdf2-sha256$1000$abc$short\n")],
     "malformed $pbkdf2-sha256$ hash"),
    (lambda d: ["--basic-auth-file", _write(d / "nouser", "justtext\n")], "expected user:hash"),
    (lambda d: ["--basic-auth-file", _write(d / "empty", "# nobody\n")], "lists no user"),
    (lambda d: ["--basic-auth-file", _write(d / "twice", f"u:{hash_password('a', rounds=1000)}\n"
                                                            f"u:{hash_password('b', rounds=1000)}\n")],
     "listed twice"),
])
def test_bad_tls_and_auth_flags_are_one_line_usage_errors(tmp_path, capsys, make, needle):
    self_signed(tmp_path)
    (tmp_path / "store").mkdir()
    assert agent_main(["--store", str(tmp_path / "store"), "--port", "0", "--gpu-interval", "0",
                       *make(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshscope agent: error: ") and needle in err[0], err


def test_bcrypt_entries_need_the_bcrypt_package(tmp_path):
    entry = "u:$2y$05$abcdefghijklmnopqrstuuJ9W0z2b9bD1zJ9Z6QZyq0Z0Z0Z0Z0Z0\n"
    (tmp_path / "users").write_text(entry)
    try:
        import bcrypt  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="'bcrypt' package is not installed"):
            Credentials.load(tmp_path / "users")
    else:
        Credentials.load(tmp_path / "users")


def test_basic_auth_without_tls_warns(tmp_path):
    (tmp_path / "users").write_text(f"{USER}:{hash_password(PASSWORD, rounds=1000)}\n")
    store = tmp_path / "store"
    store.mkdir()
    agent = AgentProcess(store, "--basic-auth-file", str(tmp_path / "users"), auth=(USER, PASSWORD))
    try:
        assert agent.scrape().value("meshscope_agent_runs") == 0
    finally:
        agent.stop()
    assert "basic auth without TLS sends passwords in clear text" in agent.stderr


def test_hash_password_cli_and_verification(tmp_path):
    out = subprocess.run([sys.executable, "-m", "meshscope.agent.security", "hash-password", "--rounds", "2000"],
                         input="correct horse\n", capture_output=True, text=True, cwd=ROOT, env=env(), timeout=60)
    assert out.returncode == 0, out.stderr
    hashed = out.stdout.strip()
    assert hashed.startswith("$pbkdf2-sha256$2000$")
    assert verify_password("correct horse", hashed) and not verify_password("correct horse ", hashed)
    (tmp_path / "users").write_text(f"alice:{hashed}\n")
    creds = Credentials.load(tmp_path / "users")
    assert creds.check("alice", "correct horse") and creds.check("alice", "correct horse")  # cached path
    assert not creds.check("alice", "wrong") and not creds.check("bob", "correct horse")


# --------------------------------------------------------------------------- dashboard file confinement

def _part(directory: Path, step: int) -> Path:
    from meshscope.agent.store.schema import stored_schema

    directory.mkdir(parents=True, exist_ok=True)
    schema = stored_schema("step")
    row = {f.name: [0 if not pa.types.is_boolean(f.type) else False] for f in schema}
    row["step"] = [step]
    path = directory / f"part-{step}.parquet"
    pq.write_table(pa.table(row, schema=schema), path)
    return path


@pytest.fixture
def planted(tmp_path):
    """A store with one real run, and a directory outside it holding a run named 'secret' that symlinks
    try to pull in at every level of the layout."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    real = _part(root / "tables" / "step" / "run=good" / "rank=0", 1)
    secret = _part(outside / "tables" / "step" / "run=secret" / "rank=0", 666)
    base = root / "tables" / "step"
    (base / "run=evil").symlink_to(secret.parent.parent, target_is_directory=True)  # run dir
    (base / "run=good" / "rank=1").symlink_to(secret.parent, target_is_directory=True)  # rank dir
    (base / "run=good" / "rank=0" / "part-9.parquet").symlink_to(secret)  # file
    (root / "tables" / "memory").symlink_to(outside / "tables" / "step", target_is_directory=True)  # kind dir
    return root, outside, real


def test_dashboard_store_access_stays_under_the_root(planted):
    from meshscope.agent.store.reader import Store, read_table
    from meshscope.dashboard import data

    root, outside, real = planted
    store = Store.open(root)
    assert store.runs() == ["good"]
    assert store.files("step", runs=["good"]) == [real]
    hostile = ["../../etc", "..", "/etc", "run=good", "good/..", "evil", "secret", "../outside", "good/../../outside",
               "*", "%2e%2e", "good\x00"]
    for kind in ("step", "memory"):
        assert store.files(kind, runs=hostile) == []
    runs = data.runs_table(store)
    assert list(runs["run"]) == ["good"]
    step = store.query("SELECT step FROM step", kinds=("step",), runs=["good", *hostile])
    assert list(step["step"]) == [1]
    assert data.events(store, run="../../etc").empty
    with pytest.raises(ValueError):
        store.files("../step", runs=["good"])
    # export-trace and the tests read through the same Store: nothing planted comes in there either.
    assert list(read_table(root, "step")["step"]) == [1] and read_table(root, "memory").empty


def test_dashboard_ignores_a_symlinked_tables_directory(tmp_path):
    from meshscope.agent.store.reader import Store

    root, outside = tmp_path / "store", tmp_path / "outside"
    _part(outside / "tables" / "step" / "run=secret" / "rank=0", 666)
    root.mkdir()
    (root / "tables").symlink_to(outside / "tables", target_is_directory=True)
    assert Store.open(root).runs() == []


# ----------------------------------------------------------------------------------------------- PromQL

TRICKY = ['plain', 'a"b', "back\\slash", 'end\\', "new\nline", "tab\tcr\r", "ctl\x00\x01\x1f\x7f", "ünï©ødé 🚀",
          "'single'", "`back`", '"}) or vector(1) #', "{job=\"x\"}", ""]


@pytest.mark.parametrize("value", TRICKY)
def test_promql_label_value_round_trips(value):
    literal = promql_label_value(value)
    assert literal.startswith('"') and literal.endswith('"') and "\n" not in literal
    assert json.loads(literal) == value


def test_promql_label_value_examples():
    assert promql_label_value('a"b') == r'"a\"b"'
    assert promql_label_value("c:\\x\n") == r'"c:\\x\n"'
    assert promql_label_value("\x01") == r'"\u0001"'
    assert promql_regex_value("run.1+") == r'"run\\.1\\+"'
    with pytest.raises(ValueError):
        promql_label_value("lone \ud800 surrogate")
    with pytest.raises(TypeError):
        promql_label_value(3)


@settings(max_examples=500, deadline=None)
@given(st.text())
def test_promql_label_value_round_trips_any_text(value):
    assert json.loads(promql_label_value(value)) == value


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make install-servers)")
def test_prometheus_parses_the_literals_back_to_the_same_values(tmp_path):
    """promtool unit tests: a series created with each escaped value is selected by ``=`` with the same
    literal and by ``=~`` with the regex literal, and not by the literal of the value plus one character."""
    tests = []
    for value in (v for v in TRICKY if v):  # Prometheus drops empty label values
        lit, rx, other = promql_label_value(value), promql_regex_value(value), promql_label_value(value + "x")
        tests.append({
            "interval": "1m",
            "input_series": [{"series": f"m{{run={lit}}}", "values": "1"}],
            "promql_expr_test": [
                {"expr": f"m{{run={lit}}}", "eval_time": "0m", "exp_samples": [{"labels": f"m{{run={lit}}}", "value": 1}]},
                {"expr": f"count(m{{run=~{rx}}})", "eval_time": "0m", "exp_samples": [{"labels": "{}", "value": 1}]},
                {"expr": f"count(m{{run={other}}})", "eval_time": "0m", "exp_samples": []},
            ],
        })
    (tmp_path / "rules.yml").write_text("groups: []\n")
    spec = tmp_path / "test.yml"
    spec.write_text(json.dumps({"rule_files": [str(tmp_path / "rules.yml")], "evaluation_interval": "1m",
                                "tests": tests}, ensure_ascii=False))  # JSON is YAML
    out = subprocess.run(["promtool", "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
