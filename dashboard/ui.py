"""Streamlit glue shared by the entry file and the pages: configuration, the shared run selection and
step range, bounded caches over ``dashboard.data``, and the messages for empty, partial or unreadable
stores. Pages stay thin: they ask this module for a ``Context`` and for data, and draw figures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from streamlit.runtime.scriptrunner import add_script_run_ctx, get_script_run_ctx

from meshscope.agent.collector.catchup import catch_up
from meshscope.agent.store.reader import SKIPPED, Store, StoreError
from meshscope.dashboard import data, views
from meshscope.dashboard.config import AppConfig, ConfigError, parse_app_args
from meshscope.dashboard.live import LiveError, PrometheusClient

CONFIG_KEY = "meshscope.config"
URL_KEY = "meshscope.url_applied"  # the link's run and steps were applied (once per session)
SELECTED_KEY = "meshscope.selected_runs"  # shared run selection (written by the Runs page)
CONTEXT_KEY = "meshscope.context"
WARNED_KEY = "meshscope.warned"  # skipped files already reported in this page run
CACHE_TTL_S = 30  # the agent appends while a run is live; a short TTL keeps pages current

# The data functions the pages may load through the cache (the name is the cache key's first part).
LOADERS: dict[str, Callable] = {name: getattr(data, name) for name in (
    "runs_table", "events", "hang_rows", "overview_data", "gpu_by_rank", "gpu_by_device", "collective_rows", "collective_links",
    "pipeline_data", "memory_data", "gpu_data", "run_summaries", "planner_data", "rank_steps", "attempts",
    "collective_counts", "run_events", "cpu_wait_steps", "diff_data")}


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    config: AppConfig
    store: Store
    runs: pd.DataFrame  # runs_table
    selected: tuple[str, ...]  # runs picked on the Runs page (default: the newest)
    focus: str | None  # the run single-run pages show
    steps: tuple[int, int] | None  # step range of the focus run


# ------------------------------------------------------------------------------------ loading
@st.cache_data(ttl=CACHE_TTL_S, max_entries=256, max_size=512 * 2**20, show_spinner="Reading the store…")
def _cached(name: str, roots: tuple[str, ...], kwargs: tuple):
    # Keyed by every root: the same run read over another set of stores is another result.
    # In the background: a bucket's listing, and a large run's packs becoming segments; the page reads
    # the cache as last synced and the packs as they are meanwhile (agent.store.remote, .compact).
    return LOADERS[name](Store.open_many(roots, compaction="background", background_sync=True), **dict(kwargs))


@st.cache_data(ttl=CACHE_TTL_S, max_entries=16, show_spinner="Ingesting the store's spools…")
def _catch_up(roots: tuple[str, ...]) -> tuple[str, ...]:
    """Records still only in spools (a job run with ``--store`` and no agent) reach the tables before the
    pages read them, at most once per cache period; an agent writing the store is left to it."""
    results = [catch_up(root) for root in roots]
    if any(r.outcome == "ingested" for r in results):
        _cached.clear()  # frames read before the ingest lack its records
    return tuple(note for r in results if (note := r.message()))


def load(name: str, store: Store, **kwargs):
    """``data.<name>(store, **kwargs)`` through a bounded, short-lived cache. Lists become tuples so
    the arguments hash."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
    return _cached(name, store.sources, frozen)


class _Loader:
    """The cached loader the page views take. Views may run a load on a thread of their own
    (``views.background``): ``bind_thread`` gives that thread this script run's context, so the cache's
    spinner and messages land on the page as from the script thread."""

    def __init__(self, ctx: Context) -> None:
        self._ctx, self._script = ctx, get_script_run_ctx()

    def __call__(self, name: str, **kwargs):
        return load(name, self._ctx.store, **kwargs)

    def bind_thread(self, thread: threading.Thread) -> None:
        if self._script is not None:
            add_script_run_ctx(thread, self._script)


def loader(ctx: Context) -> views.Loader:
    """The cached loader the page views take."""
    return _Loader(ctx)


@st.cache_resource(max_entries=4)
def prometheus_client(url: str) -> PrometheusClient:
    return PrometheusClient(url)


# ------------------------------------------------------------------------------------ context
def init(argv: list[str]) -> AppConfig | None:
    """Parse the script arguments (entry file, every rerun); show a one-line error if they are bad."""
    try:
        config = parse_app_args(argv)
    except ConfigError as e:
        st.error(f"meshscope dashboard: {e}. Start it with `meshscope dashboard --store DIR`.")
        st.session_state.pop(CONFIG_KEY, None)
        return None
    st.session_state[CONFIG_KEY] = config
    return config


def sidebar() -> None:
    """Shared widgets in the entry file (so they persist across pages): focus run and step range."""
    st.session_state.pop(CONTEXT_KEY, None)
    config = st.session_state.get(CONFIG_KEY)
    if config is None:
        return
    try:
        store = Store.open_many(config.stores, compaction="background", background_sync=True)
        for note in _catch_up(tuple(map(str, store.local_roots()))):
            st.sidebar.caption(note)
        runs = load("runs_table", store)
    except StoreError as e:
        st.sidebar.error(str(e))
        return
    names = runs["run"].tolist()
    _from_url(names)
    selected = tuple(r for r in st.session_state.get(SELECTED_KEY, ()) if r in names) or tuple(names[:1])
    focus, steps = None, None
    st.sidebar.caption(f"Store{'s' if len(store.roots) > 1 else ''}: {store.describe()}")
    if selected:
        focus = st.sidebar.selectbox("Run", selected, key="meshscope.focus",
                                     help="Pick runs on the Runs page; single-run pages show this one.")
        meta = views.meta_of(runs, focus)
        if "first_step" in meta:
            bounds = int(meta["first_step"]), int(meta["last_step"])
            steps = bounds if bounds[0] == bounds[1] else _step_slider(focus, bounds)
    st.session_state[CONTEXT_KEY] = Context(config=config, store=store, runs=runs, selected=selected,
                                            focus=focus, steps=steps)
    # The run and step range in the address bar: a link to this view shows the same run and steps.
    url = {"run": focus} if focus else {}
    if steps:
        url["steps"] = f"{steps[0]}:{steps[1]}"
    if {k: st.query_params.get(k) for k in ("run", "steps")} != {**{"run": None, "steps": None}, **url}:
        st.query_params.from_dict(url)


def _from_url(names: list[str]) -> None:
    """Once per session, the run and step range of a shared link (``?run=NAME&steps=A:B``) become the
    sidebar's; a run the store lacks or a malformed range is ignored (the defaults apply)."""
    if st.session_state.get(URL_KEY):
        return
    st.session_state[URL_KEY] = True
    run = st.query_params.get("run")
    if run not in names:
        return
    st.session_state[SELECTED_KEY] = (run, *[r for r in st.session_state.get(SELECTED_KEY, ()) if r != run])
    st.session_state["meshscope.focus"] = run
    a, sep, b = (st.query_params.get("steps") or "").partition(":")
    if sep and a.isdigit() and b.isdigit() and int(a) <= int(b):
        st.session_state[f"meshscope.steps.{run}"] = (int(a), int(b))


def _step_slider(run: str, bounds: tuple[int, int]) -> tuple[int, int]:
    """The step-range slider of a run. A live run grows: a range that ended at the newest step keeps
    following it, and a stored range is clamped to the current bounds (a slider rejects values outside)."""
    key, seen = f"meshscope.steps.{run}", f"meshscope.steps.{run}.bounds"
    lo, hi = st.session_state.get(key, bounds)
    previous = st.session_state.get(seen)
    if previous and hi == previous[1]:
        hi = bounds[1]
    lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    st.session_state[key] = (lo, hi) if lo <= hi else bounds
    st.session_state[seen] = bounds
    return st.sidebar.slider("Steps", bounds[0], bounds[1], key=key)


def render(main: Callable[[Context], None], *, needs_run: bool = True) -> None:
    """Run a page body with its context; store problems become messages, not tracebacks."""
    ctx = st.session_state.get(CONTEXT_KEY)
    if ctx is None:
        st.info("No store is open (see the message above).")
        return
    if ctx.runs.empty and needs_run:
        st.info(f"No runs in the store at {ctx.store.describe()} yet. Runs appear here once a job has written "
                "records there: its spools are read when a page opens, or by a node agent.")
        return
    st.session_state[WARNED_KEY] = set()
    if needs_run:
        warn_skipped(ctx.runs)
    try:
        main(ctx)
    except StoreError as e:
        st.error(str(e))
    except LiveError as e:
        st.warning(str(e))


# ------------------------------------------------------------------------------------ helpers
def warn_skipped(*frames: pd.DataFrame) -> None:
    """Say which files were skipped as unreadable (each file once per page run)."""
    warned = st.session_state.setdefault(WARNED_KEY, set())
    skipped = sorted({p for f in frames if f is not None for p in f.attrs.get(SKIPPED, [])} - warned)
    warned.update(skipped)
    if skipped:
        shown = ", ".join(f"`{p}`" for p in skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        st.warning(f"Skipped {len(skipped)} unreadable file(s) (corrupt or of another schema): {shown}. "
                   "The figures below leave them out.")


def table(frame: pd.DataFrame, columns: dict[str, tuple[str, str | None]]) -> None:
    """A table as a reader sees it: ``columns`` maps each shown column to its header (with its unit) and a
    number format ("percent", "%.3f", "int": whole and grouped as 4,324, or None); columns absent from
    ``frame`` are left out, the others keep that order. Milliseconds are the caller's conversion (header
    "… (ms)")."""
    shown = [c for c in columns if c in frame]
    out = frame[shown].copy()
    for c in shown:
        if columns[c][1] == "int":
            out[c] = pd.to_numeric(out[c], errors="coerce").round().astype("Int64")
    config = {columns[c][0]: st.column_config.NumberColumn(format="localized" if columns[c][1] == "int" else columns[c][1])
              for c in shown if columns[c][1]}
    st.dataframe(out.rename(columns={c: columns[c][0] for c in shown}), hide_index=True, column_config=config)


def chart(fig: go.Figure, *, key: str | None = None) -> None:
    st.plotly_chart(fig, width="stretch", key=key, config={"displaylogo": False})


def window_note(ctx: Context, window: tuple[int, int] | None, *, what: str, budget: int) -> None:
    """Say when a budgeted analysis covers fewer steps than the selected range."""
    if window and ctx.steps and tuple(window) != tuple(ctx.steps):
        st.caption(f"{what} cover steps {window[0]}–{window[1]}: the latest of the selected range "
                   f"({ctx.steps[0]}–{ctx.steps[1]}) that fit a budget of {budget:,} records. Narrow the "
                   "step range in the sidebar to look at other steps.")


def missing(what: str, *, run: str) -> None:
    """One clear line for a kind of record a (partial) run does not have."""
    st.info(f"No {what} in run `{run}` (for the selected steps).")


def hang_panel(h: dict) -> None:
    """The Hang panel (Overview, Live): the verdict, each rank's state, the culprits' stacks."""
    if h.get("status") in (None, "none"):
        return
    if h["status"] == "hung":
        st.error(f"**Hang.** {h['verdict']}", icon=":material/block:")
    else:
        st.info(f"**Hang (resolved).** {h['verdict']}", icon=":material/history:")
    st.dataframe(views.hang_table(h), hide_index=True, use_container_width=True)
    for r in h["culprit_ranks"]:
        frames = h["stacks"].get(str(r)) or []
        if frames:
            with st.expander(f"Rank {r}'s training thread (innermost last)", expanded=True):
                st.code("\n".join(frames), language="text")
    st.caption("From each rank's hang watchdog (no progress for 10 median steps, 10-60 s; the first step 300 s): "
               "`meshscope hang --store ... --run ...` prints the same, `--json` with every rank's stack.")
