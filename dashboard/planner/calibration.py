"""The what-if planner's calibration: what one or more measured runs of a model say about the machine it
ran on (docs/formulas.md, "What-if planner"). DataFrame in, dataclass out; no I/O (the frames come from
``data.planner_data``), no plotting. ``dashboard.planner.predict`` predicts other layouts from the result.

Per run, over its steps after warm-up (``stragglers.first_steady_step``), each rank's medians, then their
mean over ranks (every rank's wall is the step's, so the means add up to the measured step time):

- **Compute rate**: seconds per model FLOP of the forward and backward work,
  (``compute_s`` − ``optimizer_s``) / ``flops`` (the rank's attributed FLOPs), and the forward's share of
  it; the optimizer's seconds and the parameters the rank holds (``planner.rate_for`` fits a line in
  them over the runs).
- **Processor sharing** (CPU hosts): ranks on one host share its C cores, so the same work takes longer
  with more ranks busy at once. A run's *sharing* φ = 1 / (1 − w), w its CPU wait share (the run-queue
  delay over the time the training thread was not blocked, ``environment.cpu_wait_share``): the factor
  its threads were slowed by. The compute rate above is divided by φ ** ``SHARING_EXPONENT``, the
  optimizer's seconds and the links' by φ (per rank with a core to itself). A rank demands a core a
  share u of the step: all of it but a pipeline's idle and the part (1 − γ) of its exposed communication
  it sleeps through (gloo spins a while before it sleeps), so φ = k·u/C (``planner.sharing``)
  with k ranks on the host; each oversubscribed run gives γ = 1 − (u₀ − φ·C/k)·step / exposed, u₀ its
  share outside pipeline idle. C is the cores of the machine the planner runs on (the runs' host, as
  the CPU path is used here), or fewer where a run whose ranks outnumbered them says it had fewer
  (k·u₀/φ: another load on the host); on GPUs φ = 1.
- **Links**: per (op, group size) and sharing regime (runs with φ > 1 or not), t = α + bytes·f(op, n)/β
  (``fit_alpha_beta``; f the nccl-tests bus factor, so β is a bus bandwidth and one fit carries to other
  group sizes of the same op). An instance's time is the least over its ranks (the rank that arrived
  last waited for the transfer only), divided by its run's φ like the compute (gloo's transfers run on
  the same cores); collectives under ``SMALL_BYTES`` are left out (they time the peers' arrival).
- **Exposure**: per kind of traffic (DDP gradient buckets, FSDP gathers and reduce-scatters, TP
  activations, pipeline P2P), the seconds per step the training thread was blocked on it. Waits the ops
  do not carry (DDP waits for its buckets at the end of backward, outside any op) count for the gradient
  buckets. ``planner.exposure_of`` divides them by the model's transfer time for the run's own layout.
- **Counts**: the DDP bucket size and the TP all-reduces per layer and microbatch, as the run issued them.
- **Pipeline**: the measured transfer time per hop and host gap per action (``pipeline_sim.replay``), the
  forward's share of the actions' time and, where a zero-bubble run split its backwards, the weight
  gradient's share of them. ``planner.settle`` then solves each pipeline run's *host time per action*: the
  gap with which the planner's own schedule simulation gives the run's measured step (the replay's gap
  misses the schedule's host work outside the gaps it sees, and the stages' imbalance).
- **Memory**: per run, the measured peak minus the analytic model's bytes (``memory_model``): the
  runtime's own share (on CPU the host RSS holds the Python and torch runtime; on GPU the allocator's
  peak holds workspaces and communication buffers). The planner adds that of the runs most like a target
  layout (FSDP's buffers are not in the model) to the model's bytes for it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from meshscope.dashboard.analysis import busbw_factor, parallel_degrees
from meshscope.dashboard.data import parse_mesh
from meshscope.dashboard.environment import MIN_STEADY_STEPS, cpu_wait_share
from meshscope.dashboard.memory_model import memory_model, spec_from_meta
from meshscope.dashboard.pipeline_sim import replay
from meshscope.dashboard.stragglers import first_steady_step
from meshscope.agent.contract import is_stage_wait
from meshscope.agent.contract.layout import MULTI_STAGE

SHARED = 1.15  # a run whose sharing φ exceeds this was oversubscribed (a rank alone on a core reads 1.01-1.09)
# Ranks sharing cores lose more than the run-queue wait: a rank that runs again finds its caches taken
# by the others, so its compute's CPU time per FLOP grows too. Compute slows by φ ** this exponent (the
# grid of bench/planner_grid.py: DDP, FSDP2 and TP at 4 ranks on 2 cores against the same at 2 ranks
# give 1.25, 1.34 and 1.26).
SHARING_EXPONENT = 1.25
SMALL_BYTES = 1024  # collectives below this size synchronise (loss, gradient norm); they carry no bulk data
TRAFFIC = ("dp_grads", "fsdp", "tp", "pp")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """What the planner needs of a model (from a run record; a target may scale layers and width)."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int  # 0: unknown (a TP degree is then not checked against it)
    vocab_size: int
    seq_len: int
    n_params: float
    n_params_nonembedding: float
    flops_per_token: float
    bytes_per_param: int = 4  # parameters and gradients (fp32 master weights; bf16 runs keep fp32 params too)

    @property
    def layer_params(self) -> float:
        """Parameters of one transformer block (the unit FSDP shards and gathers)."""
        return max(self.n_params - self.embedding_params, 0.0) / self.n_layers

    @property
    def embedding_params(self) -> float:
        """Embedding, output head and final norm: what is not in a block."""
        return 2.0 * self.vocab_size * self.d_model + self.d_model


@dataclass(frozen=True, slots=True, kw_only=True)
class Rate:
    """Per rank with a processor to itself (``sharing`` divided out)."""

    s_per_flop: float  # forward + backward seconds per model FLOP on one rank
    forward_share: float  # forward / (forward + backward)
    weight_share: float = math.nan  # weight gradient / backward where a zero-bubble run split it (NaN: not measured)
    optimizer_s: float  # optimizer seconds per step, fixed part
    s_per_param: float  # optimizer seconds per step per parameter the rank holds
    other_s: float  # per step: wall − compute − exposed comm − bubble (host work between phases)


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    runs: tuple[str, ...]
    device: str  # "cpu", "cuda", ...
    model: ModelShape
    peak_flops: float  # per device, as the runs recorded it (table, override or calibrated)
    cores: float | None  # CPU host: the cores its ranks shared (None on GPUs)
    spin: float  # the share of exposed communication a waiting rank keeps a core busy (γ); 1 where not seen
    links: pd.DataFrame  # fit_alpha_beta's frame per sharing regime (``shared``: the runs' φ > 1)
    traffic: pd.DataFrame  # per run and kind of traffic: exposed_s (per rank and step), sharing, the run's layout
    counts: dict[str, float]  # ddp_bucket_bytes, tp_per_layer_mb, sync_per_step (measured only)
    pipeline: dict[str, float]  # hop_s, gap_s, hop_values (activations per hop; measured only)
    memory_measure: str  # "allocator peak" or "host RSS peak"
    dtype: str = "fp32"  # the runs' training dtype (the memory model's bytes per value)
    activation_checkpoint: bool = False
    device_bytes: float | None = None  # the smallest device capacity a run recorded (None: not recorded, CPU)
    warnings: tuple[str, ...] = ()  # what makes the calibration itself doubtful (too few steps)
    # per run: its layout, measured step time and peak memory, and its rates (``Rate``'s fields, with
    # ``optimizer_s`` and ``held`` params for the optimizer's fit); ``planner.rate_for`` picks among them
    measured: pd.DataFrame = field(default_factory=pd.DataFrame)
    # per calibration run predicted from the others (``whatif.holdout``): ``run``, ``ratio`` (measured /
    # predicted), ``kinds`` (the extrapolation it needed); ``interval.bounds`` widens by it
    holdout: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["run", "ratio", "kinds"]))
    # what the planner derived from this calibration and a layout's features (``predict.memo``): the same for
    # every layout with those features, and asked for by each of a ranking's dozens of predictions
    cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    host_cores: float | None = None  # the CPU host's cores before a run's sharing said its ranks had fewer


# ----------------------------------------------------------------------------------------------- links
def fit_alpha_beta(instances: pd.DataFrame) -> pd.DataFrame:
    """Per (op, group_size) of ``instances`` (``op``, ``group_size``, ``bytes``, ``duration_s``): ``alpha_s``,
    ``beta_bytes_per_s`` (bus bandwidth), ``n`` instances, ``sizes`` (distinct message sizes),
    ``bytes_min``, ``bytes_max`` and ``rmse_rel`` (RMS of the instances' relative residuals).

    Least squares of t = α + x/β on x = bytes × bus factor, over the per-size medians, in relative terms
    (weights √count / t: a size seen often is known better, but one size must not drown the others, and
    a large transfer's noise must not swamp a small one's latency), with α, 1/β ≥ 0. With one
    message size α and β cannot be told apart: α is 0 and β the size over its median time (``sizes`` 1
    says so)."""
    cols = ["op", "group_size", "alpha_s", "beta_bytes_per_s", "n", "sizes", "bytes_min", "bytes_max", "rmse_rel"]
    rows = []
    t = instances[(instances["duration_s"] > 0) & (instances["bytes"] >= 0)]
    for (op, n), g in t.groupby(["op", "group_size"], sort=True):
        f = busbw_factor(op, int(n))
        if not math.isfinite(f) or f <= 0:
            continue
        med = g.groupby("bytes")["duration_s"].agg(["median", "size"]).reset_index()
        x, y = med["bytes"].to_numpy(float) * f, med["median"].to_numpy(float)
        # Relative residuals (timing noise is proportional to the time): a 64 MiB transfer's noise must not
        # swamp a 1 KiB one's latency.
        w = np.sqrt(med["size"].to_numpy(float)) / np.maximum(y, 1e-12)
        alpha, inv_beta = nonneg_line(x, y, w)
        pred = alpha + g["bytes"].to_numpy(float) * f * inv_beta
        rel = (g["duration_s"].to_numpy(float) - pred) / np.maximum(pred, 1e-12)
        rows.append((op, int(n), alpha, 1.0 / inv_beta if inv_beta > 0 else math.inf, len(g), len(med),
                     int(g["bytes"].min()), int(g["bytes"].max()), float(np.sqrt(np.mean(rel**2)))))
    return pd.DataFrame(rows, columns=cols)


MAX_LATENCY_SHARE = 0.8  # a latency share borrowed for a one-size fit: some of its time is the transfer


def single_size_latency(fits: pd.DataFrame) -> pd.DataFrame:
    """``fit_alpha_beta``'s fits with each one-size fit (α 0: all its time put on bandwidth) split into α
    and β as a fit of several sizes splits its time at that message size (the same op first, then the same
    group size, then any; the nearest sizes), so that it carries to other sizes: at half a MiB most of a
    gloo transfer's time is latency, and a one-size fit taken as pure bandwidth halves a 12 MiB gather's
    speed. Unchanged where no fit has several sizes."""
    out = fits.copy()
    if fits.empty:
        return out
    beta = fits["beta_bytes_per_s"].astype(float)
    many = fits[(fits["sizes"] > 1) & (fits["alpha_s"] > 0) & np.isfinite(beta) & (beta > 0)]
    for i, r in fits[(fits["sizes"] == 1) & (fits["beta_bytes_per_s"] > 0)].iterrows():
        if many.empty:
            break
        pool = next(p for p in (many[many["op"] == r["op"]], many[many["group_size"] == r["group_size"]], many)
                    if len(p))
        near = (np.log(pool["bytes_min"].clip(lower=1)) - np.log(max(r["bytes_min"], 1))).abs()
        c = pool.loc[near.idxmin()]
        x_c = r["bytes_min"] * busbw_factor(c["op"], int(c["group_size"]))
        share = min(MAX_LATENCY_SHARE, c["alpha_s"] / (c["alpha_s"] + x_c / c["beta_bytes_per_s"]))
        x_r = r["bytes_min"] * busbw_factor(r["op"], int(r["group_size"]))
        t0 = x_r / r["beta_bytes_per_s"]
        out.loc[i, "alpha_s"], out.loc[i, "beta_bytes_per_s"] = share * t0, x_r / ((1 - share) * t0)
    return out


def nonneg_line(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Weighted least squares y = a + b·x with a, b ≥ 0."""
    if len(x) == 1 or np.ptp(x) == 0:
        return 0.0, float(np.sum(w * y) / np.sum(w * x)) if np.sum(w * x) > 0 else 0.0
    a_mat = np.column_stack([np.ones_like(x), x]) * w[:, None]
    a, b = np.linalg.lstsq(a_mat, y * w, rcond=None)[0]
    if b < 0:  # time does not grow with size: all latency
        return float(np.sum(w * y) / np.sum(w)), 0.0
    if a < 0:  # through the origin
        return 0.0, float(np.sum(w * w * x * y) / np.sum(w * w * x * x))
    return float(a), float(b)


# ------------------------------------------------------------------------------------------ per run
def _traffic(op: str, dim: str, strategy: str) -> str:
    """The kind of traffic an op of a dimension belongs to (``TRAFFIC``)."""
    if op in ("send", "recv"):
        return "pp"
    if dim == "tp":
        return "tp"
    if dim == "fsdp" or (dim == "dp" and "fsdp" in strategy):
        return "fsdp"
    return "dp_grads" if dim == "dp" else "other"


def model_shape(meta: dict, *, n_heads: int = 0, vocab_size: int = 0) -> ModelShape:
    """The model of a runs-table row. ``n_heads`` / ``vocab_size``: from the model's own description
    where the caller has one (the reference trainer's flavors); the vocabulary is otherwise recovered from
    the parameter counts (embedding = total − non-embedding = vocab × width)."""
    d = int(meta["d_model"])
    n, n_ne = float(meta["n_params"]), float(meta.get("n_params_nonembedding") or meta["n_params"])
    vocab = vocab_size or (int(round((n - n_ne) / d)) if d else 0)
    return ModelShape(name=str(meta.get("model") or "model"), n_layers=int(meta["n_layers"]), d_model=d,
                      n_heads=int(n_heads), vocab_size=int(vocab), seq_len=int(meta["seq_len"]), n_params=n,
                      n_params_nonembedding=n_ne, flops_per_token=float(meta["flops_per_token"]),
                      bytes_per_param=2 if str(meta.get("dtype", "")).lower() in ("fp16", "float16") else 4)


def layout_of(meta: dict) -> dict:
    """The parallel layout of a runs-table row (``meta`` with ``mesh`` parsed), as the planner writes it."""
    mesh = meta["mesh"] if isinstance(meta.get("mesh"), dict) else parse_mesh(meta.get("mesh"))
    world = int(meta.get("world_size") or 1)
    deg = parallel_degrees(mesh, world_size=world)
    strategy = str(meta.get("strategy") or "")
    pp = deg["pp"]
    return {"dp": deg["dp"], "tp": deg["tp"], "pp": pp, "fsdp": "fsdp" in strategy or int(mesh.get("fsdp", 1)) > 1,
            "schedule": str(meta.get("schedule") or "1f1b") if pp > 1 else "",
            "microbatches": int(meta.get("microbatches") or 1) if pp > 1 else 1,
            # as the trainer resolves it: several stages per rank only for the multi-stage schedules
            "virtual_stages": int(meta.get("virtual_stages") or 1) if pp > 1 and str(meta.get("schedule") or "")
            in MULTI_STAGE else 1,
            "world_size": world, "global_batch": int(meta.get("global_batch") or 0)}


def ranks_per_host(meta: dict) -> int:
    """The most ranks any host of the run had (``rank_hosts``); the world size when unknown."""
    try:
        hosts = json.loads(meta.get("rank_hosts") or "{}").get("host") or []
    except (TypeError, ValueError, AttributeError):
        hosts = []
    return int(pd.Series(hosts).value_counts().max()) if hosts else int(meta.get("world_size") or 1)


def steady_means(steps: pd.DataFrame) -> tuple[pd.Series, int]:
    """Per rank medians over the steps after warm-up, then their mean over ranks; and the first steady step."""
    series = steps.groupby("step", as_index=False)["wall_s"].max().rename(columns={"wall_s": "step_time_s"})
    first = first_steady_step(series, run_first_step=int(steps["step"].min()))
    steady = steps[steps["step"] >= first]
    per_rank = steady.drop(columns="step").groupby("rank").median(numeric_only=True)
    out = per_rank.mean()
    times = series.loc[series["step"] >= first, "step_time_s"]
    out["step_time_s"] = float(times.median())
    # half the 10-90 % range of the steady steps, relative: the noise of one step time on this machine
    out["step_spread"] = float((times.quantile(0.9) / times.quantile(0.1) - 1) / 2) if len(times) > 2 else math.nan
    return out, int(first)


def local_params(model: ModelShape, layout: dict) -> float:
    """Parameters one rank holds: the model / (tp · pp), / dp more when FSDP shards them."""
    shard = layout["dp"] if layout["fsdp"] else 1
    return model.n_params / (layout["tp"] * layout["pp"]) / shard


def measure(meta: dict, frames: dict[str, pd.DataFrame], *, model: ModelShape) -> dict:
    """One run's calibration inputs (``frames``: ``data.planner_data``'s). Raises ValueError for a run
    with no steps."""
    if frames["steps"].empty:
        raise ValueError(f"run {meta.get('run')!r} has no step records to calibrate from")
    means, first = steady_means(frames["steps"])
    lay = layout_of(meta)
    strategy = str(meta.get("strategy") or "")
    n_steps = max(int((frames["steps"]["step"] >= first).sum() / max(frames["steps"]["rank"].nunique(), 1)), 1)
    n_ranks = max(frames["steps"]["rank"].nunique(), 1)
    comm = frames["comm"][frames["comm"]["step"] >= first]
    comm = comm.assign(traffic=[_traffic(o, d, strategy) for o, d in zip(comm["op"], comm["dim"])],
                       small=comm["bytes"] / comm["n"].clip(lower=1) < SMALL_BYTES)
    bulk = comm[~comm["small"]]
    per = bulk.groupby("traffic")[["n", "bytes", "duration_s", "wait_s"]].sum() / (n_steps * n_ranks)
    # what the step records count as exposed: not a stage's waits for the others (bubble there)
    exposed_rows = [not is_stage_wait(o, d) for o, d in zip(comm["op"], comm["dim"])]
    waits_all = float(comm.loc[exposed_rows, "wait_s"].sum()) / (n_steps * n_ranks)
    # Exposed seconds per rank and step by kind of traffic; ``planner.exposure`` sets them against the model's
    # transfer time for this run's layout (so the run's own layout reproduces them).
    exposed = {kind: float(per.loc[kind, "wait_s"]) for kind in per.index if kind in TRAFFIC}
    if "dp_grads" in exposed:  # DDP waits for its buckets outside any op (end of backward)
        exposed["dp_grads"] += max(0.0, float(means["exposed_comm_s"]) - waits_all)
    exposed_bulk = sum(v for k_, v in exposed.items() if k_ != "pp")
    counts = {}
    inst = frames["instances"][frames["instances"]["step"] >= first]
    if "dp_grads" in per.index:
        grads = inst[(inst["dim"] == "dp") & (inst["bytes"] >= SMALL_BYTES)]
        counts["ddp_bucket_bytes"] = float(grads["bytes"].mean())  # the mean bucket: total / count
    if "tp" in per.index:
        layers = model.n_layers / lay["pp"]
        counts["tp_per_layer_mb"] = float(per.loc["tp", "n"]) / (layers * lay["microbatches"])
    flops = float(means["flops"])
    fb = float(means["compute_s"] - means["optimizer_s"])
    if not (math.isfinite(flops) and flops > 0 and math.isfinite(fb)):
        raise ValueError(f"run {meta.get('run')!r} recorded no model FLOPs per step: the planner's compute rate is "
                         "seconds per FLOP (the reference trainer and the framework integrations record them)")
    k = ranks_per_host(meta)
    # Busy: not idle in a bubble nor waiting for a pipeline neighbour (exposed time beyond the bulk traffic's).
    idle = float(means["bubble_s"]) + (max(0.0, float(means["exposed_comm_s"]) - exposed_bulk) if lay["pp"] > 1 else 0.0)
    busy = 1.0 - idle / float(means["step_time_s"]) if math.isfinite(idle) else 1.0
    busy = min(1.0, max(busy, 0.05))  # a share of the step; NaN bubble (not recorded): none
    phi = 1.0
    if str(meta.get("device") or "").startswith("cpu"):
        shares = cpu_wait_share(frames["steps"][frames["steps"]["step"] >= first])
        w = float(shares["cpu_wait_share"].mean()) if len(shares) else math.nan
        phi = 1.0 / (1.0 - min(w, 0.9)) if math.isfinite(w) and w > 0 else 1.0
        # A rank alone on a core still waits a little for one (the agent, the kernel): that belongs to the
        # rate of a rank with a core to itself, not to sharing.
        phi = phi if phi > SHARED else 1.0
    out = {"run": meta.get("run"), "layout": lay, "ranks_per_host": k, "first_step": first, "steady_steps": n_steps,
           "step_time_s": float(means["step_time_s"]),
           "s_per_flop": fb / flops / phi**SHARING_EXPONENT if flops > 0 else math.nan,
           "optimizer_s": float(means["optimizer_s"]) / phi, "held": local_params(model, lay), "sharing": phi, "busy": busy,
           "exposed_bulk_s": exposed_bulk,
           "forward_share": math.nan, "weight_share": math.nan, "exposed": exposed, "counts": counts, "pipeline": {},
           "other_s": max(0.0, float(means["step_time_s"] - means["compute_s"] - means["bubble_s"]) - exposed_bulk),
           "means": means, "memory": _memory(meta, frames["memory"]),
           # The small synchronising collectives are left out of the link fits: their time is the peers'
           # arrival skew, not the link's latency.
           "instances": inst.loc[inst["bytes"] >= SMALL_BYTES, ["op", "group_size", "bytes", "duration_s"]].assign(
               duration_s=lambda t: t["duration_s"] / phi)}
    spans = frames["spans"]
    if lay["pp"] > 1 and not spans.empty:
        spans = spans[spans["step"] >= first]
        took = spans["t_end"] - spans["t_start"]
        fwd, weight = float(took[spans["kind"] == "forward"].sum()), float(took[spans["kind"] == "weight"].sum())
        busy = float(took.sum())
        out["forward_share"] = fwd / busy if busy > 0 else math.nan
        # zero-bubble schedules split the backward into input and weight gradients (torch's W actions)
        out["weight_share"] = weight / (busy - fwd) if weight > 0 and busy > fwd else math.nan
        rep = replay(spans, schedule=lay["schedule"], p=lay["pp"], m=lay["microbatches"], v=lay["virtual_stages"])
        if len(rep):
            # a hop carries one microbatch's activations (values: ×2 or ×4 bytes by the dtype)
            out["pipeline"] = {"hop_s": float(rep["hop_s"].median()), "gap_s": float(rep["gap_s"].median()),
                               "hop_values": lay["global_batch"] * model.seq_len / lay["dp"] / lay["microbatches"]
                               * model.d_model}
        # Under PP the drain (a stage waiting for the last) shows as exposed time: it is the schedule's, which
        # the simulator reproduces, not host work between phases.
        out["other_s"] = float(means["other_s"])
    elif lay["pp"] == 1:
        f, b = float(means["forward_s"]), float(means["backward_s"])
        if not exposed.get("fsdp") and not exposed.get("tp") and f + b > 0:  # phases without waits inside
            out["forward_share"] = f / (f + b)
    return out


def _memory(meta: dict, memory: pd.DataFrame) -> dict:
    """The measured peak per rank (max over ranks) against the memory model's bytes for the run."""
    if memory.empty:
        return {}
    alloc = pd.to_numeric(memory["allocated_peak_bytes"], errors="coerce")
    measure_name, col = ("allocator peak", alloc) if (alloc > 0).any() else (
        "host RSS peak", pd.to_numeric(memory["rss_peak_bytes"], errors="coerce"))
    col = col[col > 0]
    if col.empty:
        return {}
    try:
        model_bytes = float(memory_model(spec_from_meta(meta))["bytes"].sum())
    except (KeyError, ValueError, TypeError):
        return {}
    total = pd.to_numeric(memory["device_total_bytes"], errors="coerce")
    total = total[total > 0]
    return {"measure": measure_name, "peak_bytes": float(col.max()), "model_bytes": model_bytes,
            "device_bytes": float(total.min()) if len(total) else math.nan}


def calibrate(measured: list[dict], *, model: ModelShape, device: str, peak_flops: float,
              cores: float | None = None, dtype: str = "fp32", activation_checkpoint: bool = False) -> Calibration:
    """One calibration from ``measure``'s results of one model's runs (the runs' figures averaged where
    several measured the same thing). ``cores``: the CPU host's (ignored on GPUs); ``dtype`` and
    ``activation_checkpoint``: the runs' (the memory model of a target layout uses them)."""
    if not measured:
        raise ValueError("no run to calibrate from")
    cpu = device.startswith("cpu")
    host = float(cores) if cores else None
    if cpu and cores:
        # A run whose ranks outnumbered these cores and were slowed more than that explains had fewer of
        # them (another load on the host): the cores it had are what it says. A run whose ranks fit the
        # cores but still waited for one says nothing of the host: its own threads (gloo's, DDP's reducer)
        # take cores beside the training threads (a 2-rank DDP run on 2 cores read φ 1.38 on tiny-wide, and
        # 4-rank steps then measured 0.40-0.60 of the predictions from the cores it implied).
        cores = max(1.0, min([float(cores), *(m["ranks_per_host"] * m["busy"] / m["sharing"] for m in measured
                                              if m["sharing"] > 1 and m["ranks_per_host"] * m["busy"] > cores)]))
    spins = []
    for m in measured:  # γ from each oversubscribed run (module docstring)
        e = m["exposed_bulk_s"] / m["step_time_s"]
        if cpu and cores and m["sharing"] > 1 and e > 0.05:
            spins.append(min(1.0, max(0.0, 1 - (m["busy"] - m["sharing"] * cores / m["ranks_per_host"]) / e)))
    traffic = pd.DataFrame([{"run": m["run"], "kind": kind, "exposed_s": v, "sharing": m["sharing"], **m["layout"]}
                            for m in measured for kind, v in m["exposed"].items()])
    counts = {k: _mean(m["counts"][k] for m in measured if k in m["counts"])
              for k in ("ddp_bucket_bytes", "tp_per_layer_mb") if any(k in m["counts"] for m in measured)}
    pipeline = {k: _mean(m["pipeline"][k] for m in measured if m["pipeline"]) for k in ("hop_s", "gap_s", "hop_values")
                if any(m["pipeline"] for m in measured)}
    mem = [m["memory"] for m in measured if m["memory"]]
    return Calibration(
        runs=tuple(m["run"] for m in measured), device=device, model=model, peak_flops=peak_flops,
        cores=float(cores) if cpu and cores else None, host_cores=host if cpu and host else None, spin=float(np.mean(spins)) if spins else 1.0,
        # one fit per sharing regime: a link between oversubscribed ranks waits for both to be scheduled
        links=pd.concat([single_size_latency(
            fit_alpha_beta(pd.concat([m["instances"] for m in measured if (m["sharing"] > 1) == shared])))
            .assign(shared=shared) for shared in (False, True)
            if any((m["sharing"] > 1) == shared for m in measured)], ignore_index=True), traffic=traffic,
        counts=counts, pipeline=pipeline,
        warnings=tuple(f"run {m['run']} has only {m['steady_steps']} step{'s' if m['steady_steps'] != 1 else ''} "
                       f"after warm-up: too few to calibrate from (at least {MIN_STEADY_STEPS})"
                       for m in measured if m["steady_steps"] < MIN_STEADY_STEPS),
        memory_measure=mem[0]["measure"] if mem else "", dtype=dtype, activation_checkpoint=activation_checkpoint,
        device_bytes=min(dev) if (dev := [d["device_bytes"] for d in mem
                                          if math.isfinite(d.get("device_bytes", math.nan))]) else None,
        measured=pd.DataFrame([{"run": m["run"], **m["layout"], "step_time_s": m["step_time_s"],
                                "ranks_per_host": m["ranks_per_host"], "sharing": m["sharing"], "busy": m["busy"],
                                "exposed_share": m["exposed_bulk_s"] / m["step_time_s"],
                                "s_per_flop": m["s_per_flop"], "forward_share": m["forward_share"],
                                "weight_share": m["weight_share"],
                                "optimizer_s": m["optimizer_s"], "held": m["held"], "other_s": m["other_s"],
                                "step_spread": float(m["means"].get("step_spread", math.nan)),
                                "peak_memory_bytes": m["memory"].get("peak_bytes", math.nan),
                                "memory_offset_bytes": m["memory"].get("peak_bytes", math.nan)
                                - m["memory"].get("model_bytes", math.nan)} for m in measured]))


def _mean(values) -> float:
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    return float(np.mean(v)) if v else math.nan
