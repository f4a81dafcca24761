"""Figures of ``bench/scale_bucket.py``: the bucket's totals, freshness as the reader sees it, CPU and memory
snapshots of the agents, the writer and moto, and the summary table. Split from the harness so that each
file holds one concern: this one measures and prints, the harness starts and stops things."""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

GOAL_FRESH_P95_S = 15.0
GOAL_PAGE_S = 2.0
AGENT_METRICS = {  # /metrics sample -> short name
    "meshscope_agent_upload_parts_total": "upload_parts", "meshscope_agent_upload_bytes_total": "upload_bytes",
    "meshscope_agent_upload_errors_total": "upload_errors", "meshscope_agent_upload_pending_parts": "pending_parts",
    "meshscope_agent_store_parts_written_total": "parts_written", "meshscope_agent_lag_seconds": "lag_s",
    "meshscope_agent_poll_duration_seconds": "poll_s", "meshscope_agent_backlog_bytes": "backlog_bytes",
}


def bucket_totals(url: str) -> dict:
    from pyarrow import fs

    from meshscope.agent.store import objectstore
    from meshscope.agent.contract.storelayout import TABLE_KEY

    u = objectstore.parse_url(url)
    infos = [i for i in objectstore.filesystem().get_file_info(fs.FileSelector(u.path(), recursive=True,
                                                                               allow_not_found=True))
             if i.type == fs.FileType.File]
    by_kind: dict[str, int] = {}
    for i in infos:
        rel = i.path[len(u.path()) + 1:]
        m = TABLE_KEY.match(rel)
        if m:
            by_kind[m["kind"]] = by_kind.get(m["kind"], 0) + 1
    return {"objects": len(infos), "bytes": sum(int(i.size or 0) for i in infos), "objects_by_kind": by_kind}


# -------------------------------------------------------------------------------------------- freshness

class Freshness:
    """Polls the bucket through the reader; records when each (rank, step) first shows."""

    def __init__(self, url: str, *, run: str, ranks: int) -> None:
        from meshscope.agent.store import objectstore

        self.url, self.parsed, self.run = url, objectstore.parse_url(url), run
        self.seen: dict[tuple[int, int], float] = {}  # (rank, step) -> freshness (visible - t_end)
        self.next = dict.fromkeys(range(ranks), 0)  # per rank: the lowest step not yet seen
        self.polls: list[dict] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()  # seen: written by the polling thread, read by the main one
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> dict:
        from meshscope.agent.store import remote
        from meshscope.agent.store.reader import Store, StoreError, read_table

        t0 = time.time()
        try:
            res = remote.sync(self.parsed, min_interval_s=0)
            t1 = time.time()
            store = Store.open(self.url)  # synced a moment ago: no second listing
            lo = min(self.next.values())
            df = read_table(store, "step", run=self.run, steps=(lo, None), columns=["rank", "step", "t_end"])
        except (OSError, StoreError) as exc:  # the endpoint's trouble is a figure, not the end of the bench
            self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            return {"t": t0, "error": self.errors[-1]}
        except Exception as exc:  # noqa: BLE001 - a reader bug too: reported with the figures, not lost in a thread
            import traceback

            self.errors.append("".join(traceback.format_exception(exc))[-600:])
            return {"t": t0, "error": self.errors[-1]}
        t2 = time.time()
        new = 0
        with self.lock:
            for rank, step, t_end in zip(df["rank"].tolist(), df["step"].tolist(), df["t_end"].tolist()):
                if (rank, step) not in self.seen:
                    self.seen[(rank, step)] = t2 - t_end
                    new += 1
        for rank in self.next:
            while (rank, self.next[rank]) in self.seen:
                self.next[rank] += 1
        rec = {"t": t0, "sync_s": t1 - t0, "read_s": t2 - t1, "listed": res.listed, "downloaded": res.downloaded,
               "step_files": len(store.files("step", runs=[self.run])), "new": new, "load1": os.getloadavg()[0]}
        self.polls.append(rec)
        return rec

    def complete(self, expected: set[tuple[int, int]]) -> bool:
        with self.lock:
            return expected <= self.seen.keys()

    def start(self, *, interval_s: float, t0: float) -> None:
        """Poll every ``interval_s`` (or back to back when a poll takes longer) on a thread of its own, so
        that a slow sync never delays the window's CPU snapshots."""
        every = max(1, round(10 / interval_s))

        def loop() -> None:
            due, said = time.time(), None
            while not self.stop.is_set():
                p = self.poll()
                if "error" in p:
                    if p["error"] != said:  # an outage is one line, not one per read
                        print(f"  t={p['t'] - t0:6.1f}s  read failed: {p['error']}", flush=True)
                        said = p["error"]
                elif len(self.polls) % every == 0:
                    print(f"  t={p['t'] - t0:6.1f}s  sync {p['sync_s']:.2f}s ({p['listed']} parts listed, "
                          f"{p['downloaded']} new)  read {p['read_s']:.2f}s ({p['step_files']} step files)  "
                          f"{len(self.seen)} (rank, step) seen  load {p['load1']:.1f}", flush=True)
                due = max(due + interval_s, time.time())
                self.stop.wait(due - time.time())
        self._thread = threading.Thread(target=loop, name="freshness", daemon=True)
        self._thread.start()

    def close(self, *, timeout_s: float = 120.0) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)  # a sync in flight finishes first


# ---------------------------------------------------------------------------------------------- helpers

def process_cpu_s(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.NoSuchProcess:
        return 0.0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def summary(values: list[float]) -> dict:
    return {"n": len(values), "min": min(values) if values else None,
            "mean": statistics.fmean(values) if values else None, "p50": _pct(values, 50),
            "p95": _pct(values, 95), "max": max(values) if values else None}


def scrape_all(agents, pool: ThreadPoolExecutor) -> list[dict]:
    def one(a) -> dict:
        try:
            m = a.scrape(timeout_s=30)
        except OSError:
            return {}
        return {short: m.value(name) or 0.0 for name, short in AGENT_METRICS.items()}
    return list(pool.map(one, agents))


def _uss_pss(pid: int) -> tuple[int, int]:
    try:
        m = psutil.Process(pid).memory_full_info()  # reads smaps: slower, so at the window's end only
        return m.uss, m.pss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0, 0


def snapshot(agents, writers, moto: psutil.Process | None, pool: ThreadPoolExecutor, *,
             memory: bool = False) -> dict:
    return {"t": time.time(), "agent_cpu": [a.cpu_seconds() for a in agents],
            "agent_mem": [_uss_pss(a.pid) for a in agents] if memory else None,
            "agent_rss": [a.rss_bytes() for a in agents], "metrics": scrape_all(agents, pool),
            "writer_cpu": writers.cpu_seconds(), "moto_cpu": process_cpu_s(moto.pid) if moto else None,
            "moto_rss": moto.memory_info().rss if moto else None,
            "self_cpu": process_cpu_s(os.getpid()), "machine": psutil.cpu_times(), "load": os.getloadavg()}


def window_figures(a: dict, b: dict, *, nodes: int) -> dict:
    wall = b["t"] - a["t"]
    cpu = [(y - x) / wall for x, y in zip(a["agent_cpu"], b["agent_cpu"])]
    rss = [max(x, y) / 2**20 for x, y in zip(a["agent_rss"], b["agent_rss"])]
    delta = {k: sum(m1.get(k, 0) - m0.get(k, 0) for m0, m1 in zip(a["metrics"], b["metrics"]))
             for k in ("upload_parts", "upload_bytes", "upload_errors", "parts_written")}
    end = b["metrics"]
    m0, m1 = a["machine"], b["machine"]
    idle = lambda t: t.idle + getattr(t, "iowait", 0.0)  # noqa: E731
    total_of = lambda t: sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)  # noqa: E731 (in user)
    total = total_of(m1) - total_of(m0)
    return {
        "wall_s": wall,
        "agent_cpu_per_node": {k: v for k, v in summary(cpu).items() if k != "n"},
        "agent_cpu_total_cores": sum(cpu),
        "agent_rss_mib": {"mean": statistics.fmean(rss), "max": max(rss)},
        # RSS counts the shared libraries in every process; USS is what each agent alone holds, PSS its fair share
        "agent_uss_mib_end": {"mean": statistics.fmean(m[0] for m in b["agent_mem"]) / 2**20,
                              "max": max(m[0] for m in b["agent_mem"]) / 2**20},
        "agent_pss_mib_end_total": sum(m[1] for m in b["agent_mem"]) / 2**20,
        "uploads": {**delta, "puts_per_s": delta["upload_parts"] / wall, "mb_per_s": delta["upload_bytes"] / wall / 1e6,
                    "parts_written_per_node_per_s": delta["parts_written"] / wall / nodes,
                    "pending_parts_end": sum(m.get("pending_parts", 0) for m in end),
                    "pending_parts_end_max": max((m.get("pending_parts", 0) for m in end), default=0),
                    "agent_lag_s_max": max((m.get("lag_s", 0) for m in end), default=0),
                    "agent_poll_s_max": max((m.get("poll_s", 0) for m in end), default=0),
                    "backlog_bytes_end": sum(m.get("backlog_bytes", 0) for m in end),
                    "agents_scraped": sum(1 for m in end if m)},
        "writer_cpu_cores": (b["writer_cpu"] - a["writer_cpu"]) / wall,
        "moto_cpu_cores": (b["moto_cpu"] - a["moto_cpu"]) / wall if a["moto_cpu"] is not None else None,
        "moto_rss_mib_end": b["moto_rss"] / 2**20 if b["moto_rss"] is not None else None,
        "bench_reader_cpu_cores": (b["self_cpu"] - a["self_cpu"]) / wall,
        "machine": {"busy": 1 - (idle(m1) - idle(m0)) / total if total > 0 else None, "cpus": psutil.cpu_count(),
                    "load_at_start": a["load"], "load_at_end": b["load"]},
    }



def print_table(r: dict) -> None:
    f, w, d = r["freshness"], r["window"], r["dashboard"]
    up, cpu, h = w["uploads"], w["agent_cpu_per_node"], w["agent_cpu_per_node_halves"]
    ms = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"\n{r['world_size']} ranks on {r['config']['nodes']} nodes, {w['wall_s']:.0f} s window; load "
          f"{' '.join(f'{x:.1f}' for x in r['load_before'])} before, max 1-min {ms(f['load1_max'])} during, "
          f"{' '.join(f'{x:.1f}' for x in r['load_after'])} after; machine busy {100 * w['machine']['busy']:.0f} % of "
          f"{w['machine']['cpus']} CPUs")
    ok = f["p95"] is not None and f["p95"] <= GOAL_FRESH_P95_S and not f["missing"]
    print(f"freshness (step end -> visible via the bucket reader), {f['visible']}/{f['expected']} (rank, step): "
          f"p50 {ms(f['p50'])} s, p95 {ms(f['p95'])} s, max {ms(f['max'])} s "
          f"[goal p95 <= {GOAL_FRESH_P95_S:.0f} s: {'met' if ok else 'NOT met'}]")
    rd = f["reader"]
    print(f"  reader: a read every {ms(rd['cycle_s']['p50'])} s (p50); per read, sync p50 {ms(rd['sync_s']['p50'])} s "
          f"(max {ms(rd['sync_s']['max'])}), read p50 {ms(rd['read_s']['p50'])} s (max {ms(rd['read_s']['max'])}); "
          f"{rd['listed_end']} parts listed, {rd['step_files_end']} step files at the end")
    print(f"agent CPU per node: mean {100 * cpu['mean']:.1f} %, p95 {100 * cpu['p95']:.1f} %, max {100 * cpu['max']:.1f} % "
          f"of a core (all agents {w['agent_cpu_total_cores']:.2f} cores; mean {100 * h[0]:.1f} % then {100 * h[1]:.1f} % "
          f"over the window's halves); RSS mean {w['agent_rss_mib']['mean']:.0f} MiB (max {w['agent_rss_mib']['max']:.0f}), "
          f"USS mean {w['agent_uss_mib_end']['mean']:.0f} MiB, PSS of all agents {w['agent_pss_mib_end_total']:.0f} MiB")
    print(f"uploads: {up['upload_parts']:.0f} parts ({up['puts_per_s']:.1f} PUT/s, {up['mb_per_s']:.2f} MB/s), "
          f"{up['upload_errors']:.0f} errors, {up['pending_parts_end']:.0f} pending at the end (max "
          f"{up['pending_parts_end_max']:.0f} on one agent); {up['parts_written_per_node_per_s']:.2f} parts written "
          f"per node per s")
    print(f"other CPU: writer {w['writer_cpu_cores']:.2f} cores (max tick "
          f"{max((x['max_tick_s'] for x in r['writer']), default=0):.2f} s), moto {ms(w['moto_cpu_cores'])} cores, "
          f"bench reader {w['bench_reader_cpu_cores']:.2f} cores")
    b = r["bucket"]
    print(f"bucket: {b['objects']} objects, {b['bytes'] / 1e6:.1f} MB ({b['objects_by_kind']})")
    print(f"dashboard over the bucket: first sync {d['first_sync_s']:.2f} s ({'cold cache, ' if d['first_sync_cold'] else ''}"
          f"{d['first_sync_parts']} parts, {d['first_sync_mb']:.1f} MB downloaded), then {d['warm_sync_s']:.2f} s per "
          f"page load (a listing)")
    print(f"  {'page':<14}{'first s':>9}{'median s':>10}  goal {GOAL_PAGE_S:.0f} s (median + warm sync)")
    for name, p in d["pages"].items():
        total = p["median_s"] + d["warm_sync_s"]
        print(f"  {name:<14}{p['first_s']:>9.2f}{p['median_s']:>10.2f}  {'ok' if total <= GOAL_PAGE_S else 'OVER'}")
    print(f"  {'report build':<14}{d['report']['first_s']:>9.2f}{d['report']['median_s']:>10.2f}")
    st = r["agents_stop"]
    print(f"agents' SIGTERM: all exited in {st['s']:.1f} s, exit codes {st['exit_codes']}, {st['agents_with_stderr']} wrote "
          f"to stderr{': ' + '; '.join(st['stderr_last_lines'])[:300] if st['stderr_last_lines'] else ''}")
