"""Memory: per-rank current and peak against capacity, and measured peak against an analytic model of
the run's strategy (parameters, gradients, optimizer state, activations)."""

import pandas as pd
import streamlit as st

from dashboard import ui, views


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
        st.info(f"No analytic model: the run records lack {', '.join(view.model_missing)}.")
        return
    if "model" in view.figures:
        ui.chart(view.figures["model"])
    else:
        st.info("Host RSS is not what the model describes (it holds the Python runtime and torch's own "
                "libraries, ~0.4 GiB before any tensor): on a CPU run the model is shown alone. On GPU it is "
                "compared with the allocator's peak.")
    model = view.model
    st.dataframe(model.assign(GiB=model["bytes"] / 2**30)[["component", "GiB", "formula"]], hide_index=True)
    st.caption(f"Strategy `{view.meta.get('strategy')}`, mesh {view.meta['mesh']}. The model is per device at "
               "the worst pipeline stage; allocator caching, workspaces and fragmentation come on top.")


ui.render(main)
