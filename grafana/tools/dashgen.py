"""Generate meshscope's Grafana dashboards (grafana/dashboards/*.json) from the panel lists below.

    python grafana/tools/dashgen.py            # rewrite the JSON files
    python grafana/tools/dashgen.py --check    # exit 1 if a JSON file is out of date (a test does this too)

Why generated: five dashboards share variables, links, datasource references and layout; writing them
as data keeps uids stable, keeps `id` / `$$hashKey` out, and lets tests walk every PromQL expression
(catalog names, parse check, non-empty data against a real Prometheus).

Every query uses the `${datasource}` variable (default: the provisioned uid ``meshscope-prometheus``),
and only these Grafana variables: $run, $rank, $instance, $__rate_interval (``VARIABLES``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
DATASOURCE_UID = "meshscope-prometheus"
# Grafana variables a panel query may use, and what a test substitutes for each ("All" regexes).
VARIABLES = {"$__rate_interval": None, "$run": ".+", "$rank": ".+", "$instance": ".+"}

R = 'run=~"$run"'
RR = 'run=~"$run", rank=~"$rank"'
W = "[$__rate_interval]"
GPU = 'instance=~"$instance"'


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[tuple[str, str], ...]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | table | alertlist | text
    width: int = 12
    height: int = 8
    description: str = ""
    stack: bool = False
    exemplar: bool = False
    text: str = ""  # markdown of a text panel


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[str, ...]
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def ts(title, *targets, **kw) -> Panel:
    return Panel(title, tuple(targets), **kw)


def stat(title, expr, unit="short", **kw) -> Panel:
    return Panel(title, ((expr, "{{run}}"),), unit=unit, kind="stat", width=4, height=4, **kw)


OVERVIEW = Dashboard("meshscope-overview", "meshscope / Job overview",
                     "Progress, throughput, MFU and where the step time goes, per run.", ("run",), (
    stat("World size", f"max by (run) (meshscope_run_world_size{{{R}}})"),
    stat("Ranks reporting", f"sum by (run) (meshscope_run_ranks_reporting{{{R}}})",
         description="Summed over the job's agents; below the world size means ranks are missing."),
    stat("Last step", f"max by (run) (meshscope_rank_last_step{{{R}}})"),
    stat("Since last step", f"time() - max by (run) (meshscope_rank_last_step_timestamp_seconds{{{R}}})", "s",
         description="Grows without bound during a hang (MeshscopeRunNoProgress)."),
    stat("MFU", f"meshscope:run_mfu:avg{{{R}}}", "percentunit"),
    stat("Agents up", 'sum(up{job="meshscope"})'),
    ts("Steps per second", (f"max by (run) (rate(meshscope_rank_steps_total{{{R}}}{W}))", "{{run}}"), unit="ops"),
    ts("Model FLOP/s (job) and tokens/s per model replica",
       (f"sum by (run) (rate(meshscope_rank_model_flops_total{{{R}}}{W}))", "{{run}} FLOP/s"),
       (f"max by (run) (rate(meshscope_rank_tokens_total{{{R}}}{W}))", "{{run}} tokens/s per replica"),
       description="Rank FLOPs are the rank's share, so their sum is the job's; tokens are counted per "
                   "model replica (global tokens / dp)."),
    ts("MFU vs the run's own best (alert baseline)",
       (f"meshscope:run_mfu:avg{{{R}}}", "{{run}} MFU"),
       (f"max_over_time(meshscope:run_mfu:avg{{{R}}}[1h])", "{{run}} best over 1h"), unit="percentunit",
       description="MeshscopeMfuDrop fires when MFU stays below 0.7 x the best for 15 minutes."),
    ts("Step time breakdown (fraction of wall time)",
       (f"sum by (run, phase) (rate(meshscope_rank_step_phase_seconds_total{{{R}}}{W})) / on (run) group_left "
        f"sum by (run) (rate(meshscope_rank_step_wall_seconds_total{{{R}}}{W}))", "{{run}} {{phase}}"),
       unit="percentunit", stack=True,
       description="wall = compute + exposed_comm + bubble + other, summed over ranks."),
    ts("Step wall time p50 / p99 (exemplars: slowest rank and step)",
       (f"histogram_quantile(0.5, sum by (run, le) (rate(meshscope_step_wall_seconds_bucket{{{R}}}{W})))",
        "{{run}} p50"),
       (f"histogram_quantile(0.99, sum by (run, le) (rate(meshscope_step_wall_seconds_bucket{{{R}}}{W})))",
        "{{run}} p99"),
       unit="s", exemplar=True),
    ts("Compute time per step p50 / p99 (exemplars: slowest rank and step)",
       (f"histogram_quantile(0.5, sum by (run, le) (rate(meshscope_step_compute_seconds_bucket{{{R}}}{W})))",
        "{{run}} p50"),
       (f"histogram_quantile(0.99, sum by (run, le) (rate(meshscope_step_compute_seconds_bucket{{{R}}}{W})))",
        "{{run}} p99"),
       (f"sum by (run) (rate(meshscope_step_compute_seconds_sum{{{R}}}{W})) / "
        f"sum by (run) (rate(meshscope_step_compute_seconds_count{{{R}}}{W}))", "{{run}} mean"),
       unit="s", exemplar=True,
       description="A straggler shows here (and on the Per-rank page), not in wall time."),
    ts("Loss", (f"avg by (run) (meshscope_rank_loss{{{R}}})", "{{run}}")),
    ts("Events", (f"sum by (run, kind) (increase(meshscope_run_events_total{{{R}}}{W}))", "{{run}} {{kind}}"),
       description="start, end, crash, nonfinite_loss, skipped_step, restart, telemetry_error, hang."),
    ts("Telemetry health",
       (f"sum by (run) (meshscope_rank_dropped_records_total{{{R}}})", "{{run}} records dropped by ranks"),
       ("meshscope_agent_lag_seconds", "{{instance}} agent lag (s)"),
       ("meshscope_agent_backlog_bytes", "{{instance}} backlog (bytes)"),
       ("sum by (instance) (increase(meshscope_agent_frames_rejected_total[$__rate_interval]))",
        "{{instance}} frames rejected"),
       ("increase(meshscope_agent_metric_errors_total[$__rate_interval])", "{{instance}} batches without metrics")),
    Panel("Alerts", (), kind="alertlist", width=12),
))

RANKS = Dashboard("meshscope-ranks", "meshscope / Per-rank breakdown",
                  "Which rank is slow, behind or missing.", ("run", "rank"), (
    ts("Compute seconds per second by rank, and the run median",
       (f"meshscope:rank_compute_seconds:rate{{{RR}}}", "rank {{rank}}"),
       (f"meshscope:run_compute_seconds:median{{{R}}}", "{{run}} median"), unit="percentunit"),
    ts("Compute vs its peers' median (straggler ratio)",
       (f"meshscope:rank_compute_seconds:ratio_to_peers{{{RR}}}", "rank {{rank}}"),
       description="MeshscopeStragglerRank: above 1.2 for its `for:` duration (two ranks: each against the "
                   "other), the Overview's rule."),
    ts("Robust z of compute time (median / MAD)",
       (f"meshscope:rank_compute_seconds:robust_z{{{RR}}}", "rank {{rank}}"),
       description="(x - median) / (1.4826 x MAD) across the run's ranks; a plain z-score cannot exceed "
                   "sqrt(n - 1) with n ranks."),
    ts("Compute time per step by rank",
       (f"sum without (phase) (rate(meshscope_rank_step_phase_seconds_total{{{RR}, phase=\"compute\"}}{W})) "
        f"/ rate(meshscope_rank_steps_total{{{RR}}}{W})", "rank {{rank}}"), unit="s"),
    ts("Exposed communication fraction by rank",
       (f"meshscope:rank_exposed_comm:fraction{{{RR}}}", "rank {{rank}}"), unit="percentunit",
       description="A straggler's peers show high exposed communication: they wait for it."),
    ts("Last completed step by rank", (f"meshscope_rank_last_step{{{RR}}}", "rank {{rank}}")),
    ts("Seconds behind the most advanced rank",
       (f"max by (run) (meshscope_rank_last_step_timestamp_seconds{{{R}}}) - on (run) group_right "
        f"meshscope_rank_last_step_timestamp_seconds{{{RR}}}", "rank {{rank}}"), unit="s",
       description="MeshscopeRanksMissing (behind_peers) above 300 s."),
    ts("MFU by rank", (f"meshscope_rank_mfu_ratio{{{RR}}}", "rank {{rank}}"), unit="percentunit"),
    ts("Resident memory by rank", (f"meshscope_rank_memory_rss_bytes{{{RR}}}", "rank {{rank}}"), unit="bytes"),
    ts("Non-finite losses, skipped steps, dropped records by rank",
       (f"meshscope_rank_nonfinite_loss_total{{{RR}}}", "rank {{rank}} non-finite"),
       (f"meshscope_rank_skipped_steps_total{{{RR}}}", "rank {{rank}} skipped"),
       (f"meshscope_rank_dropped_records_total{{{RR}}}", "rank {{rank}} dropped")),
    Panel("Rank placement", ((f"meshscope_rank_info{{{RR}}}", ""),), kind="table", width=24,
          description="Host, local rank and restart attempt of each rank."),
))

COMM = Dashboard("meshscope-comm", "meshscope / Communication",
                 "Collective time, bandwidth and progress by op and parallel dim.", ("run", "rank"), (
    ts("Exposed communication fraction (run mean and by rank)",
       (f"avg by (run) (meshscope:rank_exposed_comm:fraction{{{R}}})", "{{run}} mean"),
       (f"meshscope:rank_exposed_comm:fraction{{{RR}}}", "rank {{rank}}"), unit="percentunit",
       description="Communication compute does not hide; MeshscopeExposedCommHigh above 0.3 of step time."),
    ts("Collective seconds per second by op and dim",
       (f"sum by (run, op, dim) (rate(meshscope_rank_collective_seconds_total{{{RR}}}{W}))",
        "{{run}} {{op}} {{dim}}"), unit="percentunit", stack=True,
       description="Issue-to-completion time summed over ranks (overlapped time included)."),
    ts("Algorithm bandwidth by op and dim",
       (f"sum by (run, op, dim) (rate(meshscope_rank_collective_bytes_total{{{RR}}}{W})) / "
        f"sum by (run, op, dim) (rate(meshscope_rank_collective_seconds_total{{{RR}}}{W}))",
        "{{run}} {{op}} {{dim}}"), unit="Bps",
       description="algbw = bytes / time (nccl-tests); busbw = algbw x 2(n-1)/n for all-reduce, (n-1)/n for "
                   "all-gather / reduce-scatter."),
    ts("Collectives per second by op and dim",
       (f"sum by (run, op, dim) (rate(meshscope_rank_collectives_total{{{RR}}}{W}))", "{{run}} {{op}} {{dim}}"),
       unit="ops"),
    ts("Collective seconds per second by rank",
       (f"sum by (run, rank) (rate(meshscope_rank_collective_seconds_total{{{RR}}}{W}))", "rank {{rank}}"),
       unit="percentunit"),
    ts("Collective sequence lag behind the group's most advanced rank, by dim",
       (f"max by (run, dim) (meshscope_rank_collective_last_seq{{{R}}}) - on (run, dim) group_right "
        f"meshscope_rank_collective_last_seq{{{RR}}}", "rank {{rank}} {{dim}}"),
       description="During a hang the rank whose sequence number lags is where it is stuck."),
))

PIPELINE = Dashboard("meshscope-pipeline", "meshscope / Pipeline",
                     "Measured pipeline bubble per stage and point-to-point traffic.", ("run", "rank"), (
    ts("Bubble fraction by rank (measured)",
       (f"meshscope:rank_bubble:fraction{{{RR}}}", "rank {{rank}}"),
       (f"avg by (run) (meshscope:rank_bubble:fraction{{{R}}})", "{{run}} mean"), unit="percentunit",
       description="1 - (stage compute) / (step wall time); MeshscopePipelineBubbleHigh above 0.5."),
    Panel("Theory", (), kind="text", width=12, text=(
        "**Idle fraction of a stage's step** (balanced stages, equal forward/backward cost):\n\n"
        "* GPipe and 1F1B: (p - 1) / (m + p - 1)\n* Interleaved 1F1B: (p - 1) / (v m + p - 1)\n\n"
        "p stages, m microbatches, v virtual stages per rank. Example p = 4: m = 4 gives 43 %, m = 8 "
        "27 %, m = 16 16 %, m = 32 8.6 %. (p - 1) / m is bubble time relative to ideal compute, not this "
        "fraction. The run's schedule and mesh are in the table below; measured well above theory means "
        "unbalanced stages or slow send/recv.")),
    ts("Bubble seconds per step by rank",
       (f"sum without (phase) (rate(meshscope_rank_step_phase_seconds_total{{{RR}, phase=\"bubble\"}}{W})) "
        f"/ rate(meshscope_rank_steps_total{{{RR}}}{W})", "rank {{rank}}"), unit="s"),
    ts("Point-to-point (send / recv) seconds per second by rank",
       (f"sum by (run, rank, op) (rate(meshscope_rank_collective_seconds_total{{{RR}, op=~\"send|recv\"}}{W}))",
        "rank {{rank}} {{op}}"), unit="percentunit"),
    Panel("Run layout", ((f"meshscope_run_info{{{R}}}", ""),), kind="table", width=24,
          description="Strategy, mesh and schedule of the run."),
))

GPUS = Dashboard("meshscope-gpu", "meshscope / GPU",
                 "NVML samples of each node's GPUs and the ranks' device memory.", ("run", "rank", "instance"), (
    ts("GPU utilization", (f"meshscope_gpu_utilization_ratio{{{GPU}}}", "{{instance}} gpu {{gpu}}"),
       unit="percentunit"),
    ts("GPU memory used / total",
       (f"meshscope_gpu_memory_used_bytes{{{GPU}}} / meshscope_gpu_memory_total_bytes{{{GPU}}}",
        "{{instance}} gpu {{gpu}}"), unit="percentunit",
       description="MeshscopeGpuMemoryNearCapacity above 0.95 for 5 minutes."),
    ts("Memory bandwidth utilization", (f"meshscope_gpu_memory_utilization_ratio{{{GPU}}}",
                                        "{{instance}} gpu {{gpu}}"), unit="percentunit"),
    ts("SM clock / max clock",
       (f"meshscope_gpu_sm_clock_hertz{{{GPU}}} / meshscope_gpu_sm_clock_max_hertz{{{GPU}}}",
        "{{instance}} gpu {{gpu}}"), unit="percentunit"),
    ts("Power", (f"meshscope_gpu_power_watts{{{GPU}}}", "{{instance}} gpu {{gpu}}"), unit="watt"),
    ts("Temperature", (f"meshscope_gpu_temperature_celsius{{{GPU}}}", "{{instance}} gpu {{gpu}}"),
       unit="celsius"),
    ts("Throttle reasons that alert (1 = active)",
       *((f"label_replace(floor(meshscope_gpu_throttle_reasons{{{GPU}}} / {2 ** bit}) % 2, "
          f'"reason", "{reason}", "", "")', "{{instance}} gpu {{gpu}} {{reason}}")
         for bit, reason in ((3, "hw_slowdown"), (5, "sw_thermal"), (6, "hw_thermal"), (7, "hw_power_brake"))),
       description="NVML clocks-event bits 3, 5, 6, 7 (floor(x / 2^k) % 2); MeshscopeGpuThrottled."),
    ts("XID and uncorrected ECC errors",
       (f"meshscope_gpu_xid_errors_total{{{GPU}}}", "{{instance}} gpu {{gpu}} XID"),
       (f"meshscope_gpu_ecc_errors_total{{{GPU}}}", "{{instance}} gpu {{gpu}} ECC")),
    ts("Device memory peaks by rank",
       (f"meshscope_rank_device_memory_reserved_peak_bytes{{{RR}}}", "rank {{rank}} reserved"),
       (f"meshscope_rank_device_memory_allocated_peak_bytes{{{RR}}}", "rank {{rank}} allocated"), unit="bytes"),
    ts("OOMs and allocator retries by rank",
       (f"increase(meshscope_rank_device_ooms_total{{{RR}}}{W})", "rank {{rank}} OOMs"),
       (f"increase(meshscope_rank_device_alloc_retries_total{{{RR}}}{W})", "rank {{rank}} retries")),
    Panel("GPUs", ((f"meshscope_gpu_info{{{GPU}}}", ""),), kind="table", width=24),
))

DASHBOARDS = (OVERVIEW, RANKS, COMM, PIPELINE, GPUS)


def _variable(name: str) -> dict:
    if name == "datasource":
        return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
                "current": {"text": DATASOURCE_UID, "value": DATASOURCE_UID}, "hide": 0, "refresh": 1,
                "regex": ""}
    query = {"run": "label_values(meshscope_run_world_size, run)",
             "rank": 'label_values(meshscope_rank_last_step{run=~"$run"}, rank)',
             "instance": "label_values(meshscope_agent_info, instance)"}[name]
    return {"name": name, "label": name, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"{name}-variable"}, "definition": query, "refresh": 2,
            "includeAll": True, "multi": True, "allValue": ".+", "current": {}, "sort": 3 if name == "rank" else 1,
            "hide": 0}


def _panel(p: Panel, pid: int, x: int, y: int) -> dict:
    out: dict = {"id": pid, "type": p.kind, "title": p.title, "description": p.description,
                 "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y}}
    if p.kind == "text":
        out["options"] = {"mode": "markdown", "content": p.text}
        return out
    if p.kind == "alertlist":
        out["options"] = {"viewMode": "list", "groupMode": "default", "maxItems": 20, "sortOrder": 1,
                          "dashboardAlerts": False, "alertName": "", "alertInstanceLabelFilter": "",
                          "stateFilter": {"firing": True, "pending": True, "noData": False, "normal": False,
                                          "error": True}}
        return out
    out["datasource"] = DATASOURCE
    table = p.kind == "table"
    out["targets"] = [
        {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
         "range": not table, "instant": table, "exemplar": p.exemplar, **({"format": "table"} if table else {})}
        for i, (expr, legend) in enumerate(p.targets)
    ]
    defaults: dict = {"unit": p.unit}
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if p.stack else 0,
                              "showPoints": "never", "spanNulls": False,
                              "stacking": {"mode": "normal" if p.stack else "none", "group": "A"}}
        out["options"] = {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                                     "calcs": ["lastNotNull", "max"]},
                          "tooltip": {"mode": "multi", "sort": "desc"}}
    elif p.kind == "stat":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                          "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    else:
        # An instant query in table format already gives one column per label (host, mesh, ...).
        out["options"] = {"showHeader": True}
    out["fieldConfig"] = {"defaults": defaults, "overrides": []}
    return out


def render(d: Dashboard) -> dict:
    panels, x, y, row_h = [], 0, 0, 0
    for pid, p in enumerate(d.panels, start=1):
        if x + p.width > 24:  # flow left to right, wrap at Grafana's 24 columns
            x, y, row_h = 0, y + row_h, 0
        panels.append(_panel(p, pid, x, y))
        x, row_h = x + p.width, max(row_h, p.height)
    return {
        "uid": d.uid, "title": d.title, "description": d.description, "tags": ["meshscope"],
        "timezone": "browser", "editable": False, "graphTooltip": 1, "refresh": "10s", "schemaVersion": 39,
        "version": 1, "time": {"from": "now-1h", "to": "now"}, "fiscalYearStartMonth": 0, "liveNow": False,
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [{"title": "meshscope", "type": "dashboards", "tags": ["meshscope"], "asDropdown": False,
                   "includeVars": True, "keepTime": True, "targetBlank": False, "icon": "external link",
                   "tooltip": "", "url": ""}],
        "templating": {"list": [_variable(v) for v in ("datasource", *d.variables)]},
        "panels": panels,
    }


def rendered() -> dict[Path, str]:
    return {OUT_DIR / f"{d.uid}.json": json.dumps(render(d), indent=2, ensure_ascii=False) + "\n"
            for d in DASHBOARDS}


def panel_queries(directory: Path = OUT_DIR) -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) of every panel target in the dashboard JSON files."""
    out = []
    for path in sorted(directory.glob("*.json")):
        d = json.loads(path.read_text())
        out += [(d["uid"], p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", [])]
    return out


def substitute(expr: str, rate_interval: str) -> str:
    """The query Grafana sends with every variable at "All" (regex .+) and the given rate interval."""
    for var, value in VARIABLES.items():
        expr = expr.replace(var, rate_interval if value is None else value)
    return expr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dashgen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a dashboard file is out of date")
    args = ap.parse_args(argv)
    files = rendered()
    if args.check:
        stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"dashgen: {p.name} is out of date", file=sys.stderr)
        return 1 if stale else 0
    OUT_DIR.mkdir(exist_ok=True)
    for p, text in files.items():
        p.write_text(text)
        print(f"dashgen: wrote grafana/dashboards/{p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
