"""A real HTTP server on 127.0.0.1 that answers ``/api/v1/query`` and ``/api/v1/query_range`` the way
Prometheus does, for the dashboard's Live page tests (unit, AppTest and browser tiers). Values per rank are
fixed so tests can assert on them; the run is running (its last record 1 s old, no end event; each rank's
step gauge advances ``STEPS_PER_S`` over a range and reads 100 + rank now); every query received is
recorded. ``ended_at``: the run ended then (every rank's end event, its last records then), and every
series repeats its last value after it, as Prometheus answers while the agent still exports an ended run.
The real-Prometheus tests are in test_dashboard_live.py."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from meshscope.dashboard.live import METRICS
from tests.support.harness import free_port  # noqa: E402,F401


STEPS_PER_S = 2.0


def value_for(query: str, rank: int, *, behind_s: float = 0.0) -> float | None:
    """The value a live query evaluates to for one rank (phase shares are answered as ratios directly);
    ``behind_s``: that long before the rank's newest step (the step gauge reads that many steps less)."""
    if 'phase="compute"' in query:
        return 0.5 + 0.01 * rank
    if 'phase="exposed_comm"' in query:
        return 0.2
    if METRICS["mfu"] in query:
        return 0.4
    if METRICS["steps"] in query:
        return 2.0
    if METRICS["step_t"] in query:
        return None  # answered per instant by the server (it depends on the clock)
    if METRICS["step"] in query:
        return 100.0 + rank - (behind_s * STEPS_PER_S) // 1
    return None


class FakePrometheus:
    def __init__(self, *, ranks: int = 4, run: str = "live-run", ended_at: float | None = None) -> None:
        self.ranks, self.run, self.ended_at = ranks, run, ended_at
        self.queries: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server API)
                url = urllib.parse.urlparse(self.path)
                args = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
                query = args.get("query", "")
                if url.path == "/api/v1/query":
                    data = {"resultType": "vector", "result": fake.result(query)}
                elif url.path == "/api/v1/query_range":
                    data = {"resultType": "matrix", "result": fake.range_result(
                        query, float(args["start"]), float(args["end"]), float(args["step"]))}
                else:
                    self.send_error(404)
                    return
                fake.queries.append(query)
                body = json.dumps({"status": "success", "data": data}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # keep test output quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def result(self, query: str) -> list[dict]:
        now = time.time()
        if query == "vector(1)":
            return [{"metric": {}, "value": [now, "1"]}]
        if query.startswith("count by (run)"):
            return [{"metric": {"run": self.run}, "value": [now, str(self.ranks)]}]
        last = now - 1 if self.ended_at is None else self.ended_at
        ended = self.ended_at is not None and 'kind="end"' in query
        whole_run = {METRICS["last_record"]: last, METRICS["world_size"]: self.ranks,
                     METRICS["events"]: self.ranks if ended else 0}
        for name, value in whole_run.items():
            if name in query:
                return [{"metric": {}, "value": [now, repr(float(value))]}]
        if METRICS["step_t"] in query:
            return [{"metric": {"rank": str(r)}, "value": [now, repr(last)]} for r in range(self.ranks)]
        out = []
        for rank in range(self.ranks):
            v = value_for(query, rank)
            if v is not None:
                out.append({"metric": {"rank": str(rank)}, "value": [now, repr(v)]})
        return out

    def range_result(self, query: str, start: float, end: float, step: float) -> list[dict]:
        times = [start + i * step for i in range(int((end - start) // step) + 1)]
        newest = end if self.ended_at is None else self.ended_at
        out = []
        for rank in range(self.ranks):
            values = [value_for(query, rank, behind_s=max(0.0, newest - t)) for t in times]
            if None not in values:
                out.append({"metric": {"rank": str(rank)}, "values": [[t, repr(v)] for t, v in zip(times, values)]})
        return out

    def __enter__(self) -> FakePrometheus:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
