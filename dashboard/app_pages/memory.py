"""Memory: per-rank current and peak against capacity, and measured peak against an analytic model of
the run's strategy (parameters, gradients, optimizer state, activations)."""

import pandas as pd
import streamlit as st

from meshscope.dashboard import figures, ui, views


def main(ctx: ui.Context) -> None:
    run = ctx.focus
    st.title(f"Memory · {run}")
    view = views.memory(ui.loader(ctx), run=run, steps=ctx.steps)
    mem = view.per_rank
    ui.warn_skipped(mem)
    if mem.empty:
        ui.missing("memory samples", run=run)
        return
    for col, name in zip(st.columns(2), ("per_rank", "trend")):
        with col:
            ui.chart(view.figures[name])
    peak, cap = mem[view.peak_col].max(), mem["capacity"].max()
    c = st.columns(3)
    c[0].metric("max peak", f"{peak / 2**30:.2f} GiB")
    c[1].metric("of capacity", f"{peak / cap:.0%}" if pd.notna(cap) and cap > 0 else "n/a")
    ooms, retries = mem["ooms"].max(), mem["alloc_retries"].max()
    c[2].metric("OOMs / alloc retries", f"{int(ooms)} / {int(retries)}" if ooms >= 0 and retries >= 0 else "n/a",
                help="The CUDA caching allocator's counters; a CPU run has none.")

    st.subheader("Analytic model vs measured")
    if view.model is None:
        st.info(f"No analytic model: the run records lack {', '.join(view.model_missing)} (a job observed with "
                "`meshscope run` does not reveal its model's layers and width; the reference trainer and the API "
                "record them).")
        return
    if view.states is not None:
        ui.chart(view.figures["states"])
        states = view.states
        unit, div = figures.byte_unit(states[["model_bytes", "measured_max"]].to_numpy().max())
        st.dataframe(pd.DataFrame({
            "component": states["component"], f"model per device ({unit})": states["model_bytes"] / div,
            f"measured, max rank ({unit})": states["measured_max"] / div,
            f"measured, min rank ({unit})": states["measured_min"] / div, "model error": states["error"]}),
            hide_index=True, column_config={"model error": st.column_config.NumberColumn(format="percent")})
        st.caption("Measured from each rank's tensors once, after the first optimizer step: local shards, "
                   "each storage counted once; gradients at the parameters' size where `zero_grad` has freed them.")
    else:
        st.caption("The run's ranks did not measure their tensors (recorded by meshscope ≥ schema 3, after an "
                   "optimizer step): the model states are shown without a measurement.")
    if "model" in view.figures:
        ui.chart(view.figures["model"])
    else:
        st.info("Activations are not measured on a CPU run: host RSS holds the Python runtime and torch's own "
                "libraries (~0.4 GiB before any tensor), so the model's total is not compared with it. On GPU "
                "it is compared with the allocator's peak.")
    model = view.model
    unit, div = figures.byte_unit(model["bytes"].max())
    # A static table: the formulas wrap instead of being cut off at the right edge.
    st.table(pd.DataFrame({"component": model["component"], f"per device ({unit})": (model["bytes"] / div).map(
        "{:,.3f}".format), "formula": model["formula"]}).set_index("component"))
    st.caption(f"Strategy `{view.meta.get('strategy')}`, mesh {view.meta['mesh']}. The model is per device at "
               "the worst pipeline stage; allocator caching, workspaces and fragmentation come on top.")


ui.render(main)
