"""Compare: one or several runs against a baseline (``meshscope diff`` on a page). For several, each run's
change with its interval and its parts on one chart and a table; for the one picked (or the only one), the
verdict, where the difference goes (a waterfall of the parts with their intervals), exposed communication
per op side by side, the steady step-time distributions and what changed between the runs. The numbers are
``meshscope diff``'s (one computation: ``dashboard/diff.py``)."""

import pandas as pd
import streamlit as st

from meshscope.dashboard import diff, diffcli, figures, ui

def _part_columns(unit: str) -> dict[str, tuple[str, str | None]]:
    u = "ms" if unit == "step" else "µs per token"
    return {"part": ("part", None), "a_x": (f"A ({u})", "%.3f"), "b_x": (f"B ({u})", "%.3f"),
            "diff_x": (f"B − A ({u})", "%+.3f"), "diff_pct": ("% of A", "%+.1f"),
            "lo_pct": ("interval from (%)", "%+.1f"), "hi_pct": ("to (%)", "%+.1f"),
            "significant": ("interval excludes 0", None)}


RUN_COLUMNS = {"run": ("run", None), "mfu": ("MFU", "percent"), "tokens_per_s": ("tokens/s", "int"),
               "peak_gib": ("peak memory (GiB)", "%.2f"), "stragglers": ("stragglers", None)}
SEVERAL_COLUMNS = {"run": ("run", None), "diff_pct": ("B − A (%)", "%+.1f"), "lo_pct": ("interval from (%)", "%+.1f"),
                   "hi_pct": ("to (%)", "%+.1f"), "significant": ("interval excludes 0", None),
                   "carried": ("carried by", None), "changes": ("what changed", None)}


def _several_rows(results: dict[str, dict]) -> pd.DataFrame:
    rows = []
    for run, c in results.items():
        w = diff.whole(c)
        # as the verdict says it: what carries a difference, where there is one
        carried = [p for p in diff.parts_carrying(c) if p["significant"]][:2] if w is not None and w["significant"] else []
        changed = c["changes"]
        rows.append({"run": run, "diff_pct": None if w is None else w["diff_pct"],
                     "lo_pct": None if w is None else w["lo_pct"], "hi_pct": None if w is None else w["hi_pct"],
                     "significant": None if w is None else w["significant"],
                     "carried": ", ".join(f"{p['part']} {p['diff_pct']:+.1f}" for p in carried) or "—",
                     "changes": "; ".join(diff.change_line(ch) for ch in changed[:4])
                                + (f" (+{len(changed) - 4} more)" if len(changed) > 4 else "") or "nothing"})
    return pd.DataFrame(rows)


def _detail(load, c: dict, *, a: str, b: str) -> None:
    w = diff.whole(c)
    # a slowdown is a finding, not a failure of the page: a warning box (error boxes are for broken pages)
    (st.warning if w is not None and w["significant"] and w["diff_s"] > 0 else st.success)(c["verdict"])
    if not c["parts"]:
        return
    unit = "per token" if c["unit"] == "token" else "per step"
    st.caption(f"Means {unit} over {c['steps'][0]} (A) and {c['steps'][1]} (B) steady steps; {c['level']:.0%} "
               "bootstrap intervals (steps resampled in blocks); the parts sum to the whole. The whole's interval "
               f"includes run-to-run noise of {c['run_noise']['rel_sd']:.1%} per run, from {c['run_noise']['source']}.")
    ui.chart(figures.diff_waterfall(c["parts"], unit=c["unit"]))
    scale = 1e3 if c["unit"] == "step" else 1e6
    parts = pd.DataFrame(c["parts"]).assign(a_x=lambda d: d["a_s"] * scale, b_x=lambda d: d["b_s"] * scale,
                                            diff_x=lambda d: d["diff_s"] * scale)
    ui.table(parts, _part_columns(c["unit"]))
    one, two = st.columns(2)
    with one:
        ui.chart(figures.diff_comm(c["parts"], names=(a, b), unit=c["unit"]))
    with two:
        ui.chart(figures.diff_distributions({run: diffcli.run_frame(load, run=run)[0]["wall_s"] for run in (a, b)}))
    s = c["summary"]
    st.subheader("Figures of each run")
    ui.table(pd.DataFrame([{"run": name, "mfu": s[k]["mfu"], "tokens_per_s": s[k]["tokens_per_s"],
                            "peak_gib": None if s[k]["peak_memory_bytes"] is None else s[k]["peak_memory_bytes"] / 2**30,
                            "stragglers": ", ".join(f"rank {x['rank']}" for x in s[k]["stragglers"]) or "none"}
                           for k, name in (("a", a), ("b", b))]), RUN_COLUMNS)
    st.subheader("What changed")
    if c["changes"]:
        st.dataframe(pd.DataFrame([{"field": ch["key"], "A": str(ch["a"]), "B": str(ch["b"])} for ch in c["changes"]]),
                     hide_index=True)
    else:
        st.caption("Nothing in the run records differs (layout, model, batch, config, versions, environment flags).")


def main(ctx: ui.Context) -> None:
    st.title("Compare")
    names = ctx.runs["run"].tolist()
    if len(names) < 2:
        st.info("Compare needs two runs in the store.")
        return
    picked = [r for r in ctx.selected if r in names]
    a = st.selectbox("Baseline (A)", names, index=names.index(picked[1]) if len(picked) > 1 else min(1, len(names) - 1),
                     key="meshscope.compare_a")
    others = [n for n in names if n != a]
    default = [picked[0]] if picked and picked[0] != a else others[:1]
    bs = st.multiselect("Compared with it (B: one run, or several)", others, default=default,
                        key="meshscope.compare_bs")
    if not bs:
        st.info("Pick one or more runs to compare with the baseline.")
        return
    load = ui.loader(ctx)
    results = {b: diffcli.build(load, load, run_a=a, run_b=b) for b in bs}
    b = bs[0]
    if len(bs) > 1:
        st.subheader(f"{len(bs)} runs against {a}")
        ui.chart(figures.diff_several(results))
        ui.table(_several_rows(results), SEVERAL_COLUMNS)
        ui.chart(figures.diff_distributions({run: diffcli.run_frame(load, run=run)[0]["wall_s"] for run in (a, *bs)}))
        b = st.selectbox("Detail for", bs, key="meshscope.compare_detail")
        st.subheader(f"{b} against {a}")
    _detail(load, results[b], a=a, b=b)


ui.render(main)
