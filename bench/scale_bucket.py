"""Scale on loopback: N nodes x 8 ranks of live synthetic spools, one real ``meshscope agent`` per node, all
uploading to one S3 bucket; freshness, agent CPU, uploads, and the dashboard and ``report`` over the bucket.

    python bench/scale_bucket.py [--nodes 128] [--ranks-per-node 8] [--duration 180] [--warmup 30]
                                 [--step-s 2.0] [--flush-s 0.5] [--part-age 5] [--poll-interval 1]
                                 [--read-interval 2] [--writers 1] [--cold-sync] [--endpoint URL --bucket NAME]

Method
1. A moto S3 server on 127.0.0.1 (``tests.support.s3``; or ``--endpoint``, credentials from the
   AWS_* variables) and one bucket; every agent uploads to the same prefix ``s3://BUCKET/scale/<run>-<time>``.
2. One run of world size N x 8: node k's store holds the spools of ranks 8k..8k+7. The records are
   ``tests.support.spoolgen``'s live job (``testing.store``'s Llama-8B pp=4 x fsdp model, the one
   ``bench/dashboard_pages.py`` reads: per rank and step 1 step record, 20 collectives, 8 pipeline spans,
   1 memory record, plus the run record and start/end events), replayed on the wall clock at ``--step-s``
   per step: a collective reaches its rank's spool writer when its t_end has passed, a step's step, span
   and memory records when it has ended, and every ``--flush-s`` each rank's ``SpoolWriter`` (the
   transport's writer) encodes and appends what it got, as a real rank's writer thread does.
3. One ``meshscope agent --store NODE --upload s3://... --part-age S --poll-interval S --gpu-interval 0``
   process per node (``tests.support.harness.AgentProcess``), started before the job.
4. After ``--warmup`` seconds the window of ``--duration`` seconds starts. Throughout, a thread of this
   process reads the bucket like ``report`` does, every ``--read-interval`` s (back to back when a read
   takes longer): a sync of the bucket into the local cache
   (``agent.store.remote.sync``: one listing, then GETs of the new parts) and
   ``read_table(Store.open("s3://..."), "step", run=...)``. A (rank, step) is visible when that read returns
   it; its freshness is that moment minus the step's t_end (the rank's own clock: the same machine). Every
   step that ends inside the window on every rank is counted (p50/p95/max); after the window the reads go
   on until all of them are visible or ``--drain`` s pass (those still missing are reported, and their
   age at that moment is a lower bound). The sync's and the read's own times are reported.
5. Over the window: each agent's CPU seconds / wall seconds (user + system, all its threads; psutil), its
   RSS, and from its /metrics the deltas of the upload counters (parts, bytes, errors), pending parts at
   the end, parts written; the same CPU share for the writer process(es), moto and this process; the
   machine's load average before, during (max) and after, and its CPU busy share.
6. Then the job stops (an ``end`` event per rank), the agents get SIGTERM (final flush and upload; how
   long they take and how they exit is reported), and over the bucket: objects and bytes; a first sync
   into the reads' cache (``--cold-sync``: into an empty one, every part downloaded), a warm sync (one
   listing: what each page load adds); every page of ``bench/dashboard_pages.py`` (first call and median
   of ``--repeat``) on ``Store.open("s3://...")``; ``dashboard.report.build`` (what ``meshscope report``
   computes), first and median.
Output: a short table, then one JSON object on the last line.

What is real and what is synthetic. Real: the agents (the CLI, each a process of its own: ingest, Parquet
parts, compaction, the upload thread, /metrics), the transport writer's encoding and appends, the S3
protocol (pyarrow's S3 client against moto's HTTP server), the reader's sync, DuckDB reads, the dashboard
views and the report. Synthetic: the ranks (no training; the records are a model's, replayed), the
network (loopback: no latency, no bandwidth limit), and the object store: moto is one Python process
keeping objects in memory, much slower per request than S3 or MinIO, so PUT, GET and LIST latencies
and its CPU are a pessimistic stand-in (its CPU share is reported so it can be told apart).

CPU honesty on a 2-core machine. The agents are what is measured, so each is a real process and nothing
else runs inside them. The ranks' own side (building records, encoding frames, appending) runs on the
ranks' hosts in a real cluster; here it would steal the agents' CPU, so all ranks are written by
``--writers`` processes (default 1) with one ``SpoolWriter`` per rank flushed from the writer's loop (no
thread per rank); its CPU is reported (measured alone: 1.3 ms per rank and step at --flush-s 0.5, 0.65 of
a core at 1,024 ranks; ``--flush-s 2``: 0.6 ms, 0.3 of a core, with fewer, larger frames per rank than a
real rank writes). ``writer.max_tick_s`` above ``--flush-s`` means the writer could not keep up and records reached
the spools late (freshness then includes that). With N agents, moto, the writer and the reader sharing
two cores, latencies stretch as soon as the machine is saturated (load average well above 2): the CPU
seconds per agent stay meaningful (they are the work done), the freshness then measures this machine's
contention as much as the design; compare ``machine.busy`` and the load average with the figures.
moto is the first limit: it spends ~5 ms of CPU per request (0.27 cores at 4 nodes, 0.79 at 16 with
part-age 5, measured here), and every flush of an agent PUTs one part per rank and kind (~30 per node per
part-age) which every reader then GETs, so past ~20 nodes on two cores moto cannot keep up: pending parts
(``uploads.pending_parts_end``) and the reader's sync time grow, and freshness measures moto. For the full
128 nodes use ``--endpoint`` with a faster store where one exists, or read the per-agent figures (CPU,
RSS, PUT rate) and scale them. An agent with ``--upload`` shows ~250 MB RSS (~130 MB without it), much of
it shared libraries: the USS and the agents' total PSS, also reported, say what 128 of them really take.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.spoolgen import LiveJob, Schedule, make_template  # noqa: E402
from scale_bucket_figures import (  # noqa: E402
    GOAL_FRESH_P95_S, Freshness, bucket_totals, print_table, process_cpu_s, snapshot, summary, window_figures)

BUCKET = "meshscope-scale"


def node_store(root: Path, node: int) -> Path:
    return root / "nodes" / f"node-{node:04d}"


# ------------------------------------------------------------------------------------------------ writers

def _writer_main(template: str, run: str, ranks: list[int], root: str, step_s: float, flush_s: float,
                 rpn: int, t0, ready, stop, results) -> None:
    """A writer process: the live job of ``ranks`` until ``stop`` (or the bench process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the bench stops us cleanly
    parent = os.getppid()
    job = LiveJob(template, run=run, ranks=ranks, store_of=lambda r: node_store(Path(root), r // rpn),
                  step_s=step_s, flush_s=flush_s, ranks_per_node=rpn)
    ready.put(os.getpid())
    while not t0.value and not stop.is_set():
        stop.wait(0.05)
    if not t0.value:  # stopped before the job began: nothing was written
        results.put({"pid": os.getpid(), "rows": 0, "max_tick_s": 0.0, "late_ticks": 0})
        return
    job.begin(t0.value)
    due, late = t0.value, 0
    while not stop.is_set() and os.getppid() == parent:
        wait = due - time.time()
        if wait > 0:
            stop.wait(wait)
            continue
        job.tick(time.time())
        due += flush_s
        if due < time.time():  # behind by a whole tick: skip ahead (the next tick writes what is due)
            late += 1
            due = time.time()
    job.close()
    results.put({"pid": os.getpid(), "rows": job.rows_written, "max_tick_s": job.max_tick_s, "late_ticks": late})


class Writers:
    """``n`` writer processes (spawned: no inherited threads), the nodes split between them."""

    def __init__(self, n: int, *, template: Path, run: str, nodes: int, rpn: int, root: Path, step_s: float,
                 flush_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.t0, self.stop, self.ready, self.results = ctx.Value("d", 0.0), ctx.Event(), ctx.Queue(), ctx.Queue()
        groups = [list(range(i, nodes, n)) for i in range(min(n, nodes))]
        self.procs = [ctx.Process(target=_writer_main, daemon=True, args=(
            str(template), run, [r for node in g for r in range(node * rpn, (node + 1) * rpn)], str(root),
            step_s, flush_s, rpn, self.t0, self.ready, self.stop, self.results)) for g in groups]
        for p in self.procs:
            p.start()

    def wait_ready(self, *, timeout_s: float) -> None:
        import queue

        deadline, ready = time.monotonic() + timeout_s, 0
        while ready < len(self.procs):
            try:
                self.ready.get(timeout=1.0)
                ready += 1
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"writer processes not ready (exit codes {dead}; see their traceback above)")

    def begin(self, t0: float) -> None:
        self.t0.value = t0

    def cpu_seconds(self) -> float:
        return sum(process_cpu_s(p.pid) for p in self.procs)

    def close(self) -> list[dict]:
        """Stop the job (each rank writes an ``end`` event and its last flush); the writers' figures."""
        self.stop.set()
        out = []
        for _ in self.procs:  # read before joining: a child with unread queue data does not exit
            try:
                out.append(self.results.get(timeout=30))
            except Exception:  # noqa: BLE001 - queue.Empty: a writer that died or hangs; terminated below
                break
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        return out


# -------------------------------------------------------------------------------------------- the bucket

@contextmanager
def endpoint(args) -> Iterator[tuple[str, psutil.Process | None]]:
    """(endpoint URL, moto's process or None), the bucket created, the AWS variables set for the agents
    (which inherit this environment) and for this process's readers."""
    from tests.support.s3 import moto_server, s3_env

    if args.endpoint:  # the caller's credentials and region where set, moto's test ones otherwise
        for k, v in s3_env(args.endpoint).items():
            os.environ.setdefault(k, v)
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
        _create_bucket(args.bucket)
        yield args.endpoint, None
        return
    with moto_server() as moto:
        os.environ.update(s3_env(moto.endpoint))
        moto.create_bucket(args.bucket)
        yield moto.endpoint, psutil.Process(moto.proc.pid)


def _create_bucket(bucket: str) -> None:
    from pyarrow import fs

    from meshscope.agent.store.objectstore import endpoint_from_env

    s3 = fs.S3FileSystem(endpoint_override=endpoint_from_env(), allow_bucket_creation=True)
    if s3.get_file_info(bucket).type == fs.FileType.NotFound:
        s3.create_dir(bucket)


# ------------------------------------------------------------------------------------------- dashboard

def dashboard_over_bucket(url: str, *, run: str, repeat: int, cold_cache: Path | None) -> dict:
    """Every dashboard page and the report over the bucket (agents stopped), on the cache the freshness
    reads filled, or on an empty one (``cold_cache``: the first sync downloads every part)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from dashboard_pages import bench_page, pages  # the page benchmark's own functions

    from meshscope.agent.store import objectstore, remote
    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import data, report, views

    if cold_cache is not None:
        os.environ["MESHSCOPE_CACHE_DIR"] = str(cold_cache)
    parsed = objectstore.parse_url(url)
    t = time.perf_counter()
    first = remote.sync(parsed, min_interval_s=0)
    first_s = time.perf_counter() - t
    warm = []
    for _ in range(3):
        t = time.perf_counter()
        remote.sync(parsed, min_interval_s=0)
        warm.append(time.perf_counter() - t)
    store = Store.open(url)
    shared = {"runs_table": data.runs_table(store)}
    out = {"first_sync_cold": cold_cache is not None, "first_sync_s": first_s, "first_sync_parts": first.downloaded,
           "first_sync_mb": first.bytes / 1e6,
           "warm_sync_s": statistics.median(warm), "pages": {}}
    for name, fn in pages(run, [run]).items():
        r = bench_page(store, fn, repeat=repeat, shared={} if name == "runs" else shared)
        out["pages"][name] = {"first_s": r["first_s"], "median_s": r["median_s"], "data_s": r["data_s"]}
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        report.build(views.direct_loader(store), run=run)
        times.append(time.perf_counter() - t)
    out["report"] = {"first_s": times[0], "median_s": statistics.median(times)}
    return out


# ------------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--duration", type=float, default=180.0, help="measured window, seconds")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of the job before the window")
    ap.add_argument("--drain", type=float, default=60.0, help="at most this long after the window for its steps")
    ap.add_argument("--step-s", type=float, default=2.0, help="seconds per training step")
    ap.add_argument("--flush-s", type=float, default=0.5, help="each rank's spool writer flushes this often")
    ap.add_argument("--template-steps", type=int, default=10, help="distinct synthetic steps, replayed cyclically")
    ap.add_argument("--writers", type=int, default=1, help="writer processes for all ranks")
    ap.add_argument("--part-age", type=float, default=5.0, help="agent --part-age (the agent's default is 30)")
    ap.add_argument("--poll-interval", type=float, default=1.0, help="agent --poll-interval")
    ap.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                    help="one more agent argument, e.g. --agent-arg=--part-bytes=4194304 (repeatable)")
    ap.add_argument("--read-interval", type=float, default=2.0, help="seconds between the bench's bucket reads")
    ap.add_argument("--repeat", type=int, default=3, help="calls per dashboard page after the run")
    ap.add_argument("--cold-sync", action="store_true",
                    help="read the pages from an empty cache (times downloading every part: long on moto at scale)")
    ap.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of starting moto")
    ap.add_argument("--bucket", default=BUCKET)
    ap.add_argument("--keep", action="store_true", help="keep the node stores and caches (path printed)")
    a = ap.parse_args(argv)
    if a.nodes < 1 or a.ranks_per_node < 1 or (a.nodes * a.ranks_per_node) % 4 or a.nodes * a.ranks_per_node < 8:
        ap.error("nodes x ranks-per-node must be a multiple of 4 and >= 8 (the model is pp=4 x fsdp)")
    if min(a.duration, a.step_s, a.flush_s, a.part_age, a.poll_interval, a.read_interval) <= 0 or a.warmup < 0:
        ap.error("durations and intervals must be > 0 (warmup >= 0)")
    return a


def _terminate(*_) -> None:
    raise KeyboardInterrupt  # SIGTERM: the same clean shutdown as Ctrl-C (finally blocks run)


class Agents:
    """One ``meshscope agent`` process per node, started concurrently (each takes seconds to import)."""

    def __init__(self) -> None:
        self.by_node: dict = {}

    def start(self, nodes: int, *, root: Path, extra: tuple[str, ...], poll_interval: float,
              pool: ThreadPoolExecutor) -> None:
        from tests.support.harness import AgentProcess

        def one(node: int) -> None:
            self.by_node[node] = AgentProcess(node_store(root, node), *extra, poll_interval=poll_interval)
        list(pool.map(one, range(nodes)))  # re-raises the first failure; the started ones are in by_node

    @property
    def procs(self) -> list:
        return [self.by_node[n] for n in sorted(self.by_node)]

    def stop(self, *, timeout_s: float = 90.0) -> dict:
        """SIGTERM to all at once (each writes what it buffered and makes a last upload pass), then wait."""
        t = time.perf_counter()
        procs, self.by_node = self.procs, {}
        for p in procs:
            p.signal(signal.SIGTERM)
        codes = []
        for p in procs:
            try:  # wait first: AgentProcess.stop signals again, which kills an agent already finalizing
                p.proc.wait(timeout=max(0.1, t + timeout_s - time.perf_counter()))
            except subprocess.TimeoutExpired:
                pass
            try:
                codes.append(p.stop(timeout_s=10))
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                print(f"scale_bucket: agent {p.pid}: {exc}", file=sys.stderr)
                codes.append(-1)
        errs = [p.stderr.strip() for p in procs if p.stderr.strip()]
        return {"s": time.perf_counter() - t, "exit_codes": sorted(set(codes)), "nonzero_exits": sum(1 for c in codes if c),
                "agents_with_stderr": len(errs), "stderr_last_lines": sorted({e.splitlines()[-1][:200] for e in errs}),
                "stderr_sample": max(errs, key=len)[-2500:] if errs else ""}


def measure(a: argparse.Namespace, *, tmp: Path, result: dict, agents: Agents, writers_box: list,
            pool: ThreadPoolExecutor) -> None:
    world = result["world_size"]
    run = result["run"]
    with endpoint(a) as (ep, moto):
        url = f"s3://{a.bucket}/scale/{run}-{int(time.time())}"
        result["url"] = url
        t = time.perf_counter()
        make_template(tmp / "template", run=run, world_size=world, steps=a.template_steps)
        result["setup"] = {"template_s": time.perf_counter() - t}
        writers = Writers(a.writers, template=tmp / "template", run=run, nodes=a.nodes, rpn=a.ranks_per_node,
                          root=tmp, step_s=a.step_s, flush_s=a.flush_s)
        writers_box.append(writers)
        t = time.perf_counter()
        agents.start(a.nodes, root=tmp, extra=("--part-age", str(a.part_age), "--upload", url, *a.agent_arg),
                     poll_interval=a.poll_interval, pool=pool)
        result["setup"]["agents_start_s"] = time.perf_counter() - t
        writers.wait_ready(timeout_s=600)
        sched = Schedule.of_template(tmp / "template", run=run, step_s=a.step_s)
        sched.t0 = t0 = time.time() + 1.0
        writers.begin(t0)
        print(f"endpoint {ep}, {url}; template {result['setup']['template_s']:.1f} s, {a.nodes} agents started in "
              f"{result['setup']['agents_start_s']:.1f} s; the job starts", flush=True)

        w0, w1 = t0 + a.warmup, t0 + a.warmup + a.duration
        expected = {(r, k) for k in range(sched.step_at(w0), sched.step_at(w1) + 1)
                    if w0 <= sched.step_end(k) <= w1 for r in range(world)}
        fresh = Freshness(url, run=run, ranks=world)
        fresh.start(interval_s=a.read_interval, t0=t0)
        snaps: dict[str, dict] = {}
        try:
            for name, at in (("start", w0), ("mid", (w0 + w1) / 2), ("end", w1)):
                time.sleep(max(0.0, at - time.time()))
                snaps[name] = ({"t": time.time(), "agent_cpu": [p.cpu_seconds() for p in agents.procs]}
                               if name == "mid" else snapshot(agents.procs, writers, moto, pool, memory=name == "end"))
            while not fresh.complete(expected) and time.time() < w1 + a.drain:
                time.sleep(0.2)
        finally:
            fresh.close()
        drained_at = time.time()

        result["window"] = window_figures(snaps["start"], snaps["end"], nodes=a.nodes)
        halves = [sum(b["agent_cpu"]) - sum(a_["agent_cpu"]) for a_, b in ((snaps["start"], snaps["mid"]),
                                                                         (snaps["mid"], snaps["end"]))]
        result["window"]["agent_cpu_per_node_halves"] = [  # does an agent's CPU grow with the run's length?
            h / (b["t"] - a_["t"]) / a.nodes for h, (a_, b) in zip(halves, ((snaps["start"], snaps["mid"]),
                                                                          (snaps["mid"], snaps["end"])))]
        values = [fresh.seen[k] for k in expected if k in fresh.seen]
        missing = [drained_at - sched.step_end(k) for (r, k) in expected if (r, k) not in fresh.seen]
        polls = [p for p in fresh.polls if w0 <= p["t"] <= w1 and "error" not in p]
        result["freshness"] = {
            "expected": len(expected), "visible": len(values), "missing": len(missing),
            "missing_age_min_s": min(missing) if missing else None,
            **{k: v for k, v in summary(values).items() if k != "n"}, "goal_p95_s": GOAL_FRESH_P95_S,
            "reader": {"polls": len(polls), "cycle_s": summary([b["t"] - a_["t"] for a_, b in zip(polls, polls[1:])]),
                       "sync_s": summary([p["sync_s"] for p in polls]),
                       "read_s": summary([p["read_s"] for p in polls]),
                       "listed_end": fresh.polls[-1]["listed"] if fresh.polls else 0,
                       "step_files_end": fresh.polls[-1]["step_files"] if fresh.polls else 0},
            "load1_max": max((p["load1"] for p in polls), default=None),
            "read_errors": len(fresh.errors), "read_error_sample": fresh.errors[:1]}

        result["writer"] = writers.close()
        writers_box.clear()
        result["agents_stop"] = agents.stop()
        result["load_after"] = os.getloadavg()
        result["bucket"] = bucket_totals(url)
        result["dashboard"] = dashboard_over_bucket(url, run=run, repeat=a.repeat,
                                                    cold_cache=tmp / "cache-cold" if a.cold_sync else None)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    world = a.nodes * a.ranks_per_node
    tmp = Path(tempfile.mkdtemp(prefix="meshscope-scale-"))
    os.environ["MESHSCOPE_CACHE_DIR"] = str(tmp / "cache")
    result: dict = {"config": {**vars(a), "cpus": psutil.cpu_count()}, "world_size": world, "run": f"scale{world}",
                    "load_before": os.getloadavg()}
    print(f"scale_bucket: {a.nodes} nodes x {a.ranks_per_node} ranks = {world} ranks, step {a.step_s:g} s, "
          f"window {a.duration:g} s after {a.warmup:g} s; agents --part-age {a.part_age:g} --poll-interval "
          f"{a.poll_interval:g}; load before {' '.join(f'{x:.2f}' for x in result['load_before'])}; work dir {tmp}",
          flush=True)
    agents, writers_box = Agents(), []
    pool = ThreadPoolExecutor(max_workers=8)
    try:
        measure(a, tmp=tmp, result=result, agents=agents, writers_box=writers_box, pool=pool)
    except KeyboardInterrupt:
        print("scale_bucket: interrupted; stopping", file=sys.stderr, flush=True)
        result["interrupted"] = True
    except Exception as exc:  # noqa: BLE001 - the figures gathered so far still go out, with the failure
        import traceback

        result["error"] = "".join(traceback.format_exception(exc))[-2000:]
        print(f"scale_bucket: failed: {result['error']}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        for w in writers_box:
            w.close()
        if agents.by_node:
            agents.stop(timeout_s=30)
        pool.shutdown(wait=False, cancel_futures=True)
        if a.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if "dashboard" in result:
        print_table(result)
    print(json.dumps(result, default=float))
    return 1 if result.get("interrupted") or result.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
