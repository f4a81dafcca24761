"""Communication: time per op and parallel dim (exposed vs overlapped), bus bandwidth against message
size, arrival skew per rank, and groups with slow links."""

import streamlit as st

from meshscope.dashboard import data, ui, views


def main(ctx: ui.Context) -> None:
    run = ctx.focus
    st.title(f"Communication · {run}")
    view = views.communication(ui.loader(ctx), run=run, steps=ctx.steps)
    ui.warn_skipped(*view.frames)
    if view.summary.empty:
        ui.missing("collective records", run=run)
        return
    s, f, t = view.summary, view.figures, view.step_time
    c = st.columns(3)
    if t is not None:  # the step records' figure: the Overview's breakdown and report state the same
        c[0].metric("exposed comm (mean per rank-step)", f"{t['exposed_comm_s'] * 1e3:.2f} ms",
                    help=f"Mean of the step records' exposed communication over steps {t['first_step']}–"
                         f"{t['last_step']} (warm-up left out), as the Overview's breakdown and `meshscope report`.")
    c[1].metric("overlapped (mean per rank-step)", f"{s['overlapped_s'].sum() * 1e3:.2f} ms")
    c[2].metric("ops per rank-step", f"{s['ops_per_step'].sum():.1f}")
    ui.window_note(ctx, view.steps, what="The figures on this page", budget=data.RAW_BUDGET)
    ui.chart(f["time"])
    where = f"steps {view.op_steps[0]}–{view.op_steps[1]}" if view.op_steps else "the selected steps"
    st.caption("Exposed = wait_s, the time the training thread was blocked on the op; overlapped = duration − wait, "
               f"hidden behind compute. Per op, from the collective records of {where}: the ops' exposed time sums "
               f"to {s['exposed_s'].sum() * 1e3:.2f} ms per rank-step. A pipeline stage's waits in P2P ops and in "
               "collectives over pp are it waiting for the other stages: the step breakdown counts them as bubble.")
    if view.skew is None:
        st.info("No collectives (only P2P or nothing) to compare arrival times and link bandwidth.")
        return
    st.subheader("Bus bandwidth, arrival skew and slow links")
    if "busbw" in f:
        ui.chart(f["busbw"])
        st.caption("busbw = bytes × factor / transfer time (all-reduce 2(n−1)/n; all-gather, reduce-scatter, "
                   "all-to-all (n−1)/n; others 1), where the transfer time is the earliest end minus the latest "
                   "start over the group's members: waiting for late peers is left out. Points: median over "
                   "collectives; bars: p10–p90.")
    ui.chart(f["skew"])
    st.caption("For each (group, seq) collective: each rank's start minus the earliest start; the last to "
               "arrive made the others wait the sum of their differences.")
    skew = view.skew.head(10)
    ui.table(skew.assign(**{c: skew[c] * 1e3 for c in ("mean_skew_s", "p95_skew_s", "max_skew_s")}), SKEW_COLUMNS)
    if view.slow_groups is None or view.slow_groups.empty:
        st.success("No group's bus bandwidth stands out against the other groups of its dim.")
    else:
        st.warning(f"{len(view.slow_groups)} group(s) run clearly slower than the other groups of their dim: "
                   "a slow link or NIC on one of their members.")
        ui.table(view.slow_groups, SLOW_GROUP_COLUMNS)


SKEW_COLUMNS = {"rank": ("rank", None), "mean_skew_s": ("mean skew (ms)", "%.2f"), "p95_skew_s": ("p95 skew (ms)", "%.2f"),
                "max_skew_s": ("max skew (ms)", "%.2f"), "last_share": ("arrived last", "percent"),
                "collectives": ("collectives", None), "caused_wait_s": ("wait it caused others (s)", "%.3f")}
SLOW_GROUP_COLUMNS = {"dim": ("dim", None), "group": ("group", None),
                      "busbw_ratio": ("bus bandwidth vs the dim's other groups", "%.2f"),
                      "robust_z": ("robust z", "%.1f")}


ui.render(main)
