"""A realistic synthetic run store, in exactly the agent's layout and schema, for tests, demos and the
dashboard benchmark: ``write_store(root, config=SyntheticConfig(...))``.

What is modelled (one optimizer step, synchronous training, per rank):
- Compute from the model's FLOPs: flops_per_token = 6·N_ne + 12·L·D·S, split evenly over ranks, run at
  ``efficiency`` x peak; forward 1/3, backward 2/3; 1 % noise per rank and step.
- Pipeline spans from ``pipeline_sim`` for the schedule (GPipe / 1F1B / interleaved / zero-bubble), so
  the measured bubble has the shape of the real schedule.
- Collectives per rank and step for each mesh dim: DDP gradient buckets (all-reduce), FSDP per-unit
  all-gathers and reduce-scatters, TP all-reduces (2 forward + 2 backward per layer and microbatch), PP
  send/recv around every F and B span. Sizes follow docs/formulas.md; durations follow size / busbw of
  the link (NVLink within a host, InfiniBand across). Ops of one kind on one group beyond
  ``max_ops_per_group`` per step are merged (sizes and times summed), which keeps a 1,024-rank store
  small while keeping per-step totals.
- Synchronisation: a collective starts on each member when it gets there and ends on all members a
  transfer time after the last arrival (so early ranks wait: arrival skew). Every rank's step takes the
  slowest rank's time; a faster rank spends the rest waiting in its gradient sync (exposed comm).
- Files as the agent writes them: partition keys dropped from the files, its Parquet encodings.
- Memory from ``memory_model`` plus allocator overhead; NVML-like GPU samples per host and GPU.
- An injectable straggler: ``cause="compute"`` (slower compute), ``"throttle"`` (slower compute and its
  GPU reports thermal slowdown and low clocks) or ``"link"`` (collectives on its inter-host groups and its
  P2P ops run ``factor`` slower for every member).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from meshscope.agent.store import packs
from meshscope.agent.store.schema import stored_schema
from meshscope.agent.contract import DIMS, SCHEMAS
from meshscope.agent.contract import strategy_name
from meshscope.dashboard import pipeline_sim
from meshscope.agent.contract import mfu, normalize_schedule
from meshscope.agent.contract.storelayout import StoreLayout
from meshscope.dashboard.analysis import busbw_factor
from meshscope.dashboard.memory_model import ModelSpec, memory_model
from tests.support.comm import MESH_ORDER, coords_of, rank_ops, transfers

MODELS: dict[str, dict] = {  # Llama-3-shaped presets (parameters with and without embeddings)
    "llama-1b": dict(n_params=1.24e9, n_params_nonembedding=0.97e9, n_layers=16, d_model=2048, seq_len=2048),
    "llama-8b": dict(n_params=8.03e9, n_params_nonembedding=7.50e9, n_layers=32, d_model=4096, seq_len=4096),
    "llama-70b": dict(n_params=70.6e9, n_params_nonembedding=69.5e9, n_layers=80, d_model=8192, seq_len=4096),
}
PEAK_FLOPS = 989e12  # H100 SXM bf16 dense
GPU_MEMORY = 80 * 2**30
THERMAL = 0x20 | 0x40
SW_POWER_CAP = 0x4


@dataclass(frozen=True, slots=True, kw_only=True)
class Straggler:
    rank: int
    factor: float = 1.3
    cause: str = "compute"  # "compute" | "throttle" | "link"

    def __post_init__(self) -> None:
        if self.cause not in ("compute", "throttle", "link"):
            raise ValueError(f"straggler cause must be compute, throttle or link, not {self.cause!r}")
        if self.factor < 1.0:
            raise ValueError(f"straggler factor ({self.factor}) must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticConfig:
    run: str = "synthetic"
    mesh: dict[str, int] = field(default_factory=lambda: {"dp": 8})
    steps: int = 50
    model: str = "llama-1b"
    schedule: str = "1F1B"
    microbatches: int = 4
    virtual_stages: int = 1
    global_batch: int | None = None  # sequences per step; default 2 per replica and microbatch
    efficiency: float = 0.55  # achieved FLOP/s during compute spans / peak
    straggler: Straggler | None = None
    gpus_per_host: int = 8
    max_ops_per_group: int = 8
    t0: float = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    seed: int = 0
    warmup: float = 1.0  # step 0 takes about this many steady steps (host time: allocations, first calls)
    # "parts": one file per (kind, rank), as the agent writes before packing; "packs": one pack per (kind,
    # host) of gpus_per_host ranks (agent.store.packs), as packing agents on each host leave it.
    layout: str = "parts"

    def __post_init__(self) -> None:
        if self.layout not in ("parts", "packs"):
            raise ValueError(f"layout must be parts or packs, not {self.layout!r}")
        unknown = set(self.mesh) - set(MESH_ORDER)
        if unknown:
            raise ValueError(f"mesh dims {sorted(unknown)} not among {MESH_ORDER} (schema dims: {DIMS})")
        if any(int(d) < 1 for d in self.mesh.values()):
            raise ValueError(f"mesh degrees must be >= 1: {self.mesh}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; expected one of {', '.join(MODELS)}")
        if self.steps < 1:
            raise ValueError(f"steps ({self.steps}) must be >= 1")
        if self.warmup < 1.0:
            raise ValueError(f"warmup ({self.warmup}) must be >= 1")
        if self.degree("pp") > 1:
            pipeline_sim.simulate(schedule=self.schedule, p=1, m=1)  # validates the schedule name
            if MODELS[self.model]["n_layers"] % (self.degree("pp") * self.vstages):
                raise ValueError(f"n_layers must divide into pp ({self.degree('pp')}) x v ({self.vstages})")
        if self.straggler and not 0 <= self.straggler.rank < self.world_size:
            raise ValueError(f"straggler rank {self.straggler.rank} outside world size {self.world_size}")

    def degree(self, dim: str) -> int:
        return int(self.mesh.get(dim, 1))

    @property
    def world_size(self) -> int:
        return math.prod(self.degree(d) for d in MESH_ORDER)

    @property
    def vstages(self) -> int:
        return self.virtual_stages if "interleaved" in self.schedule.lower() else 1

    @property
    def strategy(self) -> str:
        fsdp, dp = self.degree("fsdp") > 1, self.degree("dp") > 1
        kind = "hsdp" if fsdp and dp else "fsdp" if fsdp else "ddp" if dp else ""
        return strategy_name(dp=kind, tp=self.degree("tp"), pp=self.degree("pp")) if kind or self.world_size > 1 else "ddp"

    @property
    def batch(self) -> int:
        m = self.microbatches if self.degree("pp") > 1 else 1
        return self.global_batch or 2 * m * self.degree("dp") * self.degree("fsdp")


def write_store(root: str | Path, *, config: SyntheticConfig) -> dict[str, int]:
    """Write one synthetic run under ``root`` (created if missing). Returns rows written per kind."""
    cfg, root = config, Path(root)
    model = MODELS[cfg.model]
    R, K, pp = cfg.world_size, cfg.steps, cfg.degree("pp")
    coords = coords_of(cfg)
    rng = np.random.default_rng([cfg.seed, 0])
    tokens_global = cfg.batch * model["seq_len"]
    flops_per_token = 6 * model["n_params_nonembedding"] + 12 * model["n_layers"] * model["d_model"] * model[
        "seq_len"]
    flops_rank = flops_per_token * tokens_global / R
    compute_base = flops_rank / (PEAK_FLOPS * cfg.efficiency)

    slow = np.ones((R, 1))
    if cfg.straggler and cfg.straggler.cause in ("compute", "throttle"):
        slow[cfg.straggler.rank] = cfg.straggler.factor
    compute = compute_base * (1 + 0.01 * rng.standard_normal((R, K))) * slow
    template, makespan = None, 1.0
    if pp > 1:
        m, v = cfg.microbatches, cfg.vstages
        zb = "zerobubble" in normalize_schedule(cfg.schedule)
        unit = 1.0 / (3 * m * v)  # per-chunk forward, so that a rank's spans sum to 1
        template = pipeline_sim.simulate(schedule=cfg.schedule, p=pp, m=m, v=v, f=unit,
                                         b=unit if zb else 2 * unit, w=unit if zb else 0.0)
        makespan = float(template["t_end"].max())
    pipe = compute * makespan
    data = 0.004 * (1 + 0.25 * np.abs(rng.standard_normal((R, K))))
    data[:, 0] += (cfg.warmup - 1.0) * float(np.median(pipe.max(axis=0) + data.max(axis=0)))
    optim = 0.02 * compute_base * (1 + 0.01 * rng.standard_normal((R, K)))
    other = data + optim

    # Pass 1: when each collective ends (the last member's arrival + transfer), and so how long every
    # rank waits; the step then takes the slowest rank's time.
    ops = [rank_ops(cfg, coords=coords, rank=r, model=model, template=template) for r in range(R)]
    last: dict[tuple[str, int], np.ndarray] = {}  # per collective: last arrival, relative to step start
    for r in range(R):
        for o in ops[r]:
            if o.key:
                arrive = data[r] + o.pos * pipe[r]
                last[o.key] = np.maximum(last[o.key], arrive) if o.key in last else arrive
    timing = lambda r: _timing(cfg, ops=ops[r], rank=r, K=K, last=last, data=data[r], pipe=pipe[r])  # noqa: E731
    # Recomputed in pass 2 (the draws are seeded) rather than kept: 1,024 ranks' timings would be ~0.7 GB.
    base_wait = np.array([timing(r)[3].sum(axis=1) for r in range(R)])
    need = other + pipe + base_wait
    wall = need.max(axis=0)
    extra = wall - need  # time a faster rank waits for the slowest one (in its gradient sync)
    t_step = cfg.t0 + np.concatenate([[0.0], np.cumsum(wall)[:-1]])
    t_end_run = float(t_step[-1] + wall[-1])

    spec = ModelSpec(n_params=model["n_params"], n_layers=model["n_layers"], d_model=model["d_model"],
                     seq_len=model["seq_len"], global_batch=cfg.batch, strategy=cfg.strategy, mesh=dict(cfg.mesh),
                     schedule=cfg.schedule if pp > 1 else "", microbatches=cfg.microbatches if pp > 1 else 1,
                     virtual_stages=cfg.vstages)
    mm = memory_model(spec).set_index("component")["bytes"]
    mem_static, mem_act = float(mm.drop("activations").sum()), float(mm["activations"])

    rows = dict.fromkeys(SCHEMAS, 0)
    part = "part-00000.parquet"
    sink = _Sink(StoreLayout.of(root), run=cfg.run, packs=cfg.layout == "packs")
    steps = np.arange(K)
    dp_total = cfg.degree("dp") * cfg.degree("fsdp")
    loss_curve = 2.2 + 8.0 * np.exp(-steps / (0.3 * K + 1))
    lr = np.where(steps < 0.1 * K, 3e-4 * (steps + 1) / (0.1 * K + 1),
                  3e-4 * 0.5 * (1 + np.cos(np.pi * steps / K)))
    for r in range(R):
        rr = np.random.default_rng([cfg.seed, 2, r])
        stage = int(coords[r][MESH_ORDER.index("pp")])
        bubble = pipe[r] - compute[r]
        has_ops = bool(ops[r])
        exposed = base_wait[r] + (extra[r] if has_ops else 0.0)
        oth = other[r] + (0.0 if has_ops else extra[r])  # no collective to wait in: idle counts as other
        loss = loss_curve * (1 + 0.01 * rr.standard_normal(K))
        if pp > 1 and stage != pp - 1:
            loss = np.full(K, np.nan)  # only the last stage computes the loss
        if r % cfg.gpus_per_host == 0:
            sink.flush()  # one pack per host and kind
        rows["step"] += sink.put("step", r, part, table={
            "step": steps, "t_start": t_step, "t_end": t_step + wall, "wall_s": wall,
            "compute_s": compute[r], "exposed_comm_s": exposed, "bubble_s": bubble, "other_s": oth,
            "data_s": data[r], "forward_s": compute[r] / 3, "backward_s": compute[r] * 2 / 3,
            "optimizer_s": optim[r], "tokens": np.full(K, tokens_global // dp_total),
            "flops": np.full(K, flops_rank), "mfu": np.array([mfu(flops=flops_rank, seconds=w, peak_flops=PEAK_FLOPS) for w in wall]), "loss": loss,
            "loss_nonfinite": np.zeros(K, bool), "grad_norm": 1.0 + 0.2 * np.abs(rr.standard_normal(K)),
            "lr": lr, "skipped": np.zeros(K, bool), "n_collectives": np.full(K, len(ops[r])),
            "dropped_records_total": np.zeros(K, np.int64),
            "cpu_s": compute[r] + oth, "cpu_wait_s": np.zeros(K)})
        if has_ops:
            rows["collective"] += sink.put("collective", r, part, table=_collectives(
                ops[r], timing=timing(r), K=K, t_step=t_step, extra=extra[r]))
        if template is not None:
            rows["span"] += sink.put("span", r, part, table=_spans(
                template[template["rank"] == stage], t_step=t_step, t_offset=data[r], scale=compute[r]))
        peak = (mem_static + mem_act) * 1.04 * (1 + 0.005 * np.abs(rr.standard_normal(K)))
        reserved = peak * 1.08
        rows["memory"] += sink.put("memory", r, part, table={
            "step": steps, "t": t_step + wall, "rss_bytes": np.full(K, 6 * 2**30), "rss_peak_bytes": np.full(
                K, 7 * 2**30), "allocated_bytes": np.full(K, mem_static * 1.01, dtype=np.int64),
            "allocated_peak_bytes": peak.astype(np.int64), "reserved_bytes": reserved.astype(np.int64),
            "reserved_peak_bytes": reserved.astype(np.int64),
            "active_bytes": np.full(K, mem_static * 1.01, dtype=np.int64),
            "active_peak_bytes": peak.astype(np.int64), "alloc_retries": np.zeros(K, np.int64),
            "ooms": np.zeros(K, np.int64), "device_total_bytes": np.full(K, GPU_MEMORY),
            "device_free_bytes": (GPU_MEMORY - reserved - 600 * 2**20).clip(0).astype(np.int64),
            **{c: np.full(K, -1, np.int64) for c in ("param_bytes", "grad_bytes", "optimizer_bytes")}})
        rows["run"] += sink.put("run", r, part, table=_run_row(cfg, rank=r, coord=coords[r], model=model,
                                                                      flops_per_token=flops_per_token))
        rows["event"] += sink.put("event", r, part, table={
            "t": [cfg.t0, t_end_run], "step": [0, K - 1], "kind": ["start", "end"],
            "message": ["synthetic run started", "synthetic run finished"]})
    sink.flush()
    rows["gpu"] = _gpu_samples(cfg, sink, t0=cfg.t0, t1=t_end_run, busy=float(np.median(compute / wall)),
                               mem_used=(mem_static + mem_act) * 1.12)
    return rows


class _Sink:
    """Where the generator's tables go: a part file each, or (``packs``) gathered per kind until ``flush``
    writes one pack of them (``agent.store.packs.write_tables``, the agent's own pack writer)."""

    def __init__(self, layout: StoreLayout, *, run: str, packs: bool) -> None:
        self.layout, self.run, self.packs = layout, run, packs
        self._held: dict[str, list[tuple[int, str, pa.Table]]] = {}

    def put(self, kind: str, rank: int, part: str, *, table: dict, stream: str = "") -> int:
        """``stream``: the spool stream the rows came from (default: the rank's own, ``syn<rank>``)."""
        if not self.packs:
            return _put(self.layout, kind, self.run, rank, part, table)
        schema = stored_schema(kind)
        t = pa.Table.from_pydict({f.name: table[f.name] for f in schema}, schema=schema)
        self._held.setdefault(kind, []).append((rank, stream or f"syn{rank}", t))
        return len(t)

    def flush(self) -> None:
        for kind, held in self._held.items():
            packs.write_tables(Path(self.layout.packs(kind, self.run)), kind=kind,
                               tables=[packs.ranked(t, rank=r, stream=st) for r, st, t in held],
                               ranges=[(r, st, 0, max(len(t), 1)) for r, st, t in held])
        self._held.clear()


def _put(layout: StoreLayout, kind: str, run: str, rank: int, part: str, table: dict) -> int:
    """Write one part file, rows in step order, one row group. (Row groups of ~100 steps were measured
    too: they let a step window skip data, but the larger footers cost more per file than they saved.)"""
    path = Path(layout.partition(kind, run=run, rank=rank)) / part
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = stored_schema(kind)  # as the agent stores it: partition keys (the run kind's rank) dropped
    # The agent's encodings (agent.store.parts): dictionaries for strings, byte-stream-split floats,
    # statistics only for the step and time columns (which also keeps the footers small).
    strings = [f.name for f in schema if pa.types.is_string(f.type)]
    floats = [f.name for f in schema if pa.types.is_floating(f.type)]
    stats = [c for c in ("step", "t_start", "t", "t_end") if c in schema.names]
    pq.write_table(pa.Table.from_pydict({f.name: table[f.name] for f in schema}, schema=schema), path,
                   compression="zstd", use_dictionary=strings, use_byte_stream_split=floats, write_statistics=stats)
    return len(next(iter(table.values())))


def _timing(cfg: SyntheticConfig, *, ops, rank: int, K: int, last: dict, data, pipe) -> tuple[np.ndarray, ...]:
    """(start, end, duration, wait) per step and op, relative to the step start, before the gradient sync
    absorbs the cross-rank slack. Waiting for late peers counts as exposed only as far as the op is."""
    if not ops:
        return (np.zeros((K, 0)),) * 4
    xfer = transfers(cfg, ops=ops, rank=rank, steps=K)
    start = data[:, None] + np.array([o.pos for o in ops])[None, :] * pipe[:, None]
    ready = np.column_stack([last[o.key] if o.key else start[:, j] for j, o in enumerate(ops)])
    end = ready + xfer
    wait = (end - start) * np.array([o.exposed for o in ops])[None, :]
    return start, end, end - start, wait


def _collectives(ops, *, timing, K: int, t_step, extra) -> dict:
    start, end, dur, wait = (x.copy() for x in timing)
    sync = np.array([o.sync for o in ops])
    # A faster rank waits in its gradient sync for the slowest rank: that op ends later for it.
    for x in (end, dur, wait):
        x[:, sync] += extra[:, None]
    nbytes = np.array([int(o.nbytes) for o in ops])
    seq = np.arange(K)[:, None] * np.array([o.per_group for o in ops])[None, :] + np.array([o.index for o in ops])
    algbw = nbytes[None, :] / dur
    factor = np.array([busbw_factor(o.op, o.group_size) for o in ops])
    rep = lambda values: np.tile(np.asarray(values), K)  # noqa: E731  (per-op constant, repeated per step)
    return {
        "step": np.repeat(np.arange(K), len(ops)), "op": rep([o.op for o in ops]), "dim": rep([o.dim for o in ops]),
        "group": rep([o.group for o in ops]), "group_size": rep([o.group_size for o in ops]),
        "seq": seq.ravel(), "bytes": rep(nbytes), "t_start": (t_step[:, None] + start).ravel(),
        "t_end": (t_step[:, None] + end).ravel(), "duration_s": dur.ravel(), "wait_s": wait.ravel(),
        "algbw": algbw.ravel(), "busbw": (algbw * factor[None, :]).ravel(), "peer": rep([o.peer for o in ops]),
        "source": rep([o.source for o in ops]), "mesh_dim": rep([o.dim for o in ops])}


def _spans(tpl, *, t_step, t_offset, scale) -> dict:
    K, n = len(t_step), len(tpl)
    base = (t_step + t_offset)[:, None]
    return {"step": np.repeat(np.arange(K), n), "stage": np.tile(tpl["stage"].to_numpy(), K),
            "microbatch": np.tile(tpl["microbatch"].to_numpy(), K), "kind": np.tile(tpl["kind"].to_numpy(), K),
            "t_start": (base + tpl["t_start"].to_numpy()[None, :] * scale[:, None]).ravel(),
            "t_end": (base + tpl["t_end"].to_numpy()[None, :] * scale[:, None]).ravel()}


def _run_row(cfg: SyntheticConfig, *, rank: int, coord, model: dict, flops_per_token: float) -> dict:
    pp = cfg.degree("pp")
    return {k: [v] for k, v in {
        "rank": rank, "world_size": cfg.world_size, "local_rank": rank % cfg.gpus_per_host,
        "host": f"node{rank // cfg.gpus_per_host:04d}", "pid": 10_000 + rank, "attempt": 0, "t_start": cfg.t0,
        "strategy": cfg.strategy, "mesh": json.dumps({d: cfg.degree(d) for d in MESH_ORDER if d in cfg.mesh}),
        "coords": json.dumps({d: int(c) for d, c in zip(MESH_ORDER, coord) if d in cfg.mesh}),
        "schedule": cfg.schedule if pp > 1 else "", "microbatches": cfg.microbatches if pp > 1 else 1,
        "virtual_stages": cfg.vstages, "model": cfg.model, "n_params": int(model["n_params"]),
        "n_params_nonembedding": int(model["n_params_nonembedding"]), "n_layers": model["n_layers"],
        "d_model": model["d_model"], "seq_len": model["seq_len"], "global_batch": cfg.batch,
        "flops_per_token": flops_per_token, "flops_method": "model shape: 6*N + 12*L*D*S (synthetic)",
        "peak_flops": PEAK_FLOPS, "peak_source": "table:H100", "device": "NVIDIA H100 80GB HBM3", "backend": "nccl", "dtype": "bfloat16", "torch_version": "2.13.0",
        "meshscope_version": "0.1.0", "python_version": "3.11.2",
        "config": json.dumps({"synthetic": True, "seed": cfg.seed, "activation_checkpoint": False}),
        "environment": json.dumps({"cuda": "12.8", "nccl": "2.26.2", "driver": "570.124.06", "cpu": "synthetic",
                                   "flags": {"NCCL_ALGO": "Ring"}}),
    }.items()}


def _gpu_samples(cfg: SyntheticConfig, sink: _Sink, *, t0: float, t1: float, busy: float, mem_used: float) -> int:
    """NVML-like samples, one file per host (as one agent per host would write), every ~2 steps."""
    n_samples = max(2, cfg.steps // 2)
    t = np.linspace(t0, t1, n_samples)
    strag = cfg.straggler if cfg.straggler and cfg.straggler.cause == "throttle" else None
    total = 0
    for h in range(math.ceil(cfg.world_size / cfg.gpus_per_host)):
        rr = np.random.default_rng([cfg.seed, 3, h])
        host = f"node{h:04d}"
        gpus = [g for g in range(cfg.gpus_per_host) if h * cfg.gpus_per_host + g < cfg.world_size]
        cols: dict[str, list] = {f.name: [] for f in SCHEMAS["gpu"]}
        for g in gpus:
            hot = strag is not None and strag.rank == h * cfg.gpus_per_host + g
            noise = rr.standard_normal((5, n_samples))
            clock = 1.755e9 * (1 + 0.005 * noise[0]) / (strag.factor if hot else 1.0)
            reasons = np.where(rr.random(n_samples) < 0.03, SW_POWER_CAP, 0)
            if hot:
                reasons = np.where(rr.random(n_samples) < 0.9, THERMAL | SW_POWER_CAP, reasons)
            util = np.clip(busy + 0.03 * noise[1], 0, 1)
            cols["t"] += t.tolist()
            cols["host"] += [host] * n_samples
            cols["gpu"] += [g] * n_samples
            cols["uuid"] += [f"GPU-{h:04x}{g:04x}-synthetic"] * n_samples
            cols["name"] += ["NVIDIA H100 80GB HBM3"] * n_samples
            cols["util_ratio"] += util.tolist()
            cols["mem_util_ratio"] += np.clip(0.35 + 0.05 * noise[2], 0, 1).tolist()
            cols["mem_used_bytes"] += [int(min(mem_used, GPU_MEMORY))] * n_samples
            cols["mem_total_bytes"] += [GPU_MEMORY] * n_samples
            cols["power_watts"] += (700 * (0.45 + 0.45 * util) * (0.85 if hot else 1.0)).tolist()
            cols["temperature_celsius"] += ((89.0 if hot else 64.0) + 2 * noise[3]).tolist()
            cols["sm_clock_hz"] += clock.tolist()
            cols["sm_clock_max_hz"] += [1.98e9] * n_samples
            cols["throttle_reasons"] += reasons.tolist()
            cols["xid_errors_total"] += [0] * n_samples
            cols["ecc_errors_total"] += [0] * n_samples
        total += sink.put("gpu", -1, f"part-{host}.parquet", table=cols, stream=f"gpu-{host}")
        sink.flush()
    return total


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.support.store --out DIR [--mesh pp=2,fsdp=4] ...``"""
    ap = argparse.ArgumentParser(prog="python -m tests.support.store", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--run", default="synthetic")
    ap.add_argument("--mesh", default="dp=8", help="comma-separated dim=degree, dims among pp,dp,fsdp,tp")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--model", default="llama-1b", choices=sorted(MODELS))
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--straggler", default=None, help="rank:factor:cause, e.g. 3:1.3:throttle")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    mesh = {k: int(v) for k, v in (kv.split("=") for kv in a.mesh.split(","))}
    strag = None
    if a.straggler:
        r, f, c = a.straggler.split(":")
        strag = Straggler(rank=int(r), factor=float(f), cause=c)
    cfg = SyntheticConfig(run=a.run, mesh=mesh, steps=a.steps, model=a.model, schedule=a.schedule,
                          microbatches=a.microbatches, virtual_stages=a.virtual_stages, straggler=strag,
                          seed=a.seed)
    rows = write_store(a.out, config=cfg)
    print(json.dumps({"store": a.out, "run": a.run, "world_size": cfg.world_size, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

