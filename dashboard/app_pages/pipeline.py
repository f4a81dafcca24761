"""Pipeline: the schedule of one step as a Gantt chart (bubbles shaded), the measured bubble per stage
against theory, and its trend across steps."""

import streamlit as st

from dashboard import data, ui, views

DEFINITION = ("Bubble shown = idle fraction of the step: 1 − (Σ the stage's F/B/W spans) / (step wall "
              "time). Theory: (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1) interleaved, for balanced "
              "stages with equal F and B cost. (p−1)/m, found in some texts, is bubble relative to ideal "
              "compute and is not what these charts show. The measured value also counts exposed "
              "communication, data loading and the optimizer as idle, so it sits above the theory. Per "
              "stage it splits into stage imbalance (orange: the slowest stage's busy time minus this "
              "stage's, over the window; balance the stages to remove it) and the rest (grey), which is "
              "what to compare with the theory.")


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
    c = st.columns(4)
    c[0].metric("schedule", view.schedule or "unknown")
    c[1].metric("p · m · v", f"{view.p} · {view.m or '?'} · {view.v}")
    c[2].metric("theory (idle fraction)", f"{view.theory:.1%}" if view.theory is not None else "no closed form")
    c[3].metric("measured (mean)", f"{per['bubble'].mean():.1%}" if len(per) else "n/a")
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


ui.render(main)
