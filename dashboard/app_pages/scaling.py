"""Scaling: runs of one model grouped into strong- and weak-scaling families; per family speedup and
efficiency against its smallest world size, an Amdahl fit where there are enough world sizes, the
communication fraction, and the best configuration. The numbers are ``meshscope sweep``'s (one computation:
``dashboard/scaling.py``)."""

import streamlit as st

from meshscope.dashboard import scaling, ui, views

RUN_COLUMNS = {"run": ("run", None), "strategy": ("strategy", None), "mesh": ("mesh", None),
               "world_size": ("ranks", None), "global_batch": ("global batch", None),
               "steady_from": ("steady from step", None), "steps_used": ("steps used", None),
               "step_time_s": ("step time (s)", "%.3f"), "tokens_per_s": ("tokens/s", "int"),
               "tokens_per_s_per_device": ("tokens/s per rank", "int"),
               "comm_fraction": ("exposed comm", "percent"), "mfu": ("MFU", "percent"), "best": ("best", None)}
FAMILY_COLUMNS = {"family": ("family", None), "run": ("run", None), "world_size": ("ranks", None),
                  "global_batch": ("global batch", None), "tokens_per_s": ("tokens/s", "int"),
                  "baseline": ("baseline run", None), "n0": ("baseline ranks", None),
                  "speedup": ("speedup", "%.2f"), "efficiency": ("efficiency", "percent")}


def main(ctx: ui.Context) -> None:
    st.title("Scaling")
    model = st.session_state.get("scaling.model")
    view = views.scaling(ui.loader(ctx), selected=list(ctx.selected), focus=ctx.focus, model=model)
    ui.warn_skipped(*view.frames)
    if len(ctx.selected) < 2:
        n = len(view.runs)
        st.caption(f"Fewer than two runs selected: comparing the {n} run{'s' if n != 1 else ''} of the focus run's model.")
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
    ui.table(per_run, RUN_COLUMNS)
    if view.table.empty:
        st.info(view.note)
    else:
        baselines = view.table.groupby("family")["baseline"].first()
        for fit in view.fits.itertuples():
            st.markdown(f"**{fit.family}** (baseline: {baselines[fit.family]}) — {fit.note}")
        ui.table(view.table, FAMILY_COLUMNS)
    for col, name in zip(st.columns(2), ("speedup", "bars")):
        if name in view.figures:
            with col:
                ui.chart(view.figures[name])
    st.caption(scaling.RULE)


ui.render(main)
