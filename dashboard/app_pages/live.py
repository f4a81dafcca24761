"""Live: current per-rank figures from Prometheus, refreshed on their own, when the dashboard was
started with --prometheus URL."""

import streamlit as st

from dashboard import figures, ui
from dashboard.live import METRICS, LiveError, live_runs, snapshot


def main(ctx: ui.Context) -> None:
    st.title("Live")
    url = ctx.config.prometheus
    if not url:
        st.info("Live view is off: start the dashboard with `--prometheus URL` to see current per-rank "
                "figures. Every other page works from the store.")
        return
    client = ui.prometheus_client(url)
    try:
        client.check()
    except LiveError as e:
        st.warning(f"{e}. Every other page works from the store.")
        return
    runs = live_runs(client)
    run = st.selectbox("Run (Prometheus label)", runs, key="live.run") if runs else None
    st.caption(f"Prometheus {url}; metrics: " + ", ".join(f"`{m}`" for m in METRICS.values()))

    @st.fragment(run_every=ctx.config.refresh_s)
    def panel() -> None:
        try:
            snap = snapshot(client, run=run)
        except LiveError as e:
            st.warning(str(e))
            return
        if snap.empty:
            st.info("Prometheus answers but has no meshscope series yet (is the agent being scraped?).")
            return
        c = st.columns(3)
        c[0].metric("ranks reporting", f"{len(snap)}")
        c[1].metric("latest step", f"{snap['step'].max():.0f}" if snap["step"].notna().any() else "n/a")
        c[2].metric("MFU (mean)", f"{snap['mfu'].mean():.1%}" if snap["mfu"].notna().any() else "n/a")
        cols = st.columns(2)
        for i, (col, title, pct) in enumerate((("compute_ratio", "compute fraction of wall time", True),
                                               ("exposed_comm_ratio", "exposed comm fraction", True),
                                               ("mfu", "MFU", True), ("step", "step", False))):
            with cols[i % 2]:
                if snap[col].notna().any():
                    ui.chart(figures.live_bars(snap, value=col, title=title, percent=pct), key=f"live.{col}")
                else:
                    st.caption(f"No `{col}` series.")

    panel()


ui.render(main, needs_run=False)
