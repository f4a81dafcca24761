"""Dashboard page benchmark: how long each page's data, analysis and figures take on a large store, and
how that grows with the number of ranks.

Method
- One synthetic store (``dashboard.synthetic``) with a run per scale (default 64, 256 and 1,024 ranks) x
  1,000 steps: Llama-8B shape, pp=4 x fsdp=n/4, 1F1B with 4 microbatches (8 spans per rank and step),
  FSDP units merged to 4 per step and direction plus PP send/recv per span (~20 collectives per rank and
  step), per-step memory, NVML samples every ~2 steps, a throttled straggler. Generated once and kept
  under ``.runs/bench_dashboard/`` (gitignored); a marker file records the generator settings.
- Per page, the same function the page calls (``dashboard.views``) with an uncached loader, plus
  serialising every figure to JSON (what Streamlit sends to the browser). Widgets and layout are not
  included. Each page runs ``--repeat`` times; "first" is the first call in this process (OS page cache
  already warm from generation or earlier runs), "median" the median of all calls.
- "data" is the time inside ``dashboard.data`` (DuckDB), "rest" analysis + figures + JSON. A page may
  run independent loads at once (``views.background``): "data" counts the time during which at least one
  load was running, so overlapping loads are not counted twice. The runs table, which the app's sidebar
  loads once (cached) for every page, is timed under Runs only.
- "cpu s": process CPU time (all threads) of the call; DuckDB uses both cores, so on an otherwise idle
  machine the wall time is roughly between cpu/2 and cpu.
- Peak memory: the highest RSS sampled every 2 ms during the call, minus RSS before it (DuckDB's native
  memory included, which tracemalloc would miss).

- ``--layout packs`` (default): the store as packing agents leave it, one pack per host (8 ranks) and kind
  (``agent.store.packs``); ``--layout parts``: one file per rank and kind (the agent with packing off).
- ``--s3``: the generated runs are uploaded to a bucket on a moto S3 server on 127.0.0.1 and every page
  reads ``Store.open("s3://...")``; each page call starts as a dashboard page load does, with
  ``Store.open(url, background_sync=True)`` (the cache as last synced, and a listing on a thread when
  the last one is ``remote.BACKGROUND_INTERVAL_S`` old: it then runs beside the page), included in the
  page's time and shown as "sync s"; ``--sync foreground`` makes each call list the bucket first instead
  (what every page paid before). The first, cold sync downloads everything and is reported on its own,
  and so is one warm listing.

Run: ``python bench/dashboard_pages.py [--ranks 64,256,1024] [--steps 1000] [--repeat 3] [--layout packs|parts]
[--s3]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshscope.agent.store.reader import Store  # noqa: E402
from meshscope.agent.contract import KINDS  # noqa: E402
from meshscope.agent.contract.storelayout import StoreLayout  # noqa: E402
from meshscope.dashboard import data, views  # noqa: E402
from tests.support.store import Straggler, SyntheticConfig, write_store  # noqa: E402

GENERATOR = "v6"  # bump when the synthetic model changes, to regenerate the cached store


def config_for(ranks: int, steps: int, *, layout: str = "parts") -> SyntheticConfig:
    if ranks % 4:
        raise ValueError(f"ranks ({ranks}) must be a multiple of pp = 4")
    return SyntheticConfig(run=f"bench-{ranks}" + ("-packs" if layout == "packs" else ""),
                           mesh={"pp": 4, "fsdp": ranks // 4}, steps=steps, model="llama-8b",
                           schedule="1F1B", microbatches=4, max_ops_per_group=4, t0=1.8e9 + ranks,
                           straggler=Straggler(rank=ranks // 3, factor=1.25, cause="throttle"), seed=ranks,
                           layout=layout)


def ensure_run(root: Path, cfg: SyntheticConfig) -> tuple[float | None, int]:
    """Generate the run unless a matching one is cached. Returns (seconds spent generating or None, bytes)."""
    marker = root / "markers" / f"{cfg.run}.json"
    want = json.dumps({"generator": GENERATOR, "config": repr(cfg)}, sort_keys=True)
    took = None
    if not marker.exists() or marker.read_text() != want:
        for kind in KINDS:
            shutil.rmtree(StoreLayout.of(root).run_dir(kind, cfg.run), ignore_errors=True)
        t = time.perf_counter()
        write_store(root, config=cfg)
        took = time.perf_counter() - t
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(want)
    size = sum(p.stat().st_size for p in run_files(root, cfg.run))
    return took, size


def run_files(root: Path, run: str) -> list[Path]:
    layout = StoreLayout.of(root)
    return sorted(p for kind in KINDS for p in Path(layout.run_dir(kind, run)).glob("*/*.parquet"))


def upload(root: Path, runs: list[str], *, url) -> tuple[int, int, float]:
    """PUT every file of ``runs`` to the bucket under the same keys. Returns (objects, bytes, seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    from meshscope.agent.store import objectstore

    s3 = objectstore.filesystem()
    files = [p for run in runs for p in run_files(root, run)]
    t = time.perf_counter()

    def put(p: Path) -> int:
        body = p.read_bytes()
        with s3.open_output_stream(url.path(p.relative_to(root).as_posix())) as out:
            out.write(body)
        return len(body)

    with ThreadPoolExecutor(max_workers=16) as pool:
        total = sum(pool.map(put, files))
    return len(files), total, time.perf_counter() - t


class PeakRss:
    """Highest RSS seen while active, sampled on a thread."""

    def __init__(self, interval: float = 0.002) -> None:
        self.proc, self.interval = psutil.Process(), interval
        self.peak = self.base = 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self.proc.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def timed_loader(store: Store, spent: list[tuple[float, float]], *, shared: dict) -> views.Loader:
    """Uncached, except the runs table: the app's sidebar loads it once (cached) for every page, so it is
    timed under the Runs page and shared by the others. Appends each load's (start, end) to ``spent``."""
    def load(name, **kw):
        if name in shared and not kw:
            return shared[name]
        t = time.perf_counter()
        try:
            return getattr(data, name)(store, **kw)
        finally:
            spent.append((t, time.perf_counter()))  # list.append is atomic: loads may run on threads
    return load


def busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals (time during which at least one load ran)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _figures_of(result) -> list:
    if isinstance(result, tuple):
        return [x for x in result if hasattr(x, "to_json")]
    return list(getattr(result, "figures", {}).values())


def pages(run: str, runs: list[str]) -> dict:
    """Page name -> function(load) doing what the page does."""
    return {
        "runs": lambda load: views.runs_view(load),
        "overview": lambda load: views.overview(load, run=run, runs=[run], steps=None),
        "pipeline": lambda load: views.pipeline(load, run=run, steps=None),
        "communication": lambda load: views.communication(load, run=run, steps=None),
        "memory": lambda load: views.memory(load, run=run, steps=None),
        "scaling": lambda load: views.scaling(load, selected=runs, focus=run),
        "gpu": lambda load: views.gpu(load, run=run),
    }


def bench_page(store: Store, fn, *, repeat: int, shared: dict, before=None) -> dict:
    """``before``: called first inside each timed call (over a bucket: the sync a page load starts with)."""
    totals, datas, peaks, cpus, syncs = [], [], [], [], []
    for _ in range(repeat):
        spent: list[tuple[float, float]] = []
        with PeakRss() as mem:
            t, c = time.perf_counter(), time.process_time()
            if before is not None:
                before()
            syncs.append(time.perf_counter() - t)
            result = fn(timed_loader(store, spent, shared=shared))
            figs = result if isinstance(result, list) else _figures_of(result)
            for fig in figs:
                if fig is not None:
                    fig.to_json()
            totals.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
        datas.append(busy(spent))
        peaks.append((mem.peak - mem.base) / 2**20)
    return {"first_s": totals[0], "median_s": statistics.median(totals), "data_s": statistics.median(datas),
            "rest_s": statistics.median(totals) - statistics.median(datas) - statistics.median(syncs),
            "peak_mib": max(peaks), "cpu_s": statistics.median(cpus), "sync_s": statistics.median(syncs)}


def compacted(store: Store, runs: list[str]) -> Store:
    """Build every kind's segments of ``runs`` (``agent.store.compact``), timed; the store that reads
    them and builds nothing more."""
    build = dataclasses.replace(store, compaction="now")
    for run in runs:
        for kind in KINDS:
            before = len(dataclasses.replace(store, compaction="off").files(kind, runs=[run]))
            with PeakRss() as mem:
                t = time.perf_counter()
                after = len(build.files(kind, runs=[run]))
                took = time.perf_counter() - t
            print(f"compaction {run} {kind}: {before:,} -> {after:,} files in {took:.1f} s, "
                  f"peak +{(mem.peak - mem.base) / 2**20:.0f} MiB")
    return dataclasses.replace(store, compaction="use")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--store", default=str(ROOT / ".runs" / "bench_dashboard"))
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per page (goal)")
    ap.add_argument("--layout", choices=("packs", "parts"), default="packs")
    ap.add_argument("--s3", action="store_true", help="read the runs from a moto S3 bucket on 127.0.0.1")
    ap.add_argument("--compaction", choices=("now", "off"), default="now",
                    help="now: build the reader's segments first (timed on their own), then time the pages "
                         "reading them, as the dashboard does once its background builds are done; off: packs only")
    ap.add_argument("--sync", choices=("background", "foreground"), default="background",
                    help="over S3: how each page call syncs the bucket (see the docstring)")
    ap.add_argument("--cache", help="the reader's cache directory (default: a new temporary one)")
    a = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        return _main(a, stack)


def _main(a: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    scales = [int(x) for x in a.ranks.split(",")]
    root = Path(a.store)
    print(__doc__.split("Run:")[0].strip(), "\n")
    print(f"machine: {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM; python "
          f"{sys.version.split()[0]}; store {root}\n")
    cfgs = [config_for(n, a.steps, layout=a.layout) for n in scales]
    for cfg in cfgs:
        took, size = ensure_run(root, cfg)
        how = f"generated in {took:.1f} s" if took is not None else "cached"
        print(f"run {cfg.run}: {cfg.world_size} ranks x {cfg.steps} steps, {len(run_files(root, cfg.run)):,} files "
              f"({a.layout}), {size / 2**20:.0f} MiB on disk ({how})")
    runs = [c.run for c in cfgs]
    before = None
    os.environ["MESHSCOPE_CACHE_DIR"] = a.cache or str(stack.enter_context(tempfile.TemporaryDirectory()))
    if a.s3:
        from meshscope.agent.store import objectstore, remote
        from tests.support.s3 import moto_server, s3_env

        moto = stack.enter_context(moto_server())
        moto.create_bucket("bench")
        os.environ.update(s3_env(moto.endpoint))
        url = objectstore.parse_url("s3://bench/dashboard")
        n, nbytes, took = upload(root, runs, url=url)
        print(f"uploaded {n:,} objects, {nbytes / 2**20:.0f} MiB to {url} (moto) in {took:.1f} s")
        t = time.perf_counter()
        cold = remote.sync(url, min_interval_s=0)
        print(f"cold sync: {cold.listed:,} listed, {cold.downloaded:,} downloaded ({cold.bytes / 2**20:.0f} MiB) "
              f"in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        remote.sync(url, min_interval_s=0)
        print(f"warm sync (one listing): {time.perf_counter() - t:.2f} s")
        before = ((lambda: remote.sync(url, min_interval_s=0)) if a.sync == "foreground"
                  else (lambda: Store.open(str(url), background_sync=True)))
        store = Store.open(str(url))
    else:
        store = Store.open(root)
    store = compacted(store, runs) if a.compaction == "now" else dataclasses.replace(store, compaction="off")
    rows = []
    shared = {"runs_table": data.runs_table(store)}
    for cfg in cfgs:
        for name, fn in pages(cfg.run, runs).items():
            r = bench_page(store, fn, repeat=a.repeat, shared={} if name == "runs" else shared, before=before)
            rows.append({"ranks": cfg.world_size, "page": name, **r})
    print(f"\nload average during the run: {' '.join(f'{x:.1f}' for x in psutil.getloadavg())} "
          f"(other users' work on the same {psutil.cpu_count()} CPUs inflates wall times)")
    print(f"\n{'page':<14}{'ranks':>6}{'first s':>9}{'median s':>10}{'sync s':>8}{'data s':>8}{'rest s':>8}"
          f"{'cpu s':>7}{'peak MiB':>10}  goal")
    for r in rows:
        ok = "ok" if r["median_s"] <= a.budget else f"OVER {a.budget:.0f} s"
        print(f"{r['page']:<14}{r['ranks']:>6}{r['first_s']:>9.2f}{r['median_s']:>10.2f}{r['sync_s']:>8.2f}"
              f"{r['data_s']:>8.2f}{r['rest_s']:>8.2f}{r['cpu_s']:>7.2f}{r['peak_mib']:>10.0f}  {ok}")
    if len(scales) > 1:
        print("\nscaling with ranks (median s):")
        for name in pages(runs[0], runs):
            times = {r["ranks"]: r["median_s"] for r in rows if r["page"] == name}
            lo, hi = min(times), max(times)
            print(f"  {name:<14}" + "  ".join(f"{n}: {t:.2f}" for n, t in sorted(times.items()))
                  + f"   x{times[hi] / max(times[lo], 1e-9):.1f} for x{hi // lo} ranks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
