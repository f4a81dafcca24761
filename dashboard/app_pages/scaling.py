"""Scaling: runs of one model grouped into strong- and weak-scaling families; per family speedup and
efficiency against its smallest world size, an Amdahl fit where there are enough world sizes, the
communication fraction, and the best configuration. The families take clean runs only
(``dashboard/runs_clean.py``); the others are listed with why, and a checkbox puts them back (marked), as
``meshscope sweep --include-unclean`` does. The numbers are ``meshscope sweep``'s (one computation:
``dashboard/scaling.py``)."""

import streamlit as st

from meshscope.dashboard import environment, runs_clean, scaling, ui, views

RUN_COLUMNS = {"run": ("run", None), "strategy": ("strategy", None), "mesh": ("mesh", None),
               "world_size": ("ranks", None), "global_batch": ("global batch", None),
               "steady_from": ("steady from step", None), "steps_used": ("steps used", None),
               "step_time_s": ("step time (s)", "%.3f"), "tokens_per_s": ("tokens/s", "int"),
               "tokens_per_s_per_device": ("tokens/s per rank", "int"),
               "comm_fraction": ("exposed comm", "percent"), "mfu": ("MFU", "percent"), "best": ("best", None),
               "marks": ("marks", None)}
LEFT_OUT_COLUMNS = {"run": ("run", None), "strategy": ("strategy", None), "world_size": ("ranks", None),
                    "global_batch": ("global batch", None), "tokens_per_s": ("tokens/s", "int"),
                    "reason": ("why left out", None)}
FAMILY_COLUMNS = {"family": ("family", None), "run": ("run", None), "world_size": ("ranks", None),
                  "global_batch": ("global batch", None), "tokens_per_s": ("tokens/s", "int"),
                  "baseline": ("baseline run", None), "n0": ("baseline ranks", None),
                  "speedup": ("speedup", "%.2f"), "efficiency": ("efficiency", "percent"), "marks": ("marks", None)}


def _marks(per_run) -> list[str]:
    """What a run's row says beside its numbers: not clean (included on request), CPU contention."""
    out = []
    for r in per_run.itertuples():
        m = []
        if not getattr(r, "clean", True):
            m.append(f"✕ not clean: {r.reason}")
        if getattr(r, "cpu_contention", False):
            m.append(f"◆ CPU contention ({r.cpu_wait_share:.0%} wait)")
        out.append("; ".join(m))
    return out


def _left_out(view: views.Scaling) -> None:
    left = view.left_out
    if left is not None and len(left) and not view.include_unclean:
        n = len(left)
        st.markdown(f"**Left out: {n} run{'s' if n != 1 else ''} not clean** — the families below are built from "
                    "clean runs only; tick *Include runs that are not clean* to compare them too.")
        ui.table(left, LEFT_OUT_COLUMNS)


def main(ctx: ui.Context) -> None:
    st.title("Scaling")
    model = st.session_state.get("scaling.model")
    include = st.checkbox("Include runs that are not clean", key="scaling.include_unclean",
                          help=runs_clean.RULE)
    view = views.scaling(ui.loader(ctx), selected=list(ctx.selected), focus=ctx.focus, model=model,
                         include_unclean=include)
    ui.warn_skipped(*view.frames)
    if len(ctx.selected) < 2:
        n = len(view.runs)
        st.caption(f"Fewer than two runs selected: comparing the {n} run{'s' if n != 1 else ''} of the focus run's model.")
    per_run = view.per_run
    if len(view.models) > 1:
        st.selectbox("Model", view.models, key="scaling.model")
    if per_run is None or per_run.empty:
        st.info(view.note if view.left_out is not None and len(view.left_out)
                else "No run with both run records and step records among the selection.")
        _left_out(view)
        return
    per_run = per_run.assign(marks=_marks(per_run))
    best = per_run[per_run["best"]].iloc[0]
    c = st.columns(2)
    c[0].metric("best configuration", f"{best['run']}")
    c[1].metric("best tokens/s", f"{best['tokens_per_s']:,.0f}")
    st.caption(f"Best: `{best['run']}` — {best['strategy']}, mesh {best['mesh']}, {best['world_size']:.0f} ranks "
               f"(highest throughput of the runs shown; across families it compares different batches).")
    ui.table(per_run, RUN_COLUMNS if per_run["marks"].str.len().gt(0).any() else
             {k: v for k, v in RUN_COLUMNS.items() if k != "marks"})  # marks only where a run has one
    _left_out(view)
    if view.table.empty:
        st.info(view.note)
    else:
        baselines = view.table.groupby("family")["baseline"].first()
        for fit in view.fits.itertuples():
            st.markdown(f"**{fit.family}** (baseline: {baselines[fit.family]}) — {fit.note}")
        fam = view.table.assign(marks=_marks(view.table))
        ui.table(fam, FAMILY_COLUMNS if fam["marks"].str.len().gt(0).any() else
                 {k: v for k, v in FAMILY_COLUMNS.items() if k != "marks"})
    for col, name in zip(st.columns(2), ("speedup", "bars")):
        if name in view.figures:
            with col:
                ui.chart(view.figures[name])
    if "cpu_contention" in per_run and per_run["cpu_contention"].fillna(False).astype(bool).any():
        st.caption(f"◆ CPU contention: a rank waited for a core more than {environment.CPU_WAIT_MAX:.0%} of the "
                   "time it was ready to run (as the Overview warns); the run stays in (its throughput is what the "
                   "machine gave) but its speedup describes the machine's load as much as the job.")
    st.caption(scaling.RULE + " " + runs_clean.RULE)


ui.render(main)
