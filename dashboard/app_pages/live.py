"""Live: per-rank time series of the last minutes from Prometheus, refreshed on their own, and whether the
run is still going, when the dashboard was started with --prometheus URL."""

import time
from datetime import datetime, timezone

import streamlit as st

from meshscope.dashboard import figures, ui, views
from meshscope.dashboard.live import METRICS, STALE_AFTER_S, LiveError, history, live_runs, run_status, snapshot

MINUTES = 10
SERIES = (("steps_per_s", "steps per second", False), ("compute_ratio", "compute fraction of wall time", True),
          ("exposed_comm_ratio", "exposed comm fraction", True), ("mfu", "MFU", True))


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%H:%M:%S UTC")


def _status(status: dict, now: float) -> None:
    last = status["last_record"]
    ago = f"{now - last:,.0f} s ago ({_utc(last)})" if last is not None else "not known"
    if status["state"] == "ended":
        st.success(f"The run ended: all {status['world_size']:.0f} ranks recorded their end; last record {ago}. "
                   "Each rank's series stop at its last step; the store's pages hold the whole run.")
    elif status["state"] == "crashed":
        st.error(f"A rank crashed ({status['crashes']:.0f} crash event(s)); last record {ago}. The Overview "
                 "names the failure.")
    elif status["state"] == "quiet":
        st.warning(f"No record for over {STALE_AFTER_S:.0f} s (last {ago}) and no end: the run may hang or "
                   "have been killed. Each rank's series stop at its last step.")
    else:
        st.caption(f"Running: last record {ago}.")


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
        runs = live_runs(client)
    except LiveError as e:
        st.warning(f"{e}. Every other page works from the store.")
        return
    if not runs:
        st.info("Prometheus answers but no run reports to it now (is the agent being scraped?).")
        return
    if ctx.focus and ctx.focus not in runs:
        st.caption(f"The sidebar's run `{ctx.focus}` does not report to Prometheus now; these runs do.")
    index = runs.index(ctx.focus) if ctx.focus in runs else 0
    # Keyed by the sidebar's run: picking another run there brings this picker along.
    run = st.selectbox("Run reporting to Prometheus", runs, index=index, key=f"live.run.{ctx.focus}")
    step_s = max(1.0, float(ctx.config.refresh_s))
    st.caption(f"Prometheus {url}; the last {MINUTES} minutes, refreshed every {ctx.config.refresh_s:g} s; "
               "metrics: " + ", ".join(f"`{METRICS[m]}`" for m in ("steps", "phase", "wall", "mfu")))

    @st.fragment(run_every=ctx.config.refresh_s)
    def panel() -> None:
        now = time.time()
        try:
            status = run_status(client, run=run, now=now)
            snap = snapshot(client, run=run)
            hist = history(client, run=run, now=now, minutes=MINUTES, step_s=step_s)
        except LiveError as e:
            st.warning(str(e))
            return
        _status(status, now)
        if status["state"] != "ended" and run in set(ui.load("runs_table", ctx.store)["run"]):
            ui.hang_panel(views.hang_view(ui.loader(ctx), run=run, now=now))  # the store's hang records
        c = st.columns(3)
        c[0].metric("ranks reporting", f"{len(snap)}")
        c[1].metric("latest step", f"{snap['step'].max():.0f}" if snap["step"].notna().any() else "n/a")
        c[2].metric("MFU (mean)", f"{snap['mfu'].mean():.1%}" if snap["mfu"].notna().any() else "n/a")
        cols = st.columns(2)
        for i, (series, title, pct) in enumerate(SERIES):
            with cols[i % 2]:
                part = hist[hist["series"] == series]
                if part.empty:
                    st.caption(f"No {title} in the last {MINUTES} minutes.")
                else:
                    ui.chart(figures.live_series(part, title=title, percent=pct, until=now), key=f"live.{series}")

    panel()


ui.render(main, needs_run=False)
