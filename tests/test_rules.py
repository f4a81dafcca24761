"""Alert rules: generated from one source, parse, reference only catalog metrics, and behave as specified
(promtool unit tests: a firing and a quiet case for every alert)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshscope.agent.catalog import sample_names

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "grafana" / "tools"
sys.path.insert(0, str(TOOLS))  # grafana/tools is scripts, not a package

import dashgen  # noqa: E402
import promql  # noqa: E402
import rulegen  # noqa: E402

TESTS_DIR = ROOT / "grafana" / "prometheus" / "tests"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")


@pytest.fixture(scope="module")
def source() -> dict:
    return rulegen.load_source()


def _rules(source: dict, profile: str = "default") -> list[dict]:
    return rulegen.prometheus_rules(source, profile)["groups"][0]["rules"]


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_generated_files_are_up_to_date(source):
    assert rulegen.stale_files(source) == [], "run: python grafana/tools/rulegen.py"


@needs_promtool
@pytest.mark.parametrize("profile", rulegen.PROFILES)
def test_promtool_check_rules(source, profile, tmp_path):
    if profile == "default":
        path = rulegen.PROMETHEUS_RULES  # the file Prometheus loads, as committed
    else:
        path = tmp_path / "e2e.rules.yml"
        path.write_text(rulegen.dump(rulegen.prometheus_rules(source, profile), what=profile))
    proc = _promtool("check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_rules(source))} rules found" in proc.stdout


@needs_promtool
def test_promtool_check_config():
    proc = _promtool("check", "config", str(ROOT / "grafana" / "prometheus" / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout


@needs_promtool
def test_promtool_unit_tests():
    """The test files as shipped, as a user runs them: `promtool test rules *.yml` in their folder.
    annotations.yml runs against the generated rules; the others (labels and timing) against the same rules
    with annotations stripped (rules/labels-only.rules.yml, generated too and checked up to date above)."""
    files = sorted(p.name for p in TESTS_DIR.glob("*.yml"))
    assert len(files) >= 5
    for name in files:
        spec = yaml.safe_load((TESTS_DIR / name).read_text())
        want = "../rules/meshscope.rules.yml" if name == "annotations.yml" else "rules/labels-only.rules.yml"
        assert spec["rule_files"] == [want], name
    proc = _promtool("test", "rules", *files, cwd=TESTS_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(files), proc.stdout


def test_every_alert_has_a_firing_and_a_quiet_promtool_case(source):
    firing, quiet = set(), set()
    for path in TESTS_DIR.glob("*.yml"):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = {a["alert"] for a in source["alerts"]}
    assert alerts - firing == set(), "alerts without a firing promtool case"
    assert alerts - quiet == set(), "alerts without a quiet promtool case"
    assert (firing | quiet) - alerts == set(), "promtool cases for alerts that do not exist"


def test_alerts_carry_severity_summary_description_and_dashboard(source):
    pages = {d.uid: d.title.split(" / ")[1] for d in dashgen.DASHBOARDS}  # uid -> "Per-rank breakdown"
    names = [a["alert"] for a in source["alerts"]]
    assert len(names) == len(set(names))
    for rule in _rules(source):
        if "alert" not in rule:
            continue
        assert rule["alert"].startswith("Meshscope")
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        ann = rule["annotations"]
        assert ann["summary"] and "\n" not in ann["summary"], rule["alert"]
        uid = ann["dashboard"].split("?")[0].removeprefix("/d/")
        assert uid in pages, f"{rule['alert']} links to unknown dashboard {uid}"
        # The description says what to look at, on the page the alert links to.
        assert "Look at" in ann["description"], rule["alert"]
        assert pages[uid] in ann["description"], f"{rule['alert']}: description does not name {pages[uid]}"


def test_rules_reference_only_catalog_metrics(source):
    """Every series a rule selects is in the catalog (or is a recording rule defined earlier in the
    group, or Prometheus's own `up`): a renamed metric fails here, not silently in production."""
    known = set(sample_names()) | promql.BUILTIN_SERIES
    defined: set[str] = set()
    for rule in _rules(source):
        names = promql.metric_names(rule["expr"])
        assert names, rule
        unknown = names - known - defined
        assert not unknown, f"{rule.get('record') or rule.get('alert')}: unknown {sorted(unknown)}"
        if "record" in rule:
            assert rule["record"].startswith("meshscope:") and rule["record"] not in known
            defined.add(rule["record"])
    # ... and every recording rule is used by a rule after it or by a dashboard panel.
    used = set().union(*(promql.metric_names(r["expr"]) for r in _rules(source)))
    used |= {name for d in dashgen.DASHBOARDS for p in d.panels for expr, _ in p.targets
             for name in promql.metric_names(expr)}
    assert defined - used == set(), "recording rules nothing uses"


def test_metric_name_extraction():
    expr = ('label_replace(sum without (phase) (rate(meshscope_a_total{phase="x:y"}[5m])) / on (run) group_left () '
            'meshscope:b:rate > 1.5e3, "reason", "meshscope_not_a_metric", "", "") or absent(up{job="m"}) '
            'unless x offset 5m or time() - y[$__rate_interval] > bool 3 and max by (run) (z{run=~"$run"})')
    assert promql.metric_names(expr) == {"meshscope_a_total", "meshscope:b:rate", "up", "x", "y", "z"}
    assert promql.label_values_metric('label_values(meshscope_rank_last_step{run=~"$run"}, rank)') == \
        "meshscope_rank_last_step"


def test_grafana_rules_carry_the_same_promql(source):
    prom = {r["alert"]: r for r in _rules(source) if "alert" in r}
    grafana = yaml.safe_load(rulegen.GRAFANA_RULES.read_text())
    assert grafana["apiVersion"] == 1
    rules = grafana["groups"][0]["rules"]
    assert [r["title"] for r in rules] == list(prom)
    uids = [r["uid"] for r in rules]
    assert len(set(uids)) == len(uids) and all(len(u) <= 40 for u in uids)
    for r in rules:
        query, threshold = r["data"]
        assert query["model"]["expr"] == rulegen.grafana_expr(prom[r["title"]]["expr"])
        assert query["model"]["expr"].startswith("group without () (")
        assert query["datasourceUid"] == rulegen.DATASOURCE_UID and query["model"]["instant"] is True
        assert r["condition"] == threshold["refId"] == "C"
        assert threshold["model"]["type"] == "threshold" and threshold["model"]["expression"] == "A"
        assert threshold["model"]["conditions"][0]["evaluator"] == {"type": "gt", "params": [0]}
        assert r["noDataState"] == "OK"
        assert r["for"] == prom[r["title"]]["for"]
        assert r["labels"] == prom[r["title"]]["labels"]
        assert r["annotations"]["summary"] == prom[r["title"]]["annotations"]["summary"]
        assert r["annotations"]["__dashboardUid__"] in {d.uid for d in dashgen.DASHBOARDS}


def test_e2e_profile_shortens_durations_only(source):
    """The e2e test trips the alerts within seconds with the same rules: only windows, staleness and
    `for` may differ between profiles, never a threshold."""
    default, e2e = rulegen.params_for(source, "default"), rulegen.params_for(source, "e2e")
    assert {k for k in default if default[k] != e2e[k]} == {"window", "baseline_window", "stale_s"}
    d_rules, e_rules = _rules(source), _rules(source, "e2e")
    assert [r.get("alert") or r.get("record") for r in d_rules] == [r.get("alert") or r.get("record") for r in e_rules]
    for d, e in zip(d_rules, e_rules):
        assert d.get("labels") == e.get("labels")
        if d["expr"] != e["expr"]:
            swapped = d["expr"]
            for key in ("window", "baseline_window"):
                swapped = swapped.replace(f"[{default[key]}]", f"[{e2e[key]}]").replace(
                    f"offset {default[key]}", f"offset {e2e[key]}")
            swapped = swapped.replace(f"> {default['stale_s']}", f"> {e2e['stale_s']}")
            assert swapped == e["expr"], d.get("alert") or d.get("record")


def test_rulegen_rejects_unknown_parameters_and_profiles(source, tmp_path):
    with pytest.raises(rulegen.SourceError, match="unknown parameter"):
        rulegen.expand("rate(x[${windw}])", rulegen.params_for(source, "default"))
    with pytest.raises(rulegen.SourceError, match="unknown profile"):
        rulegen.params_for(source, "staging")
    assert rulegen.expand("{{ $labels.rank }} ${window}", {"window": "5m"}) == "{{ $labels.rank }} 5m"
    bad = tmp_path / "source.yaml"
    bad.write_text(yaml.safe_dump({"params": {}, "recording": [], "alerts": [{"alert": "X", "expr": "up"}]}))
    with pytest.raises(rulegen.SourceError, match="missing"):
        rulegen.load_source(bad)


def test_rulegen_check_cli():
    proc = subprocess.run([sys.executable, str(TOOLS / "rulegen.py"), "--check"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_straggler_alert_uses_the_overviews_threshold(source):
    """One rule for the user: MeshscopeStragglerRank fires at the relative margin the Overview and
    `meshscope report` flag a rank at (dashboard.stragglers), against its peers (with two ranks, the other)."""
    from meshscope.dashboard import stragglers

    params = rulegen.params_for(source, "default")
    assert float(params["straggler_ratio"]) == pytest.approx(1 + stragglers.STRAGGLER_REL)
    alert = next(a for a in source["alerts"] if a["alert"] == "MeshscopeStragglerRank")
    assert "ratio_to_peers" in alert["expr"]
