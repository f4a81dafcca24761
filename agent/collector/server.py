"""The one place the agent's HTTP endpoint is created: plain HTTP, or HTTPS and/or HTTP basic auth.

    serve_metrics(registry, host="127.0.0.1", port=9477)                  # http://host:port/metrics
    serve_metrics(registry, host=..., port=..., web=WebConfig(tls_cert=..., tls_key=...,
                                                              basic_auth_file=...))

The exposition itself is prometheus-client's WSGI app (it negotiates OpenMetrics, which carries the
histogram exemplars, with Prometheus). Around it this module adds what a node agent needs when the
scraper is slow, stuck or hostile, none of which may reach the ingest loop or the training ranks:

- one thread per connection, at most ``max_connections`` at a time; a connection beyond that is closed
  at once instead of queuing a thread;
- a socket timeout per connection (``connection_timeout_s``): a client that connects and sends nothing,
  or never reads the response, is dropped after it; and a lifetime per connection
  (``connection_deadline_s``), enforced by one reaper thread, for clients that dribble (a slowloris
  sending a byte just often enough, a reader taking a byte at a time);
- the TLS handshake runs in the connection's own thread, under that timeout. prometheus-client's
  ``start_http_server(certfile=...)`` wraps the *listening* socket, so the handshake runs in the accept
  loop: one client that opens a TCP connection and never sends a ClientHello blocks every later scrape;
- basic auth (``agent.security.Credentials``) answers 401 with ``WWW-Authenticate`` before the
  registry is touched;
- nothing is logged per request or per failed connection (a port scanner must not fill the log).

A scrape reads ``MetricsState`` under its lock only while the response body is built; writing it to a
slow client happens after the lock is released.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from socketserver import ThreadingMixIn
from threading import BoundedSemaphore, Event, Lock, Thread
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from meshscope.agent.security import Credentials, parse_basic_authorization

REALM = "meshscope"


@dataclass(kw_only=True, slots=True)
class WebConfig:
    """TLS and basic auth for /metrics (all off by default) and the connection limits."""

    tls_cert: Path | None = None  # PEM certificate (chain); with tls_key: serve HTTPS only
    tls_key: Path | None = None
    basic_auth_file: Path | None = None  # user:hash lines, see agent.security
    connection_timeout_s: float = 10.0  # per socket operation (idle client)
    connection_deadline_s: float = 30.0  # whole connection, request and response
    max_connections: int = 64

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if not 0 < self.connection_timeout_s <= self.connection_deadline_s:
            raise ValueError(f"connection timeout ({self.connection_timeout_s}) must be > 0 and at most the "
                             f"connection deadline ({self.connection_deadline_s})")
        if self.max_connections < 1:
            raise ValueError(f"max connections ({self.max_connections}) must be >= 1")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server TLS context (TLS 1.2+), or None without TLS. Raises ValueError (one line) when the
        certificate or key cannot be loaded."""
        if not self.tls:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(certfile=str(self.tls_cert), keyfile=str(self.tls_key))
        except (OSError, ssl.SSLError) as exc:
            reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
            raise ValueError(f"cannot load TLS certificate {str(self.tls_cert)!r} / key {str(self.tls_key)!r}: "
                             f"{reason}") from None
        return ctx

    def credentials(self) -> Credentials | None:
        """The basic-auth users, or None without basic auth. Raises ValueError (one line)."""
        return None if self.basic_auth_file is None else Credentials.load(self.basic_auth_file)


@dataclass(slots=True)
class MetricsServer:
    httpd: WSGIServer
    thread: Thread
    scheme: str = "http"
    stats: dict = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.closed.set()


def serve_metrics(registry: CollectorRegistry, *, host: str, port: int, web: WebConfig | None = None,
                  ssl_context: ssl.SSLContext | None = None, credentials: Credentials | None = None,
                  ) -> MetricsServer:
    """Serve ``registry`` at ``http(s)://host:port/metrics`` from a daemon thread (port 0: any free port).

    ``web`` configures TLS / basic auth / limits; an already built ``ssl_context`` or ``credentials``
    take precedence over loading them from ``web`` (the CLI loads them first to report errors before
    binding). Raises OSError when it cannot bind, ValueError for unusable TLS or auth files.
    """
    web = web or WebConfig()
    ctx = ssl_context if ssl_context is not None else web.ssl_context()
    creds = credentials if credentials is not None else web.credentials()
    app = make_wsgi_app(registry)
    if creds is not None:
        app = _basic_auth(app, creds)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_cls = type("_Server", (_MetricsHTTPServer,), {"address_family": family})
    httpd = server_cls((host, port), _Handler)
    httpd.configure(ssl_context=ctx, timeout_s=web.connection_timeout_s, deadline_s=web.connection_deadline_s,
                    max_connections=web.max_connections)
    httpd.set_app(app)
    thread = Thread(target=httpd.serve_forever, name="meshscope-metrics-http", daemon=True)
    thread.start()
    Thread(target=httpd.reap, name="meshscope-metrics-reaper", daemon=True).start()
    return MetricsServer(httpd, thread, scheme="https" if ctx is not None else "http", stats=httpd.stats)


def _basic_auth(app, creds: Credentials):
    def guarded(environ, start_response):
        pair = parse_basic_authorization(environ.get("HTTP_AUTHORIZATION"))
        if pair is None or not creds.check(*pair):
            body = b"401 Unauthorized: this endpoint needs HTTP basic auth\n"
            start_response("401 Unauthorized", [
                ("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"'),
                ("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
            ])
            return [body]
        return app(environ, start_response)

    return guarded


class _NullStream:
    """wsgi.errors sink: a client that disconnects or times out is not worth a traceback."""

    def write(self, _text: str) -> int:
        return 0

    def writelines(self, _lines) -> None:
        pass

    def flush(self) -> None:
        pass


class _Handler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = self.server.timeout_s  # StreamRequestHandler applies it to the connection
        super().setup()

    def get_stderr(self):
        return _NullStream()

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        pass


class _MetricsHTTPServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True

    def configure(self, *, ssl_context: ssl.SSLContext | None, timeout_s: float, deadline_s: float,
                  max_connections: int) -> None:
        self.ssl_context = ssl_context
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.slots = BoundedSemaphore(max_connections)
        self.closed = Event()
        self._live: dict[int, tuple[socket.socket, float]] = {}  # id -> (raw socket, deadline)
        self._live_lock = Lock()
        # Connection outcomes (for tests and debugging; not exported: no catalog entry).
        self.stats = {"refused_busy": 0, "failed": 0, "reaped": 0}

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.stats["refused_busy"] += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        conn = request
        with self._live_lock:
            self._live[id(request)] = (request, time.monotonic() + self.deadline_s)
        try:
            request.settimeout(self.timeout_s)
            if self.ssl_context is not None:
                # Handshake here, in this connection's thread and under its timeout.
                conn = self.ssl_context.wrap_socket(request, server_side=True)
            self.finish_request(conn, client_address)
        except Exception:  # noqa: BLE001 - timeouts, resets, failed handshakes, plain HTTP on the TLS port
            self.stats["failed"] += 1
        finally:
            with self._live_lock:
                self._live.pop(id(request), None)
            self.shutdown_request(conn)
            self.slots.release()

    def reap(self) -> None:
        """Shut down connections past their deadline; their threads then fail out of their read/write."""
        while not self.closed.wait(min(1.0, self.deadline_s / 4)):
            now = time.monotonic()
            with self._live_lock:
                expired = [sock for sock, deadline in self._live.values() if deadline <= now]
            for sock in expired:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    self.stats["reaped"] += 1
                except OSError:
                    pass

    def handle_error(self, request, client_address) -> None:
        self.stats["failed"] += 1
