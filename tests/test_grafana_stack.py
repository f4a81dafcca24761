"""``meshscope stack``: one clear error line for bad input or missing packages, and the configs it renders
are valid (promtool / amtool) and point at what it was given. Starting and stopping the real servers is
covered by tests/test_alerting_e2e.py."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from meshscope.agent import stack

HAVE_SERVERS = not stack.missing_binaries()[1]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("meshscope stack: error: ")
    return lines[0]


def test_missing_packages_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing installed on this PATH
    assert stack.main(["--store", str(tmp_path), "--dir", str(tmp_path / "w")]) == 2
    line = _error_line(capsys)
    assert "not installed: prometheus, prometheus-alertmanager" in line
    assert "apt-get install prometheus prometheus-alertmanager" in line
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(("args", "message"), [
    ([], "nothing to scrape"),
    (["--store", "/nonexistent/store"], "does not exist"),
    (["--agent", "localhost"], "must be HOST:PORT"),
    (["--agent", "127.0.0.1:99999"], "must be HOST:PORT"),
    (["--agent", "127.0.0.1:9477", "--interval", "fast"], "must look like"),
    (["--agent", "127.0.0.1:9477", "--group-wait=-1s"], "must look like"),
    (["--agent", "127.0.0.1:9477", "--rules", "/nonexistent.yml"], "rule file"),
    (["--agent", "127.0.0.1:9477", "--webhook", "ftp://x"], "http(s) URL"),
    (["--agent", "127.0.0.1:9477", "--prometheus-port", "x"], "invalid int value"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_input_one_line(args, message, tmp_path, capsys):
    assert stack.main([*args, "--dir", str(tmp_path / "w")]) == 2
    assert message in _error_line(capsys)


@pytest.mark.skipif(not HAVE_SERVERS, reason="prometheus / prometheus-alertmanager not installed")
def test_port_in_use_one_line(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = stack.main(["--agent", "127.0.0.1:9477", "--prometheus-port", str(port), "--dir", str(tmp_path)])
    assert rc == 2
    assert f"--prometheus-port {port}: 127.0.0.1:{port} is in use" in _error_line(capsys)


@pytest.mark.skipif(not HAVE_SERVERS or shutil.which("promtool") is None or shutil.which("amtool") is None,
                    reason="prometheus / prometheus-alertmanager not installed")
def test_rendered_configs_are_valid_and_point_at_the_agents(tmp_path):
    p = stack.plan(["--store", str(tmp_path), "--agent", "node1:9477", "--agent-port", "0",
                    "--prometheus-port", "0", "--alertmanager-port", "0", "--dir", str(tmp_path / "w"),
                    "--interval", "1s", "--webhook", "http://127.0.0.1:5999/hook", "--group-wait", "1s"])
    prom_path, am_path = stack.render_configs(p)
    proc = subprocess.run(["promtool", "check", "config", str(prom_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run(["amtool", "check-config", str(am_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    prom = yaml.safe_load(prom_path.read_text())
    assert prom["global"]["scrape_interval"] == prom["global"]["evaluation_interval"] == "1s"
    assert prom["global"]["scrape_timeout"] == "1s"  # never longer than the interval
    assert prom["rule_files"] == [str(stack.DEFAULT_RULES)]
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [f"127.0.0.1:{p.alertmanager_port}"]
    sd = prom["scrape_configs"][0]["file_sd_configs"][0]["files"]
    assert sd == [str(p.workdir / "targets" / "*.yml")]
    targets = yaml.safe_load((p.workdir / "targets" / "agents.yml").read_text())
    assert targets == [{"targets": [f"127.0.0.1:{p.agent_port}", "node1:9477"]}]

    am = yaml.safe_load(am_path.read_text())
    assert am["route"]["group_by"] == ["alertname", "run"]
    assert am["route"]["group_wait"] == "1s" and all(r["group_wait"] == "1s" for r in am["route"]["routes"])
    assert am["receivers"][0]["webhook_configs"][0]["url"] == "http://127.0.0.1:5999/hook"
    commands = {name: argv for name, argv, _ in stack.commands(p, prom_path, am_path)}
    assert "--enable-feature=exemplar-storage" in commands["prometheus"]
    assert f"--web.listen-address=127.0.0.1:{p.prometheus_port}" in commands["prometheus"]
    assert "--cluster.listen-address=" in commands["alertmanager"]
    assert commands["agent"][:3] == [sys.executable, "-m", "meshscope.agent.collector.cli"]
