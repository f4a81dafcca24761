"""Runs: every run in the store with its metadata; pick the runs the other pages show."""

import pandas as pd
import streamlit as st

from meshscope.dashboard import ui, views

_COLUMNS = {"run": "run", "model": "model", "strategy": "strategy", "mesh": "mesh", "schedule": "schedule",
            "microbatches": "microbatches", "world_size": "world size", "ranks_stepping": "ranks with steps",
            "steps": "steps", "start": "start (UTC)", "attempts": "restarts", "status": "status"}


def _status(row) -> str:
    if pd.isna(row["world_size"]):
        return "partial: no run records"
    if pd.isna(row["steps"]):
        return "no steps yet"
    if row["ranks_stepping"] < row["world_size"]:
        return f"partial: {row['ranks_stepping']:.0f}/{row['world_size']:.0f} ranks"
    return "ok"


def _sync() -> None:
    # Widget state is dropped when a page is left; keep the selection in a plain session key.
    st.session_state[ui.SELECTED_KEY] = list(st.session_state["meshscope.runs_widget"])


def main(ctx: ui.Context) -> None:
    st.title("Runs")
    table, timeline = views.runs_view(ui.loader(ctx))
    table = table.assign(start=pd.to_datetime(table["t_start"], unit="s", utc=True))
    table["status"] = table.apply(_status, axis=1)
    st.dataframe(table[list(_COLUMNS)].rename(columns=_COLUMNS), hide_index=True)
    st.multiselect("Runs to analyse (shared with the other pages)", table["run"].tolist(),
                   default=list(ctx.selected), key="meshscope.runs_widget", on_change=_sync)
    st.caption("Overview, Pipeline, Communication, Memory and GPU show the run picked in the sidebar; "
               "Overview's step charts and Scaling compare all selected runs.")
    ui.chart(timeline)


ui.render(main)
