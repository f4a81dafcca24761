"""Scaling: runs of one model grouped into strong- and weak-scaling families; per family speedup and
efficiency against its smallest world size, an Amdahl fit where there are enough world sizes, the
communication fraction, and the best configuration. The numbers are ``meshscope sweep``'s (one computation:
``dashboard/scaling.py``)."""

import streamlit as st

from dashboard import scaling, ui, views

RUN_COLUMNS = ["run", "strategy", "mesh", "world_size", "global_batch", "steady_from", "steps_used", "step_time_s",
               "tokens_per_s", "tokens_per_s_per_device", "comm_fraction", "mfu", "best"]
FAMILY_COLUMNS = ["family", "run", "world_size", "global_batch", "tokens_per_s", "baseline", "n0", "speedup",
                  "efficiency"]


def main(ctx: ui.Context) -> None:
    st.title("Scaling")
    model = st.session_state.get("scaling.model")
    view = views.scaling(ui.loader(ctx), selected=list(ctx.selected), focus=ctx.focus, model=model)
    ui.warn_skipped(*view.frames)
    if len(ctx.selected) < 2:
        st.caption(f"Fewer than two runs selected: comparing the {len(view.runs)} runs of the focus run's model.")
    per_run = view.per_run
    if per_run is None or per_run.empty:
        st.info("No run with both run records and step records among the selection.")
        return
    if len(view.models) > 1:
        st.selectbox("Model", view.models, key="scaling.model")
    best = per_run[per_run["best"]].iloc[0]
    c = st.columns(2)
    c[0].metric("best configuration", f"{best['run']}")
    c[1].metric("best tokens/s", f"{best['tokens_per_s']:,.0f}")
    st.caption(f"Best: `{best['run']}` — {best['strategy']}, mesh {best['mesh']}, {best['world_size']:.0f} ranks "
               f"(highest throughput of the runs shown; across families it compares different batches).")
    st.dataframe(per_run[[c for c in RUN_COLUMNS if c in per_run]], hide_index=True)
    if view.table.empty:
        st.info(view.note)
    else:
        baselines = view.table.groupby("family")["baseline"].first()
        for fit in view.fits.itertuples():
            st.markdown(f"**{fit.family}** (baseline: {baselines[fit.family]}) — {fit.note}")
        st.dataframe(view.table[FAMILY_COLUMNS], hide_index=True)
    for col, name in zip(st.columns(2), ("speedup", "bars")):
        if name in view.figures:
            with col:
                ui.chart(view.figures[name])
    st.caption(scaling.RULE)


ui.render(main)
