"""The collective tracer's groups: what a traced op's group designator resolves to, found in one dict hit.

Every site looks its group up by the designator's identity in ``GroupTable.entries`` (the tracer's hot
``groups``) and calls ``resolve`` on a miss. An entry is ``(designator, GroupInfo, the group's issue
counter, the GroupInfo's key)``. The key (an index into ``infos``) is what an op's tuples carry, not the
GroupInfo: a tuple of plain values is one the cyclic GC stops tracking (see ``ops``). Designators of one
group (None and the world group; a mesh and its group) share the counter (``next`` of an
``itertools.count``: the op's sequence number in its group, from 1), or where the functional collectives are
traced in torch's dispatcher, of the group's counter there (``counter_of``: funcol_kernels.Bound.counter), so
that the kernels and the sites number one group's ops in one sequence.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Iterator

from meshscope.agent.instrument.meshinfo import GroupInfo, MeshInfo

Entry = tuple[Any, GroupInfo, Iterator[int], int]


class GroupTable:
    """Group designators → entries, resolved through ``mesh_info`` once per designator; ``limit`` bounds
    each map (rank lists built per call must not grow it forever)."""

    def __init__(self, mesh_info: MeshInfo, *, limit: int) -> None:
        self.mesh_info = mesh_info
        self.limit = limit
        self.entries: dict[int, Entry] = {}  # id(designator) → entry
        self.infos: list[GroupInfo] = []  # by key
        self._mesh_dims: dict[tuple[int, Any], Entry] = {}  # (id(mesh), mesh_dim) → entry: see resolve
        self._rank_lists: dict[tuple[int, ...], Entry] = {}  # tuple(ranks) → entry: see resolve
        self._info_keys: dict[GroupInfo, int] = {}
        self._lock = threading.Lock()
        self._counters: dict[str, Iterator[int]] = {}
        # A group's counter, by its c10d name (set before the first op: funcol_kernels)
        self.counter_of: Callable[[str], Iterator[int]] = lambda name: itertools.count(1)

    def info(self, group: Any) -> GroupInfo:
        """The group's ``GroupInfo`` (resolved once per designator)."""
        hit = self.entries.get(id(group))
        if hit is None or hit[0] is not group:
            hit = self.resolve(group)
        return hit[1]

    def resolve(self, group: Any) -> Entry:
        """The entry of ``group``, made and stored if new."""
        # DTensor names its group ``(mesh, mesh_dim)``, a new tuple per call, which no lookup by identity
        # finds: resolved from the designator every time, its funcol op cost the training thread 40 µs
        # where a ProcessGroup's cost 11.5 (2-vCPU dev VM). Such a pair is found by the mesh's identity
        # and the dim instead; the entry holds the mesh, which keeps its id from being reused.
        # A list of ranks (funcol's ``RANK_TYPES``), also built per call in a user's loop, is found by its
        # ranks' values the same way.
        by_mesh = by_ranks = None
        if type(group) is list:
            try:
                by_ranks = tuple(group)
                hit = self._rank_lists.get(by_ranks)
            except TypeError:  # an unhashable rank: resolved as given, below
                by_ranks = hit = None
            if hit is not None:
                return hit
        elif type(group) is tuple and len(group) == 2:
            try:
                by_mesh = (id(group[0]), group[1])
                hit = self._mesh_dims.get(by_mesh)
            except TypeError:  # an unhashable second item: not a (mesh, dim) pair
                by_mesh = hit = None
            if hit is not None and hit[0] is group[0]:
                return hit
        info = self.mesh_info.lookup(group)
        table = (self._mesh_dims if by_mesh is not None else self._rank_lists if by_ranks is not None
                 else self.entries)
        if len(table) >= self.limit:
            table.clear()
        counter = self._counters.get(info.name)
        if counter is None:
            counter = self._counters[info.name] = self.counter_of(info.name)
        with self._lock:  # a group first seen by two threads at once still gets one key
            key = self._info_keys.get(info)
            if key is None:  # one per distinct group: GroupInfo compares by value
                key = self._info_keys[info] = len(self.infos)
                self.infos.append(info)
        if by_mesh is not None:
            hit = self._mesh_dims[by_mesh] = (group[0], info, counter, key)
        elif by_ranks is not None:
            hit = self._rank_lists[by_ranks] = (by_ranks, info, counter, key)
        else:
            hit = self.entries[id(group)] = (group, info, counter, key)
        return hit

    def issued(self) -> list[tuple[GroupInfo, int | None]]:
        """Each group this table has numbered ops on, with the sequence number of its last op issued
        (``native.issued``; None where the counter cannot be read): what the hang watchdog says was
        entered. Read off the training thread; the maps are copied under the lock."""
        from meshscope.agent.instrument import native

        with self._lock:
            infos, counters = list(self.infos), dict(self._counters)
        seen: dict[str, GroupInfo] = {}
        for info in infos:
            seen.setdefault(info.name, info)
        return [(info, native.issued(counters[name])) for name, info in seen.items() if name in counters]
