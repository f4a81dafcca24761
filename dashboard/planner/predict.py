"""The what-if planner: a measured calibration (``dashboard.planner.calibration``) turned into predictions for
layouts not yet run (docs/formulas.md, "What-if planner"). Pure functions; ``meshscope plan``, the
What-if page and ``bench/planner_grid.py`` call them.

Per rank and step (FLOPs per rank F = flops_per_token × global tokens / world; φ the processor sharing
of a CPU host, ``calibration``):

- compute = F × s_per_flop × φ, the rate of the calibration runs most like the layout (``most_like``: the
  same use of TP, FSDP and a pipeline, the same sharing regime); optimizer = (a + b × the parameters the
  rank holds) × φ, the line fitted over all runs;
- exposed communication per kind of traffic = exposure × its transfer time on the fitted links
  (α + bytes·f(op, n)/β) × φ: DDP's gradient buckets (all-reduce over dp), FSDP's gathers (two per block
  per step, one under PP, which keeps blocks gathered across microbatches) and reduce-scatters (one per
  block), TP's all-reduces of a microbatch's activations (the measured count per layer and microbatch);
  exposure = the calibration runs' exposed seconds / the same model's transfer time for their layouts;
- pipeline: the schedule simulator with per chunk and microbatch forward and backward = (compute + TP's
  exposed all-reduces) × the forward share / (m·v), the measured transfer per hop and host gap per
  action; on a CPU host its ranks share the cores (``pipeline_sim.makespan_shared``); the makespan
  replaces compute, its idle is the bubble;
- step = compute (or makespan) + optimizer + exposed DDP and FSDP communication + other (the measured host
  time between phases); tokens/s = global tokens / step; MFU = F / step / peak; peak memory = the memory
  model's bytes for the layout + the runtime share of the runs most like it.

What the calibration did not measure is taken from the nearest thing it did, and listed in
``extrapolated``: an op at a group size or sharing regime not measured, an op not measured (another op's
link), message sizes far outside the measured ones, traffic whose exposure was not measured (that of the
traffic measured, at most all of it; the textbook's where none was), a compute rate from runs that differ,
a scaled model.

``textbook`` is the uncalibrated model people use before they measure: compute = FLOPs / (peak × ranks),
communication = volume / nominal bus bandwidth with a fixed 90 % overlap, bubble by the closed form.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from meshscope.agent.contract import bubble_theory, busbw_factor, normalize_schedule, training_flops_per_token
from meshscope.agent.contract import mfu as model_flops_utilisation
from meshscope.dashboard.planner.calibration import SHARED, SHARING_EXPONENT, Calibration, ModelShape, Rate, local_params, nonneg_line
from meshscope.dashboard.planner.layouts import SIMULATED, Layout, candidates, family, measured_layout
from meshscope.dashboard.planner import interval
from meshscope.dashboard.planner.links import NOMINAL_BUS_BW, Links, Notes, act_bytes
from meshscope.dashboard.planner.links import note as _note
from meshscope.dashboard.memory_model import ModelSpec, memory_model
from meshscope.dashboard.pipeline_sim import ORDERED, makespan_shared, simulate

TEXTBOOK_OVERLAP = 0.9
# Exposure where the calibration measured no traffic at all: on GPUs bucketed / prefetched data-parallel
# traffic overlapped as the textbook says, TP's all-reduces on the critical path (Megatron's are blocking);
# on a CPU host gloo's transfers run on the cores the compute needs, so FSDP's prefetch hides nothing and
# DDP's buckets ``OVERLAPPED_SHARE`` (below).
DEFAULT_EXPOSURE = {"dp_grads": 1 - TEXTBOOK_OVERLAP, "fsdp": 1 - TEXTBOOK_OVERLAP, "tp": 1.0}
DEFAULT_EXPOSURE_CPU = {"dp_grads": 0.5, "fsdp": 1.0, "tp": 1.0}
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default
TP_PER_LAYER = 4.0  # Megatron: two all-reduces forward, two backward per block
# DDP reduces its buckets while backward still runs; FSDP's gathers and TP's all-reduces sit on the critical
# path. Where only one of the two was measured, DDP exposes this share of what a blocking kind exposes: on a
# CPU host gloo's transfers take the cores backward runs on (0.47-0.48 on bench/planner_grid.py's grid, with
# and without ranks sharing cores); on GPUs the textbook's overlap against a blocking kind's all.
OVERLAPPED = ("dp_grads",)
OVERLAPPED_SHARE = {"cpu": DEFAULT_EXPOSURE_CPU["dp_grads"], "cuda": 1 - TEXTBOOK_OVERLAP}


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    layout: Layout
    step_time_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_bytes: float
    memory_fits: bool | None  # None: the device's capacity is not known
    breakdown: dict[str, float]
    extrapolated: tuple[str, ...]
    # where a run of the layout may measure its step (``interval``), and the kinds of extrapolation that widened it
    step_time_low_s: float = math.nan
    step_time_high_s: float = math.nan
    extrapolation_kinds: tuple[str, ...] = ()

    def as_json(self) -> dict:
        return {"layout": self.layout.as_dict(), "step_time_s": self.step_time_s,
                "step_time_low_s": self.step_time_low_s, "step_time_high_s": self.step_time_high_s,
                "extrapolation_kinds": list(self.extrapolation_kinds), "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu, "peak_memory_bytes": self.peak_memory_bytes, "memory_fits": self.memory_fits,
                "breakdown": self.breakdown, "extrapolated": list(self.extrapolated)}


# -------------------------------------------------------------------------------------------- predict
def scaled_model(model: ModelShape, lay: Layout) -> ModelShape:
    """The model with the layout's layer count and width (blocks scale with width², embeddings with width)."""
    if lay.n_layers == model.n_layers and lay.d_model == model.d_model:
        return model
    r = lay.d_model / model.d_model
    layer = model.layer_params * r * r
    emb = model.embedding_params * r
    n = layer * lay.n_layers + emb
    n_ne = n - model.vocab_size * lay.d_model
    return dataclasses.replace(model, n_layers=lay.n_layers, d_model=lay.d_model, n_params=n, n_params_nonembedding=n_ne,
                               flops_per_token=training_flops_per_token(n_matmul_params=n_ne, n_attention_layers=lay.n_layers,
                                                                        attention_dim=lay.d_model, seq_len=model.seq_len))


def sharing(cal: Calibration, *, k: int, exposed_share: float, residual: float = 1.0) -> float:
    """φ = k·u/C × ``residual`` on a CPU host, u = 1 − (1 − γ) × the step's exposed-communication share
    (``calibration``), 1 where that is at most ``SHARED`` (as the calibration counts its runs: a little
    wait is a rank's own); 1 on GPUs."""
    if cal.cores is None:
        return 1.0
    u = 1.0 - (1.0 - cal.spin) * exposed_share
    phi = k * u / cal.cores
    return phi * residual if phi > SHARED else 1.0


def sharing_residual(cal: Calibration, lay: Layout) -> float:
    """What the sharing model missed on the oversubscribed calibration runs most like ``lay``: their
    measured φ over the model's for them (γ is one figure for all traffic; how long a rank spins before it
    sleeps differs between kinds of traffic). 1 where no run was oversubscribed."""
    m = cal.measured
    if cal.cores is None or m.empty or not (m["sharing"] > 1).any():
        return 1.0
    best, _ = most_like(cal, lay, shared=True)
    best = best[best["sharing"] > 1]
    if best.empty:
        return 1.0
    model = best["ranks_per_host"] * (best["busy"] - (1 - cal.spin) * best["exposed_share"]) / cal.cores
    ratio = (best["sharing"] / model)[model > 0]
    return float(ratio.mean()) if len(ratio) else 1.0


def predict(cal: Calibration, lay: Layout, *, ranks_per_host: int | None = None,
            device_bytes: float | None = None, pipeline_gap: float | None = None) -> Prediction:
    """The calibrated prediction of one layout (module docstring). ``ranks_per_host``: how many of its
    ranks share a host (default: all, one host; only a CPU host's sharing depends on it);
    ``device_bytes``: the memory one rank may use (default: the smallest device a calibration run had;
    None there too: not judged); ``pipeline_gap``: a pipeline's host seconds per action (default:
    ``gap_for``)."""
    notes = Notes()
    model = scaled_model(cal.model, lay)
    if model is not cal.model:
        _note(notes, f"model scaled to {lay.n_layers} layers × width {lay.d_model} (measured {cal.model.n_layers} × "
                     f"{cal.model.d_model}): compute rate assumed the measured one", "model")
    widest = int(cal.measured["world_size"].max()) if len(cal.measured) else lay.world_size
    doublings = math.log2(lay.world_size / widest) if lay.world_size > widest else 0.0
    if doublings:
        _note(notes, f"world size {lay.world_size} beyond the largest measured ({widest})", "world")
    k = ranks_per_host or lay.world_size
    tokens = lay.global_batch * model.seq_len
    flops = model.flops_per_token * tokens / lay.world_size
    held = local_params(model, {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "fsdp": lay.fsdp})
    # Outside the pipeline every rank is busy but where it sleeps through exposed communication; the
    # pipeline's schedule is simulated with its ranks sharing the cores (its fill and drain leave some free).
    cores_sim = cal.cores * lay.pp / k if cal.cores else None
    residual = sharing_residual(cal, lay)
    own = own_sharing(cal, lay) if ranks_per_host is None or ranks_per_host == lay.world_size else None
    phi = own or sharing(cal, k=k, exposed_share=0.0, residual=residual)  # first: every rank busy all the step
    first, cells = notes, exposure_cells(cal, like=lay)
    for _ in range(4):  # φ depends on the exposed share, which depends on φ and on the regime it puts the fits in
        notes = Notes(first)
        links = Links(cal, notes, shared=phi > 1)
        exposure = {}
        for kind in DEFAULT_EXPOSURE:
            exposure[kind], how = exposure_for(cal, kind, shared=phi > 1, cells=cells)
            if how and _uses(lay, kind):
                _note(notes, f"{kind} exposure not measured: {exposure[kind]:.0%} of its modelled time exposed, {how}",
                      "exposure")
        parts = _parts(cal, lay, model=model, links=links, flops=flops, held=held, tokens=tokens, exposure=exposure,
                       phi=phi, cores=cores_sim, notes=notes, pipeline_gap=pipeline_gap)
        if own:  # a measured layout: its runs' sharing, as measured
            break
        settled = sharing(cal, k=k, exposed_share=sum(parts["comm"].values()) / parts["step_s"], residual=residual)
        if abs(settled - phi) < 1e-3 * phi:
            break
        phi = settled
    step = parts["step_s"]
    if phi > 1 and not own and cal.cores and cal.host_cores and cal.cores < cal.host_cores - 1e-6:
        _note(notes, f"the host's cores taken as {cal.cores:.2f} of its {cal.host_cores:g} (a calibration run's "
                     "sharing said its ranks had fewer): the slowdown of ranks sharing them", "cores")
    elif phi > 1 and not own and abs(residual - 1) > 0.05:
        _note(notes, f"ranks sharing cores: the calibration runs like it waited {residual:.2f}× what the sharing "
                     "model gives them (their own threads), carried to this layout", "cores")
    kinds = notes.all_kinds()
    low, high = interval.bounds(step, kinds=kinds, holdout=cal.holdout, noise=cal_noise(cal), doublings=doublings)
    peak, fits = _memory(cal, model, lay, device_bytes if device_bytes is not None else cal.device_bytes,
                         shared=phi > 1)
    return Prediction(
        layout=lay, step_time_s=step, tokens_per_s=tokens / step,
        mfu=model_flops_utilisation(flops=flops, seconds=step, peak_flops=cal.peak_flops), peak_memory_bytes=peak, memory_fits=fits,
        breakdown={"compute_s": parts["compute_s"], "optimizer_s": parts["optimizer_s"], "bubble_s": parts["bubble_s"],
                   "other_s": parts["other_s"], "exposed_comm_s": parts["comm"], "sharing": phi},
        extrapolated=tuple(notes), step_time_low_s=low, step_time_high_s=high, extrapolation_kinds=kinds)


def own_sharing(cal: Calibration, lay: Layout) -> float | None:
    """The measured sharing φ of the calibration runs with exactly this layout (their mean; 1 where a run
    had a core per rank): a measured layout is predicted at the sharing it measured. None: no such run."""
    m = cal.measured
    if m.empty or not _measured(cal, lay):
        return None
    return float(m.loc[_same_layout(m, lay), "sharing"].mean())


def _measured(cal: Calibration, lay: Layout) -> bool:
    """Whether a calibration run had exactly this layout (its own prediction reproduces it)."""
    m = cal.measured
    return (not m.empty and bool(_same_layout(m, lay).any()) and lay.n_layers == cal.model.n_layers
            and lay.d_model == cal.model.d_model)


def _same_layout(m: pd.DataFrame, lay: Layout) -> pd.Series:
    return ((m["dp"] == lay.dp) & (m["tp"] == lay.tp) & (m["pp"] == lay.pp) & (m["world_size"] == lay.world_size)
            & (m["global_batch"] == lay.global_batch) & ((m["fsdp"].astype(bool) & (m["dp"] > 1)) == lay.fsdp)
            & (m["schedule"].fillna("") == lay.schedule) & (m["microbatches"] == lay.microbatches)
            & (m["virtual_stages"] == lay.virtual_stages))


def cal_noise(cal: Calibration) -> float:
    """The noise of a step on this machine: ``interval.NOISE``, or the calibration runs' own steady-step
    spread (their median) where wider."""
    spreads = cal.measured["step_spread"].dropna() if "step_spread" in cal.measured else pd.Series(dtype=float)
    return max(interval.NOISE, float(spreads.median())) if len(spreads) else interval.NOISE


SAME_TIME = {"tp": 1, "fsdp": 1, "pp": 1, "shared": 1}
SAME_MEMORY = {"tp": 1, "fsdp": 3, "pp": 1, "shared": 0}  # FSDP's buffers dominate what the model leaves out


def memo(cal: Calibration, key: tuple, compute):
    """``compute()`` once per calibration and ``key`` (the calibration is frozen: what it gives is fixed)."""
    if key not in cal.cache:
        cal.cache[key] = compute()
    return cal.cache[key]


def most_like(cal: Calibration, lay: Layout, *, shared: bool,
              weights: dict[str, int] = SAME_TIME) -> tuple[pd.DataFrame, list[str]]:
    """``_most_like``, once per calibration and the features it compares."""
    key = ("most_like", lay.tp > 1, lay.fsdp, lay.pp > 1, shared, tuple(weights.items()))
    return memo(cal, key, lambda: _most_like(cal, lay, shared=shared, weights=weights))


def _most_like(cal: Calibration, lay: Layout, *, shared: bool,
               weights: dict[str, int]) -> tuple[pd.DataFrame, list[str]]:
    """The calibration runs most like ``lay``: the same use of TP, FSDP and a pipeline, and the same
    sharing regime (each a feature that costs time or memory the FLOPs and the model's bytes do not count:
    TP's replicated work and DTensor's dispatch, FSDP's copies and buffers, ranks sharing cores); and the
    features in which they still differ. ``weights``: how much each feature counts."""
    m = cal.measured
    feats = tuple(f for f, w in weights.items() if w)
    want = {"tp": lay.tp > 1, "fsdp": lay.fsdp, "pp": lay.pp > 1, "shared": shared}
    have = pd.DataFrame({"tp": m["tp"] > 1, "fsdp": m["fsdp"].astype(bool) & (m["dp"] > 1), "pp": m["pp"] > 1,
                         "shared": m["sharing"] > 1})
    score = sum((have[f] == want[f]).astype(int) * weights[f] for f in feats)
    best = m[score == score.max()]
    # each as (its name, whether the layout has it and the runs lack it): a rate borrowed across a feature
    # errs one way when the target has the costly feature and the other way when the runs had it
    differ = [({"shared": "sharing cores"}.get(f, f.upper()), bool(want[f])) for f in feats
              if (have.loc[best.index, f] != want[f]).any()]
    return best, differ


def gap_for(cal: Calibration, lay: Layout) -> tuple[float, str]:
    """A pipeline's host seconds per action: the solved gap (``settle``) of the pipeline runs with the
    layout's schedule, else of every pipeline run (and their schedules, to note), else the gap the replay
    measured (NaN: none)."""
    m = cal.measured
    if "pipeline_gap_s" in m and m["pipeline_gap_s"].notna().any():
        runs = m[m["pipeline_gap_s"].notna()]
        same = runs[runs["schedule"].map(normalize_schedule) == normalize_schedule(lay.schedule)]
        if len(same):
            return float(same["pipeline_gap_s"].mean()), ""
        return float(runs["pipeline_gap_s"].mean()), ", ".join(sorted(set(runs["schedule"])))
    return float(cal.pipeline.get("gap_s", math.nan)), ""


def settle(cal: Calibration, *, tolerance: float = 1e-3) -> Calibration:
    """The calibration with each pipeline run's host seconds per action (``pipeline_gap_s``) solved so
    that the planner's prediction of the run's own layout is its measured step: the replay's gap counts
    only the host time between two actions whose input was there; the schedule's other host work (posting
    receives, splitting and merging microbatches) and the stages' imbalance (the last stage holds the
    head and the loss) lengthen a real step by 3-17 % more on the grids of bench/planner_grid.py. The
    step grows with the gap (each action waits for it), so a bracketing search finds it; 0 where the
    prediction is too long even without a gap (the run's own layout then keeps that error)."""
    m = cal.measured
    pipes = m[m["pp"] > 1] if len(m) else m
    if pipes.empty:
        return cal
    gaps = {}
    for r in pipes.to_dict("records"):
        lay = measured_layout(r, model=cal.model)
        target = float(r["step_time_s"])

        def excess(g: float) -> float:
            return predict(cal, lay, ranks_per_host=int(r["ranks_per_host"]), pipeline_gap=g).step_time_s - target

        lo, hi = 0.0, max(gap_for(cal, lay)[0], 0.0) or 1e-4
        f_lo = excess(lo)
        if f_lo >= 0:
            gaps[r["run"]] = 0.0
            continue
        for _ in range(40):  # widen until the step passes the measured one
            f_hi = excess(hi)
            if f_hi >= 0:
                break
            lo, f_lo, hi = hi, f_hi, hi * 2
        else:
            gaps[r["run"]] = math.nan  # not reached: a gap of 2**40 × a measured one passes any step
            continue
        for _ in range(60):  # regula falsi (Illinois): the step is piecewise linear in the gap
            g = hi - f_hi * (hi - lo) / (f_hi - f_lo)
            f = excess(g)
            if abs(f) <= tolerance * target:
                break
            if f > 0:
                hi, f_hi, f_lo = g, f, f_lo / 2
            else:
                lo, f_lo, f_hi = g, f, f_hi / 2
        gaps[r["run"]] = g
    return dataclasses.replace(cal, measured=m.assign(pipeline_gap_s=m["run"].map(gaps)))


def rate_for(cal: Calibration, lay: Layout, *, held: float, shared: bool, notes: list[str]) -> Rate:
    """The compute rate and host time of the calibration runs most like ``lay`` (``most_like``); the
    optimizer's fixed and per-parameter seconds fitted over all runs (a line in the parameters held), its
    fixed part moved by what the line misses on the runs most like ``lay`` (a pipeline stage's optimizer
    runs beside its schedule's tail; what else differs between layouts is not in the parameters)."""
    m = cal.measured
    best, differ = most_like(cal, lay, shared=shared)
    if differ:
        _note(notes, f"compute rate from {', '.join(best['run'])} (which differ in {', '.join(d for d, _ in differ)})",
              *(f"rate:{d}" if has else f"rate:-{d}" for d, has in differ))
    share = m.loc[m["pp"] > 1, "forward_share"].dropna()
    share = share if len(share) else m["forward_share"].dropna()
    split = m["weight_share"].dropna() if "weight_share" in m else pd.Series(dtype=float)
    x, y = m["held"].to_numpy(float), m["optimizer_s"].to_numpy(float)
    fixed, per_param = nonneg_line(x, y, np.ones_like(x))
    missed = best["optimizer_s"].to_numpy(float) - (fixed + per_param * best["held"].to_numpy(float))
    fixed += float(np.nanmean(missed)) if np.isfinite(missed).any() else 0.0
    return Rate(s_per_flop=float(best["s_per_flop"].mean()), forward_share=float(share.mean()) if len(share) else math.nan,
                weight_share=float(split.mean()) if len(split) else math.nan,
                optimizer_s=fixed, s_per_param=per_param, other_s=float(best["other_s"].mean()))


def _uses(lay: Layout, kind: str) -> bool:
    return {"dp_grads": lay.dp > 1 and not lay.fsdp, "fsdp": lay.dp > 1 and lay.fsdp, "tp": lay.tp > 1}[kind]


def transfer_times(cal: Calibration, lay: Layout, *, model: ModelShape, links: "Links", tokens: float, held: float,
                   notes: list[str]) -> dict[str, float]:
    """Seconds per rank and step each kind of traffic takes on the fitted links (none of it hidden, no
    processor sharing)."""
    out = {"dp_grads": 0.0, "fsdp": 0.0, "tp": 0.0}
    if _uses(lay, "dp_grads"):
        grad = held * model.bytes_per_param
        bucket = cal.counts.get("ddp_bucket_bytes", DDP_BUCKET_BYTES)
        full, rest = divmod(grad, bucket)
        out["dp_grads"] = full * links.time("all_reduce", lay.dp, bucket) + (
            links.time("all_reduce", lay.dp, rest) if rest >= 1 else 0.0)
    if _uses(lay, "fsdp"):
        unit = model.layer_params * model.bytes_per_param / lay.tp
        root = model.embedding_params * model.bytes_per_param / lay.tp / lay.pp
        gathers = 2 if lay.pp == 1 else 1  # under PP the blocks stay gathered across microbatches
        out["fsdp"] = model.n_layers / lay.pp * (gathers * links.time("all_gather", lay.dp, unit)
                                                 + links.time("reduce_scatter", lay.dp, unit))
        out["fsdp"] += gathers * links.time("all_gather", lay.dp, root) + links.time("reduce_scatter", lay.dp, root)
    if lay.tp > 1:
        per_layer = cal.counts.get("tp_per_layer_mb", math.nan)
        if not math.isfinite(per_layer):
            per_layer = TP_PER_LAYER
            _note(notes, f"TP all-reduces per layer and microbatch not measured: {TP_PER_LAYER:g} (Megatron)", "tp_count")
        mb_tokens = tokens / lay.dp / lay.microbatches
        n_ops = per_layer * model.n_layers / lay.pp * lay.microbatches
        out["tp"] = n_ops * links.time("all_reduce", lay.tp, mb_tokens * model.d_model * act_bytes(cal))
    return out


def exposure_of(cal: Calibration, kind: str, *, shared: bool, like: Layout | None = None) -> float | None:
    """Exposed seconds per second of modelled transfer for a kind of traffic, as the calibration runs of one
    sharing regime (``shared``: their φ > 1) measured it, those most like ``like`` where given (the same
    use of TP, FSDP and a pipeline, then the same degrees: what else runs beside the traffic changes how
    much of it stays exposed): their exposed time over the model's transfer time for their own layouts (at
    their sharing); None where none of them had that traffic. Above 1 where the thread also waited for its
    peers' arrival."""
    rows = cal.traffic[cal.traffic["kind"] == kind] if len(cal.traffic) else cal.traffic
    rows = rows[(rows["sharing"] > 1) == shared] if len(rows) else rows
    if rows.empty:
        return None
    if like is not None:
        score = (2 * ((rows["tp"] > 1) == (like.tp > 1)) + 2 * ((rows["pp"] > 1) == (like.pp > 1))
                 + 2 * ((rows["fsdp"].astype(bool) & (rows["dp"] > 1)) == like.fsdp)
                 + (rows["tp"] == like.tp) + (rows["dp"] == like.dp) + (rows["pp"] == like.pp))
        rows = rows[score == score.max()]
    links = Links(cal, [], shared=shared)
    exposed = modelled = 0.0
    for r in rows.to_dict("records"):
        lay = measured_layout(r, model=cal.model)
        held = local_params(cal.model, r)
        t = transfer_times(cal, lay, model=cal.model, links=links, tokens=lay.global_batch * cal.model.seq_len,
                           held=held, notes=[])[kind] * r["sharing"]
        exposed, modelled = exposed + r["exposed_s"], modelled + t
    return exposed / modelled if modelled > 0 else None


def exposure_cells(cal: Calibration, *, like: Layout | None = None) -> dict[tuple[str, bool], float]:
    """``exposure_of`` of every kind of traffic in both sharing regimes, where measured: (kind, shared) →
    exposure. ``exposure_for`` reads them; they do not depend on the target's φ, so ``predict`` takes them
    once (per calibration and the features ``exposure_of`` compares)."""
    key = ("cells", None if like is None else (like.tp, like.pp, like.dp, like.fsdp))
    return memo(cal, key, lambda: {(k, r): e for k in DEFAULT_EXPOSURE for r in (False, True)
                                   if (e := exposure_of(cal, k, shared=r, like=like)) is not None and e > 0})


def exposure_for(cal: Calibration, kind: str, *, shared: bool, like: Layout | None = None,
                 cells: dict[tuple[str, bool], float] | None = None) -> tuple[float, str]:
    """The exposure of a kind of traffic in a sharing regime, and how it was found where it was not
    measured there ('' where it was). Each measured exposure is first put in a blocking kind's terms
    (DDP's overlapped buckets expose ``OVERLAPPED_SHARE`` of what FSDP's gathers or TP's all-reduces do).
    A kind measured in the other regime: × the ratio between the regimes (of the kinds measured in both,
    else of the two regimes' means). A kind not measured: its family's (blocking or overlapped), else the
    other family's converted. The textbook's where nothing was measured."""
    share = OVERLAPPED_SHARE.get(cal.device.split(":")[0], OVERLAPPED_SHARE["cuda"])

    def conv(k: str) -> float:  # a kind's exposure per unit of a blocking kind's
        return share if k in OVERLAPPED else 1.0

    cells = exposure_cells(cal, like=like) if cells is None else cells
    if (kind, shared) in cells:
        return cells[(kind, shared)], ""
    if not cells:
        if cal.device.startswith("cpu"):
            return DEFAULT_EXPOSURE_CPU[kind], "a CPU host's (gloo's transfers take the compute's cores)"
        return DEFAULT_EXPOSURE[kind], "the textbook's"
    both = [k for k in DEFAULT_EXPOSURE if (k, True) in cells and (k, False) in cells]
    means = {r: np.mean([np.log(e / conv(k)) for (k, rr), e in cells.items() if rr == r]) for r in (False, True)
             if any(rr == r for _, rr in cells)}
    if both:  # shared over unshared
        ratio = float(np.exp(np.mean([np.log(cells[(k, True)] / cells[(k, False)]) for k in both])))
    else:
        ratio = float(np.exp(means[True] - means[False])) if len(means) == 2 else 1.0
    into = ratio if shared else 1 / ratio  # from the other regime into this one
    other = f"runs {'without' if shared else 'with'} ranks sharing cores"
    if (kind, not shared) in cells:
        return cells[(kind, not shared)] * into, f"from {other} (× {into:.2f}, the regimes' ratio)"
    for regime, factor, where in ((shared, 1.0, ""), (not shared, into, f" in {other} (× {into:.2f})")):
        seen = {k: e for (k, r), e in cells.items() if r == regime}
        alike = {k: e for k, e in seen.items() if (k in OVERLAPPED) == (kind in OVERLAPPED)}
        use = alike or seen
        if use:
            value = float(np.exp(np.mean([np.log(e / conv(k)) for k, e in use.items()]))) * conv(kind) * factor
            return value, (f"from {', '.join(use)}'s{where}"
                           + ("" if alike else f", DDP exposing {share:.0%} of a blocking kind's"))
    return DEFAULT_EXPOSURE[kind], "the textbook's"  # not reached: ``cells`` has a regime


def _parts(cal: Calibration, lay: Layout, *, model: ModelShape, links: "Links", flops: float, held: float,
           tokens: float, exposure: dict, phi: float, cores: float | None, notes: list[str],
           pipeline_gap: float | None = None) -> dict:
    """The step's parts with every rank's work slowed by ``phi`` (processor sharing), the pipeline's
    schedule simulated with its p ranks sharing ``cores`` (None: each has its device)."""
    rate = rate_for(cal, lay, held=held, shared=phi > 1, notes=notes)
    compute = flops * rate.s_per_flop * phi**SHARING_EXPONENT
    optimizer = max(0.0, rate.optimizer_s + held * rate.s_per_param) * phi
    raw = transfer_times(cal, lay, model=model, links=links, tokens=tokens, held=held, notes=notes)
    comm = {"dp": raw["dp_grads"] * phi * exposure["dp_grads"], "fsdp": raw["fsdp"] * phi * exposure["fsdp"],
            "tp": raw["tp"] * phi * exposure["tp"]}
    busy = compute + comm["tp"]  # TP's all-reduces sit inside the forward and backward
    bubble = 0.0
    if lay.pp > 1:
        m, v = lay.microbatches, lay.virtual_stages
        share = rate.forward_share if math.isfinite(rate.forward_share) else 1 / 3
        hop = cal.pipeline.get("hop_s", math.nan)
        if not math.isfinite(hop):
            hop = links.time("all_reduce", 2, tokens / lay.dp / m * model.d_model * act_bytes(cal)) * phi
            _note(notes, "pipeline transfer per hop not measured: an all-reduce of one microbatch's activations over 2",
                  "pipeline")
        if pipeline_gap is not None:
            gap = pipeline_gap
        else:
            gap, other = gap_for(cal, lay)
            if not math.isfinite(gap):
                _note(notes, "pipeline host time per action not measured (no pipeline run): none", "pipeline_host")
            if other:
                _note(notes, f"pipeline host time per action from the {other} runs (no {lay.schedule} run measured)",
                      "schedule")
        if cores is not None and normalize_schedule(lay.schedule) in ORDERED:
            work = compute / phi**SHARING_EXPONENT + comm["tp"] / phi  # with a core to itself; the simulation shares
            makespan, ran = makespan_shared(schedule=lay.schedule, p=lay.pp, m=m, v=v, f=work * share / (m * v),
                                            b=work * (1 - share) / (m * v), hop=hop,
                                            gap=gap if math.isfinite(gap) else 0.0, cores=cores)
            slow = ran / work if work > 0 else 1.0  # the pipeline's own sharing
            compute = compute / phi**SHARING_EXPONENT * slow**SHARING_EXPONENT
            comm["tp"] = comm["tp"] / phi * slow
            # The simulation slows shared work by the cores' share alone; compute also loses its caches
            # (φ ** SHARING_EXPONENT): the whole schedule stretches with it, so its parts add up to the step.
            busy = compute + comm["tp"]
            makespan *= busy / ran if ran > 0 else 1.0
        else:
            back = busy * (1 - share) / (m * v)
            weight = 0.0
            if normalize_schedule(lay.schedule) == "interleavedzerobubble":  # W split off the backward
                split = rate.weight_share
                if not math.isfinite(split):
                    split = 0.5
                    _note(notes, "weight gradient's share of the backward not measured (no zero-bubble run): half",
                          "pipeline")
                back, weight = back * (1 - split), back * split
            sim = simulate(schedule=lay.schedule, p=lay.pp, m=m, v=v, f=busy * share / (m * v),
                           b=back, w=weight, hop=hop, gap=gap if math.isfinite(gap) else 0.0)
            makespan = float(sim["t_end"].max() - sim["t_start"].min())
        bubble = max(0.0, makespan - busy)
    step = busy + bubble + optimizer + comm["dp"] + comm["fsdp"] + rate.other_s
    return {"compute_s": compute, "optimizer_s": optimizer, "bubble_s": bubble, "other_s": rate.other_s,
            "comm": comm, "step_s": step}


def _memory(cal: Calibration, model: ModelShape, lay: Layout, device_bytes: float | None, *,
            shared: bool) -> tuple[float, bool | None]:
    """The memory model's bytes for the layout + the runtime share the most similar calibration runs had."""
    mesh = {"fsdp" if lay.fsdp else "dp": lay.dp, "tp": lay.tp, "pp": lay.pp}
    spec = ModelSpec(n_params=model.n_params, n_layers=model.n_layers, d_model=model.d_model, seq_len=model.seq_len,
                     global_batch=lay.global_batch, strategy="fsdp" if lay.fsdp else "ddp", mesh=mesh,
                     schedule=lay.schedule, microbatches=lay.microbatches, virtual_stages=lay.virtual_stages,
                     dtype=cal.dtype, activation_checkpoint=cal.activation_checkpoint)
    best, _ = most_like(cal, lay, shared=shared, weights=SAME_MEMORY)
    rows = best.dropna(subset=["memory_offset_bytes"])
    rows = rows if len(rows) else cal.measured.dropna(subset=["memory_offset_bytes"])
    offsets = rows["memory_offset_bytes"].astype(float)
    m = cal.measured
    sharded = rows["fsdp"].astype(bool) & (rows["dp"] > 1)
    plain = m.loc[~(m["fsdp"].astype(bool) & (m["dp"] > 1)), "memory_offset_bytes"].dropna()
    if lay.fsdp and sharded.any() and len(plain):
        # What FSDP holds beyond the model (gathered blocks, reduce-scatter inputs; on a CPU host the heap
        # they leave) grows with the parameters a rank gathers, N/(tp·pp): the FSDP runs' share above the
        # runs without FSDP, rescaled from their tp·pp to the target's.
        base = float(plain.mean())
        scaled = base + (offsets - base) * (rows["tp"] * rows["pp"]) / (lay.tp * lay.pp)
        offsets = offsets.where(~sharded, scaled)
    peak = float(memory_model(spec)["bytes"].sum()) + (float(offsets.mean()) if len(offsets) else 0.0)
    return peak, (None if not device_bytes else peak <= device_bytes)


def rank_layouts(cal: Calibration, *, world_size: int, global_batch: int, **kw) -> list[Prediction]:
    """Every candidate layout predicted, fastest (tokens/s) first; layouts that do not fit in memory last."""
    preds = [predict(cal, lay, **kw) for lay in candidates(model=cal.model, world_size=world_size,
                                                           global_batch=global_batch)]
    return sorted(preds, key=lambda p: (p.memory_fits is False, -p.tokens_per_s))


PROBED_KINDS = {"rate:TP": "tp", "rate:FSDP": "fsdp", "rate:PP": "pp"}  # what ``meshscope plan --probe`` measures


def unmeasured(cal: Calibration, kinds) -> list[str]:
    """Of ``kinds`` (extrapolation kinds), the parallelism kinds (``tp``, ``fsdp``, ``pp``) whose compute
    rate was borrowed and that no calibration run had: what ``--probe`` measures."""
    m = cal.measured
    had = {"tp": bool((m["tp"] > 1).any()), "fsdp": bool((m["fsdp"].astype(bool) & (m["dp"] > 1)).any()),
           "pp": bool((m["pp"] > 1).any())} if len(m) else {}
    return sorted({PROBED_KINDS[k] for k in kinds if k in PROBED_KINDS and not had.get(PROBED_KINDS[k], False)})


def verdict(preds: list[Prediction], *, cal: Calibration, measured: pd.DataFrame | None = None) -> dict:
    """Which layout of ``rank_layouts``' list is fastest, only where the intervals say so: ``fastest``
    (a label, or None), ``tied`` (the labels whose interval overlaps the first's), ``measure`` (the layout
    whose measurement would narrow the question most: the widest interval among the tied) and ``sentence``.
    ``measured`` (``comparison``'s frame: ``layout``, ``measured_s``): runs shown beside the ranking; a
    layout is not named fastest when another layout's run measured a shorter step than its own runs (or,
    unmeasured, than its interval's low end)."""
    fits = [p for p in preds if p.memory_fits is not False]
    if not fits:
        return {"fastest": None, "tied": [], "measure": None, "sentence": "No layout fits in memory."}
    ok, tied = interval.decided([(p.layout.label, p.step_time_low_s, p.step_time_high_s) for p in fits])
    first = fits[0]
    if ok and measured is not None and len(measured):
        own = measured.loc[measured["layout"] == first.layout.label, "measured_s"]
        bar = float(own.median()) if len(own) else first.step_time_low_s
        faster = measured[(measured["layout"] != first.layout.label) & (measured["measured_s"] < bar)]
        if len(faster):
            r = faster.sort_values("measured_s").iloc[0]
            return {"fastest": None, "tied": [first.layout.label, r["layout"]], "measure": first.layout.label,
                    "sentence": f"Not decided: {first.layout.label} is predicted fastest, but a run of {r['layout']} "
                                f"measured {r['measured_s']:.3f} s, faster than "
                                + (f"{first.layout.label}'s runs" if len(own) else "its interval")
                                + f"; a run of {first.layout.label} would decide."}
    if ok:
        return {"fastest": first.layout.label, "tied": [], "measure": None,
                "sentence": f"Fastest: {first.layout.label} (its interval is below every other layout's)."}
    group = [first, *(p for p in fits if p.layout.label in set(tied))]
    widest = max(group, key=lambda p: p.step_time_high_s / p.step_time_low_s)
    probe = unmeasured(cal, widest.extrapolation_kinds)
    how = (f"`meshscope plan --probe` (measures {', '.join(k.upper() for k in probe)}) or a run of {widest.layout.label}"
           if probe else f"a run of {widest.layout.label}")
    shown = ", ".join(p.layout.label for p in group[:4]) + (f" and {len(group) - 4} more" if len(group) > 4 else "")
    return {"fastest": None, "tied": [p.layout.label for p in group], "measure": widest.layout.label,
            "sentence": f"Not decided: {shown} overlap within their intervals; {how} would decide "
                        f"(its interval, {widest.step_time_low_s:.3f}-{widest.step_time_high_s:.3f} s, is the widest)."}


def textbook(cal: Calibration, lay: Layout) -> float:
    """The uncalibrated step time (module docstring): nominal peak and bus bandwidth, 90 % overlap, the
    closed-form bubble."""
    model = scaled_model(cal.model, lay)
    if cal.peak_flops <= 0:  # no peak recorded: the textbook has nothing to divide by
        return math.nan
    tokens = lay.global_batch * model.seq_len
    compute = model.flops_per_token * tokens / (cal.peak_flops * lay.world_size)
    bw = NOMINAL_BUS_BW.get(cal.device, NOMINAL_BUS_BW["cpu"])
    held = local_params(model, {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "fsdp": lay.fsdp})
    volume = 0.0  # bus bytes per rank and step
    if lay.dp > 1:
        n = lay.dp
        grads = held * (n if lay.fsdp else 1) * model.bytes_per_param
        # FSDP: the parameters gathered twice (forward, backward) and the gradients reduce-scattered once
        volume += grads * (2 * busbw_factor("all_gather", n) + busbw_factor("reduce_scatter", n) if lay.fsdp
                           else busbw_factor("all_reduce", n))
    if lay.tp > 1:
        act = tokens / lay.dp * model.d_model * act_bytes(cal)
        volume += TP_PER_LAYER * model.n_layers / lay.pp * act * busbw_factor("all_reduce", lay.tp)
    if lay.pp > 1:
        volume += 2 * tokens / lay.dp * model.d_model * act_bytes(cal)  # activations forward, gradients backward
    exposed = (1 - TEXTBOOK_OVERLAP) * volume / bw
    frac = bubble_theory(schedule=lay.schedule, p=lay.pp, m=lay.microbatches, v=lay.virtual_stages) if lay.pp > 1 else 0.0
    return (compute + exposed) / (1 - (frac or 0.0))


def comparison(cal: Calibration, measured: pd.DataFrame, **kw) -> pd.DataFrame:
    """Measured runs (``run``, the layout columns, ``step_time_s``, ``peak_memory_bytes``) against the
    calibrated and the textbook predictions: ``predicted_s``, ``error``, ``textbook_s``, ``textbook_error``,
    ``memory_predicted``, ``memory_error`` (relative: predicted / measured − 1) and ``calibration`` (the
    run was one the calibration used)."""
    rows = []
    for r in (measured.to_dict("records") if len(measured) else []):
        lay = measured_layout(r, model=cal.model)
        if lay.pp > 1 and lay.schedule not in SIMULATED:
            continue  # a schedule the planner cannot simulate (looped BFS): nothing to compare
        p = predict(cal, lay, **kw)
        tb = textbook(cal, lay)
        mem = r.get("peak_memory_bytes", math.nan)
        rows.append({"run": r["run"], "layout": lay.label, "world_size": lay.world_size, "family": family(lay),
                     "measured_s": r["step_time_s"], "predicted_s": p.step_time_s,
                     "low_s": p.step_time_low_s, "high_s": p.step_time_high_s,
                     "inside": p.step_time_low_s <= r["step_time_s"] <= p.step_time_high_s,
                     "error": p.step_time_s / r["step_time_s"] - 1, "textbook_s": tb,
                     "textbook_error": tb / r["step_time_s"] - 1, "memory_measured": mem,
                     "memory_predicted": p.peak_memory_bytes,
                     "memory_error": p.peak_memory_bytes / mem - 1 if mem and mem == mem else math.nan,
                     "calibration": r["run"] in cal.runs, "extrapolated": "; ".join(p.extrapolated)})
    return pd.DataFrame(rows)
