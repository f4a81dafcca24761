"""``meshscope dashboard``: the command it runs and its one-line errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshscope.dashboard import cli
from meshscope.dashboard.config import AppConfig, ConfigError, parse_app_args


def test_command_binds_localhost_headless_and_passes_the_store(tmp_path):
    cmd = cli.build_command(["--store", str(tmp_path), "--port", "8600"])
    assert cmd[:5] == [sys.executable, "-m", "streamlit", "run", str(cli.APP)]
    assert Path(cli.APP).name == "app.py" and Path(cli.APP).is_file()
    opts = dict(zip(cmd[5:cmd.index("--")][::2], cmd[5:cmd.index("--")][1::2]))
    assert opts["--server.address"] == "127.0.0.1" and opts["--server.port"] == "8600"
    assert opts["--server.headless"] == "true" and opts["--browser.gatherUsageStats"] == "false"
    script_args = cmd[cmd.index("--") + 1:]
    assert parse_app_args(script_args).stores == (str(tmp_path.resolve()),)


def test_prometheus_host_and_refresh_are_passed_on(tmp_path):
    cmd = cli.build_command(["--store", str(tmp_path), "--prometheus", "http://127.0.0.1:9090", "--host", "0.0.0.0",
                             "--refresh", "2"])
    assert cmd[cmd.index("--server.address") + 1] == "0.0.0.0"
    config = parse_app_args(cmd[cmd.index("--") + 1:])
    assert config.prometheus == "http://127.0.0.1:9090" and config.refresh_s == 2.0


@pytest.mark.parametrize(("args", "message"), [
    (["--store", "{missing}"], "store directory not found: {missing}"),
    (["--store", "{ok}", "--store", "{missing}"], "store directory not found: {missing}"),
    (["--store", "{ok}", "--port", "http"], "--port must be an integer in 1..65535, got 'http'"),
    (["--store", "{ok}", "--port", "0"], "--port must be an integer in 1..65535, got '0'"),
    (["--store", "{ok}", "--port", "70000"], "--port must be an integer in 1..65535, got '70000'"),
    (["--store", "{ok}", "--prometheus", "localhost:9090"], "--prometheus must be an http(s)://host:port URL"),
    (["--store", "{ok}", "--refresh", "-1"], "--refresh must be > 0 seconds"),
    ([], "the following arguments are required: --store"),
])
def test_user_mistakes_give_one_line_and_exit_2(tmp_path, capsys, args, message):
    fill = {"missing": str(tmp_path / "missing"), "ok": str(tmp_path)}
    args = [a.format(**fill) for a in args]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshscope dashboard: error: ")
    assert message.format(**fill) in err


def test_help_and_the_top_level_dispatcher(capsys):
    assert cli.main(["--help"]) == 0
    assert "--store" in capsys.readouterr().out
    import meshscope.cli

    assert meshscope.cli.COMMANDS["dashboard"][:2] == ("meshscope.dashboard.cli", "main")


def test_app_arguments_are_validated():
    with pytest.raises(ConfigError, match="--prometheus"):
        parse_app_args(["--store", "/x", "--prometheus", "ftp://host"])
    with pytest.raises(ConfigError, match="--store"):
        parse_app_args([])
    assert parse_app_args(["--store", "/a", "--store", "/b"]).stores == ("/a", "/b")
    with pytest.raises(TypeError, match="tuple of directories"):
        AppConfig(stores="/a")


def test_the_app_names_a_missing_second_store_in_one_line(monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    missing = tmp_path / "node-b"
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(tmp_path), "--store", str(missing)])
    at = AppTest.from_file(str(cli.APP), default_timeout=60).run()
    assert not at.exception
    assert [e.value for e in at.sidebar.error] == [f"store directory not found: {missing}"]


def test_main_becomes_the_streamlit_server(monkeypatch, tmp_path):
    seen = {}

    def execv(path, args):  # stands in for the real exec, which would replace the test process
        seen.update(path=path, args=args)
        raise SystemExit(0)

    monkeypatch.setattr(cli.os, "execv", execv)
    with pytest.raises(SystemExit):
        cli.main(["--store", str(tmp_path), "--port", "8700"])
    assert seen["path"] == sys.executable and seen["args"] == cli.build_command(["--store", str(tmp_path),
                                                                                 "--port", "8700"])


def test_several_stores_are_passed_on_resolved_and_once(tmp_path):
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    a.mkdir()
    b.mkdir()
    (tmp_path / "a-link").symlink_to(a)
    cmd = cli.build_command(["--store", str(a), "--store", str(tmp_path / "a-link"), "--store", str(b)])
    config = parse_app_args(cmd[cmd.index("--") + 1:])
    assert config.stores == (str(a.resolve()), str(b.resolve()))


def test_stores_that_cannot_be_read_together_give_one_line(tmp_path, capsys):
    keyed, plain = tmp_path / "node=1", tmp_path / "plain"
    keyed.mkdir()
    plain.mkdir()
    assert cli.main(["--store", str(plain), "--store", str(keyed)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be read together" in err and "node" in err
