"""Figure builders: pure functions from the analysis tables to ``plotly.graph_objects.Figure``.

No Streamlit and no I/O here, so each figure can be built in a test or the benchmark. Every figure
states its units and, where a definition matters (bubble, busbw), which one it shows.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go


COLORS = {"compute_s": "#2e7d32", "exposed_comm_s": "#c62828", "bubble_s": "#9e9e9e", "other_s": "#1565c0",
          "forward": "#43a047", "backward": "#1e88e5", "weight": "#8e24aa", "idle": "rgba(160,160,160,0.35)",
          "p2p": "#212121"}
# One colour per scaling family (Plotly's default qualitative sequence, written out: figures do not depend on
# the theme's order).
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
LABELS = {"compute_s": "compute", "exposed_comm_s": "exposed comm", "bubble_s": "bubble", "other_s": "other"}


def _layout(fig: go.Figure, *, title: str, x: str, y: str, height: int = 380) -> go.Figure:
    # The legend sits at the bottom of the figure, below the x-axis title, in a margin of its own (placed
    # relative to the plot area it ran over the axis title on short charts).
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, height=height, margin=dict(l=60, r=20, t=50, b=95),
                      legend=dict(orientation="h", yref="container", y=0.0, yanchor="bottom", x=0.0))
    return fig


def _dt(t: pd.Series) -> pd.Series:
    return pd.to_datetime(t, unit="s", utc=True)


# ------------------------------------------------------------------------------------------ runs
TIMELINE_LANES = 40  # rows of the Runs timeline: the newest runs, one row each (the table above lists all)


def runs_timeline(runs: pd.DataFrame) -> go.Figure:
    """A row per run, newest at the top, its name (and world size) on the y axis: a bar from its start to
    its last step's end, coloured by strategy; ranks, steps and duration on hover. Runs that started
    seconds apart get rows of their own, so no two names can overlap (placed by the plot, beside the
    markers, they printed over each other). At most ``TIMELINE_LANES`` rows, the newest runs."""
    t = runs.dropna(subset=["t_start"]).sort_values("t_start", kind="stable")
    n_all = len(t)
    t = t.tail(TIMELINE_LANES)
    end = t["t_end"].where(t["t_end"] >= t["t_start"], t["t_start"]) if "t_end" in t else t["t_start"]
    ranks = t["world_size"].fillna(t["ranks_stepping"])
    names = t["run"].astype(str)
    fig = go.Figure()
    for i, (strategy, idx) in enumerate(t.groupby(t["strategy"].fillna("no run record"), sort=True).groups.items()):
        xs, ys, info = [], [], []
        for k in idx:
            detail = [f"{ranks[k]:.0f}" if pd.notna(ranks[k]) else "?",
                      f"{t.at[k, 'steps']:.0f}" if pd.notna(t.at[k, "steps"]) else "no",
                      f"{end[k] - t.at[k, 't_start']:,.0f} s"]
            xs += [t.at[k, "t_start"], end[k], None]
            ys += [names[k], names[k], None]
            info += [detail, detail, [None] * 3]
        x = pd.to_datetime(pd.Series(xs, dtype=float), unit="s", utc=True)
        color = _PALETTE[i % len(_PALETTE)]
        fig.add_trace(go.Scatter(
            x=x, y=ys, mode="lines+markers", name=str(strategy), customdata=info, connectgaps=False,
            line=dict(width=8, color=color), marker=dict(size=9, color=color),
            hovertemplate="%{y}: %{customdata[0]} ranks, %{customdata[1]} steps, %{customdata[2]}"
                          "<extra>%{fullData.name}</extra>"))
    label = [f"{name} ({r:.0f} ranks)" if pd.notna(r) else name for name, r in zip(names, ranks)]
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=list(names), tickmode="array",
                     tickvals=list(names), ticktext=label, automargin=True, title=None)
    title = "Runs: a row per run, from its start to its last step (hover: ranks, steps, duration)"
    if n_all > len(t):
        title = f"The newest {len(t)} of {n_all} runs, a row each, from start to last step (hover: ranks, steps)"
    return _layout(fig, title=title, x="time (UTC)", y="", height=max(260, 150 + 24 * len(t)))


# -------------------------------------------------------------------------------------- overview
def step_lines(series: pd.DataFrame, *, y: str, title: str, y_title: str, percent: bool = False,
               zero: bool = False) -> go.Figure:
    """One line per run of column ``y`` over steps; ``zero``: the axis starts at 0 (for magnitudes, where a
    dip from 4,300 to 3,300 must not look like a collapse)."""
    fig = go.Figure()
    for run, g in series.groupby("run", sort=False):
        g = g.dropna(subset=[y])
        fig.add_trace(go.Scatter(x=g["step"], y=g[y], mode="lines", name=str(run)))
    if percent:
        # Two significant digits: CPU runs sit at fractions of a percent, where ".0%" reads "0%, 0%, 1%".
        fig.update_yaxes(tickformat=".2~%")
    if zero:
        fig.update_yaxes(rangemode="tozero")
    return _layout(fig, title=title, x="step", y=y_title, height=300)


NONFINITE_COLOR = "#d50000"


def mark_nonfinite(fig: go.Figure, series: pd.DataFrame, *, found: dict) -> go.Figure:
    """The loss chart with a red mark at each step of ``series`` (one run: ``step``, ``loss``,
    ``loss_nonfinite``) whose loss was non-finite on some rank, at the last finite loss before it (or the
    next one; 0 when the run has none), and a red line above the plot saying so (``found``:
    ``analysis.nonfinite_loss``)."""
    s = series.sort_values("step")
    level = s["loss"].ffill().bfill().fillna(0.0)
    bad = s["loss_nonfinite"].fillna(0) > 0
    kind = "NaN" if found["nan"] else "infinite"
    fig.add_trace(go.Scatter(
        x=s.loc[bad, "step"], y=level[bad], mode="markers", name=f"loss {kind}",
        marker=dict(color=NONFINITE_COLOR, symbol="x", size=11, line=dict(width=2, color=NONFINITE_COLOR)),
        customdata=s.loc[bad, "loss_nonfinite"], hovertemplate="step %{x}: loss " + kind + " on %{customdata} "
        "rank(s)<extra></extra>"))
    n = found["rank_steps"]
    fig.add_annotation(text=f"loss {kind} on {n} rank-step{'' if n == 1 else 's'} from step {found['first_step']}",
                       xref="paper", yref="paper", x=1.0, y=1.0, xanchor="right", yanchor="top", showarrow=False,
                       font=dict(color=NONFINITE_COLOR))
    return fig


# Per-rank charts past this many ranks draw one SVG path per series instead of a bar (or marker) per rank:
# 16,384 ranks x 4 stacked bars are 65,536 SVG elements, which took a browser ~25 s to draw.
BAR_MAX_RANKS = 512


def rank_trace(x, y, *, name: str, color: str, stack: str | None = None, fill: bool = True,
               **kw) -> go.BaseTraceType:
    """One per-rank series: bars up to BAR_MAX_RANKS ranks, then a step line (every rank still its own
    step), filled to zero or stacked on the previous series of ``stack`` when ``fill``."""
    if len(x) <= BAR_MAX_RANKS:
        return go.Bar(x=x, y=y, name=name, marker_color=color, **kw)
    area = dict(stackgroup=stack, fillcolor=color) if stack else dict(fill="tozeroy", fillcolor=color) if fill else {}
    return go.Scatter(x=x, y=y, name=name, mode="lines", line=dict(width=0 if stack else 1, shape="hv", color=color),
                      **area, **kw)


def breakdown_bars(bd: pd.DataFrame) -> go.Figure:
    """Stacked mean seconds per step per rank: compute / exposed comm / bubble / other."""
    fig = go.Figure([rank_trace(bd["rank"], bd[c], name=LABELS[c], color=COLORS[c], stack="parts") for c in LABELS])
    fig.update_layout(barmode="stack", bargap=0.05 if len(bd) > 64 else 0.2)
    return _layout(fig, title="Where each rank's step time goes (mean per step)", x="rank", y="seconds")


HEATMAP_TICKS = 16  # rank labels on the compute heatmap, at most


def compute_heatmap(hm: pd.DataFrame, *, rank_width: int, step_width: int, first_steady: int | None = None) -> go.Figure:
    """Rank x step heatmap of compute seconds (downsampled: mean over a step bin, max over a rank bin). The
    colour scale runs from 0 to the largest cell from ``first_steady`` on: one warm-up step 9x slower would
    otherwise take the whole scale and leave every steady cell one colour; warm-up cells show at its top."""
    grid = hm.pivot(index="rank_bin", columns="step_bin", values="compute_s")
    steady = grid.loc[:, grid.columns >= first_steady] if first_steady is not None else grid
    scale = {}
    if steady.notna().to_numpy().any():
        # From zero: 2 ms of noise on 15 ms must not look like a straggler's 100 ms.
        scale = {"zmin": 0.0, "zmax": float(np.nanmax(steady.to_numpy()))}
    note = [] if rank_width == 1 and step_width == 1 else [f"{rank_width} ranks x {step_width} steps per cell; "
                                                           "max over ranks of the mean over steps"]
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=grid.columns, y=grid.index, colorscale="Viridis",
                               colorbar=dict(title="compute s"), **scale))
    title = "Compute time per rank and step" + (f" ({note[0]})" if note else "")
    fig = _layout(fig, title=title, x="step", y="rank", height=420)
    # Whole ranks, never 0.5; bin starts, at most ~16 of them (128 bins of 128 ranks at 16,384 ranks would
    # print 128 labels on top of each other).
    fig.update_yaxes(tickformat="d", tick0=0, dtick=max(1, rank_width) * max(1, -(-len(grid.index) // HEATMAP_TICKS)))
    return fig


def straggler_cost(cost: pd.DataFrame) -> go.Figure:
    """Per-step wait cost (``stragglers.step_cost``): the longest any rank made its peers wait, seconds."""
    fig = go.Figure(go.Scatter(x=cost["step"], y=cost["cost_s"], mode="lines", fill="tozeroy",
                               customdata=cost["rank"], name="peers' wait",
                               hovertemplate="step %{x}: %{y:.3f} s, waiting for rank %{customdata}<extra></extra>",
                               line_color="#c62828"))
    fig = _layout(fig, title="Straggler cost per step: how long peers waited for the slowest rank", x="step",
                  y="seconds lost", height=260)
    fig.update_yaxes(rangemode="tozero")
    span = int(cost["step"].max() - cost["step"].min()) if len(cost) else 0
    fig.update_xaxes(tick0=0, dtick=max(1, -(-span // 10)))  # whole steps, never 1.5
    return fig


# -------------------------------------------------------------------------------------- pipeline
def gantt(spans: pd.DataFrame, *, gaps: pd.DataFrame, t0: float, labels: dict[int, str],
          p2p: pd.DataFrame | None = None) -> go.Figure:
    """Spans per rank (one row per pipeline position) for one step, forward / backward / weight, with
    idle time shaded and the P2P waits (``p2p``: ``rank``, ``op``, ``peer``, ``t_end``, ``wait_s``) as thin
    bars inside it: the time a stage blocked on a send or receive. Times in ms from the step start; bar
    text is the microbatch."""
    fig = go.Figure()
    order = list(labels)
    ylab = lambda ranks: [labels[r] for r in ranks]  # noqa: E731
    if len(gaps):
        fig.add_trace(go.Bar(y=ylab(gaps["rank"]), x=(gaps["t_end"] - gaps["t_start"]) * 1e3,
                             base=(gaps["t_start"] - t0) * 1e3, orientation="h", name="idle (bubble)",
                             marker_color=COLORS["idle"], hovertemplate="idle %{x:.2f} ms<extra></extra>"))
    for kind in ("forward", "backward", "weight"):
        s = spans[spans["kind"] == kind]
        if s.empty:
            continue
        fig.add_trace(go.Bar(y=ylab(s["rank"]), x=(s["t_end"] - s["t_start"]) * 1e3, base=(s["t_start"] - t0) * 1e3,
                             orientation="h", name=kind, marker_color=COLORS[kind], text=s["microbatch"],
                             textposition="inside", insidetextanchor="middle",
                             customdata=np.stack([s["stage"], s["microbatch"]], axis=1),
                             hovertemplate=kind + " stage %{customdata[0]} mb %{customdata[1]}: %{x:.2f} ms"
                                           "<extra></extra>"))
    if p2p is not None and len(p2p):
        w = p2p[(p2p["wait_s"] > 0) & p2p["rank"].isin(order)]
        fig.add_trace(go.Bar(y=ylab(w["rank"]), x=w["wait_s"] * 1e3, base=(w["t_end"] - w["wait_s"] - t0) * 1e3,
                             orientation="h", name="P2P wait", marker_color=COLORS["p2p"], width=0.2,
                             customdata=np.stack([w["op"], w["peer"]], axis=1),
                             hovertemplate="%{customdata[0]} with rank %{customdata[1]}: waited %{x:.2f} ms"
                                           "<extra></extra>"))
    fig.update_layout(barmode="overlay", bargap=0.25)
    fig.update_yaxes(categoryorder="array", categoryarray=[labels[r] for r in reversed(order)])
    return _layout(fig, title="Pipeline schedule of the step (bar text: microbatch; grey: idle; black: P2P wait)",
                   x="ms since step start", y="pipeline position (rank)", height=max(260, 80 + 50 * len(order)))


def bubble_by_stage(stages: pd.DataFrame, *, theory: float | None) -> go.Figure:
    """Each stage's idle over the pipeline's extent, stacked: the schedule's fill and drain for the op
    times measured, transfers and host gaps (P2P), what the replay does not explain, and stage imbalance;
    the closed-form theory as a line (``analysis.pipeline_stages``' columns). Without a replay the schedule
    share is one bar."""
    x = "stage " + stages["stage"].astype(str)
    if stages["schedule_idle"].notna().all():
        parts = [(stages["schedule_idle"], "fill & drain (schedule)", "#616161"),
                 (stages["p2p_share"], "P2P transfers & host gaps", COLORS["p2p"]),
                 (stages["unexplained"].clip(lower=0), "other waits", "#9e9e9e")]
    else:
        parts = [(stages["schedule_share"], "schedule share", "#616161")]
    parts.append((stages["imbalance"], "stage imbalance", "#ef6c00"))
    fig = go.Figure([go.Bar(x=x, y=y, name=name, marker_color=c) for y, name, c in parts])
    fig.update_layout(barmode="stack")
    if theory is not None:
        fig.add_hline(y=theory, line_dash="dash", line_color="#c62828",
                      annotation_text=f"theory {theory:.1%}", annotation_position="top left",
                      annotation_bgcolor="rgba(255,255,255,0.85)")  # readable where it crosses a dark bar
    fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    return _layout(fig, title="Bubble = 1 − Σ spans / pipeline extent (idle fraction of the schedule)",
                   x="stage", y="idle fraction", height=320)


def bubble_trend(per_step: pd.DataFrame, *, theory: float | None) -> go.Figure:
    """Measured bubble per step (one line per stage) with the theoretical reference."""
    fig = go.Figure()
    for stage, g in per_step.groupby("stage"):
        fig.add_trace(go.Scatter(x=g["step"], y=g["bubble"], mode="lines", name=f"stage {stage}"))
    if theory is not None:
        fig.add_hline(y=theory, line_dash="dash", line_color="#c62828", annotation_text="theory")
    fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    return _layout(fig, title="Bubble fraction across steps", x="step", y="idle fraction", height=320)


# --------------------------------------------------------------------------------- communication
def dim_label(df: pd.DataFrame) -> pd.Series:
    """The job's own mesh dim name (``mesh_dim``) where a record has one, else the dim's kind (``dim``)."""
    if "mesh_dim" not in df.columns:
        return df["dim"]
    own = df["mesh_dim"].fillna("")
    return own.where(own != "", df["dim"])


def comm_time(summary: pd.DataFrame) -> go.Figure:
    """Per op and dim (the job's own dim name where the records carry it, e.g. ``dp_shard``): exposed
    (waited) and overlapped seconds per rank and step, stacked."""
    x = summary["op"] + " · " + dim_label(summary)
    fig = go.Figure([
        go.Bar(x=x, y=summary["exposed_s"] * 1e3, name="exposed (wait)", marker_color=COLORS["exposed_comm_s"]),
        go.Bar(x=x, y=summary["overlapped_s"] * 1e3, name="overlapped", marker_color="#ef9a9a")])
    fig.update_layout(barmode="stack")
    return _layout(fig, title="Collective time per op and parallel dim (per rank and step)", x="op · dim",
                   y="ms per rank-step")


def busbw_vs_size(df: pd.DataFrame) -> go.Figure:
    """Network-side busbw (GB/s, nccl-tests definition, after the last member arrived) against message
    size: median over collective instances, p10-p90 as error bars."""
    fig = go.Figure()
    for (op, dim), g in df.groupby(["op", "dim"]):
        fig.add_trace(go.Scatter(
            x=g["bytes"], y=g["busbw"] / 1e9, mode="markers+lines", name=f"{op} · {dim}",
            error_y=dict(type="data", symmetric=False, array=(g["busbw_p90"] - g["busbw"]) / 1e9,
                         arrayminus=(g["busbw"] - g["busbw_p10"]) / 1e9),
            customdata=g["count"], hovertemplate="%{x:.3s}B: %{y:.1f} GB/s (%{customdata} ops)<extra></extra>"))
    # SI prefixes with a byte suffix (500MB, 1GB): plotly's default "B" exponent means billions, which on a
    # bytes axis read as 0.5 bytes.
    fig.update_xaxes(type="log", tickformat="~s", ticksuffix="B")
    return _layout(fig, title="Bus bandwidth vs message size (busbw = bytes / transfer time x factor; GB/s = 1e9 B/s)",
                   x="message size (bytes)", y="busbw GB/s")


def skew_by_rank(df: pd.DataFrame) -> go.Figure:
    """Mean arrival skew per rank and the wait it caused others when it arrived last."""
    d = df.sort_values("rank")
    caused = dict(x=d["rank"], y=d["caused_wait_s"] * 1e3, name="wait it caused others (sum)", yaxis="y2")
    fig = go.Figure([
        rank_trace(d["rank"], d["mean_skew_s"] * 1e3, name="mean arrival skew", color="#6a1b9a"),
        go.Scatter(**caused, mode="markers", marker_color="#c62828") if len(d) <= BAR_MAX_RANKS
        else rank_trace(**caused, color="#c62828", fill=False)])
    fig.update_layout(yaxis2=dict(overlaying="y", side="right", title="ms caused (sum)", rangemode="tozero"))
    fig = _layout(fig, title="Arrival skew: each rank's start minus the earliest, per collective", x="rank",
                  y="ms (mean)")
    fig.update_yaxes(rangemode="tozero", selector=dict(overlaying=None))  # a 2.9 s dot must not sit at the axis
    fig.update_xaxes(tickformat="d", dtick=1 if d["rank"].nunique() <= 32 else None)
    return fig


# ---------------------------------------------------------------------------------------- memory
def memory_by_rank(df: pd.DataFrame, *, current: str, peak: str, label: str) -> go.Figure:
    """Per rank current and peak bytes (GiB) against device capacity."""
    gib = 2**30
    fig = go.Figure([rank_trace(df["rank"], df[peak] / gib, name=f"peak {label}", color="#ef6c00"),
                     rank_trace(df["rank"], df[current] / gib, name=f"current {label}", color="#1565c0")])
    cap = df["capacity"].dropna()
    if len(cap):
        fig.add_hline(y=float(cap.max()) / gib, line_dash="dash", line_color="#c62828",
                      annotation_text=f"capacity {cap.max() / gib:.0f} GiB")
    fig.update_layout(barmode="overlay")
    fig = _layout(fig, title=f"Memory per rank ({label})", x="rank", y="GiB")
    fig.update_xaxes(tickformat="d", dtick=1 if df["rank"].nunique() <= 32 else None)
    fig.update_yaxes(rangemode="tozero")
    return fig


def memory_trend(per_step: pd.DataFrame, *, peak: str, label: str) -> go.Figure:
    """Max and median over ranks of the per-step peak (GiB)."""
    gib = 2**30
    fig = go.Figure([go.Scatter(x=per_step["step"], y=per_step[f"{peak}_max"] / gib, mode="lines", name="max rank"),
                     go.Scatter(x=per_step["step"], y=per_step[f"{peak}_median"] / gib, mode="lines",
                                name="median rank")])
    fig = _layout(fig, title=f"Peak memory per step ({label})", x="step", y="GiB", height=300)
    fig.update_yaxes(rangemode="tozero")  # from zero: 4 MB of 0.4 GiB must not look like a leak
    return fig


def memory_model_vs_measured(model: pd.DataFrame, *, measured: dict[str, float]) -> go.Figure:
    """Analytic breakdown (stacked) next to measured peaks (GiB)."""
    gib = 2**30
    fig = go.Figure()
    for row in model.itertuples():
        fig.add_trace(go.Bar(x=["model"], y=[row.bytes / gib], name=row.component, hovertext=row.formula))
    for name, value in measured.items():
        fig.add_trace(go.Bar(x=[name], y=[value / gib], name=name, marker_color="#424242", showlegend=False))
    fig.update_layout(barmode="stack")
    return _layout(fig, title="Analytic model vs measured peak per device", x="", y="GiB")


def byte_unit(top: float) -> tuple[str, int]:
    """The unit to show byte counts up to ``top`` in (charts and tables alike): GiB from 1 GiB, else MiB."""
    return ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)


def memory_states_vs_tensors(table: pd.DataFrame) -> go.Figure:
    """Model states per device, analytic next to measured from the tensors (``memory_model.states_vs_tensors``),
    in MiB or GiB by magnitude."""
    unit, div = byte_unit(float(table[["model_bytes", "measured_max"]].to_numpy().max()))
    fig = go.Figure()
    fig.add_trace(go.Bar(x=table["component"], y=table["model_bytes"] / div, name="model (per device)",
                         marker_color="#90a4ae"))
    fig.add_trace(go.Bar(x=table["component"], y=table["measured_max"] / div, name="measured (max rank)",
                         marker_color="#1565c0"))
    fig.update_layout(barmode="group")
    fig.update_yaxes(rangemode="tozero")
    return _layout(fig, title="Parameters, gradients, optimizer state: model vs the tensors", x="", y=unit)


# --------------------------------------------------------------------------------------- scaling
def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values for a log axis over [lo, hi] that read without their decade: 1-2-5 steps (0.1, 0.2, 0.5,
    1, 2, 5, ...), finer where that leaves fewer than three (Plotly's own log ticks label the minor ones
    by their first digit only: "5, 2, 1, 5, 2, 0.1, 5")."""
    lo, hi = float(min(lo, hi)), float(max(lo, hi))
    if not (lo > 0 and np.isfinite(hi)):
        return []
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8),
                      tuple(np.round(np.arange(1.0, 10.0, 0.1), 1))):
        decades = range(int(np.floor(np.log10(lo))) - 1, int(np.ceil(np.log10(hi))) + 1)
        ticks = [float(f"{m * 10.0 ** e:.6g}") for e in decades for m in mantissas]
        ticks = [t for t in ticks if lo <= t <= hi]
        if len(ticks) >= 3:
            return ticks
    return ticks


def _log_axis(values, *, pad: float = 1.15) -> dict:
    """A log axis's range, tick values and labels (``log_ticks``) covering ``values`` with a margin."""
    v = np.asarray([x for x in values if np.isfinite(x) and x > 0], dtype=float)
    lo, hi = (float(v.min()) / pad, float(v.max()) * pad) if len(v) else (0.5, 2.0)
    ticks = log_ticks(lo, hi)
    return dict(type="log", range=[np.log10(lo), np.log10(hi)], tickmode="array", tickvals=ticks,
                ticktext=[f"{t:g}" for t in ticks])


CONTENTION_SYMBOL, UNCLEAN_SYMBOL = "diamond", "x"


def scaling_speedup(table: pd.DataFrame, *, fits: pd.DataFrame) -> go.Figure:
    """Speedup vs world size per family (``scaling.scaling_table``), each against its own baseline n0 (the
    median throughput of its runs at n0), with its ideal line n / n0 and, where ``fits``
    (``scaling.amdahl_fits``) has one, the fitted throughput on the same scale: 1 / T(n) over the measured
    baseline, so the line runs through the points it was fitted to. Runs with CPU contention
    (``cpu_contention``) are diamonds, runs that are not clean (``clean`` False: included on request) crosses;
    without a fit the family's median per world size is joined by a thin line."""
    fig = go.Figure()
    fit_of = dict(zip(fits["family"], fits["fit"]))
    xs, ys = [], []
    for i, (family, g) in enumerate(table.groupby("family", sort=True)):
        color = _PALETTE[i % len(_PALETTE)]
        g = g.sort_values(["world_size", "run"])
        n = g["world_size"].astype(float)
        n0 = float(g["n0"].iloc[0])
        base = float((g["tokens_per_s"] / g["speedup"]).iloc[0])  # the baseline's median throughput
        top = max(float(n.max()), 2 * n0)
        ideal = np.geomspace(n0, top, 50)
        fig.add_trace(go.Scatter(x=ideal, y=ideal / n0, mode="lines", name=f"ideal ({family})", legendgroup=family,
                                 showlegend=False, hoverinfo="skip", line=dict(dash="dot", color=color, width=1)))
        xs += [n0, top]
        ys += [1.0, top / n0]
        fit = fit_of.get(family)
        if fit is not None:
            grid = np.geomspace(float(n.min()), float(n.max()), 50)
            y = 1.0 / np.asarray(fit.time(grid)) / base
            fig.add_trace(go.Scatter(x=grid, y=y, mode="lines", legendgroup=family, line=dict(color=color, width=2),
                                     name=f"Amdahl fit c = {fit.c:.3f} (R² {fit.r2:.2f})",
                                     hovertemplate="n = %{x:.3g}: fitted speedup %{y:.2f}<extra></extra>"))
            ys += list(y)
        else:
            med = g.groupby("world_size")["speedup"].median()
            fig.add_trace(go.Scatter(x=med.index.astype(float), y=med.to_numpy(), mode="lines", legendgroup=family,
                                     showlegend=False, hoverinfo="skip", line=dict(color=color, width=1)))
        no = pd.Series(False, g.index)
        contended = g["cpu_contention"].fillna(False).astype(bool) if "cpu_contention" in g else no
        unclean = ~g["clean"].fillna(True).astype(bool) if "clean" in g else no
        symbol = np.where(unclean, UNCLEAN_SYMBOL, np.where(contended, CONTENTION_SYMBOL, "circle"))
        why = np.where(unclean, "not clean: " + g.get("reason", pd.Series("", g.index)).fillna("").astype(str),
                       np.where(contended, "CPU contention", "clean"))
        fig.add_trace(go.Scatter(x=n, y=g["speedup"], mode="markers", name=family, legendgroup=family,
                                 text=g["run"], customdata=why,
                                 hovertemplate="%{text}: n = %{x}, speedup %{y:.2f} (%{customdata})<extra></extra>",
                                 marker=dict(size=11, color=color, symbol=symbol, line=dict(width=1, color="white"))))
        xs += list(n)
        ys += list(g["speedup"])
    for sym, label, col in ((CONTENTION_SYMBOL, "◆ CPU contention (ranks waited for a core)", "cpu_contention"),
                            (UNCLEAN_SYMBOL, "✕ not clean (included on request)", "clean")):
        if col in table and (table[col].fillna(col == "clean").astype(bool) != (col == "clean")).any():
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label,
                                     marker=dict(size=10, color="#616161", symbol=sym)))
    sizes = sorted({float(x) for x in xs})
    fig.update_xaxes(type="log", range=[np.log10(min(sizes) / 1.25), np.log10(max(sizes) * 1.25)],
                     tickmode="array", tickvals=sizes, ticktext=[f"{x:g}" for x in sizes])
    fig.update_yaxes(**_log_axis(ys))
    return _layout(fig, title="Speedup vs world size per family (dotted: ideal)",
                   x="world size", y="speedup (throughput / family's n0)")


def scaling_bars(per_run: pd.DataFrame) -> go.Figure:
    """Throughput per run (green: the best) with its exposed-communication fraction."""
    colors = np.where(per_run["best"], "#2e7d32", "#1565c0")
    fig = go.Figure([
        go.Bar(x=per_run["run"], y=per_run["tokens_per_s"], name="tokens/s", marker_color=colors),
        go.Scatter(x=per_run["run"], y=per_run["comm_fraction"], name="exposed comm fraction", yaxis="y2",
                   mode="markers+lines")])
    fig.update_layout(yaxis2=dict(overlaying="y", side="right", tickformat=".0%", range=[0, 1.1]))
    return _layout(fig, title="Throughput (steady steps) and exposed communication fraction", x="run", y="tokens/s")


# ------------------------------------------------------------------------------------------- gpu
def gpu_heatmap(series: pd.DataFrame, *, of: int | None = None, value: str = "clock_ratio",
                title: str = "SM clock / max") -> go.Figure:
    """GPU x time heatmap of one metric (time-binned). ``of``: how many GPUs the run has, when
    ``series`` holds only the lowest-clock ones (said in the title)."""
    grid = series.pivot(index="gpu", columns="bin", values=value)
    t = series.groupby("bin")["t"].min().reindex(grid.columns)
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=_dt(t), y=grid.index, colorscale="RdYlGn",
                               colorbar=dict(title=title)))
    which = (f"the {len(grid)} GPUs with the lowest mean SM clock of {of:,}" if of is not None and of > len(grid)
             else "per GPU")
    return _layout(fig, title=f"{title} over time, {which}", x="time (UTC)", y="host:gpu",
                   height=min(900, max(300, 80 + 12 * len(grid))))


def gpu_lines(series: pd.DataFrame, *, gpus: list[str], value: str, title: str) -> go.Figure:
    fig = go.Figure()
    for gpu in gpus:
        g = series[series["gpu"] == gpu]
        fig.add_trace(go.Scatter(x=_dt(g["t"]), y=g[value], mode="lines", name=gpu))
    return _layout(fig, title=title, x="time (UTC)", y=title, height=300)


# ------------------------------------------------------------------------------------------ live
def live_series(df: pd.DataFrame, *, title: str, percent: bool = False,
                until: float | None = None) -> go.Figure:
    """One Live series over the last minutes, a line per rank (``rank``, ``t`` Unix seconds, ``value``).
    ``until`` (Unix seconds, the page's now): the time axis runs to it, so a series that stopped (the run
    ended) visibly ends before now instead of filling the chart."""
    fig = go.Figure()
    if until is not None and len(df):
        fig.update_xaxes(range=list(_dt(pd.Series([min(float(df["t"].min()), until), until]))))
    for i, (rank, g) in enumerate(df.sort_values("t").groupby("rank", sort=True)):
        fig.add_trace(go.Scatter(x=_dt(g["t"]), y=g["value"], mode="lines",
                                 name=f"rank {rank}", line=dict(color=_PALETTE[i % len(_PALETTE)], width=1.5)))
    # Whole percents label an MFU of 1 % "0%, 1%, 1%" (ticks every 0.5 %): a decimal below 10 %.
    small = percent and len(df) and float(df["value"].max()) < 0.1
    fig.update_yaxes(rangemode="tozero", tickformat=(".1%" if small else ".0%") if percent else None)
    return _layout(fig, title=title, x="time (UTC)", y=title, height=280)


# ------------------------------------------------------------------------------------------ what-if
_WHATIF_PARTS = (("compute_s", "compute", COLORS["compute_s"]), ("optimizer_s", "optimizer", "#66bb6a"),
                 ("exposed_dp_s", "exposed DDP", "#c62828"), ("exposed_fsdp_s", "exposed FSDP", "#ef5350"),
                 ("exposed_tp_s", "exposed TP", "#ff8a65"), ("bubble_s", "bubble", COLORS["bubble_s"]),
                 ("other_s", "other", COLORS["other_s"]))


def whatif_layouts(table: pd.DataFrame, *, measured: pd.DataFrame) -> go.Figure:
    """Predicted step time per candidate layout, stacked by part (seconds), fastest at the top, with the
    interval a run of it may measure (``step_time_low_s``-``step_time_high_s``, where given) as an error
    bar; the measured runs of the layouts drawn as black diamonds on their bars."""
    t = table.iloc[::-1]  # plotly draws the first category at the bottom
    fig = go.Figure()
    if t.empty:
        return _layout(fig, title="Predicted step time by layout (no valid layout)", x="seconds per step", y="")
    for col, name, color in _WHATIF_PARTS:
        if col in t:
            fig.add_bar(y=t["layout"], x=t[col], name=name, orientation="h", marker_color=color)
    if "step_time_low_s" in t:  # where a run of the layout may measure its step
        fig.add_scatter(y=t["layout"], x=t["step_time_s"], mode="markers", name="interval",
                        marker=dict(size=1, color="#424242"),
                        error_x=dict(type="data", symmetric=False, array=t["step_time_high_s"] - t["step_time_s"],
                                     arrayminus=t["step_time_s"] - t["step_time_low_s"], color="#424242", width=4),
                        customdata=t[["step_time_low_s", "step_time_high_s"]].to_numpy(),
                        hovertemplate="%{y}: %{x:.3f} s, a run may measure %{customdata[0]:.3f}-%{customdata[1]:.3f} s"
                                      "<extra>interval</extra>")
    measured = measured[measured["layout"].isin(set(t["layout"]))] if len(measured) else measured
    if len(measured):
        fig.add_scatter(y=measured["layout"], x=measured["measured_s"], mode="markers", name="measured",
                        marker=dict(symbol="diamond", size=11, color="black"),
                        customdata=measured["run"], hovertemplate="%{customdata}: %{x:.3f} s<extra>measured</extra>")
    fig.update_layout(barmode="stack")
    return _layout(fig, title="Predicted step time by layout (fastest first)", x="seconds per step", y="",
                   height=max(300, 60 + 26 * len(t)))


# --------------------------------------------------------------------------------------- compare
def diff_waterfall(parts: list[dict], *, unit: str = "step") -> go.Figure:
    """A's mean step time, each part's change (B − A, with its bootstrap interval as an error bar), and B's:
    the parts sum to the difference (``dashboard.diff``)."""
    whole = next(p for p in parts if p["part"] == "step")
    rest = [p for p in parts if p["part"] != "step"]
    scale, label = (1e3, "ms per step") if unit == "step" else (1e6, "µs per token")
    x = ["A", *[p["part"] for p in rest], "B"]
    y = [whole["a_s"] * scale, *[p["diff_s"] * scale for p in rest], whole["b_s"] * scale]
    fig = go.Figure(go.Waterfall(x=x, y=y, measure=["absolute", *["relative"] * len(rest), "total"],
                                 increasing=dict(marker_color=COLORS["exposed_comm_s"]),
                                 decreasing=dict(marker_color=COLORS["compute_s"]),
                                 totals=dict(marker_color=COLORS["other_s"]), connector=dict(line=dict(width=1)),
                                 showlegend=False))
    # The intervals of the parts, at each bar's end (a waterfall bar has no error bars of its own)
    ends = np.cumsum([whole["a_s"] * scale, *[p["diff_s"] * scale for p in rest]])[1:]
    fig.add_trace(go.Scatter(x=[p["part"] for p in rest], y=ends, mode="markers", marker=dict(size=1, opacity=0),
                             error_y=dict(type="data", symmetric=False,
                                          array=[(p["hi_s"] - p["diff_s"]) * scale for p in rest],
                                          arrayminus=[(p["diff_s"] - p["lo_s"]) * scale for p in rest]),
                             name="95 % interval", showlegend=False))
    return _layout(fig, title=f"Where the difference goes: A, each part's change B − A (interval), B", x="",
                   y=label, height=420)


def diff_distributions(walls: dict[str, pd.Series]) -> go.Figure:
    """The steady steps' times of each run (the baseline first), side by side (box with every step)."""
    fig = go.Figure([go.Box(y=w * 1e3, name=name, boxpoints="all", jitter=0.4,
                            marker_color=_PALETTE[i % len(_PALETTE)]) for i, (name, w) in enumerate(walls.items())])
    return _layout(fig, title="Steady step times (mean over ranks)", x="run", y="ms per step")


def _part_color(part: str, i: int) -> str:
    fixed = {"compute": COLORS["compute_s"], "bubble": COLORS["bubble_s"], "other": COLORS["other_s"],
             "optimizer": "#66bb6a", "unattributed": "#bdbdbd", "exposed, unattributed": "#ef9a9a"}
    return fixed.get(part, _PALETTE[(i + 3) % len(_PALETTE)])


def diff_several(results: dict[str, dict]) -> go.Figure:
    """Each compared run against the one baseline: its parts' changes stacked (points of the baseline's step
    time; a part that shrank stacks to the left) and the whole's change with its interval (a diamond with
    error bars), one row per run (``dashboard.diff``'s results, by run name)."""
    runs = list(results)
    parts: list[str] = []
    for c in results.values():
        parts += [p["part"] for p in c["parts"] if p["part"] != "step" and p["part"] not in parts]
    fig = go.Figure()
    for i, part in enumerate(parts):
        x = []
        for run in runs:
            by = {p["part"]: p for p in results[run]["parts"]}
            x.append(by[part]["diff_pct"] if part in by and by[part]["diff_pct"] is not None else 0.0)
        if any(abs(v) > 0.05 for v in x):  # a part that moved in none of the runs stays out of the legend
            fig.add_bar(y=runs, x=x, name=part, orientation="h", marker_color=_part_color(part, i),
                        hovertemplate="%{y}: %{x:+.1f} points<extra>" + part + "</extra>")
    wholes = [next((p for p in results[r]["parts"] if p["part"] == "step"), None) for r in runs]
    have = [(r, w) for r, w in zip(runs, wholes) if w is not None and w["diff_pct"] is not None]
    if have:
        fig.add_scatter(y=[r for r, _ in have], x=[w["diff_pct"] for _, w in have], mode="markers",
                        name="step (interval)", marker=dict(symbol="diamond", size=11, color="black"),
                        error_x=dict(type="data", symmetric=False, array=[w["hi_pct"] - w["diff_pct"] for _, w in have],
                                     arrayminus=[w["diff_pct"] - w["lo_pct"] for _, w in have]),
                        hovertemplate="%{y}: %{x:+.1f} %<extra>step</extra>")
    fig.update_layout(barmode="relative", yaxis=dict(autorange="reversed"))  # the first run on top, as listed
    fig.add_vline(x=0, line_width=1, line_color="#616161")
    return _layout(fig, title="Each run against the baseline: the step's change (interval) and its parts",
                   x="% of the baseline's step time", y="", height=max(300, 140 + 48 * len(runs)))


def diff_comm(parts: list[dict], *, names: tuple[str, str], unit: str = "step") -> go.Figure:
    """Exposed communication per op and dim in each run, side by side (ms per step, or µs per token where the
    runs are compared per token)."""
    comm = [p for p in parts if p["part"].startswith("exposed")]
    x = [p["part"].removeprefix("exposed ") for p in comm]
    scale, label = (1e3, "ms per step") if unit == "step" else (1e6, "µs per token")
    fig = go.Figure([go.Bar(x=x, y=[p["a_s"] * scale for p in comm], name=names[0], marker_color=_PALETTE[0]),
                     go.Bar(x=x, y=[p["b_s"] * scale for p in comm], name=names[1], marker_color=_PALETTE[1])])
    fig.update_layout(barmode="group")
    return _layout(fig, title="Exposed communication per op and dim", x="op on dim", y=label)
