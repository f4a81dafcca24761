"""Scaling: across runs of one model at different world sizes and strategies: throughput, speedup,
strong- and weak-scaling efficiency, communication fraction, an Amdahl fit, and the best configuration."""

import streamlit as st

from dashboard import ui, views

COLUMNS = ["run", "strategy", "mesh", "world_size", "global_batch", "step_time_s", "tokens_per_s",
           "tokens_per_s_per_device", "speedup", "efficiency", "strong_efficiency", "weak_efficiency",
           "comm_fraction", "mfu", "best"]


def main(ctx: ui.Context) -> None:
    st.title("Scaling")
    model = st.session_state.get("scaling.model")
    view = views.scaling(ui.loader(ctx), selected=list(ctx.selected), focus=ctx.focus, model=model)
    ui.warn_skipped(*view.frames)
    if len(ctx.selected) < 2:
        st.caption(f"Fewer than two runs selected: comparing the {len(view.runs)} runs of the focus run's model.")
    if not view.figures:
        st.info("No run with both run records and step records among the selection.")
        return
    if len(view.models) > 1:
        st.selectbox("Model", view.models, key="scaling.model")
    table, fit = view.table, view.fit
    best = table[table["best"]].iloc[0]
    c = st.columns(3)
    c[0].metric("best configuration", f"{best['run']}")
    c[1].metric("best tokens/s", f"{best['tokens_per_s']:,.0f}")
    c[2].metric("Amdahl c (fit)", f"{fit.c:.3f}" if fit else "needs 2+ world sizes")
    st.caption(f"Best: `{best['run']}` — {best['strategy']}, mesh {best['mesh']}, {best['world_size']:.0f} ranks.")
    for col, name in zip(st.columns(2), ("speedup", "bars")):
        with col:
            ui.chart(view.figures[name])
    st.dataframe(table[COLUMNS], hide_index=True)
    st.caption("Speedup = n0 · throughput / throughput(n0) against the smallest run n0; efficiency = speedup / n. "
               "Strong-scaling efficiency only where the global batch equals the baseline's, weak-scaling where "
               "the per-device batch does. Amdahl: time per token = T1 · (c + (1 − c)/n), fitted by least "
               "squares in 1/n; speedup ≤ 1 / (c + (1 − c)/n).")


ui.render(main)
