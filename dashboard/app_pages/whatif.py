"""What-if: the layouts of a world size predicted from the selected runs (one model; calibration and
model in ``dashboard/planner/calibration.py`` and ``dashboard/planner/predict.py``), fastest first, with the measured runs
of that world size on the same chart. One computation with ``meshscope plan``."""

import streamlit as st

from meshscope.dashboard import runs_clean, ui
from meshscope.dashboard.planner import whatif
from meshscope.dashboard.config import ConfigError

MAX_RUNS = 8  # runs calibrated from when the user selected fewer than two
COLUMNS = {"layout": ("layout", None), "step_time_s": ("step time (s)", "%.3f"),
           "step_time_low_s": ("a run may measure, from (s)", "%.3f"), "step_time_high_s": ("to (s)", "%.3f"),
           "tokens_per_s": ("tokens/s", "int"),
           "mfu": ("MFU", "percent"), "compute_s": ("compute (s)", "%.3f"), "optimizer_s": ("optimizer (s)", "%.3f"),
           "exposed_dp_s": ("exposed DDP (s)", "%.3f"), "exposed_fsdp_s": ("exposed FSDP (s)", "%.3f"),
           "exposed_tp_s": ("exposed TP (s)", "%.3f"), "bubble_s": ("bubble (s)", "%.3f"),
           "peak_memory_mib": ("peak memory (MiB)", "int"), "memory_fits": ("fits", None),
           "extrapolated": ("extrapolated", None)}
MEASURED = {"run": ("run", None), "calibration": ("calibrated from", None), "layout": ("layout", None), "measured_s": ("measured step (s)", "%.3f"),
            "predicted_s": ("predicted (s)", "%.3f"), "error": ("error", "percent"),
            "low_s": ("interval from (s)", "%.3f"), "high_s": ("to (s)", "%.3f"), "inside": ("inside", None),
            "textbook_s": ("textbook (s)", "%.3f"), "textbook_error": ("textbook error", "percent")}


def _whole(v) -> int:
    """A runs-table number as a widget's start value (1 where the run did not record it)."""
    try:
        return max(1, int(v))
    except (TypeError, ValueError):
        return 1


def main(ctx: ui.Context) -> None:
    st.title("What-if")
    runs = ctx.runs.set_index("run")
    model = runs.loc[ctx.focus, "model"] if ctx.focus in runs.index else None
    same = [r for r in runs.index if runs.loc[r, "model"] == model and r is not None]
    picked = [r for r in ctx.selected if r in same]
    if len(picked) < 2:  # as the Scaling page: fewer than two selected, the model's runs (the newest)
        picked = list(dict.fromkeys([ctx.focus, *same]))[:MAX_RUNS]
        how = f"the newest runs of the focus run's model (at most {MAX_RUNS}); select runs on the Runs page to choose"
    else:
        how = "the selected runs of the focus run's model"
    st.caption(f"Calibrated from {', '.join(f'`{r}`' for r in picked)} ({how}). Each layout's step time is "
               "predicted from what those runs measured on this machine: compute rate, links (α + bytes/β per op "
               "and group size), how much communication stayed exposed, the pipeline's transfers, memory beyond "
               "the model's bytes.")
    c = st.columns(2)
    world = int(c[0].number_input("world size (ranks)", min_value=1, max_value=4096,
                                  value=_whole(runs.loc[ctx.focus, "world_size"] if ctx.focus in runs.index else 1)))
    batch = int(c[1].number_input("global batch (sequences)", min_value=1,
                                  value=_whole(runs.loc[ctx.focus, "global_batch"] if ctx.focus in runs.index else 1)))
    include = st.checkbox("Include runs that are not clean", key="whatif.include_unclean", help=runs_clean.RULE)
    try:
        view = whatif.whatif(ui.loader(ctx), runs=picked, world_size=world, global_batch=batch,
                             include_unclean=include)
    except ConfigError as e:  # what the selected runs cannot tell (no model shape, no steps): not a fault
        st.info(f"No prediction: {e}")
        return
    for w in view.calibration.warnings:
        st.warning(w)
    unclean = view.cleanliness[~view.cleanliness["clean"]]
    if len(unclean):
        st.caption(("Included though not clean: " if include else "Left out, not clean: ")
                   + "; ".join(f"`{r.run}` ({r.reason})" for r in unclean.itertuples()))
    busy = view.cleanliness[view.cleanliness["cpu_contention"] & view.cleanliness["run"].isin(view.runs)]
    if len(busy):
        st.caption("Calibrated from runs with CPU contention (ranks waited for a core; kept: the planner models "
                   "an oversubscribed host): " + ", ".join(f"`{r.run}` ({r.cpu_wait_share:.0%} wait)"
                                                          for r in busy.itertuples()))
    if view.table.empty:
        st.info(f"No layout of {world} ranks divides this model (heads, layers) and a global batch of {batch}.")
        return
    best = view.predictions[0]
    m = st.columns(3)
    m[0].metric("fastest layout", view.verdict["fastest"] or "not decided")
    m[1].metric("predicted tokens/s (first listed)", f"{best.tokens_per_s:,.0f}")
    m[2].metric("predicted step time (first listed)", f"{best.step_time_s:.3f} s",
                help=f"a run may measure {best.step_time_low_s:.3f}-{best.step_time_high_s:.3f} s")
    st.caption(view.verdict["sentence"].replace("`", ""))
    ui.chart(view.figure)
    ui.table(view.table.assign(peak_memory_mib=view.table["peak_memory_bytes"] / 2**20), COLUMNS)
    if len(view.measured):
        st.subheader("Measured runs of this world size and batch")
        ui.table(view.measured, MEASURED)
    st.caption("Interval: where a run of the layout may measure its step: this machine's run-to-run noise, the "
               "calibration runs' errors when each is predicted from the others, and a spread per kind of "
               "extrapolation (docs/formulas.md, What-if planner). "
               "Extrapolated: what the calibration runs did not measure (another group size, an op not seen, a "
               "kind of traffic whose overlap was not measured) is taken from the nearest measurement and listed "
               "per layout. Textbook: FLOPs / (peak × ranks), volume / nominal bandwidth, 90 % overlap, the closed-form "
               "bubble (docs/formulas.md, What-if planner).")


ui.render(main)
