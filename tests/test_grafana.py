"""Grafana files, validated offline (no Grafana server can be installed here): dashboards are generated
and up to date, have stable uids and no `id` / `$$hashKey`, use the datasource variable or the fixed uid,
reference only catalog metrics, and every panel expression parses (promtool). Their data against a real
Prometheus is checked in tests/test_alerting_e2e.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshscope.agent.catalog import sample_names

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "grafana"
sys.path.insert(0, str(GRAFANA / "tools"))  # grafana/tools is scripts, not a package

import dashgen  # noqa: E402
import promql  # noqa: E402
import rulegen  # noqa: E402

PROVISIONING = GRAFANA / "provisioning"
FILES = sorted((GRAFANA / "dashboards").glob("*.json"))


def _walk(node, path=""):
    """(path, key, value) for every dict entry in a JSON tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield path, k, v
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def _recording_names() -> set[str]:
    return {r["record"] for r in rulegen.load_source()["recording"]}


def test_dashboards_are_generated_and_up_to_date():
    assert {p.name for p in FILES} == {f"{d.uid}.json" for d in dashgen.DASHBOARDS}
    stale = [p.name for p, text in dashgen.rendered().items() if p.read_text() != text]
    assert stale == [], "run: python grafana/tools/dashgen.py"


def test_dashboards_have_stable_uids_and_no_ids_or_hash_keys():
    uids = set()
    expected = {"meshscope-overview", "meshscope-ranks", "meshscope-comm", "meshscope-pipeline", "meshscope-gpu"}
    for path in FILES:
        d = json.loads(path.read_text())
        assert d["uid"] == path.stem and d["uid"] not in uids and len(d["uid"]) <= 40
        uids.add(d["uid"])
        assert "id" not in d, f"{path.name}: a dashboard id makes provisioning collide across instances"
        assert not [k for _, k, _ in _walk(d) if k == "$$hashKey"], path.name
        assert d["title"].startswith("meshscope / ") and "meshscope" in d["tags"]
        ids = [p["id"] for p in d["panels"]]  # panel ids (alert links use them) are fine and unique
        assert len(ids) == len(set(ids))
        for p in d["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, (path.name, p["title"])
    assert uids == expected


def test_datasource_is_the_variable_or_the_fixed_uid():
    ds = yaml.safe_load((PROVISIONING / "datasources" / "meshscope.yaml").read_text())
    uid = ds["datasources"][0]["uid"]
    assert uid == dashgen.DATASOURCE_UID == rulegen.DATASOURCE_UID
    for path in FILES:
        d = json.loads(path.read_text())
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["current"]["value"] == uid
        refs = [(where, v) for where, k, v in _walk(d) if k == "datasource" and isinstance(v, dict)]
        assert refs, path.name
        for where, ref in refs:
            if ref.get("type") == "grafana":  # the built-in annotation source
                continue
            assert ref == {"type": "prometheus", "uid": "${datasource}"} or ref.get("uid") == uid, (path.name, where)


def test_panel_queries_reference_catalog_metrics_and_known_variables():
    known = set(sample_names()) | _recording_names() | promql.BUILTIN_SERIES
    queries = dashgen.panel_queries()
    assert len(queries) >= 40
    for uid, title, expr in queries:
        names = promql.metric_names(expr)
        assert names and names <= known, f"{uid} / {title}: unknown {sorted(names - known)}"
        used_vars = set(re.findall(r"\$\w+", expr))
        assert used_vars <= set(dashgen.VARIABLES), f"{uid} / {title}: {used_vars}"
    for path in FILES:
        for v in json.loads(path.read_text())["templating"]["list"]:
            if v["type"] == "query":
                assert promql.label_values_metric(v["query"]["query"]) in known, (path.name, v["name"])


def test_every_panel_shows_something():
    for path in FILES:
        for p in json.loads(path.read_text())["panels"]:
            if p["type"] in ("timeseries", "stat", "table"):
                assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
            elif p["type"] == "text":
                assert p["options"]["content"]
            else:
                assert p["type"] == "alertlist", p["type"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_every_panel_expression_parses(tmp_path):
    """promtool parses each expression (with the variables substituted) as a recording rule."""
    rules = [{"record": f"panel:check_{i}:x", "expr": dashgen.substitute(expr, "1m")}
             for i, (_, _, expr) in enumerate(dashgen.panel_queries())]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


def test_provisioning_files():
    ds = yaml.safe_load((PROVISIONING / "datasources" / "meshscope.yaml").read_text())
    assert ds["apiVersion"] == 1
    source = ds["datasources"][0]
    assert source["type"] == "prometheus" and source["jsonData"]["timeInterval"]
    prom = yaml.safe_load((GRAFANA / "prometheus" / "prometheus.yml").read_text())
    assert source["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]

    dash = yaml.safe_load((PROVISIONING / "dashboards" / "meshscope.yaml").read_text())
    provider = dash["providers"][0]
    assert dash["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]

    contacts = yaml.safe_load((PROVISIONING / "alerting" / "contact-points.yaml").read_text())
    receivers = {cp["name"]: cp["receivers"] for cp in contacts["contactPoints"]}
    assert receivers["meshscope-webhook"][0]["type"] == "webhook"
    assert receivers["meshscope-webhook"][0]["settings"]["url"].startswith("http")

    policies = yaml.safe_load((PROVISIONING / "alerting" / "policies.yaml").read_text())
    root = policies["policies"][0]
    assert root["group_by"] == ["alertname", "run"]
    names = [root["receiver"], *(r["receiver"] for r in root.get("routes", []))]
    assert set(names) <= set(receivers)

    rules = yaml.safe_load((PROVISIONING / "alerting" / "rules.yaml").read_text())
    group = rules["groups"][0]
    assert group["folder"] and group["interval"]
    assert {r["data"][0]["datasourceUid"] for r in group["rules"]} == {source["uid"]}


def test_alertmanager_config():
    am = yaml.safe_load((GRAFANA / "alertmanager" / "alertmanager.yml").read_text())
    assert am["route"]["group_by"] == ["alertname", "run"]
    receivers = {r["name"]: r for r in am["receivers"]}
    assert receivers[am["route"]["receiver"]]["webhook_configs"][0]["url"].startswith("http")
    if shutil.which("amtool"):
        proc = subprocess.run(["amtool", "check-config", str(GRAFANA / "alertmanager" / "alertmanager.yml")],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashgen_check_cli():
    proc = subprocess.run([sys.executable, str(GRAFANA / "tools" / "dashgen.py"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
