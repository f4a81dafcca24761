"""Which parallel dimension a process group belongs to, looked up per collective call.

A collective is labelled with its DeviceMesh dimension (``dp``, ``fsdp``, ``tp``, ``pp``, see
``agent.contract.DIMS``): that is what a dashboard groups by. The mesh's dim names are normalised to the
schema's vocabulary (``dp_shard`` → ``fsdp``, ``dp_replicate`` → ``dp``; a name it does not know → ``other``). A group that is no mesh dim is ``world`` when it is the default (world) group and
``other`` otherwise. A mesh dim wins over ``world``: on a 1-D mesh ``init_device_mesh`` reuses the world
group for the only dim, and the collectives on it belong to that dim.

Lookups take whatever the collective APIs accept as a group: a ``ProcessGroup``, ``None`` (the default
group), a group name (``str``), a 1-D ``DeviceMesh``, a ``(mesh, dim)`` pair, or a rank list (functional
collectives). The first lookup of an object resolves it (microseconds); later ones are a dict hit keyed by
the object's identity, with the object kept alive by the cache so that an identity can never be reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# Mesh dim names as written by users / torchtitan → the schema's DIMS.
DIM_ALIASES: Mapping[str, str] = {
    "dp": "dp", "ddp": "dp", "dp_replicate": "dp", "replicate": "dp",
    "fsdp": "fsdp", "dp_shard": "fsdp", "shard": "fsdp", "dp_shard_cp": "fsdp",
    "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep",
    # torchtitan's flattened dims: FSDP's shard group (dp_shard × cp) and the batch / loss groups
    "efsdp": "fsdp", "batch": "dp", "loss": "dp", "loss_mesh": "dp", "dp_cp": "dp", "world": "world",
}
_CACHE_LIMIT = 4096  # distinct group objects; rank lists built per call would otherwise grow it forever


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """What a collective record needs about its group."""

    dim: str  # one of agent.contract.DIMS
    size: int
    name: str  # the ProcessGroup's unique name (the flight recorder's ``process_group[0]``)
    ranks: tuple[int, ...]  # global ranks, indexed by group rank
    label: str = ""  # the job's own mesh dim name ("dp_shard", "tp"), "world" for the default group, else ""

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank] if 0 <= group_rank < len(self.ranks) else -1


class MeshInfo:
    """Maps process groups to ``GroupInfo``; build one per tracer from the job's DeviceMesh (or a list of
    them, or ``None``).

    ``aliases`` extends/overrides ``DIM_ALIASES`` (mesh dim name → schema dim)."""

    def __init__(self, mesh: Any = None, *, aliases: Mapping[str, str] | None = None) -> None:
        self._aliases = {**DIM_ALIASES, **(aliases or {})}
        self._dim_by_group_name: dict[str, str] = {}
        self._label_by_group_name: dict[str, str] = {}
        self._cache: dict[int, tuple[Any, GroupInfo]] = {}
        meshes = mesh if isinstance(mesh, (list, tuple)) else [mesh] if mesh is not None else []
        for one in meshes:  # a job may name its dims on several meshes (``census.mesh_of``): the first wins
            for dim_name, pg in _mesh_groups(one):
                # First name wins: a real dim is listed before the flattened dims that may alias it.
                self._dim_by_group_name.setdefault(pg.group_name, self._aliases.get(dim_name, "other"))
                self._label_by_group_name.setdefault(pg.group_name, dim_name)

    def lookup(self, group: Any) -> GroupInfo:
        """``GroupInfo`` for any group designator the c10d / functional-collective APIs accept."""
        hit = self._cache.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1]
        info = self._resolve(group)
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[id(group)] = (group, info)
        return info

    def _resolve(self, group: Any) -> GroupInfo:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if group is None:
            pg = c10d._get_default_group()
        elif isinstance(group, dist.ProcessGroup):
            pg = group
        else:
            from torch.distributed import _functional_collectives as funcol

            pg = c10d._resolve_process_group(funcol._resolve_group_name(group))
        name = pg.group_name
        dim, label = self._dim_by_group_name.get(name), self._label_by_group_name.get(name, "")
        if dim is None:
            world = c10d.GroupMember.WORLD
            dim_name = mesh_dim_name(pg)
            if world is not None and name == world.group_name:
                dim, label = "world", "world"
            elif dim_name:  # a mesh dim of a mesh the job never showed us (torchtitan's cp mesh)
                dim, label = self._aliases.get(dim_name, "other"), dim_name
            else:
                dim = "other"
        return GroupInfo(dim=dim, size=pg.size(), name=name, ranks=tuple(dist.get_process_group_ranks(pg)),
                         label=label)


def mesh_dim_name(pg: Any) -> str:
    """The mesh dim a process group was made for, from its description: ``DeviceMesh`` names each group it
    creates ``mesh_<dim name>`` (its own dims and its flattened ones); "" for any other group."""
    desc = str(getattr(pg, "group_desc", "") or "")
    return desc[5:] if desc.startswith("mesh_") and desc != "mesh_default" else ""


def _mesh_groups(mesh: Any) -> list[tuple[str, Any]]:
    """(dim name, ProcessGroup) for every named dim of the mesh and every flattened dim of its root."""
    names = list(mesh.mesh_dim_names or ())
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    flattened = [(root, n) for n in getattr(root, "_flatten_mapping", {}) or {} if n not in names]  # mesh._flatten()
    out = []
    for owner, name in [(mesh, n) for n in names] + flattened:
        try:
            out.append((name, owner.get_group(name)))
        except Exception:  # a dim without a group of its own (a size-1 or fake-backend dim): no label from it
            continue
    return out
