"""Real-browser tier: serve the dashboard with ``meshscope dashboard`` on a free localhost port and load
every page in headless Debian Chromium; each page must draw at least one non-empty Plotly chart and no
Streamlit exception. Screenshots go to artifacts/screenshots/ (gitignored)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.support.harness import terminate
from tests.support.store import Straggler, SyntheticConfig, write_store
from fake_prometheus import FakePrometheus, free_port

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "artifacts" / "screenshots"
PAGES = ["",  # the root URL opens the Runs page
         "runs",
         "overview", "pipeline", "communication", "memory", "scaling", "compare", "whatif", "gpu", "live"]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# A chart counts when Plotly has drawn it and at least one trace has data points. Plotly 6 ships numpy
# arrays as typed-array objects ({dtype, bdata, _inputArray}), so length comes from either form.
NON_EMPTY_PLOT = """() => {
    const n = a => !a ? 0 : (a.length ?? (a._inputArray ? a._inputArray.length : 0));
    return [...document.querySelectorAll('.js-plotly-plot')].some(p =>
        Array.isArray(p.data) && p.data.some(t => n(t.x) > 0 || n(t.y) > 0 || n(t.z) > 0));
}"""


def _wait_healthy(url: str, proc: subprocess.Popen, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"dashboard exited early with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"dashboard not healthy within {timeout} s")


@contextlib.contextmanager
def dashboard_process(cli_args: list[str], *, cwd=ROOT, env=None):
    """``python -m meshscope.cli CLI_ARGS --port P`` in a session of its own, once healthy: yields (url,
    process). At the end SIGTERM to the session (Streamlit and anything it started), SIGKILL if it lingers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "meshscope.cli", *cli_args, "--port", str(port)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, timeout=60)
        yield url, proc
    finally:
        terminate(proc, group=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not (os.path.exists(CHROMIUM) and shutil.which(CHROMIUM)):
        pytest.skip(f"Debian chromium not installed at {CHROMIUM} (apt-get install -y chromium)")
    store = tmp_path_factory.mktemp("store")
    # The newest run is the pipeline run, so it is the default focus; the older DDP run of the same model
    # gives the Scaling page a second run (a different strategy: throughput only, no scaling family).
    write_store(store, config=SyntheticConfig(run="ddp-8", mesh={"dp": 8}, steps=30, t0=1.8e9))
    write_store(store, config=SyntheticConfig(run="pp-fsdp-16", mesh={"pp": 2, "fsdp": 4, "tp": 2}, steps=30,
                                              straggler=Straggler(rank=5, cause="throttle"), t0=1.8e9 + 86400))
    with FakePrometheus(ranks=4) as prom, dashboard_process(
            ["dashboard", "--store", str(store), "--prometheus", prom.url, "--refresh", "2"]) as (url, _):
        yield url


def test_every_page_draws_a_chart_without_exceptions(served):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # Tall: Streamlit scrolls inside its own container, so full_page alone would cut the page off.
            page = browser.new_page(viewport={"width": 1500, "height": 3000})
            for name in PAGES:
                page.goto(f"{served}/{name}", wait_until="domcontentloaded", timeout=30_000)
                page.wait_for_selector('[data-testid="stApp"]', timeout=30_000)
                page.wait_for_function(NON_EMPTY_PLOT, timeout=45_000)
                # Let the script run finish so a late exception would be on the page.
                page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"] "
                                       "button')", timeout=30_000)
                page.screenshot(path=str(SHOTS / f"{name or 'root'}.png"), full_page=True)
                text = page.locator('[data-testid="stMain"]').inner_text()
                assert "Page not found" not in text, name
                if name in ("", "runs"):  # the root URL opens the Runs page, and so does its own path
                    assert urllib.parse.urlparse(page.url).path == "/runs", page.url
                    assert "Runs" in page.locator("h1").first.inner_text()
                errors = page.locator('[data-testid="stException"]')
                assert errors.count() == 0, f"{name}: {errors.first.inner_text()}"
                assert page.locator(".js-plotly-plot").count() >= 1, name
                if name == "overview":  # the verdict a user reads, as the browser shows it
                    assert "Straggler: rank 5 (GPU throttling" in text, text[:2000]
                    assert "A rank is a straggler when" in text
            # A shared link to the root keeps its run: it opens the Runs page with that run in focus.
            page.goto(f"{served}/?run=ddp-8", wait_until="domcontentloaded", timeout=30_000)
            page.wait_for_url("**/runs?run=ddp-8*", timeout=30_000)
        finally:
            browser.close()


def test_sigterm_while_the_dashboard_builds_a_segment_exits_cleanly(tmp_path):
    # The dashboard merges a large run's packs into a segment on a worker thread (agent.store.compact).
    # SIGTERM during that build used to abort the process (exit -6, "terminate called ... exception not
    # rethrown": the thread was unwound by force inside DuckDB at interpreter exit), as could a page's
    # load thread inside DuckDB. Now every DuckDB connection is interrupted at exit and waited for
    # (agent.store.duckconn; tests/test_duckconn.py reproduces the abort): exit 0, nothing half-written
    # left in the cache.
    import numpy as np
    import pyarrow.parquet as pq

    from meshscope.agent.contract.storelayout import StoreLayout
    from meshscope.agent.store import packs
    from tests.support.store import SyntheticConfig, write_store

    if not (os.path.exists(CHROMIUM) and shutil.which(CHROMIUM)):
        pytest.skip(f"Debian chromium not installed at {CHROMIUM} (apt-get install -y chromium)")
    store, cache = tmp_path / "store", tmp_path / "cache"
    write_store(store, config=SyntheticConfig(run="big", mesh={"pp": 4, "fsdp": 128}, steps=4, layout="packs"))
    rng, old = np.random.default_rng(0), time.time() - 3600  # settled: an hour old
    pack_files = sorted(Path(StoreLayout.of(store).table("collective")).rglob("pack-*.parquet"))
    assert len(pack_files) == 64
    for path in pack_files:  # each pack 200 k rows: a build that takes seconds
        f = pq.ParquetFile(path)
        t = f.read()
        big = t.take(rng.integers(0, len(t), 200_000)).replace_schema_metadata(f.schema_arrow.metadata)
        pq.write_table(big, path)
    for path in Path(StoreLayout.of(store).tables).rglob("*.parquet"):
        os.utime(path, (old, old))
    from playwright.sync_api import sync_playwright

    def spills() -> list[Path]:  # a segment build's spill directory, beside its kind's segments in the cache
        return [p for d in cache.glob("compact/*") for p in Path(StoreLayout.of(d).table("collective")).glob(".spill-*")]

    with dashboard_process(["dashboard", "--store", str(store)],
                           env={**os.environ, "MESHSCOPE_CACHE_DIR": str(cache)}) as (url, proc):
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(f"{url}/overview", wait_until="domcontentloaded", timeout=60_000)
                # The collective segment's build (seconds; the small kinds' take milliseconds) is running.
                deadline = time.monotonic() + 180
                while not spills() and time.monotonic() < deadline:
                    page.wait_for_timeout(50)  # (keeps the page's connection served, unlike time.sleep)
            finally:
                browser.close()
        built = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
        assert spills(), f"the collective build did not start: {built}"
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "terminate called" not in out, (proc.returncode, out[-2000:])
    assert [p.name for p in cache.rglob("*") if p.name.startswith(".")] == []  # no temporary segment or spill
    assert all(packs.manifest(p) for p in cache.rglob("pack-*.parquet"))  # what was finished is whole
