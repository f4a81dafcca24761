"""Live per-rank figures from Prometheus (HTTP API ``/api/v1/query``), for the Live page.

The metrics the page reads are the one mapping below, names taken from the agent's metric catalog
(``agent.catalog``; a test checks names and types against it). Queries aggregate ``by (rank)``: a few
series per rank, never per op.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

import pandas as pd

from meshscope.agent.security import promql_label_value

# Logical name -> Prometheus metric name (the type the queries assume in the comment).
METRICS: dict[str, str] = {
    "step": "meshscope_rank_last_step",  # gauge: last optimizer step the rank completed
    "step_t": "meshscope_rank_last_step_timestamp_seconds",  # gauge: when that step ended (Unix s, the rank's clock)
    "wall": "meshscope_rank_step_wall_seconds_total",  # counter: step wall time
    "phase": "meshscope_rank_step_phase_seconds_total",  # counter: wall time by phase (label below)
    "mfu": "meshscope_rank_mfu_ratio",  # gauge: MFU of the rank's last step, 0-1
    "steps": "meshscope_rank_steps_total",  # counter: optimizer steps completed
    "last_record": "meshscope_run_last_record_timestamp_seconds",  # gauge: newest record of the run (Unix s)
    "world_size": "meshscope_run_world_size",  # gauge
    "events": "meshscope_run_events_total",  # counter by kind (agent.contract.EVENT_KINDS)
}
RANK_LABEL = "rank"
RUN_LABEL = "run"
PHASE_LABEL = "phase"  # values: compute, exposed_comm, bubble, other (they add up to the wall time)


class LiveError(Exception):
    """Prometheus unreachable or answering with an error; the message is for the user."""


def _selector(run: str | None, **labels: str) -> str:
    pairs = ({RUN_LABEL: run} if run else {}) | labels
    if not pairs:
        return ""
    # The one escaper (control characters too): a run name is user input and ends up inside PromQL.
    return "{" + ", ".join(f"{k}={promql_label_value(v)}" for k, v in pairs.items()) + "}"


def queries(*, run: str | None, window: str = "1m") -> dict[str, str]:
    """PromQL per column of the live table. A phase's share of the step: the rate of its seconds over
    the rate of wall seconds (so pauses between steps do not count)."""
    by = f"by ({RANK_LABEL})"
    wall = f"sum {by} (rate({METRICS['wall']}{_selector(run)}[{window}]))"

    def share(phase: str) -> str:
        return f"sum {by} (rate({METRICS['phase']}{_selector(run, **{PHASE_LABEL: phase})}[{window}])) / {wall}"

    return {
        "step": f"max {by} ({METRICS['step']}{_selector(run)})",
        "compute_ratio": share("compute"),
        "exposed_comm_ratio": share("exposed_comm"),
        "mfu": f"avg {by} ({METRICS['mfu']}{_selector(run)})",
    }


def series_queries(*, run: str | None, window: str = "1m") -> dict[str, str]:
    """PromQL per time series of the Live page: the snapshot's shares and MFU, and the step rate."""
    by = f"by ({RANK_LABEL})"
    q = queries(run=run, window=window)
    # Steps per second from the last two samples (irate): a rate over the whole window divides a run shorter
    # than the window by the window's length (a real 8-steps/s job of 8 s read 1 step/s).
    return {"steps_per_s": f"sum {by} (irate({METRICS['steps']}{_selector(run)}[{window}]))",
            "compute_ratio": q["compute_ratio"], "exposed_comm_ratio": q["exposed_comm_ratio"], "mfu": q["mfu"]}


Opener = Callable[..., object]


class PrometheusClient:
    """Minimal instant-query client (stdlib only). ``opener`` is injectable for tests."""

    def __init__(self, url: str, *, timeout: float = 3.0, opener: Opener = urllib.request.urlopen) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"Prometheus URL must be http(s)://host[:port], got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._open = opener

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """Instant vector query -> [(labels, value)]."""
        data = self._get("query", {"query": promql})
        if data.get("resultType") != "vector":
            return []
        return [(r.get("metric", {}), float(r["value"][1])) for r in data.get("result", [])]

    def query_range(self, promql: str, *, start: float, end: float, step_s: float
                    ) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        """Range query -> [(labels, [(unix time, value)])]."""
        data = self._get("query_range", {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                          "step": f"{step_s:g}"})
        if data.get("resultType") != "matrix":
            return []
        return [(r.get("metric", {}), [(float(t), float(v)) for t, v in r.get("values", [])])
                for r in data.get("result", [])]

    def _get(self, endpoint: str, params: dict[str, str]) -> dict:
        q = urllib.parse.urlencode(params)
        try:
            with self._open(f"{self.url}/api/v1/{endpoint}?{q}", timeout=self.timeout) as resp:
                body = json.loads(resp.read().decode())
        except urllib.error.HTTPError as e:
            detail = _error_detail(e)
            raise LiveError(f"Prometheus at {self.url} rejected the query ({e.code}): {detail}") from e
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            raise LiveError(f"Prometheus at {self.url} is not reachable: {getattr(e, 'reason', e)}") from e
        except json.JSONDecodeError as e:
            raise LiveError(f"Prometheus at {self.url} answered with something other than JSON") from e
        if body.get("status") != "success":
            raise LiveError(f"Prometheus query failed: {body.get('error', 'unknown error')}")
        return body.get("data", {})

    def check(self) -> None:
        """Raise LiveError unless Prometheus answers a trivial query."""
        self.query("vector(1)")


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        return json.loads(e.read().decode()).get("error", str(e))
    except (json.JSONDecodeError, OSError, UnicodeDecodeError):
        return str(e)


def live_runs(client: PrometheusClient) -> list[str]:
    """Runs that currently report (empty when the metrics carry no run label)."""
    rows = client.query(f"count by ({RUN_LABEL}) ({METRICS['step']})")
    return sorted(labels[RUN_LABEL] for labels, _ in rows if labels.get(RUN_LABEL))


def snapshot(client: PrometheusClient, *, run: str | None, window: str = "1m") -> pd.DataFrame:
    """Current per-rank table: ``rank`` plus one column per query (NaN where a rank has no value)."""
    table: dict[int, dict[str, float]] = {}
    for column, promql in queries(run=run, window=window).items():
        for labels, value in client.query(promql):
            try:
                rank = int(labels.get(RANK_LABEL, ""))
            except ValueError:
                continue  # series without a usable rank label cannot be placed
            table.setdefault(rank, {})[column] = value if math.isfinite(value) else math.nan
    cols = ["rank", *queries(run=run)]
    if not table:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame.from_dict(table, orient="index").rename_axis("rank").reset_index()
    return df.reindex(columns=cols).sort_values("rank").reset_index(drop=True)


def _rank(labels: dict[str, str]) -> int | None:
    try:
        return int(labels.get(RANK_LABEL, ""))
    except ValueError:
        return None  # series without a usable rank label cannot be placed


def last_steps(client: PrometheusClient, *, run: str | None, start: float, end: float, step_s: float
               ) -> dict[int, float]:
    """Per rank, the time from which its series show nothing new: the first point of the range at which
    Prometheus shows the rank's newest step (the step gauge reached its last value), in Prometheus's own
    clock, so neither the scrape interval nor a rank's clock offset moves it. Where the gauge holds one
    value over the whole range (no step in it, or one older than it), the rank's own record of when that
    step ended (its clock) plus one point of the range; a rank with no step yet is absent.

    After a run ends the agent keeps exporting its gauges (for its ``--run-ttl``, 10 minutes by default),
    and where Prometheus saw no staleness marker it repeats a series' last sample for its 5-minute
    lookback: a range query draws the last MFU, and a zero step rate, flat on past the run's end (seen
    with a real agent and Prometheus). :func:`history` cuts each rank there."""
    sel = _selector(run)
    out: dict[int, float] = {}
    for labels, points in client.query_range(f"max by ({RANK_LABEL}) ({METRICS['step']}{sel})", start=start,
                                             end=end, step_s=step_s):
        rank = _rank(labels)
        if rank is None or not points:
            continue
        final = points[-1][1]
        changed = [i for i, (_, v) in enumerate(points) if v != final]
        if changed:
            out[rank] = points[changed[-1] + 1][0]
        elif points[0][0] > start + step_s / 2:  # the series began inside the range: at its first step
            out[rank] = points[0][0]
    for labels, t in client.query(f"max by ({RANK_LABEL}) ({METRICS['step_t']}{sel})"):
        rank = _rank(labels)
        if rank is not None and rank not in out and math.isfinite(t):
            out[rank] = t + step_s
    return out


def history(client: PrometheusClient, *, run: str | None, now: float, minutes: float = 10.0,
            step_s: float = 5.0, window: str = "1m") -> pd.DataFrame:
    """The Live page's time series over the last ``minutes``: ``rank``, ``t`` (Unix seconds), ``series``
    (a key of :func:`series_queries`) and ``value``. Each rank's series end where its steps end
    (:func:`last_steps`): a run that ended, crashed or hangs is not drawn on with its last values."""
    start, rows = now - minutes * 60, []
    ends = last_steps(client, run=run, start=start, end=now, step_s=step_s)
    for series, promql in series_queries(run=run, window=window).items():
        for labels, points in client.query_range(promql, start=start, end=now, step_s=step_s):
            rank = _rank(labels)
            if rank is None:
                continue
            cut = ends.get(rank, math.inf)
            rows.extend((rank, t, series, v) for t, v in points if math.isfinite(v) and t <= cut)
    out = pd.DataFrame(rows, columns=["rank", "t", "series", "value"])
    # A share is a rate over a rate, and Prometheus extrapolates each counter's rate to its window on its
    # own (stopping at zero near a series' start), so the first points of a run can exceed 1 (1.10 seen
    # over a real job): a fraction of wall time is at most 1.
    shares = out["series"].str.endswith("_ratio")
    out.loc[shares, "value"] = out.loc[shares, "value"].clip(0.0, 1.0)
    return out


STALE_AFTER_S = 60.0  # no record for this long, no end: the run may have stopped without saying so


def run_status(client: PrometheusClient, *, run: str, now: float) -> dict:
    """Whether ``run`` is still going, from the agent's run series: ``state`` is "ended" once every rank
    has an end event, "crashed" after a crash event, "quiet" when no record came for ``STALE_AFTER_S``,
    else "running"; with ``last_record`` (Unix seconds), ``world_size``, ``ended_ranks`` and ``crashes``."""
    sel = _selector(run)

    def one(promql: str) -> float | None:
        rows = client.query(promql)
        return rows[0][1] if rows and math.isfinite(rows[0][1]) else None

    last = one(f"max({METRICS['last_record']}{sel})")
    world = one(f"max({METRICS['world_size']}{sel})")
    ended = one(f"sum({METRICS['events']}{_selector(run, kind='end')})") or 0.0
    crashes = one(f"sum({METRICS['events']}{_selector(run, kind='crash')})") or 0.0
    if world and ended >= world:
        state = "ended"
    elif crashes:
        state = "crashed"
    elif last is not None and now - last > STALE_AFTER_S:
        state = "quiet"
    else:
        state = "running"
    return {"state": state, "last_record": last, "world_size": world, "ended_ranks": ended, "crashes": crashes}
