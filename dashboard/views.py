"""What each page shows, computed without Streamlit: data (through an injected loader), analysis and
figures, returned as one small object per page. The pages only lay these out; the benchmark and the
tests call the same functions, so what they time and check is what the pages run.

``load(name, **kwargs)`` calls ``dashboard.data.<name>(store, **kwargs)``: the pages pass a cached
loader (``dashboard.ui.loader``), the benchmark ``direct_loader(store)``. A view may start a load that
does not depend on the others on a thread (``background``) and wait for it where it needs the result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from meshscope.agent.store.reader import Store
from meshscope.dashboard import analysis, data, environment, figures, runs_clean, stragglers
from meshscope.dashboard.memory_model import memory_model, spec_from_meta, states_vs_tensors
from meshscope.dashboard.pipeline_sim import replay
from meshscope.dashboard.scaling import amdahl_fits, family_runs, no_family_reason, run_throughput, scaling_table

Loader = Callable[..., Any]
_MODEL_FIELDS = ("n_params", "n_layers", "d_model", "seq_len", "global_batch")


def direct_loader(store: Store) -> Loader:
    """A loader without caching (benchmark, tests)."""
    return lambda name, **kw: getattr(data, name)(store, **kw)


def meta_of(runs: pd.DataFrame, run: str | None) -> dict:
    """A run's row of the runs table without missing values; ``mesh`` parsed to {dim: degree}."""
    row = runs[runs["run"] == run]
    meta = {} if row.empty else {k: v for k, v in row.iloc[0].items() if not _isna(v)}
    meta["mesh"] = data.parse_mesh(meta.get("mesh"))
    return meta


def _isna(v) -> bool:
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def _dp(meta: dict, *, fallback: int) -> int:
    return analysis.parallel_degrees(meta["mesh"], world_size=int(meta.get("world_size", fallback)))["dp"]


class Pending:
    """A load running on a thread of its own (see ``background``)."""

    def __init__(self, load: Loader, name: str, kwargs: dict) -> None:
        self._box: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._work, args=(load, name, kwargs), daemon=True,
                                        name=f"meshscope-load-{name}")
        bind = getattr(load, "bind_thread", None)
        if bind is not None:
            bind(self._thread)
        self._thread.start()

    def _work(self, load: Loader, name: str, kwargs: dict) -> None:
        try:
            self._box["value"] = load(name, **kwargs)
        except BaseException as e:  # re-raised in the caller's thread by result()
            self._box["error"] = e

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        """Its result, once it is done; its exception, if it raised one."""
        self._thread.join()
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]


def background(load: Loader, name: str, **kwargs) -> Pending:
    """Start ``load(name, **kwargs)`` on a thread now; ``.result()`` waits for it. DuckDB releases the GIL
    while it reads, so a page's independent reads overlap. A loader with a ``bind_thread(thread)`` method
    (the Streamlit one) prepares the thread before it starts. A view waits for every load it started
    before it returns, whatever path it returns by."""
    return Pending(load, name, kwargs)


# -------------------------------------------------------------------------------------- overview
@dataclass(slots=True, kw_only=True)
class Overview:
    series: pd.DataFrame  # per run and step, with tokens_per_s
    figures: dict[str, go.Figure] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    stragglers: pd.DataFrame | None = None
    first_steady_step: int | None = None  # verdicts use the steps from here (stragglers.first_steady_step)
    verdict_steps: int = 0  # steady steps the straggler verdict judged
    warnings: list[str] = field(default_factory=list)  # environment.warnings: when a figure means less
    breakdown: pd.DataFrame | None = None  # analysis.breakdown over the steady steps
    step_time: dict | None = None  # analysis.step_time over the steady rank-steps (report, Communication)
    loss_nonfinite: dict | None = None  # analysis.nonfinite_loss of the focus run (None: every loss finite)
    notes: dict[str, str] = field(default_factory=dict)  # figure name -> why it is not drawn (no data)
    has_peers: bool = False  # some rank shares its pipeline stage with another: a straggler verdict exists
    unattributed_s: float = 0.0
    frames: list[pd.DataFrame] = field(default_factory=list)  # for the skipped-files warning


def _range_of(meta: dict, steps) -> tuple[int, int] | None:
    """The selected range, or the run's whole recorded range."""
    if steps:
        return int(steps[0]), int(steps[1])
    if "first_step" in meta and "last_step" in meta:
        return int(meta["first_step"]), int(meta["last_step"])
    return None


def collective_window(meta: dict, steps, *, budget: int) -> tuple[int, int] | None:
    """Latest steps of the range whose collective records (all ranks) fit in ``budget``."""
    rng = _range_of(meta, steps)
    return rng and data.budget_window(rng, rows_per_step=meta.get("collectives_per_step"), budget=budget)


def steady_rank_steps(rank_steps: pd.DataFrame, *, meta: dict) -> tuple[int | None, pd.DataFrame]:
    """(the first steady step, the rank-steps from it) of ``data.rank_steps``' rows: warm-up
    (``stragglers.first_steady_step`` on each step's slowest rank) left out. The Overview, ``report`` and the
    Communication page cut their figures here, so they state the same ones."""
    per_step = rank_steps.groupby("step", as_index=False)["wall_s"].max().rename(columns={"wall_s": "step_time_s"})
    first = stragglers.first_steady_step(per_step, run_first_step=int(meta.get("first_step", 0)))
    steady = rank_steps[rank_steps["step"] >= first] if first is not None else rank_steps
    return first, (steady if len(steady) else rank_steps)


def overview(load: Loader, *, run: str, runs: list[str], steps, threshold: float = stragglers.STRAGGLER_REL) -> Overview:
    """``threshold``: the straggler rule's relative excess over the peers' median compute."""
    table = load("runs_table")
    meta = meta_of(table, run)
    # The collective read does not depend on the step records: it runs beside them, and is waited for
    # once the straggler table needs it.
    links = background(load, "collective_links", run=run, steps=collective_window(meta, steps, budget=data.RAW_BUDGET))
    try:
        return _overview(load, links, table=table, meta=meta, run=run, runs=runs, steps=steps, threshold=threshold)
    finally:
        links.wait()


def _overview(load: Loader, links: Pending, *, table: pd.DataFrame, meta: dict, run: str, runs: list[str], steps,
              threshold: float) -> Overview:
    d = load("overview_data", run=run, runs=runs, steps=steps)
    series = d["series"]
    view = Overview(series=series, frames=list(d.values()))
    if series.empty:
        return view
    gpu_later = None
    if not d["breakdown"].empty:
        w = d["window"].iloc[0]
        # GPU figures per (host, GPU), given to ranks through the runs table's host map (no run files read).
        gpu_later = background(load, "gpu_by_device", run=run, window=(float(w["t_start"]), float(w["t_end"])))
    try:
        return _overview_figures(view, d, gpu_later, links, table=table, meta=meta, run=run, threshold=threshold)
    finally:
        if gpu_later is not None:
            gpu_later.wait()


def _overview_figures(view: Overview, d: dict, gpu_later: Pending | None, links: Pending, *, table: pd.DataFrame,
                      meta: dict, run: str, threshold: float) -> Overview:
    series = d["series"]
    parts = [analysis.step_throughput(g, dp=_dp(meta_of(table, r), fallback=int(g["ranks"].max())))
             for r, g in series.groupby("run", sort=False)]
    view.series = series = pd.concat(parts, ignore_index=True)
    mine = series[series["run"] == run]
    step_time = float(mine["step_time_s"].median()) if len(mine) else np.nan
    loss = mine["loss"].dropna()
    view.loss_nonfinite = bad = analysis.nonfinite_loss(mine)
    view.metrics = {"tokens_per_s": float(mine["tokens_per_s"].median()), "mfu": float(mine["mfu"].median()),
                    "step_time_s": step_time, "step_time_s_mean": np.nan,
                    # the last step's loss; NaN when it was not finite (``loss_nonfinite`` says so)
                    "loss": np.nan if bad and bad["last"] or not len(loss) else float(loss.iloc[-1])}
    f = view.figures
    charts = (("tokens", "tokens_per_s", dict(title="Throughput", y_title="tokens/s", zero=True)),
              ("mfu", "mfu", dict(title="MFU (mean of per-rank MFU)", y_title="MFU", percent=True, zero=True)),
              ("loss", "loss", dict(title="Loss (mean over ranks with a finite loss)", y_title="loss")))
    for name, column, kw in charts:
        if series[column].notna().any() or (name == "loss" and bad):
            f[name] = figures.step_lines(series, y=column, **kw)
        else:  # an empty chart's axes say nothing: one line on why instead
            view.notes[name] = analysis.no_series_reason(name, meta=meta, tokens=bool(mine["tokens_mean"].gt(0).any()))
    if bad:
        f["loss"] = figures.mark_nonfinite(f["loss"], mine, found=bad)
        view.warnings = [analysis.nonfinite_loss_warning(bad)]
    if gpu_later is None:  # the focus run has no step records in the range (others may)
        return view
    rs = d["rank_steps"]
    view.first_steady_step, steady = steady_rank_steps(rs, meta=meta)
    # Means over the steady steps (warm-up left out, as the verdicts): the latest that fit the budget.
    view.breakdown = bd = analysis.breakdown(steady if len(steady) else d["breakdown"])
    # The headline figures over the same steady steps: step time (median and mean of the rank-steps the
    # breakdown's means sum to), tokens/s and MFU (medians over those steps).
    view.step_time = analysis.step_time(steady)
    cut = mine[mine["step"] >= view.first_steady_step] if view.first_steady_step is not None else mine
    step_time = view.step_time["step_time_s_median"]
    view.metrics.update(step_time_s=step_time, step_time_s_mean=view.step_time["step_time_s_mean"],
                        tokens_per_s=float(cut["tokens_per_s"].median()), mfu=float(cut["mfu"].median()))
    f["breakdown"] = figures.breakdown_bars(bd)
    view.unattributed_s = float(bd["unattributed_s"].abs().max())
    hm = d["heatmap"]
    f["heatmap"] = figures.compute_heatmap(hm, rank_width=int(hm["rank_width"].iloc[0]),
                                           step_width=int(hm["step_width"].iloc[0]),
                                           first_steady=view.first_steady_step)
    view.verdict_steps = int(steady["step"].nunique())
    verdicts = stragglers.rank_step_verdicts(steady, peers=data.rank_stages(meta.get("rank_hosts")), rel=threshold)
    cost = stragglers.step_cost(verdicts)
    view.has_peers = bool(len(cost))  # empty: every rank is alone in its pipeline stage (no peers, no verdict)
    if view.has_peers:
        f["cost"] = figures.straggler_cost(cost)

    devices = gpu_later.result()
    gpu = analysis.gpu_ranks(devices, hosts=data.rank_hosts(meta.get("rank_hosts")))
    # Link ratios need collective instances, aggregated in SQL: no raw records cross into pandas.
    lk = links.result()
    link, _ = analysis.link_ratios(analysis.instance_busbw(lk["instances"]), members=lk["members"])
    view.stragglers = stragglers.straggler_table(verdicts, gpu=gpu, link=link)
    view.warnings += environment.warnings(device=meta.get("device"), shares=environment.run_queue_share(steady),
                                          n_steady=view.verdict_steps, hosts=data.rank_hosts(meta.get("rank_hosts")),
                                          clocks=gpu)
    # The job's cost: per step, the largest wait a flagged rank caused (none flagged: nothing to blame).
    flagged = cost[cost["rank"].isin(view.stragglers["rank"])]
    view.metrics["cost_s"] = float(flagged["cost_s"].sum() / max(len(cost), 1))
    view.metrics["cost_share"] = view.metrics["cost_s"] / step_time if step_time > 0 else np.nan
    view.frames += [devices, lk["members"]]
    return view


# -------------------------------------------------------------------------------------- pipeline
@dataclass(slots=True, kw_only=True)
class Pipeline:
    per_step_stage: pd.DataFrame
    steps: tuple[int, int] | None = None  # steps covered (the latest that fit the budget)
    gantt_spans: int = 0
    gantt_bubble: dict[int, float] = field(default_factory=dict)  # stage -> bubble of the drawn ranks
    frames: list[pd.DataFrame] = field(default_factory=list)
    schedule: str | None = None
    p: int = 0
    m: int = 0
    v: int = 1
    theory: float | None = None
    theory_source: str = ""  # "closed form", or the balanced replay of the order the run used
    stages: pd.DataFrame | None = None  # analysis.pipeline_stages: the bubble split per stage (report, page)
    figures: dict[str, go.Figure] = field(default_factory=dict)


def pipeline(load: Loader, *, run: str, steps, gantt_step: int | None = None) -> Pipeline:
    """Bubble per stage and step over the latest steps that fit the span budget, and the Gantt chart of
    ``gantt_step`` (default: the last step of the range)."""
    meta = meta_of(load("runs_table"), run)
    rng = _range_of(meta, steps)
    p = int(meta["mesh"].get("pp", 1))
    m = int(meta.get("microbatches", 0) or 0)
    v = int(meta.get("virtual_stages", 1) or 1)
    # Spans per step: every rank records F and B (and W under zero-bubble) per microbatch and chunk.
    per_step = float(meta.get("world_size", 0)) * max(m, 1) * v * 3 if p > 1 else None
    window = rng and data.budget_window(rng, rows_per_step=per_step, budget=data.ROW_BUDGET)
    gantt = gantt_step if gantt_step is not None else (rng[1] if rng else None)
    d = load("pipeline_data", run=run, steps=window, gantt_step=gantt)
    per = d["bubble"]
    view = Pipeline(per_step_stage=per, steps=window, frames=[d["windows"]])
    if per.empty and d["spans"].empty:
        return view
    view.p = p if p > 1 else int(per["stage"].nunique())
    view.m, view.v, view.schedule = m, v, meta.get("schedule")
    if view.m:
        view.theory = analysis.bubble_theory(schedule=view.schedule, p=view.p, m=view.m, v=view.v)
        view.theory_source = "closed form" if view.theory is not None else ""
    if len(per):
        # Without the microbatch count the schedule's actions are unknown: no replay (empty input).
        rs = d["replay_spans"] if view.m else d["replay_spans"].iloc[:0]
        replayed = replay(rs, schedule=view.schedule or "", p=view.p, m=max(view.m, 1), v=view.v)
        view.stages = analysis.pipeline_stages(per, replayed)
        if view.theory is None and replayed["balanced_idle"].notna().any():
            # No closed form (zero-bubble, looped BFS, a user's own order): the theory of the order the
            # ranks ran, with balanced stages, equal op times and free transfers.
            view.theory = float(replayed["balanced_idle"].median())
            view.theory_source = "the run's own order replayed with balanced stages"
        view.figures["by_stage"] = figures.bubble_by_stage(view.stages, theory=view.theory)
        view.figures["trend"] = figures.bubble_trend(per, theory=view.theory)
    spans, windows = d["spans"], d["windows"]
    if len(spans):
        t0 = float(windows["t_start"].min()) if len(windows) else float(spans["t_start"].min())
        t1 = float(windows["t_end"].max()) if len(windows) else float(spans["t_end"].max())
        stage_of = spans.groupby("rank")["stage"].min().sort_values()
        labels = {int(r): f"stage {s} · rank {r}" for r, s in stage_of.items()}
        gaps = analysis.idle_gaps(spans, t0=t0, t1=t1)
        view.figures["gantt"] = figures.gantt(spans, gaps=gaps, t0=t0, labels=labels, p2p=d["p2p"])
        view.gantt_spans = len(spans)
        shown = analysis.measured_bubble(spans, windows=windows if len(windows) else None)
        view.gantt_bubble = dict(zip(shown["stage"].astype(int), shown["bubble"]))
    return view


# --------------------------------------------------------------------------------- communication
@dataclass(slots=True, kw_only=True)
class Communication:
    summary: pd.DataFrame
    steps: tuple[int, int] | None = None  # steps covered (the latest of the range that fit the budget)
    step_time: dict | None = None  # analysis.step_time over the steady rank-steps: the Overview's and report's
    first_steady_step: int | None = None
    op_steps: tuple[int, int] | None = None  # the steps the per-op figures cover (the window, warm-up left out)
    skew: pd.DataFrame | None = None
    slow_groups: pd.DataFrame | None = None
    figures: dict[str, go.Figure] = field(default_factory=dict)
    frames: list[pd.DataFrame] = field(default_factory=list)


def communication(load: Loader, *, run: str, steps) -> Communication:
    """Everything from one read of the raw records of the latest steps that fit ``RAW_BUDGET`` (time per op
    over the steady ones among them), and the exposed communication per rank-step of the step records over
    the steady steps, as the Overview and ``report`` state it (``step_time``)."""
    meta = meta_of(load("runs_table"), run)
    rs = load("rank_steps", run=run, steps=steps)
    step_time = first = None
    if len(rs):
        first, steady = steady_rank_steps(rs, meta=meta)
        step_time = analysis.step_time(steady)
    window = collective_window(meta, steps, budget=data.RAW_BUDGET)
    rows = load("collective_rows", run=run, steps=window)
    view = Communication(summary=rows, frames=[rows, rs], steps=window, step_time=step_time, first_steady_step=first)
    if rows.empty:
        return view
    # Time per op over the steady steps too (the first step's waits, e.g. DDP's bucket setup, would weigh on
    # the mean as they do not on the step figure above); skew and bus bandwidth keep the whole window.
    timed = rows[rows["step"] >= first] if first is not None and (rows["step"] >= first).any() else rows
    view.op_steps = (int(timed["step"].min()), int(timed["step"].max()))
    view.summary = analysis.comm_summary(timed)
    view.figures["time"] = figures.comm_time(view.summary)
    coll = rows[rows["peer"] < 0]
    if coll.empty:
        return view
    view.skew = analysis.skew_by_rank(analysis.arrival_skew(coll))
    view.figures["skew"] = figures.skew_by_rank(view.skew)
    instances = analysis.collective_instances(coll)
    bb = analysis.busbw_spread(instances)
    if len(bb):
        view.figures["busbw"] = figures.busbw_vs_size(bb)
    _, groups = analysis.link_ratios(instances, members=coll)
    view.slow_groups = analysis.slow_groups(groups)
    return view


# ---------------------------------------------------------------------------------------- memory
@dataclass(slots=True, kw_only=True)
class Memory:
    per_rank: pd.DataFrame
    label: str = ""
    peak_col: str = ""
    model: pd.DataFrame | None = None
    states: pd.DataFrame | None = None  # model states vs the tensors (memory_model.states_vs_tensors)
    model_missing: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    figures: dict[str, go.Figure] = field(default_factory=dict)


def memory(load: Loader, *, run: str, steps) -> Memory:
    d = load("memory_data", run=run, steps=steps)
    mem = d["per_rank"]
    view = Memory(per_rank=mem)
    if mem.empty:
        return view
    on_device = mem["allocated_peak"].fillna(0).max() > 0
    current, view.peak_col, view.label = ("allocated", "allocated_peak", "device allocator") if on_device else (
        "rss", "rss_peak", "host RSS (no device memory recorded)")
    view.figures["per_rank"] = figures.memory_by_rank(mem, current=current, peak=view.peak_col, label=view.label)
    view.figures["trend"] = figures.memory_trend(d["per_step"], peak=view.peak_col, label=view.label)
    view.meta = meta = meta_of(load("runs_table"), run)
    # 0 is how a writer says "not known" (a zero-code run does not know a model's layers or width)
    view.model_missing = [f for f in _MODEL_FIELDS if f not in meta or not (pd.notna(meta[f]) and meta[f] > 0)]
    if not view.model_missing:
        view.model = memory_model(spec_from_meta(meta))
        view.states = states_vs_tensors(view.model, mem)
        if view.states is not None:
            view.figures["states"] = figures.memory_states_vs_tensors(view.states)
        if on_device:  # host RSS is mostly the runtime: no comparison with what the model describes
            measured = {"measured peak (max rank)": float(mem[view.peak_col].max()),
                        "measured peak (median rank)": float(mem[view.peak_col].median())}
            view.figures["model"] = figures.memory_model_vs_measured(view.model, measured=measured)
    return view


# --------------------------------------------------------------------------------------- scaling
@dataclass(slots=True, kw_only=True)
class Scaling:
    table: pd.DataFrame  # per (family, run): speedup and efficiency (scaling.scaling_table)
    runs: list[str]
    per_run: pd.DataFrame | None = None  # per run used: throughput over steady steps (scaling.run_throughput)
    left_out: pd.DataFrame | None = None  # the runs of the model that are not clean, with their ``reason``
    include_unclean: bool = False  # the families take every run (the left-out ones marked), not the clean only
    fits: pd.DataFrame | None = None  # per family: the Amdahl fit or why there is none (scaling.amdahl_fits)
    note: str = ""  # why there is no family, when there is none
    models: list[str] = field(default_factory=list)
    figures: dict[str, go.Figure] = field(default_factory=dict)
    frames: list[pd.DataFrame] = field(default_factory=list)


def run_cleanliness(load: Loader, *, runs: list[str], table: pd.DataFrame | None = None) -> pd.DataFrame:
    """``runs_clean.clean_runs`` of ``runs``: ``run``, ``clean``, ``reason``, ``cpu_contention``,
    ``cpu_wait_share``, from two reads for all of them: their events (``data.run_events``) and, for the runs
    on a CPU (the contention rule is for CPU devices), the rank-steps ``environment.run_queue_share`` takes
    (``data.cpu_wait_steps``), warm-up left out as on the Overview (``steady_rank_steps``): the share the
    Overview's CPU-contention warning states. ``table``: the
    runs table, if already loaded. The Scaling page, ``meshscope sweep`` and the planner call this."""
    table = load("runs_table") if table is None else table
    table = table[table["run"].isin(runs)]
    events = background(load, "run_events", runs=list(runs))
    cpu = table.loc[table["device"].fillna("").astype(str).str.startswith("cpu"), "run"].tolist() \
        if "device" in table else []
    shares = []
    try:
        rows = load("cpu_wait_steps", runs=cpu) if cpu else None
        for run, g in (rows.groupby("run", sort=False) if rows is not None else ()):
            _, steady = steady_rank_steps(g, meta=meta_of(table, run))
            shares.append(environment.run_queue_share(steady).assign(run=run))
    finally:
        ev = events.result()
    return runs_clean.clean_runs(table, ev, shares=pd.concat(shares, ignore_index=True) if shares else None)


def scaling_runs(load: Loader, *, runs: list[str]) -> tuple[pd.DataFrame, list[pd.DataFrame]]:
    """Per run of ``runs`` with step records: the runs table's metadata, MFU and exposed-communication
    fraction (``data.run_summaries``), the throughput over its steady steps (``scaling.run_throughput``) and
    whether it is clean (``run_cleanliness``: ``clean``, ``reason``, ``cpu_contention``, ``cpu_wait_share``),
    plus the frames read (for the skipped-files warning). ``meshscope sweep`` reads its table through this
    too, so its numbers are the page's."""
    table = load("runs_table")
    table = table[table["run"].isin(runs)]
    summaries = load("run_summaries", runs=runs)
    # The per-step series of every run (one grouped read of the step records) is the Overview's read; its
    # per-rank parts for one focus run are not needed here, so they are cut to one cell and one step.
    series = load("overview_data", run=runs[0], runs=runs, steps=None, max_ranks=1, max_steps=1,
                  budget=0)["series"] if runs else pd.DataFrame(columns=["run", "step", "step_time_s", "tokens_mean"])
    meta = table.merge(summaries[["run", "mfu", "comm_fraction"]], on="run", how="left")
    per_run = run_throughput(series, runs=meta)
    clean = run_cleanliness(load, runs=per_run["run"].tolist(), table=table)
    return per_run.merge(clean, on="run", how="left"), [summaries, series]


def scaling(load: Loader, *, selected: list[str], focus: str | None, model: str | None = None,
            include_unclean: bool = False) -> Scaling:
    """Runs compared: the selection, or with fewer than two selected all runs of the focus run's model;
    of them the clean ones (``runs_clean``), or all with ``include_unclean``."""
    table = load("runs_table")
    chosen = list(selected)
    if len(chosen) < 2:
        focus_model = meta_of(table, focus).get("model")
        if focus_model:
            chosen = table.loc[table["model"] == focus_model, "run"].tolist()
    per_run, frames = scaling_runs(load, runs=chosen)
    view = Scaling(table=per_run.iloc[:0], runs=chosen, per_run=per_run, frames=frames,
                   include_unclean=include_unclean)
    view.models = per_run["model"].dropna().unique().tolist() if "model" in per_run else []
    if per_run.empty or not view.models:
        view.note = no_family_reason(per_run.iloc[:0])
        return view
    per_run = per_run[per_run["model"] == (model if model in view.models else view.models[0])].reset_index(drop=True)
    per_run, view.left_out = family_runs(per_run, include_unclean=include_unclean)
    if per_run.empty:
        view.per_run = per_run.assign(best=pd.Series(dtype=bool))
        view.note = (f"No scaling verdict: none of the {len(view.left_out)} runs is clean (listed below with "
                     "why); include them to compare them anyway.")
        return view
    per_run["best"] = per_run.index == per_run["tokens_per_s"].idxmax()
    view.per_run = per_run
    view.table = scaling_table(per_run)
    view.fits = amdahl_fits(view.table, clean=not include_unclean and "clean" in per_run)
    if view.table.empty:
        view.note = no_family_reason(per_run)
    else:
        view.figures["speedup"] = figures.scaling_speedup(view.table, fits=view.fits)
    view.figures["bars"] = figures.scaling_bars(per_run)
    return view


# ------------------------------------------------------------------------------------------- gpu
@dataclass(slots=True, kw_only=True)
class Gpu:
    summary: pd.DataFrame
    series: pd.DataFrame | None = None
    worst: list[str] = field(default_factory=list)
    figures: dict[str, go.Figure] = field(default_factory=dict)


GPU_LINES = (("util", "utilisation"), ("clock_ratio", "SM clock / max"), ("power_w", "power (W)"),
             ("temp_c", "temperature (°C)"))
GPU_HEATMAP_ROWS = 64  # beyond this the heatmap shows the GPUs with the lowest mean SM clock
GPU_WORST = 8  # lines drawn by default: the GPUs with the lowest mean SM clock


def gpu(load: Loader, *, run: str, pick: list[str] | None = None) -> Gpu:
    d = load("gpu_data", run=run, lowest=max(GPU_HEATMAP_ROWS, GPU_WORST), gpus=sorted(pick or ()))
    summary = d["summary"]
    view = Gpu(summary=summary)
    if summary.empty:
        return view
    view.summary = summary = summary.assign(
        gpu_id=summary["host"] + ":" + summary["gpu"].astype(str),
        throttle=[", ".join(analysis.decode_throttle(int(b))) for b in summary["reasons"].fillna(0)])
    view.series = series = d["series"]
    lowest = summary.sort_values("clock_order")["gpu_id"]
    view.worst = lowest.head(GPU_WORST).tolist()
    view.figures["heatmap"] = figures.gpu_heatmap(series[series["gpu"].isin(lowest.head(GPU_HEATMAP_ROWS))],
                                                  of=len(summary))
    chosen = view.worst if pick is None else pick
    for value, title in GPU_LINES:
        view.figures[value] = figures.gpu_lines(series, gpus=chosen, value=value, title=title)
    return view


# ------------------------------------------------------------------------------------------ runs
def hang_view(load: Loader, *, run: str, now: float | None = None) -> dict:
    """``hang.analyse`` of ``run`` (the Hang panel of the Overview and Live pages, ``meshscope hang``)."""
    from meshscope.dashboard import hang

    meta = meta_of(load("runs_table"), run)
    rows = load("hang_rows", run=run)
    return hang.analyse(rows["hangs"], rows["last_steps"], world_size=int(meta.get("world_size") or 0), now=now)


def hang_table(h: dict) -> pd.DataFrame:
    """The Hang panel's table: one row per rank (state, op, group and seq waited on, step, phase, where)."""
    rows = []
    for r, info in sorted((h.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
        open_ = [g for g in h.get("groups") or () if int(r) in g["ranks"]]
        rows.append({"rank": int(r), "culprit": "✕" if int(r) in h["culprit_ranks"] else "",
                     "state": f"waits in {info['op'] or '?'}" if info["in_collective"] else "NOT in a collective",
                     "group": open_[0]["group"] if open_ else "", "seq": open_[0]["seq"] if open_ else None,
                     "step": info["step"], "phase": info["phase"], "where": info["where"]})
    for r in h.get("missing_ranks") or ():
        rows.append({"rank": int(r), "culprit": "✕" if int(r) in h["culprit_ranks"] else "",
                     "state": "no hang record", "group": "", "seq": None, "step": None, "phase": "", "where": ""})
    return pd.DataFrame(rows, columns=["rank", "culprit", "state", "group", "seq", "step", "phase", "where"]).astype(
        {"seq": "Int64", "step": "Int64"})  # a rank in no group: blank, not "None"


def runs_view(load: Loader) -> tuple[pd.DataFrame, go.Figure]:
    table = load("runs_table")
    return table, figures.runs_timeline(table)
