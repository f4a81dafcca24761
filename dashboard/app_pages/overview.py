"""Overview: throughput, MFU and loss over steps; per-rank time breakdown; rank x step compute heatmap;
stragglers (each rank against its peers in the same step), what they cost their peers and a cause hint."""

import time

import pandas as pd
import streamlit as st

from meshscope.dashboard import analysis, environment, stragglers, ui, views
from meshscope.dashboard.tracepanel import panel as deeptrace_panel


def _fmt(value: float, spec: str) -> str:
    return "n/a" if value != value else format(value, spec)  # NaN check without numpy


def main(ctx: ui.Context) -> None:
    run = ctx.focus
    st.title(f"Overview · {run}")
    deeptrace_panel(ctx, run)  # torch.profiler on the running job, from this page
    threshold = st.session_state.get("overview.threshold", stragglers.STRAGGLER_REL)
    view = views.overview(ui.loader(ctx), run=run, runs=list(ctx.selected), steps=ctx.steps, threshold=threshold)
    ui.warn_skipped(*view.frames)
    if view.series.empty:
        ui.missing("step records", run=run)
        return
    m, f = view.metrics, view.figures
    for text in view.warnings:  # the environment qualifies every figure below: say so first
        st.warning(text, icon="⚠️")
    ev = ui.load("events", ctx.store, run=run)
    failures = analysis.event_summary(ev, kinds=analysis.FAILURE_KINDS)
    if key := failures["key_event"]:  # a restarted or failed run: its figures cover the steps it completed
        counts = ", ".join(f"{k.replace('_', ' ')} ×{n}" for k, n in failures["counts"].items())
        st.warning(f"This run had failures: {counts}. Key event: rank {key['rank']} at step {key['step']}, "
                   f"{key['kind'].replace('_', ' ')}: {key['message'][:200]}. The Events table below lists them "
                   "all.", icon="⚠️")
    ui.hang_panel(views.hang_view(ui.loader(ctx), run=run, now=time.time()))  # a stall: who holds the job, first
    if view.stragglers is not None and len(view.stragglers):  # the headline verdict; details below
        st.warning(_verdict(view) + " Details under Stragglers below.", icon="🐢")
    over = (f"over steps {view.first_steady_step}–{view.step_time['last_step']} (warm-up left out)"
            if view.step_time else "over the selected steps")
    c = st.columns(5)
    c[0].metric("tokens/s (median)", _fmt(m["tokens_per_s"], ",.0f"), help=f"Median of the steps' tokens/s {over}.")
    c[1].metric("MFU (median)", _fmt(m["mfu"], ".1%"), help=f"Median of the steps' MFU {over}.")
    c[2].metric("step time (median)", _fmt(m["step_time_s"], ".3f") + " s",
                help=f"Median of the ranks' step wall times {over}.")
    c[3].metric("step time (mean)", _fmt(m["step_time_s_mean"], ".3f") + " s",
                help=f"Mean of the ranks' step wall times {over}: the sum of the breakdown below.")
    bad = view.loss_nonfinite
    c[4].metric("loss (last)", ("non-finite (NaN)" if bad["nan"] else "non-finite (inf)") if bad and bad["last"]
                else _fmt(m["loss"], ".3f"))
    for col, name in zip(st.columns(3), ("tokens", "mfu", "loss")):
        with col:
            if name in f:
                ui.chart(f[name])
            else:  # no data for it: why, in one line, not empty axes
                st.info(view.notes[name])
    if view.stragglers is None:  # other selected runs have steps in the range, the focus run has none
        ui.missing("step records", run=run)
        return

    st.subheader("Per-rank time breakdown")
    t = view.step_time
    st.caption(f"Means per step {over}: compute {t['compute_s']:.3f} s + exposed comm {t['exposed_comm_s']:.3f} s "
               f"+ bubble {t['bubble_s']:.3f} s + other {t['other_s']:.3f} s = {t['step_time_s_mean']:.3f} s, the mean "
               f"step time (the median is {t['step_time_s_median']:.3f} s).")
    ui.chart(f["breakdown"])
    if view.unattributed_s > 1e-3:
        st.caption(f"Components do not add up to wall time on some ranks (up to {view.unattributed_s:.3f} s "
                   "per step unattributed).")
    ui.chart(f["heatmap"])

    st.subheader("Stragglers")
    st.caption(stragglers.RULE + f" Judged on {view.verdict_steps} steps from step {view.first_steady_step} "
               f"(warm-up before it excluded).")
    st.slider("Slower than peers by at least", 0.05, 1.0, stragglers.STRAGGLER_REL, 0.05, key="overview.threshold",
              format="%.2f", help="Relative excess of a rank's compute over its peers' median in the same step.")
    c = st.columns(3)
    c[0].metric("flagged stragglers' cost per step", _fmt(m["cost_s"] * 1e3, ".1f") + " ms",
                help="What the other ranks lose per step waiting for the flagged ranks (their exposed "
                     "communication beyond the straggler's own)")
    c[1].metric("share of step time", _fmt(m["cost_share"], ".1%"))
    c[2].metric("flagged ranks", f"{len(view.stragglers)}")
    if "cost" in f:
        ui.chart(f["cost"])
        # Without a flagged rank the chart still shows each step's slowest rank: ordinary jitter, which the
        # cost above (flagged ranks only) leaves out. Said, so that 0 ms beside a 3 ms curve is not a puzzle.
        st.caption("The chart is each step's wait for whichever rank was slowest in that step, flagged or not; "
                   "the cost above counts only the flagged ranks, so without one it is 0 and the chart is "
                   "ordinary step-to-step jitter.")
    else:
        st.info("Every rank is alone in its pipeline stage: no peers doing the same work to compare it with, so "
                "no straggler verdict on compute (the Pipeline page shows stage imbalance).")
    if view.stragglers.empty and view.verdict_steps < environment.MIN_STEADY_STEPS:
        st.info(f"No straggler verdict: only {view.verdict_steps} steps after warm-up.")
    elif view.stragglers.empty:
        st.success(f"No straggler: no rank held its peers up (≥ {threshold:.0%} slower than them and last to "
                   "arrive) in most steps, and no rank's bus bandwidth stands out.")
    else:
        st.warning(_verdict(view))
        table = view.stragglers.rename(columns={
            "rank": "Rank", "compute_s": "Compute (s/step)", "peers_compute_s": "Peers' compute (s/step)",
            "excess_s": "Excess (s/step)", "slow_share": "Steps slow", "cost_s_per_step": "Cost (s/step)",
            "busbw_ratio": "Bus bandwidth vs peers", "clock_ratio": "SM clock / max",
            "throttle_share": "Throttled samples", "cause": "Cause"})
        shown = table[["Rank", "Compute (s/step)", "Peers' compute (s/step)", "Excess (s/step)", "Steps slow",
                       "Cost (s/step)", "Bus bandwidth vs peers", "SM clock / max", "Throttled samples", "Cause"]]
        # The cause in one word in the table (a sentence there is cut off), whole below it.
        shown = shown.assign(Cause=shown["Cause"].str.split(" (", n=1, regex=False).str[0])
        st.dataframe(shown.dropna(axis=1, how="all"),  # no GPU columns on a CPU run: absent, not "None"
                     hide_index=True,
                     column_config={"Steps slow": st.column_config.NumberColumn(format="percent"),
                                    "Throttled samples": st.column_config.NumberColumn(format="percent")})
        for r in view.stragglers.itertuples():
            st.caption(f"Rank {int(r.rank)}: {r.cause}")
    if len(ev):
        st.subheader("Events")
        ui.table(ev.assign(t=pd.to_datetime(ev["t"], unit="s", utc=True).dt.strftime("%Y-%m-%d %H:%M:%S")), EVENT_COLUMNS)


EVENT_COLUMNS = {"t": ("time (UTC)", None), "rank": ("rank", None), "step": ("step", None), "kind": ("event", None),
                 "message": ("message", None)}


def _verdict(view) -> str:
    names = ", ".join(f"rank {int(r.rank)} ({r.cause.split(' (')[0]}, {r.cost_s_per_step * 1e3:.0f} ms/step)"
                      for r in view.stragglers.itertuples())
    return f"Straggler{'s' if len(view.stragglers) > 1 else ''}: {names}."


ui.render(main)
