"""A job's parallel layout and its model FLOPs, read off the structure it built: the module wrappers
(``DistributedDataParallel``, FSDP2's ``fully_shard`` and composable ``replicate``), the DeviceMesh its
parameters live on, the pipeline schedules it stepped, and its modules' parameter shapes.

Nothing here runs inside the job's forward or backward: it reads attributes, once, at the end of the first
step. What it cannot tell is left out and said (``Flops.reason``), never guessed and never raised into the
job (the driver counts a failure as a ``telemetry_error``).

Layout rules (the contract's vocabulary, ``agent.contract.formulas``):
- data parallel: FSDP2's mesh says it — shard > 1 and replicate > 1 is ``hsdp``, shard > 1 ``fsdp``,
  replicate > 1 with shard 1 ``ddp`` (torchtitan applies ``fully_shard`` even with a shard degree of 1);
  a ``DistributedDataParallel`` wrapper or composable ``replicate`` is ``ddp``;
- tensor parallel: a parameter that is a DTensor on a mesh dim FSDP does not own (FSDP's sharded parameters
  are DTensors on FSDP's own dims);
- context / expert parallel: a dim of the job's root mesh named ``cp`` / ``ep`` of size > 1;
- pipeline: a schedule stepped (``detect.pipeline``).

FLOPs (``agent.contract.formulas.training_flops_per_token``): N is every parameter of a module other than
an ``nn.Embedding`` (a lookup; an output head tied to it is a matmul, counted), counted on the shapes this rank computes with: FSDP gathers its shards (the
global shape), tensor parallelism splits a matmul (the global shape over the TP degree when the parameter
is sharded on a TP dim); MoE experts count top-k of E. Attention adds 12·L·D·S, L the outermost modules
named ``*Attention*``, D
the input width of their output projection (heads × head dim).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from meshscope.agent.contract.formulas import strategy_name, training_flops_per_token
from meshscope.agent.instrument.meshinfo import DIM_ALIASES

# How a mesh dim name reads: by its ``_``-separated words, so "dp_replicate" is data parallel although
# "rep" holds "ep".
_DIM_WORDS = {"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep"}
# an attention's output and query projections, by the names models give them
_OUT_NAMES = ("wo", "o_proj", "out_proj", "c_proj", "proj", "dense", "to_out", "o")
_Q_NAMES = ("wq", "q_proj", "query", "q", "to_q")


def dim_kind(name: str) -> str:
    """tp / pp / cp / ep / dp for a mesh dim name (``dp_shard``, ``dp_replicate``, ``fsdp``: dp): the known
    names first (torchtitan's ``dp_shard_cp`` is FSDP's group, not cp), else the words of the name."""
    known = DIM_ALIASES.get((name or "").lower())
    if known is not None:
        return known if known in _DIM_WORDS else "dp"
    words = [w for w in re.split(r"[^a-z0-9]+", (name or "").lower()) if w]
    return next((_DIM_WORDS[w] for w in words if w in _DIM_WORDS), "dp")


@dataclass(slots=True)
class JobLayout:
    """What the job's structure says: the data-parallel kind, the degree of each dimension, the job's root
    DeviceMesh (its dim names label the collectives) and this rank's coordinate per dimension."""

    dp_kind: str = ""  # "", ddp, fsdp, hsdp
    sizes: dict = field(default_factory=lambda: {"dp": 1, "tp": 1, "pp": 1})
    coords: dict = field(default_factory=lambda: {"dp": 0, "tp": 0, "pp": 0})
    mesh: Any = None  # the meshes that name the job's dims (``_meshes``)
    fsdp_dims: tuple = ()  # the mesh dim names FSDP2 owns (its parameters are DTensors on them too)
    tp_dims: tuple = ()  # the dims a parameter is split on for compute

    def strategy(self, *, world_size: int) -> str:
        s = self.sizes
        return strategy_name(dp=self.dp_kind, tp=s.get("tp", 1), pp=s.get("pp", 1), cp=s.get("cp", 1),
                             ep=s.get("ep", 1), world_size=world_size)


def _fsdp_mesh_info(root: Any) -> Any:
    """The mesh info of the first FSDP2 (or composable ``replicate``) parameter group under ``root``."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None:
                return group.mesh_info
    return None


def _old_replicate(root: Any) -> bool:
    """``torch.distributed._composable.replicate`` (the DDP-based one) registers itself on the module."""
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:
        return False
    return any("replicate" in (_get_registry(m) or {}) for m in root.modules())


def root_mesh(mesh: Any) -> Any:
    if mesh is None:
        return None
    getter = getattr(mesh, "_get_root_mesh", None)
    return getter() if getter is not None else mesh


def _meshes(*found: Any) -> list[Any]:
    """The meshes that name a job's dims: those its parameters live on (FSDP2's, a DTensor's), then their
    root (a job may build its meshes by unflattening one 1-D world mesh: torchtitan does, and then only
    the meshes it built name its dims)."""
    out: list[Any] = []
    for mesh in [*found, *(root_mesh(m) for m in found if m is not None)]:
        if mesh is not None and all(mesh is not m for m in out):
            out.append(mesh)
    return out


def mesh_of(root: Any) -> list[Any]:
    """The DeviceMeshes ``root``'s parameters show (``_meshes``), for the collectives' dim labels."""
    info = _fsdp_mesh_info(root)
    dtensor = next((p.device_mesh for p in root.parameters() if getattr(p, "device_mesh", None) is not None), None)
    return _meshes(info.mesh if info is not None else None, dtensor)


def layout(roots: list[Any], *, world_size: int, rank: int, pipeline: dict, meshes: list[Any] = ()) -> JobLayout:
    """The job's layout (see the module docstring). ``pipeline``: ``detect.pipeline``'s fields or {};
    ``meshes``: every DeviceMesh the job built (the zero-code driver keeps them), for cp and ep."""
    from torch.nn.parallel import DistributedDataParallel

    out = JobLayout()
    replicas = shards = 1
    fsdp_mesh = None
    for root in roots:
        info = _fsdp_mesh_info(root)
        if info is not None:
            replicas = max(replicas, int(getattr(info, "replicate_mesh_size", 1) or 1))
            shards = max(shards, int(getattr(info, "shard_mesh_size", 1) or 1))
            fsdp_mesh = fsdp_mesh or info.mesh
        elif isinstance(root, DistributedDataParallel):
            pg = getattr(root, "process_group", None)
            replicas = max(replicas, pg.size() if pg is not None else world_size)
        elif _old_replicate(root):
            replicas = max(replicas, world_size)  # refined below once the other degrees are known
    if fsdp_mesh is not None:
        out.fsdp_dims = tuple(fsdp_mesh.mesh_dim_names or ())
    # Tensor parallel: parameters split on a dim FSDP does not own.
    tp_mesh, tp_dims = None, []
    for root in roots:
        for p in root.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:
                continue
            names = _dim_names(mesh)
            for i, name in enumerate(names):
                if name in out.fsdp_dims or (fsdp_mesh is not None and (mesh is fsdp_mesh or mesh == fsdp_mesh)):
                    continue
                # a dim named tp (or an unnamed one: a DTensor outside FSDP splits compute); a dp / cp / ep
                # dim FSDP does not own is no tensor parallelism
                if (dim_kind(name) == "tp" or not mesh.mesh_dim_names) and name not in tp_dims:
                    tp_dims.append(name)
                    tp_mesh = mesh
        if tp_dims:
            break
    out.tp_dims = tuple(tp_dims)
    own = _meshes(fsdp_mesh, tp_mesh)
    out.mesh = own
    sizes = {"dp": 1, "tp": 1, "pp": 1}
    coords = {"dp": 0, "tp": 0, "pp": 0}
    if tp_mesh is not None:
        for name in tp_dims:
            sizes["tp"] *= tp_mesh.size(_dim_names(tp_mesh).index(name))
    seen: set[str] = set()
    for mesh in own:  # each named dim once, from the first mesh that has it
        for i, name in enumerate(mesh.mesh_dim_names or ()):
            if name in seen or name == "world":
                continue
            seen.add(name)
            kind = dim_kind(name)
            if kind in ("cp", "ep") and mesh.size(i) > 1:
                sizes[kind] = sizes.get(kind, 1) * mesh.size(i)
            coords[kind] = coords.get(kind, 0) * mesh.size(i) + int(mesh.get_local_rank(i))
    # Context and expert parallelism on meshes no parameter lives on: torchtitan's cp mesh is used only in
    # its attention's code (an all-gather of K and V on the cp group). Its group may be the world's (a dim
    # over every rank reuses the default group), so it is named by the meshes the job built, not by groups.
    for mesh in meshes:
        names = mesh.mesh_dim_names or ()
        for i, name in enumerate(names):
            kind = dim_kind(name)
            if kind not in ("cp", "ep") or name in seen or mesh.size(i) <= 1:
                continue
            coordinate = mesh.get_coordinate()
            if coordinate is None:  # this rank is not in that mesh
                continue
            seen.add(name)
            sizes[kind] = sizes.get(kind, 1) * mesh.size(i)
            coords[kind] = coords.get(kind, 0) * mesh.size(i) + int(coordinate[i])
    if pipeline:
        sizes["pp"], coords["pp"] = int(pipeline["pp"]), int(pipeline["pp_rank"])
    rest = sizes["tp"] * sizes["pp"] * sizes.get("cp", 1)
    if fsdp_mesh is not None:
        sizes["dp"] = replicas * shards
        if sizes["dp"] * rest > world_size and sizes["dp"] % sizes.get("cp", 1) == 0:
            # FSDP shards over data parallel × cp (torchtitan's dp_shard_cp, its "fsdp", cp the inner dim):
            # the batches are dp's
            sizes["dp"] //= sizes["cp"]
            coords["dp"] //= sizes["cp"]
        out.dp_kind = "hsdp" if replicas > 1 and shards > 1 else "fsdp" if shards > 1 else "ddp" if replicas > 1 else ""
    elif replicas > 1:
        sizes["dp"] = max(1, world_size // rest) if _old_replicate_only(roots) else replicas
        out.dp_kind = "ddp"
    if sizes["dp"] * rest != world_size and pipeline:  # PP over plain data parallel: the rest of the ranks
        sizes["dp"] = max(1, world_size // rest)
    if not seen:  # no named mesh: the data-parallel coordinate from the rank
        coords["dp"] = rank // sizes["pp"] % sizes["dp"] if sizes["dp"] > 1 else 0
    out.sizes, out.coords = sizes, {k: v for k, v in coords.items() if k in sizes}
    return out


def _old_replicate_only(roots: list[Any]) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return not any(isinstance(r, DistributedDataParallel) for r in roots) and any(_old_replicate(r) for r in roots)


@dataclass(frozen=True, slots=True)
class Flops:
    """This rank's model FLOPs per token it processes, and how they were found (or why not)."""

    per_token: float  # 0.0 when not counted
    method: str  # "analytic: ..." or "off" or "absent: <reason>"

    def per_step(self, tokens: int) -> float:
        return self.per_token * tokens if self.per_token > 0 and tokens > 0 else float("nan")


def _dim_names(mesh: Any) -> list[str]:
    """A mesh's dim names; an unnamed mesh's dims are ``dim0``, ``dim1``, ..."""
    return list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])


def _local_share(p: Any, *, tp_dims: tuple) -> float:
    """The fraction of a parameter's matmul work this rank does: 1 / the degree of the TP dims it is split on."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or not tp_dims:
        return 1.0
    names = _dim_names(mesh)
    split = 1
    for i, placement in enumerate(getattr(p, "placements", ())):
        if i < len(names) and names[i] in tp_dims and placement.is_shard():
            split *= mesh.size(i)
    return 1.0 / split


def _expert_share(module: Any, parent: Any, p: Any) -> float:
    """top-k / E for an MoE expert bank's parameter (a 3-D weight whose first dim is the experts) under a
    module that routes top-k of E; 1 elsewhere."""
    if p.dim() < 3 or parent is None:
        return 1.0
    router = getattr(parent, "router", None) or getattr(parent, "gate", None)
    top_k = getattr(router, "top_k", None) or getattr(parent, "top_k", None)
    experts = getattr(router, "num_experts", None) or getattr(parent, "num_experts", None) or p.shape[0]
    if not top_k or not experts or p.shape[0] != experts:
        return 1.0
    return float(top_k) / float(experts)


def _attention(roots: list[Any], *, tp_dims: tuple) -> tuple[int, float]:
    """(layers, attention width this rank computes) of the outermost ``*Attention*`` modules: the width is
    the input of the attention's output projection (heads × head dim, whatever q, k and v look like: fused,
    grouped-query), else the output of its query projection."""
    import torch

    layers, width = 0, 0.0
    for root in roots:
        stack: list[Any] = [root]
        while stack:
            module = stack.pop()
            if "attention" in type(module).__name__.lower() and module is not root:
                found = _attention_width(module)
                if found is not None:
                    w, dim = found
                    layers += 1
                    width = float(dim) * _local_share(w, tp_dims=tp_dims)
                continue  # an attention's inner modules (its kernels' wrappers) are not more layers
            stack.extend(module.children())
    return layers, width


def _attention_width(attention: Any) -> tuple[Any, int] | None:
    """(the weight it is read from, heads × head dim) of one attention module, or None."""
    import torch

    named = [(name.rsplit(".", 1)[-1], m) for name, m in attention.named_modules() if name]
    for names, pick in ((_OUT_NAMES, "in"), (_Q_NAMES, "out")):
        for short, m in named:
            w = getattr(m, "weight", None)
            if short in names and isinstance(w, torch.Tensor) and w.dim() == 2:
                # Linear: (out, in); Hugging Face's Conv1D: (in, out)
                linear = isinstance(m, torch.nn.Linear)
                if pick == "in":
                    return w, int(w.shape[1] if linear else w.shape[0])
                return w, int(w.shape[0] if linear else w.shape[1])
    return None


def flops(roots: list[Any], *, seq_len: int, layout: JobLayout, mode: str = "analytic") -> Flops:
    """This rank's training FLOPs per token from its modules' parameter shapes (module docstring)."""
    import torch

    if mode == "off":
        return Flops(0.0, "off")
    n = 0.0
    seen: set[int] = set()  # counted once, though a parameter may be tied to several modules
    for root in roots:
        parents = {id(c): m for m in root.modules() for c in m.children()}
        for module in root.modules():
            if isinstance(module, torch.nn.Embedding):
                continue  # a lookup; its weight tied to an output head is counted there (a real matmul)
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                n += p.numel() * _local_share(p, tp_dims=layout.tp_dims) * _expert_share(module, parents.get(id(module)), p)
    if n <= 0:
        return Flops(0.0, "absent: the model has no parameters outside embeddings")
    layers, width = _attention(roots, tp_dims=layout.tp_dims)
    if layers and not seq_len:
        return Flops(0.0, "absent: attention found but no token ids seen (sequence length unknown)")
    # under context parallelism a rank holds 1/cp of each sequence and attends over all of it
    seq_len *= int(layout.sizes.get("cp", 1) or 1)
    per_token = training_flops_per_token(n_matmul_params=n, n_attention_layers=layers,
                                         attention_dim=int(round(width)), seq_len=seq_len)
    what = f"analytic: 6*N (N={int(n)})" + (f" + 12*L*D*S (L={layers}, D={int(width)}, S={seq_len})" if layers else
                                           ", no attention module found")
    return Flops(per_token if math.isfinite(per_token) else 0.0, what)
