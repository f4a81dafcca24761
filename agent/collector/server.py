"""The one place the agent's HTTP endpoint is created (TLS and basic auth will be added here)."""

from __future__ import annotations

from dataclasses import dataclass
from threading import Thread

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry


@dataclass(slots=True)
class MetricsServer:
    httpd: object
    thread: Thread

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_metrics(registry: CollectorRegistry, *, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` at http://host:port/metrics from a daemon thread (port 0: any free port).

    prometheus-client negotiates the format: Prometheus asks for OpenMetrics, which carries the
    histogram exemplars; plain clients get the text format. Raises OSError when it cannot bind.
    """
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(httpd, thread)
