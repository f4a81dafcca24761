"""Push the agent's metrics over OTLP/HTTP (protobuf) with the OpenTelemetry SDK (``--otlp-endpoint``).

One source of truth: each push converts what the agent's registry yields at that moment, i.e. the very
families ``/metrics`` serves (built from ``agent.catalog``), into OTLP ``MetricsData`` and hands it to the
SDK's ``OTLPMetricExporter``, which encodes and sends it. The SDK has no observable histogram and its
instruments would aggregate again what the agent already aggregated, so the data points are built here.

Mapping (names stay the PromQL names, so queries and rules carry over to an OTLP backend)::

    catalog type   OTLP                                              name
    counter        Sum, monotonic, cumulative                        meshscope_rank_steps_total (keeps _total)
    gauge          Gauge                                             meshscope_rank_mfu_ratio
    histogram      Histogram, cumulative: explicit bounds = the      meshscope_step_wall_seconds (no _bucket,
                   finite ``le``s, per-bucket counts, sum, count,    _sum, _count)
                   exemplars (rank, step) of the slowest steps
    info           Gauge of 1, the metadata labels as attributes     meshscope_run_info (keeps _info)

Units are UCUM, as OTLP expects: seconds → ``s``, bytes → ``By``, ratio → ``1``, watts → ``W``, celsius →
``Cel``, hertz → ``Hz``; counts have no unit (not ``1``: a Collector's Prometheus exporter would add
``_ratio`` to a gauge of unit ``1``). Every name already ends in its unit word, so a Collector translating
back to Prometheus adds no suffix twice. Attributes are the Prometheus labels (strings). A cumulative
point starts at the pusher's start (the agent's counters count from there) or, for a series born later or
that went backwards (a run that expired and came back), at the previous push.

Resource: ``service.name=meshscope-agent``, ``service.version`` (meshscope's), ``host.name``, plus
``OTEL_RESOURCE_ATTRIBUTES``. Headers, TLS files, timeout and compression come from the standard
``OTEL_EXPORTER_OTLP_*`` variables, which the SDK reads. A failed push is counted
(``meshscope_agent_otlp_export_errors_total``, on /metrics and in the next push), warned about at most once
a minute and never raised: it runs on its own daemon thread, so neither ingest nor /metrics waits for it.

The OpenTelemetry packages are imported only when a pusher is built (an agent with ``--otlp-endpoint``);
nothing of the in-process instrumentation imports this module.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from meshscope.agent.catalog import BASE_UNITS, CATALOG, MetricSpec, spec
from meshscope.agent.contract import Clock

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import HistogramDataPoint, MetricsData
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

UNITS = {"seconds": "s", "bytes": "By", "ratio": "1", "watts": "W", "celsius": "Cel", "hertz": "Hz", "": ""}
assert set(UNITS) == {*BASE_UNITS, ""}, "a catalog unit without its UCUM code"
SIGNAL_PATH = "/v1/metrics"  # the OTLP/HTTP metrics path, appended to a URL that has none
INTERVAL_S = 15.0
WARN_EVERY_S = 60.0
STOP_WAIT_S = 5.0  # how long shutdown waits for the last push (a receiver that is down must not hold it)
SERVICE_NAME = "meshscope-agent"
ERRORS = spec("agent_otlp_export_errors_total")
_BY_FAMILY: dict[str, MetricSpec] = {s.family_name: s for s in CATALOG}


def endpoint_url(url: str) -> str:
    """The OTLP/HTTP metrics URL for ``url``: http(s) with a host; ``/v1/metrics`` when it has no path.
    Raises ValueError naming the value otherwise."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number or out of range
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        valid = False
    if not valid or any(c.isspace() for c in url):
        raise ValueError(f"OTLP endpoint {url!r} must be an http:// or https:// URL with a host "
                         "(e.g. http://collector:4318)")
    return urlunsplit(parts._replace(path=parts.path if parts.path not in ("", "/") else SIGNAL_PATH))


@dataclass(kw_only=True, slots=True)
class OtlpConfig:
    endpoint: str  # as given; ``url`` is where the pushes go
    interval_s: float = INTERVAL_S
    timeout_s: float | None = None  # per push, the SDK's retries included; None: OTEL_EXPORTER_OTLP_TIMEOUT or 10
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = endpoint_url(self.endpoint)
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"OTLP interval ({self.interval_s}) must be > 0")
        if self.timeout_s is not None and not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"OTLP timeout ({self.timeout_s}) must be > 0")


def _stderr_warning(message: str) -> None:
    print(f"meshscope agent: warning: {message}", file=sys.stderr, flush=True)


class OtlpPusher:
    """Pushes ``registry`` to ``config.url`` every ``config.interval_s`` from a daemon thread (``start``),
    and once more on ``stop``. Registers ``meshscope_agent_otlp_export_errors_total`` on ``registry``."""

    def __init__(self, registry: CollectorRegistry, *, config: OtlpConfig, host: str, version: str, clock: Clock,
                 warn: Callable[[str], None] = _stderr_warning) -> None:
        # Here, not at module level: only an agent with --otlp-endpoint pays for importing the SDK.
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.config = config
        self.errors = 0
        self._registry = registry
        self._clock = clock
        self._warn = warn
        self._resource = Resource.create({"service.name": SERVICE_NAME, "service.version": version,
                                          "host.name": host})
        self._scope = InstrumentationScope(__name__, version)
        self._exporter = OTLPMetricExporter(endpoint=config.url, timeout=config.timeout_s)
        self._starts = StartTimes(_ns(clock.now()))
        # The SDK logs every failed attempt; the reason goes into our rate-limited warning instead.
        self._sdk_log = _LastMessage()
        self._sdk_logger = logging.getLogger(OTLPMetricExporter.__module__)
        self._sdk_logger.addFilter(self._sdk_log)
        self._lock = threading.Lock()  # one push at a time (the thread's, or run_once's)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._warned_at: float | None = None
        self._unwarned = 0
        registry.register(_ErrorsCollector(self))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="meshscope-otlp", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            self.push()
        self.push()  # the last push: what the agent held at shutdown

    def push(self) -> bool:
        """One export of the registry as it is now; True when the receiver took it."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        with self._lock:
            self._sdk_log.last = None
            try:
                data = to_metrics_data(self._registry.collect(), resource=self._resource, scope=self._scope,
                                       now_ns=_ns(self._clock.now()), starts=self._starts)
                ok = self._exporter.export(data) is MetricExportResult.SUCCESS
                reason = self._sdk_log.last or "the exporter reported a failure"
            except Exception as exc:  # noqa: BLE001 - telemetry failures are counted, never raised
                ok, reason = False, f"{type(exc).__name__}: {exc}"
            if not ok:
                self._failed(reason)
            return ok

    def _failed(self, reason: str) -> None:
        self.errors += 1
        self._unwarned += 1
        now = self._clock.now()
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
            self._warn(f"OTLP push to {self.config.url} failed ({self._unwarned} failed since the last warning, "
                       f"{self.errors} in all): {reason}")
            self._warned_at, self._unwarned = now, 0

    def stop(self) -> None:
        """Stop the thread after its last push (bounded by ``STOP_WAIT_S``); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)
        self._exporter.shutdown()  # also cuts short a retry the last push may still be waiting on
        if self._thread is not None:
            self._thread.join(1.0)
        self._sdk_logger.removeFilter(self._sdk_log)


class _LastMessage(logging.Filter):
    """Keeps the SDK exporter's last log message (the failure's reason) and drops the record."""

    def __init__(self) -> None:
        super().__init__()
        self.last: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        self.last = record.getMessage()
        return False


class _ErrorsCollector(Collector):
    """The pusher's health, served with the rest::

        # TYPE meshscope_agent_otlp_export_errors_total counter
        meshscope_agent_otlp_export_errors_total 0.0
    """

    def __init__(self, pusher: OtlpPusher) -> None:
        self._pusher = pusher

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(ERRORS.family_name, ERRORS.help, labels=ERRORS.labels)
        family.add_metric([], self._pusher.errors)
        yield family

    def describe(self) -> list[Metric]:
        return list(self.collect())


class StartTimes:
    """Start time of each cumulative series: the previous push for a series not in it (a new one, or one
    that came back after its run expired) or one that went backwards (a reset); else what it had. Before
    the first push, "the previous push" is the pusher's start. Series gone from a push are forgotten."""

    def __init__(self, t0_ns: int) -> None:
        self._previous_ns = t0_ns
        self._seen: dict[tuple, tuple[int, float]] = {}
        self._next: dict[tuple, tuple[int, float]] = {}

    def start(self, key: tuple, *, value: float) -> int:
        start, last = self._seen.get(key, (self._previous_ns, value))
        if value < last:
            start = self._previous_ns
        self._next[key] = (start, value)
        return start

    def commit(self, now_ns: int) -> None:
        self._seen, self._next, self._previous_ns = self._next, {}, now_ns


def to_metrics_data(families: Iterable[Metric], *, resource: Resource, scope: InstrumentationScope, now_ns: int,
                    starts: StartTimes) -> MetricsData:
    """Prometheus metric families (as the registry yields them) → OTLP ``MetricsData`` (see the module
    docstring for the mapping). Families outside the catalog are not pushed: the catalog is the contract."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality, Gauge, Histogram, Metric as OtlpMetric, MetricsData, NumberDataPoint,
        ResourceMetrics, ScopeMetrics, Sum,
    )

    cumulative = AggregationTemporality.CUMULATIVE
    metrics = []
    for family in families:
        entry = _BY_FAMILY.get(family.name)
        if entry is None:
            continue
        if entry.type == "histogram":
            data = Histogram(data_points=_histogram_points(family, entry=entry, now_ns=now_ns, starts=starts),
                             aggregation_temporality=cumulative)
        else:
            # Only the sample that carries the value (a counter family could also hold _created samples).
            samples = [s for s in family.samples if s.name == entry.name]
            if entry.type == "counter":
                data = Sum(data_points=[
                    NumberDataPoint(attributes=dict(s.labels), value=float(s.value), time_unix_nano=now_ns,
                                    start_time_unix_nano=starts.start((entry.name, *sorted(s.labels.items())),
                                                                      value=float(s.value)))
                    for s in samples], aggregation_temporality=cumulative, is_monotonic=True)
            else:  # gauge, and info (a gauge of 1 whose labels are the metadata)
                data = Gauge(data_points=[
                    NumberDataPoint(attributes=dict(s.labels), value=float(s.value), time_unix_nano=now_ns,
                                    start_time_unix_nano=0)  # a gauge has no start
                    for s in samples])
        metrics.append(OtlpMetric(name=entry.name, description=entry.help, unit=UNITS[entry.unit], data=data))
    starts.commit(now_ns)
    return MetricsData(resource_metrics=[ResourceMetrics(
        resource=resource, schema_url="", scope_metrics=[ScopeMetrics(scope=scope, metrics=metrics, schema_url="")])])


def _histogram_points(family: Metric, *, entry: MetricSpec, now_ns: int, starts: StartTimes,
                      ) -> list[HistogramDataPoint]:
    """Prometheus keeps cumulative ``le`` buckets; OTLP wants the count of each bucket on its own."""
    from opentelemetry.sdk.metrics import Exemplar
    from opentelemetry.sdk.metrics.export import HistogramDataPoint

    series: dict[tuple, dict] = {}
    for s in family.samples:
        labels = dict(s.labels)
        le = labels.pop("le", None)
        one = series.setdefault(tuple(sorted(labels.items())), {"buckets": [], "sum": 0.0, "count": 0})
        kind = s.name.removeprefix(entry.name)
        if kind == "_bucket":
            one["buckets"].append((float(le), s.value, s.exemplar))
        elif kind in ("_sum", "_count"):
            one[kind[1:]] = s.value
    points = []
    for key, one in series.items():
        buckets = sorted(one["buckets"], key=lambda b: b[0])
        assert buckets and math.isinf(buckets[-1][0]), f"{entry.name}: no +Inf bucket"
        totals = [int(b[1]) for b in buckets]
        exemplars = [Exemplar(filtered_attributes=dict(ex.labels), value=float(ex.value),
                              time_unix_nano=_ns(ex.timestamp) if ex.timestamp else now_ns)
                     for _, _, ex in buckets if ex is not None]
        points.append(HistogramDataPoint(
            attributes=dict(key), start_time_unix_nano=starts.start((entry.name, *key), value=float(one["count"])),
            time_unix_nano=now_ns, count=int(one["count"]), sum=float(one["sum"]),
            bucket_counts=[t - p for t, p in zip(totals, [0, *totals[:-1]])],
            # Prometheus buckets keep no min or max: left unset rather than guessed from the bounds.
            explicit_bounds=[b[0] for b in buckets[:-1]], min=None, max=None, exemplars=exemplars))
    return points


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))
