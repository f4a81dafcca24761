"""The collective model of the synthetic store: which collectives one rank issues per step, with what
sizes, on which groups and links, and how long they take. See ``tests.support.store`` for the whole model.

Sizes follow docs/formulas.md: DDP all-reduces the bf16 gradients in 25 MiB buckets; FSDP all-gathers
each unit's bf16 parameters (forward, and again in backward unless pipelined) and reduce-scatters its fp32
gradients; TP all-reduces B_micro·S·D activations twice in forward and twice in backward per layer and
microbatch; PP sends and receives one activation (gradient) tensor per F (B) span and stage boundary.
Timing: a collective starts on each member when that member reaches it (its own compute progress) and
ends on all members together, a transfer time after the last one arrived; the transfer is size x busbw
factor / link busbw (NVLink within a host, InfiniBand across), plus latency. So early ranks wait
(arrival skew) and a slow link slows every member of its groups alike.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from meshscope.dashboard.analysis import busbw_factor

if TYPE_CHECKING:
    import pandas as pd

    from tests.support.store import SyntheticConfig

MESH_ORDER = ("pp", "dp", "fsdp", "tp")  # outermost to innermost: tp stays within a host
BUSBW = {"intra": 200e9, "inter": 45e9, "p2p_inter": 22e9}  # bytes/s, nominal
LATENCY_S = 20e-6


def coords_of(cfg: SyntheticConfig) -> np.ndarray:
    """Rank -> coordinate per MESH_ORDER dim (row-major, tp innermost), shape (world, 4)."""
    shape = [cfg.degree(d) for d in MESH_ORDER]
    return np.stack(np.unravel_index(np.arange(cfg.world_size), shape), axis=1)


def group_of(cfg: SyntheticConfig, *, coords: np.ndarray, rank: int, dim: str) -> tuple[str, list[int]]:
    """The rank's group on ``dim``: its name and member ranks (all coords equal except ``dim``)."""
    i = MESH_ORDER.index(dim)
    mask = np.all(np.delete(coords, i, axis=1) == np.delete(coords[rank], i), axis=1)
    members = np.flatnonzero(mask).tolist()
    others = [d for d in MESH_ORDER if d != dim]
    gid = int(np.ravel_multi_index(tuple(coords[rank][MESH_ORDER.index(d)] for d in others),
                                   tuple(cfg.degree(d) for d in others)))
    return f"{dim}:{gid}", members


@dataclass(slots=True)
class Op:
    """One collective (or P2P op) a rank issues every step."""

    op: str
    dim: str
    group: str
    group_size: int
    nbytes: float
    pos: float  # issue time as a fraction of the rank's pipeline time in the step
    exposed: float  # fraction of the duration the training thread waits
    peer: int
    source: str
    bw: float
    slow: bool = False  # on a group or link of the injected link straggler
    sync: bool = False  # the gradient sync that absorbs cross-rank waiting
    index: int = 0  # position among this rank's ops on the same group in a step (-> seq)
    per_group: int = 1  # ops per step on that group

    @property
    def key(self) -> tuple[str, int] | None:
        """Identifies the same collective on every member of its group (None for P2P)."""
        return (self.group, self.index) if self.peer < 0 else None


def rank_ops(cfg: SyntheticConfig, *, coords: np.ndarray, rank: int, model: dict,
             template: pd.DataFrame | None) -> list[Op]:
    """The collectives one rank issues per step, in issue order."""
    tp, pp, fsdp = cfg.degree("tp"), cfg.degree("pp"), cfg.degree("fsdp")
    local_params = model["n_params"] / (tp * pp)
    layers = model["n_layers"] // pp
    mbs = cfg.microbatches if pp > 1 else 1
    b_micro = cfg.batch / (cfg.degree("dp") * fsdp) / mbs
    act_bytes = b_micro * model["seq_len"] * model["d_model"] * 2
    strag = cfg.straggler.rank if cfg.straggler and cfg.straggler.cause == "link" else None
    hosts = lambda ranks: {r // cfg.gpus_per_host for r in ranks}  # noqa: E731
    ops: list[Op] = []

    def add(op, dim, total, count, *, pos, exposed, source, peer=-1, group=None, sync=False):
        name, members = group or group_of(cfg, coords=coords, rank=rank, dim=dim)
        inter = len(hosts(members + ([peer] if peer >= 0 else []))) > 1
        bw = (BUSBW["p2p_inter"] if peer >= 0 else BUSBW["inter"]) if inter else BUSBW["intra"]
        slow = strag is not None and inter and (strag in members if peer < 0 else strag in (rank, peer))
        n = max(1, min(count, cfg.max_ops_per_group))
        for i in range(n):
            p_ = pos(i, n)
            ops.append(Op(op, dim, name, len(members), total / n, p_, exposed(i, n), peer, source, bw, slow,
                           sync and i == n - 1))

    if cfg.degree("tp") > 1:
        count = 4 * layers * mbs
        add("all_reduce", "tp", 4 * layers * mbs * act_bytes / tp, count, pos=lambda i, n: (i + 0.5) / n,
            exposed=lambda i, n: 1.0, source="funcol")
    if pp > 1:
        name, members = group_of(cfg, coords=coords, rank=rank, dim="pp")
        stage = coords[rank][MESH_ORDER.index("pp")]
        n_stages = pp * cfg.vstages
        span = template[template["rank"] == stage]
        makespan = template["t_end"].max()
        for row in span.itertuples():
            fwd = row.kind == "forward"
            if row.kind == "weight":
                continue
            for op, at, nxt in (("recv", row.t_start, row.stage - 1 if fwd else row.stage + 1),
                                ("send", row.t_end, row.stage + 1 if fwd else row.stage - 1)):
                if 0 <= nxt < n_stages:
                    peer = members[nxt % pp]
                    add(op, "pp", act_bytes / tp, 1, pos=lambda i, n, at=at: at / makespan,
                        exposed=lambda i, n: 0.05, source="c10d", peer=peer, group=(name, members))
    if fsdp > 1:
        units = layers
        ag = 2 * local_params  # bf16 parameters, all-gather output = the full unit
        phases = [("all_gather", 0.0, 1 / 3)] if pp > 1 else [("all_gather", 0.0, 1 / 3),
                                                              ("all_gather", 1 / 3, 1.0)]
        for op, a, b in phases:
            add(op, "fsdp", ag, units, pos=lambda i, n, a=a, b=b: a + (b - a) * i / n,
                exposed=lambda i, n: 1.0 if i == 0 else 0.15, source="fsdp_comm")
        # fp32 gradient reduce-scatter (FSDP2 default reduce dtype), the last one right after backward.
        add("reduce_scatter", "fsdp", 4 * local_params, units, pos=lambda i, n: 1 / 3 + 2 / 3 * (i + 1) / n,
            exposed=lambda i, n: 0.2, source="fsdp_comm", sync=cfg.degree("dp") == 1)
    if cfg.degree("dp") > 1:
        grads = 2 * local_params / fsdp
        buckets = math.ceil(grads / (25 * 2**20))  # DDP's default 25 MiB buckets
        add("all_reduce", "dp", grads, buckets, pos=lambda i, n: 1 / 3 + 2 / 3 * (i + 1) / n,
            exposed=lambda i, n: 1.0 if i == n - 1 else 0.1,
            source="ddp_comm_hook" if fsdp == 1 else "fsdp_comm", sync=True)
    ops.sort(key=lambda o: o.pos)
    if ops and not any(o.sync for o in ops):
        ops[-1].sync = True
    counts: dict[str, int] = {}
    for o in ops:  # the order of ops on a group is the same on all its members
        o.index = counts.get(o.group, 0)
        counts[o.group] = o.index + 1
    for o in ops:
        o.per_group = counts[o.group]
    return ops


def transfers(cfg: SyntheticConfig, *, ops: list[Op], rank: int, steps: int) -> np.ndarray:
    """Per step and op: the transfer time once every member has arrived: size x busbw factor / link
    busbw, plus latency and 5 % one-sided noise, slowed by the link straggler's factor on its groups.
    A collective's draws depend only on its group and position, so all members see the same transfer."""
    out = np.empty((steps, len(ops)))
    for j, o in enumerate(ops):
        seed = [cfg.seed, 1, zlib.crc32(o.group.encode()), o.index] if o.key else [cfg.seed, 2, rank, j]
        noise = np.abs(np.random.default_rng(seed).standard_normal(steps))
        slow = cfg.straggler.factor if (o.slow and cfg.straggler) else 1.0
        out[:, j] = (LATENCY_S + o.nbytes * busbw_factor(o.op, o.group_size) / o.bw) * slow * (1 + 0.05 * noise)
    return out
