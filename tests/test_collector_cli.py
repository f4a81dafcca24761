"""CLI input errors: one clear line naming the value, exit status 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshscope.agent.collector.cli import agent_main, ingest_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, needle", [
    (["--store", "{tmp}/afile/sub"], "cannot create store directory"),
    (["--store", "{tmp}/afile"], "afile' is not a directory"),
    (["--store", "{tmp}/ro"], "ro' is not writable"),
    (["--store", "{tmp}", "--port", "70000"], "port (70000)"),
    (["--store", "{tmp}", "--port", "http"], "invalid int value: 'http'"),
    (["--store", "{tmp}", "--poll-interval", "0"], "poll interval (0.0)"),
    ([], "--store"),
])
def test_bad_agent_input_is_one_line_and_exit_2(tmp_path, capsys, args, needle):
    (tmp_path / "afile").write_text("")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "agent").write_text("a file where the agent directory goes: not writable")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert agent_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshscope agent: error: ") and needle in err[0], err


def test_ingest_reports_a_missing_store(tmp_path, capsys):
    assert ingest_main(["--store", str(tmp_path / "nope")]) == 2
    assert "nope' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()


def test_the_agent_creates_its_store(tmp_path, capsys):
    # The live flow starts the agent first; the job that fills the store comes after.
    assert agent_main(["--store", str(tmp_path / "new" / "runs"), "--once", "--gpu-interval", "0"]) == 0
    assert (tmp_path / "new" / "runs" / "agent").is_dir()


def test_port_in_use_is_a_clear_error(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "meshscope.cli", "agent", "--store", str(tmp_path), "--port",
                              str(port), "--gpu-interval", "0"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr


def test_once_ingests_and_exits(tmp_path, capsys):
    from tests.support.spools import write_run

    counts = write_run(tmp_path, run="r", world_size=2, steps=3, collectives_per_step=4, frame_rows=4)
    assert agent_main(["--store", str(tmp_path), "--once", "--gpu-interval", "0"]) == 0
    assert f"ingested {sum(counts.values())} records" in capsys.readouterr().out


def test_one_agent_per_store(tmp_path, capsys, monkeypatch):
    import fcntl

    from meshscope.agent.collector import cli

    monkeypatch.setattr(cli, "LOCK_WAIT_S", 0.3)  # how long a second writer waits before giving up

    (tmp_path / "agent").mkdir()
    with open(tmp_path / "agent" / "agent.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running agent would
        assert ingest_main(["--store", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already writing store" in err[0]
    assert ingest_main(["--store", str(tmp_path)]) == 0  # released: free again
