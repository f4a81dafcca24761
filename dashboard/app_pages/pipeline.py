"""Pipeline: the schedule of one step as a Gantt chart (bubbles shaded), the measured bubble per stage
against theory, and its trend across steps."""

import streamlit as st

from meshscope.dashboard import data, ui, views

DEFINITION = ("Bubble = idle fraction of the schedule: 1 − (Σ the stage's F/B/W spans) / (the pipeline's "
              "extent: first span start to last span end of the step, all stages; the optimizer and work "
              "before the schedule are outside it). Theory: (p−1)/(m+p−1) for GPipe and 1F1B, "
              "(p−1)/(v·m+p−1) interleaved, for balanced stages with equal op times and free transfers; for "
              "schedules without a closed form (zero-bubble, looped BFS) the order the ranks ran, replayed "
              "under the same assumptions (F = I = W where the weight gradient is split off) "
              "((p−1)/m, found in some texts, is relative to ideal compute). Per stage the bubble splits "
              "into stage imbalance (orange: lighter than the slowest stage; balance the stages) and the "
              "schedule share, which is what to compare with the theory. The replay runs the schedule with "
              "the op times measured: its fill & drain is what the schedule itself costs for those times, "
              "P2P transfers & host gaps is the time between ops it adds, other waits the rest.")


def main(ctx: ui.Context) -> None:
    run = ctx.focus
    st.title(f"Pipeline · {run}")
    key = f"pipeline.step.{run}"
    lo, hi = ctx.steps or (0, 0)
    if not lo <= st.session_state.get(key, hi) <= hi:  # the sidebar range moved past the chosen step
        st.session_state[key] = hi
    view = views.pipeline(ui.loader(ctx), run=run, steps=ctx.steps, gantt_step=st.session_state.get(key))
    per = view.per_step_stage
    ui.warn_skipped(per, *view.frames)
    if per.empty and not view.gantt_spans:
        ui.missing("pipeline spans (is this a pipeline-parallel run?)", run=run)
        return
    st.caption(f"Schedule **{view.schedule or 'unknown'}**: p = {view.p} pipeline ranks, m = {view.m or '?'} "
               f"microbatches, v = {view.v} stage{'s' if view.v > 1 else ''} per rank.")
    c = st.columns(4)
    c[0].metric("theory (idle fraction)", f"{view.theory:.1%}" if view.theory is not None else "no theory",
                help=f"From {view.theory_source}." if view.theory_source else "Neither a closed form nor a replay.")
    st_ = view.stages
    c[1].metric("schedule share (measured)", _pct(st_["schedule_share"].mean() if st_ is not None else None),
                help="Compare with the theory: the idle the schedule leaves, stage imbalance split off.")
    c[2].metric("fill & drain (replayed)", _pct(st_["schedule_idle"].mean() if st_ is not None else None),
                help="The schedule run with the op times measured, transfers free.")
    c[3].metric("P2P & host gaps", _pct(st_["p2p_share"].mean() if st_ is not None else None))
    st.caption(DEFINITION)

    if hi > lo:
        st.slider("Step for the Gantt chart", lo, hi, hi, key=key)
    if "gantt" in view.figures:
        ui.chart(view.figures["gantt"])
        bubbles = ", ".join(f"stage {k} {v:.0%}" for k, v in sorted(view.gantt_bubble.items()))
        st.caption(f"One rank per pipeline position (the lowest rank); {view.gantt_spans} spans; bubble of "
                   f"the ranks drawn: {bubbles}. Window: the step's wall time from the step records, else the "
                   "extent of the spans.")
    else:
        st.info("No spans in the chosen step.")
    ui.window_note(ctx, view.steps, what="Bubble per stage and trend", budget=data.ROW_BUDGET)
    for col, name in zip(st.columns(2), ("by_stage", "trend")):
        if name in view.figures:
            with col:
                ui.chart(view.figures[name])


def _pct(v) -> str:
    return "n/a" if v is None or v != v else f"{v:.1%}"


ui.render(main)
