"""Analytic memory per device for a run's strategy (docs/formulas.md, "Memory model").

Model states, mixed precision with Adam: parameters 2 B, gradients 2 B, optimizer state 12 B per
parameter (fp32 master 4 + momentum 4 + variance 4); pure fp32: 4 + 4 + 8. Sharding:
- DDP: nothing sharded, and its buckets hold a second copy of the gradients. ZeRO-1: optimizer / dp. ZeRO-2: gradients and optimizer / dp.
- FSDP / ZeRO-3: all three / the shard degree, plus the unsharded parameters of the layers in flight
  (the current layer and the prefetched next one).
- TP divides the sharded layers' parameters by tp (we divide all of them: embeddings are sharded too in
  torchtitan-style plans); PP keeps N / p per stage.
Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation"): 34·b·s·h bytes per layer
per microbatch in 16-bit with flash attention (their 5·a·s²·b attention-score term vanishes), / tp with
sequence parallelism; with activation checkpointing only the layer input (2·b·s·h) per layer plus one
layer's full activations for the recomputation. In flight: 1 microbatch without PP; m for GPipe;
min(p, m) for 1F1B at stage 0 (the worst stage); p·(1 + (p-1)/(p·v)) for interleaved 1F1B and interleaved
zero-bubble (assumed the same; not measured); m for looped BFS (all forwards
first, as GPipe).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pandas as pd

from meshscope.dashboard.analysis import normalize_schedule
from meshscope.dashboard.data import parse_config


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    n_params: float
    n_layers: int
    d_model: int
    seq_len: int
    global_batch: int
    strategy: str
    mesh: dict[str, int]
    schedule: str = ""
    microbatches: int = 1
    virtual_stages: int = 1
    dtype: str = "bfloat16"
    activation_checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.n_params <= 0 or self.n_layers <= 0:
            raise ValueError(f"n_params ({self.n_params}) and n_layers ({self.n_layers}) must be positive")


def spec_from_meta(meta: dict) -> ModelSpec:
    """Build a spec from a ``run`` record (mesh and config are JSON strings there)."""
    mesh = meta.get("mesh") or {}
    if isinstance(mesh, str):
        mesh = json.loads(mesh or "{}")
    config = parse_config(meta.get("config"))
    # The reference trainer nests it under "model"; other writers may put it at the top level.
    model_cfg = config.get("model") if isinstance(config.get("model"), dict) else {}
    ac = config.get("activation_checkpoint", model_cfg.get("activation_checkpoint", False))
    return ModelSpec(
        n_params=float(meta["n_params"]), n_layers=int(meta["n_layers"]), d_model=int(meta["d_model"]),
        seq_len=int(meta["seq_len"]), global_batch=int(meta["global_batch"]),
        strategy=str(meta.get("strategy") or "ddp"), mesh={k: int(v) for k, v in mesh.items()},
        schedule=str(meta.get("schedule") or ""), microbatches=int(meta.get("microbatches") or 1),
        virtual_stages=int(meta.get("virtual_stages") or 1), dtype=str(meta.get("dtype") or "bfloat16"),
        activation_checkpoint=bool(ac and ac not in ("none", "off", "false")),
    )


def _degrees(spec: ModelSpec) -> tuple[int, int, int, int]:
    """(data replicas, shard degree for FSDP/ZeRO, tp, pp)."""
    mesh, strategy = spec.mesh, spec.strategy.lower()
    tp, pp = mesh.get("tp", 1), mesh.get("pp", 1)
    dp = mesh.get("dp", 1) * mesh.get("fsdp", 1)
    sharded = "fsdp" in strategy or "zero" in strategy
    # A mesh may call the FSDP dim "fsdp" or, with strategy "fsdp", just "dp".
    shard = mesh.get("fsdp", mesh.get("dp", 1) if sharded else 1)
    return max(dp, 1), max(shard, 1), max(tp, 1), max(pp, 1)


def memory_model(spec: ModelSpec) -> pd.DataFrame:
    """Bytes per device by component: ``component``, ``bytes``, ``formula``."""
    fp32 = spec.dtype.lower() in ("float32", "fp32", "torch.float32")
    bp, bg, bo = (4, 4, 8) if fp32 else (2, 2, 12)
    act_bytes = 4 if fp32 else 2
    dp, shard, tp, pp = _degrees(spec)
    strategy = spec.strategy.lower()
    local = spec.n_params / (tp * pp)  # parameters this device holds before data-parallel sharding
    n_p, n_g, n_o = local * bp, local * bg, local * bo
    rows = []
    if "zero1" in strategy:
        n_o /= shard
        how = f"optimizer / dp ({shard})"
    elif "zero2" in strategy:
        n_g, n_o = n_g / shard, n_o / shard
        how = f"grads, optimizer / dp ({shard})"
    elif "fsdp" in strategy or "zero3" in strategy:
        n_p, n_g, n_o = n_p / shard, n_g / shard, n_o / shard
        how = f"all / shard ({shard})"
        in_flight = 2 * spec.n_params / spec.n_layers / tp * bp
        rows.append(("unsharded params in flight", in_flight, f"2 layers x N/L/tp x {bp} B"))
    else:
        how = "replicated"
        if dp > 1 and "ddp" in strategy:
            # torch DDP copies the gradients into its buckets (gradient_as_bucket_view is off by default).
            rows.append(("DDP gradient buckets", n_g, "a second copy of the gradients"))
    base = f"N/(tp·pp) = {local:.3g} params; {how}"
    rows = [("parameters", n_p, f"{bp} B/param; {base}"), ("gradients", n_g, f"{bg} B/param; {base}"),
            ("optimizer state", n_o, f"{bo} B/param; {base}"), *rows]

    m = max(spec.microbatches, 1)
    b = spec.global_batch / dp / m  # microbatch size per replica
    s, h = spec.seq_len, spec.d_model
    layers = spec.n_layers / pp
    per_layer = 34 * b * s * h * act_bytes / 2 / tp  # 34 is for 16-bit; scale for fp32
    if spec.activation_checkpoint:
        per_mb = layers * 2 * b * s * h * act_bytes / 2 / tp
        extra, note = per_layer, "checkpointed: 2·b·s·h per layer + one full layer"
    else:
        per_mb, extra = layers * per_layer, 0.0
        note = (f"34·b·s·h per layer in 16-bit{' (x2: fp32)' if fp32 else ''}; attention scores not stored "
                "(fused attention: torch SDPA on CPU and GPU)")
    sched = normalize_schedule(spec.schedule)
    if pp == 1:
        flight, fnote = 1.0, "1 microbatch"
    elif sched in ("gpipe", "loopedbfs"):  # every forward before the first backward: all m held
        flight, fnote = float(m), f"{'GPipe' if sched == 'gpipe' else 'looped BFS'}: m = {m} microbatches"
    elif sched in ("interleaved1f1b", "interleavedzerobubble"):
        v = max(spec.virtual_stages, 1)
        flight, fnote = pp * (1 + (pp - 1) / (pp * v)), f"interleaved: p(1+(p-1)/(pv)), v = {v}"
    else:
        flight, fnote = float(min(pp, m)), f"1F1B: min(p, m) = {min(pp, m)}"
    rows.append(("activations", per_mb * flight + extra,
                 f"{note}; b = {b:.3g}, s = {s}, h = {h}, {layers:.3g} layers/stage, /tp; {fnote}"))
    return pd.DataFrame(rows, columns=["component", "bytes", "formula"])


STATES = {"parameters": "param_bytes", "gradients": "grad_bytes", "optimizer state": "optimizer_bytes"}


def states_vs_tensors(model: pd.DataFrame, per_rank: pd.DataFrame) -> pd.DataFrame | None:
    """The model's parameters, gradients and optimizer state per device against the bytes measured from
    each rank's tensors (``memory.param_bytes`` ...; local shards, each storage once): ``component``,
    ``model_bytes``, ``measured_max``, ``measured_min`` (over ranks) and ``error`` = measured max / model
    - 1 (the model is per device at the worst stage, so the max rank is its counterpart). None when no
    rank measured its tensors."""
    rows = []
    for component, col in STATES.items():
        if col not in per_rank:
            return None
        measured = pd.to_numeric(per_rank[col], errors="coerce")
        measured = measured[measured >= 0]
        hit = model.loc[model["component"] == component, "bytes"]
        if measured.empty or hit.empty:
            return None
        m = float(hit.iloc[0])
        rows.append((component, m, float(measured.max()), float(measured.min()),
                     float(measured.max()) / m - 1 if m > 0 else float("nan")))
    return pd.DataFrame(rows, columns=["component", "model_bytes", "measured_max", "measured_min", "error"])
