"""The deep-trace panel on a run's Overview page: a button that runs ``meshscope trace`` on the running job
(torch.profiler for N steps on every rank, nothing restarted), its status, and the traces collected, with
merged.json to download for https://ui.perfetto.dev. The logic is ``dashboard.deeptrace``."""

from __future__ import annotations

import streamlit as st

from meshscope.dashboard import deeptrace, ui


def panel(ctx: ui.Context, run: str) -> None:
    key = f"deeptrace.proc.{run}"
    running = key in st.session_state
    with st.expander("Deep trace: torch.profiler on the running job", expanded=running):
        root = deeptrace.local_root(ctx.store.local_roots(), run)
        if root is None:
            st.caption("A run can be traced while it runs, from a store its ranks write (their spools are "
                       "there); this run has no spool in the stores this dashboard reads.")
            return
        st.caption(f"Arms torch.profiler on every rank at a step boundary a few seconds ahead, for the steps "
                   f"chosen, with nothing restarted (`meshscope trace --store {root} --run {run}`). Each rank's "
                   "Kineto trace and one merged timeline with meshscope's steps and collectives are kept under "
                   "the store's traces/ folder.")
        c = st.columns([1, 1, 3])
        steps = c[0].number_input("steps", min_value=1, max_value=1000, value=deeptrace.DEFAULT_STEPS,
                                  key=f"deeptrace.steps.{run}")
        if c[1].button(f"Trace {steps} steps", key=f"deeptrace.go.{run}", disabled=running):
            st.session_state[key] = deeptrace.launch(root, run, int(steps))
            running = True
        # polled each second while the command runs, not otherwise
        st.fragment(run_every=1.0 if running else None)(_status)(key, root, run)


def _status(key: str, root, run: str) -> None:
    proc = st.session_state.get(key)
    if proc is not None:
        done = deeptrace.outcome(proc)
        if done is None:
            st.caption("Tracing: armed at the job's next step boundaries; the ranks answer after the steps.")
        else:
            del st.session_state[key]
            st.session_state[f"deeptrace.last.{run}"] = done.summary()
            st.rerun()  # the whole page: the button back, the polling off
    if last := st.session_state.get(f"deeptrace.last.{run}"):
        st.caption(last)
    for t in deeptrace.traces(root, run):
        st.caption(f"Trace {t['id']}: steps {t['steps']} on ranks {', '.join(map(str, t['ranks']))}; `{t['dir']}`")
        if t["merged"] is not None:
            st.download_button("merged.json", data=t["merged"].read_bytes, file_name=f"{run}-{t['id']}.json",
                               mime="application/json", key=f"deeptrace.dl.{run}.{t['id']}", on_click="ignore")
