"""Overview: throughput, MFU and loss over steps; per-rank time breakdown; rank x step compute heatmap;
stragglers with a robust score, the delay they cost and a cause hint."""

import streamlit as st

from dashboard import ui, views


def _fmt(value: float, spec: str) -> str:
    return "n/a" if value != value else format(value, spec)  # NaN check without numpy


def main(ctx: ui.Context) -> None:
    run = ctx.focus
    st.title(f"Overview · {run}")
    threshold = st.session_state.get("overview.threshold", 3.5)
    view = views.overview(ui.loader(ctx), run=run, runs=list(ctx.selected), steps=ctx.steps, threshold=threshold)
    ui.warn_skipped(*view.frames)
    if view.series.empty:
        ui.missing("step records", run=run)
        return
    m, f = view.metrics, view.figures
    c = st.columns(4)
    c[0].metric("tokens/s (median)", _fmt(m["tokens_per_s"], ",.0f"))
    c[1].metric("MFU (median)", _fmt(m["mfu"], ".1%"))
    c[2].metric("step time (median)", _fmt(m["step_time_s"], ".3f") + " s")
    c[3].metric("loss (last)", _fmt(m["loss"], ".3f"))
    for col, name in zip(st.columns(3), ("tokens", "mfu", "loss")):
        with col:
            ui.chart(f[name])
    if view.stragglers is None:  # other selected runs have steps in the range, the focus run has none
        ui.missing("step records", run=run)
        return

    st.subheader("Per-rank time breakdown")
    ui.chart(f["breakdown"])
    if view.unattributed_s > 1e-3:
        st.caption(f"Components do not add up to wall time on some ranks (up to {view.unattributed_s:.3f} s "
                   "per step unattributed).")
    ui.chart(f["heatmap"])

    st.subheader("Stragglers")
    st.slider("Robust z threshold", 2.0, 8.0, 3.5, 0.5, key="overview.threshold",
              help="z = (x − median) / (1.4826 · MAD) across ranks of the mean compute per step; a rank is "
                   "also listed when its bus bandwidth is that far below its peers'.")
    c = st.columns(3)
    c[0].metric("straggler cost per step (mean)", _fmt(m["cost_s"] * 1e3, ".1f") + " ms",
                help="max − median compute over ranks, per step: what synchronous training loses to the slowest rank")
    c[1].metric("share of step time", _fmt(m["cost_share"], ".1%"))
    c[2].metric("flagged ranks", f"{len(view.stragglers)}")
    ui.chart(f["cost"])
    if view.stragglers.empty:
        st.success(f"No rank's compute or bus bandwidth stands out (|robust z| ≤ {threshold}).")
    else:
        st.dataframe(view.stragglers[["rank", "compute_s", "ratio_to_median", "robust_z", "slowest_share",
                                      "cost_s_per_step", "busbw_ratio", "clock_ratio", "throttle_share", "cause"]],
                     hide_index=True,
                     column_config={"slowest_share": st.column_config.NumberColumn(format="percent"),
                                    "throttle_share": st.column_config.NumberColumn(format="percent")})
    ev = ui.load("events", ctx.store, run=run)
    if len(ev):
        st.subheader("Events")
        st.dataframe(ev, hide_index=True)


ui.render(main)
