"""Compare: run B against a baseline A (``meshscope diff`` on a page): the verdict, where the difference
goes (a waterfall of the parts with their intervals), exposed communication per op side by side, the
steady step-time distributions and what changed between the runs. The numbers are ``meshscope diff``'s (one
computation: ``dashboard/diff.py``)."""

import pandas as pd
import streamlit as st

from meshscope.dashboard import diffcli, figures, ui

PART_COLUMNS = {"part": ("part", None), "a_ms": ("A (ms)", "%.3f"), "b_ms": ("B (ms)", "%.3f"),
                "diff_ms": ("B − A (ms)", "%.3f"), "diff_pct": ("% of A", "%+.1f"), "lo_pct": ("interval from (%)", "%+.1f"),
                "hi_pct": ("to (%)", "%+.1f"), "significant": ("interval excludes 0", None)}


def main(ctx: ui.Context) -> None:
    st.title("Compare")
    names = ctx.runs["run"].tolist()
    if len(names) < 2:
        st.info("Compare needs two runs in the store.")
        return
    picked = [r for r in ctx.selected if r in names]
    left, right = st.columns(2)
    a = left.selectbox("Baseline (A)", names, index=names.index(picked[1]) if len(picked) > 1 else min(1, len(names) - 1),
                       key="meshscope.compare_a")
    b = right.selectbox("Compared (B)", names, index=names.index(picked[0]) if picked else 0, key="meshscope.compare_b")
    if a == b:
        st.info("Pick two different runs.")
        return
    load = ui.loader(ctx)
    c = diffcli.build(load, load, run_a=a, run_b=b)
    (st.error if diffcli.diff.gate(c, fail_above_pct=0.0) else st.success)(c["verdict"])
    if not c["parts"]:
        return
    unit = "per token" if c["unit"] == "token" else "per step"
    st.caption(f"Means {unit} over {c['steps'][0]} (A) and {c['steps'][1]} (B) steady steps; {c['level']:.0%} "
               "bootstrap intervals (steps resampled in blocks); the parts sum to the whole.")
    ui.chart(figures.diff_waterfall(c["parts"], unit=c["unit"]))
    parts = pd.DataFrame(c["parts"]).assign(a_ms=lambda d: d["a_s"] * 1e3, b_ms=lambda d: d["b_s"] * 1e3,
                                            diff_ms=lambda d: d["diff_s"] * 1e3)
    ui.table(parts, PART_COLUMNS)
    one, two = st.columns(2)
    with one:
        ui.chart(figures.diff_comm(c["parts"], names=(a, b)))
    with two:
        fa, _, _ = diffcli.run_frame(load, run=a)
        fb, _, _ = diffcli.run_frame(load, run=b)
        ui.chart(figures.diff_distributions(fa["wall_s"], fb["wall_s"], names=(a, b)))
    s = c["summary"]
    st.subheader("Figures of each run")
    st.dataframe(pd.DataFrame([{"run": name, "MFU": s[k]["mfu"], "tokens/s": s[k]["tokens_per_s"],
                                "peak memory (bytes)": s[k]["peak_memory_bytes"],
                                "stragglers": ", ".join(f"rank {x['rank']}" for x in s[k]["stragglers"]) or "none"}
                               for k, name in (("a", a), ("b", b))]), hide_index=True)
    st.subheader("What changed")
    if c["changes"]:
        st.dataframe(pd.DataFrame([{"field": ch["key"], "A": str(ch["a"]), "B": str(ch["b"])} for ch in c["changes"]]),
                     hide_index=True)
    else:
        st.caption("Nothing in the run records differs (layout, model, batch, versions, config).")


ui.render(main)
