"""GPU: NVML telemetry per GPU (utilisation, clocks, throttling, power, temperature) when the agent
sampled any."""

import streamlit as st

from meshscope.dashboard import ui, views

COLUMNS = {"gpu_id": ("GPU", None), "name": ("model", None), "samples": ("samples", None),
           "util": ("utilisation", "percent"), "clock_ratio": ("SM clock / max (mean)", "percent"),
           "clock_ratio_min": ("SM clock / max (min)", "percent"), "throttle_share": ("throttled samples", "percent"),
           "throttle": ("throttle reasons", None), "power_w": ("power (W)", "%.0f"),
           "temp_max_c": ("max temperature (°C)", "%.0f"), "xid_errors": ("XID errors", None),
           "ecc_errors": ("ECC errors", None)}


def main(ctx: ui.Context) -> None:
    run = ctx.focus
    st.title(f"GPU · {run}")
    key = f"gpu.pick.{run}"
    view = views.gpu(ui.loader(ctx), run=run, pick=st.session_state.get(key))
    s = view.summary
    ui.warn_skipped(s)
    if s.empty:
        st.info(f"No GPU samples in run `{run}` (CPU run, or the agent had no NVML access).")
        return
    c = st.columns(4)
    c[0].metric("GPUs", f"{len(s)}")
    c[1].metric("mean utilisation", f"{s['util'].mean():.0%}")
    c[2].metric("GPUs throttled >10 % of samples", f"{int((s['throttle_share'] > 0.1).sum())}")
    c[3].metric("XID / ECC errors", f"{int(s['xid_errors'].sum())} / {int(s['ecc_errors'].sum())}")
    ui.chart(view.figures["heatmap"])
    st.multiselect("GPUs to plot (default: the 8 with the lowest SM clock)", s["gpu_id"].tolist(),
                   default=view.worst, key=key)
    cols = st.columns(2)
    for i, (value, _) in enumerate(views.GPU_LINES):
        with cols[i % 2]:
            ui.chart(view.figures[value])
    ui.table(s, COLUMNS)


ui.render(main)
