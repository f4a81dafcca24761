"""The fast CPU sites against the real torch API on the ``fake`` backend (one process, no network): prints
one JSON object of what each case recorded, and which form of the sites ran (``MESHSCOPE_NATIVE``: C or
Python, see agent/instrument/native.py). Used by tests/test_hooks_fastpaths.py."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshscope.agent.instrument import native
from meshscope.agent.instrument.collectives import CollectiveTracer
from meshscope.agent.instrument.meshinfo import MeshInfo
from meshscope.agent.instrument.recorder import ListRecorder


def records(rec: ListRecorder) -> list[dict[str, Any]]:
    keep = ("op", "group_size", "nbytes", "t_start", "t_end", "wait_s", "peer", "source", "seq")
    return [{k: r[k] for k in keep if k in r} for r in rec.collectives]


class PerfClock:
    """``time.perf_counter`` itself: the clock a Telemetry's tracer reads, for which the C sites are made."""

    now = staticmethod(time.perf_counter)


def case(name: str, fn: Any, out: dict, *, mesh: Any = None) -> None:
    rec = ListRecorder(clock=PerfClock())
    tracer = CollectiveTracer(rec, mesh_info=MeshInfo(mesh))
    lookups = {"n": 0}
    lookup = tracer.mesh_info.lookup

    def counted(group: Any) -> Any:  # how often a designator is resolved from scratch
        lookups["n"] += 1
        return lookup(group)
    tracer.mesh_info.lookup = counted
    tracer.attach(None)
    try:
        fn()
        funcol_form = [type(funcol.all_reduce).__name__, type(funcol.wait_tensor).__name__]
    finally:
        tracer.flush()
        tracer.detach()
    out[name] = {"records": records(rec), "errors": [w for w, _ in rec.errors], "stats": dict(tracer.stats),
                 "funcol_form": funcol_form,
                 "pending": len(tracer._pending_works) + len(tracer._pending_tensors), "lookups": lookups["n"],
                 "groups": [(r["dim"], r["group"]) for r in rec.collectives]}


def main() -> None:
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    world = dist.group.WORLD
    t = torch.ones(2, 8)  # 64 bytes
    out: dict[str, Any] = {}

    # all_gather_single with gather_dim != 0 waits inside its own call (torch cats the chunks after it):
    # one record, completed at that inner wait.
    case("funcol_nested_wait", lambda: funcol.all_gather_single(t, 1, world), out)
    # The usual DTensor pattern: issue, then wait on first use.
    case("funcol_issue_then_wait", lambda: funcol.all_reduce(t, "sum", world).wait(), out)

    # DTensor's designator, (mesh, mesh_dim): a new tuple per call, resolved once per mesh and dim.
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def by_mesh_dim() -> None:
        for dim in (1, 1, 1, 0, 1, 1):
            funcol.all_reduce(t, reduceOp="sum", group=(mesh, dim)).wait()
        for out in funcol.all_gather_single_coalesced([t, t], (mesh, 1)):  # bytes: the output's, × group size
            out.wait()
    case("funcol_mesh_dim", by_mesh_dim, out, mesh=mesh)

    # A pending funcol op whose wait comes inside the next op's issuing call (its output is the next
    # op's input): each op gets its own record, the first completed by that wait.
    def chained() -> None:
        a = funcol.all_reduce(t, "sum", world)
        funcol.all_gather_single(a, 1, world)  # gather_dim 1: torch waits on a inside this call
    case("funcol_wait_inside_another_issue", chained, out)

    # Fast c10d sites against the same ops made through a keyword-only call (same records).
    case("c10d_positional", lambda: (dist.all_reduce(t), dist.all_reduce(t, dist.ReduceOp.SUM, None, True).wait()),
         out)
    case("c10d_keywords", lambda: (dist.all_reduce(tensor=t, group=world),
                                   dist.all_reduce(t, async_op=True, group=world).wait(timeout=timedelta(seconds=30))),
         out)
    sub = dist.new_group([0, 3])

    # A list of ranks (funcol's RANK_TYPES), also a new object per call: resolved once per set of ranks
    # (funcol finds a group by its ranks: [0, 3] is ``sub``).
    def by_rank_list() -> None:
        for ranks in ([0, 1, 2, 3], [0, 1, 2, 3], [0, 3], [0, 1, 2, 3], [0, 3]):
            funcol.all_reduce(t, reduceOp="sum", group=list(ranks)).wait()
    case("funcol_rank_list", by_rank_list, out)

    # A torch before 2.13 (a GPU machine's 2.11): no all_gather_single & co.; the older names, which DTensor
    # calls there, issue the op themselves. Emulated here: the new functions under the older names only.
    renamed = {"all_gather_single": "all_gather_tensor", "reduce_scatter_single": "reduce_scatter_tensor",
               "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
               "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced"}
    saved = {name: getattr(funcol, name) for pair in renamed.items() for name in pair}
    for new, old in renamed.items():
        setattr(funcol, old, saved[new])
        delattr(funcol, new)
    t4 = torch.ones(4, 8)  # 128 bytes: reduce-scattered over 4 ranks
    seen: dict[str, Any] = {}

    def older_names() -> None:
        seen["created"] = [name for name in renamed if hasattr(funcol, name)]  # while attached: none
        funcol.all_gather_tensor(t, 0, world).wait()
        funcol.reduce_scatter_tensor(t4, "sum", 0, world).wait()
        for o in funcol.all_gather_into_tensor_coalesced([t, t], world):
            o.wait()
        for o in funcol.reduce_scatter_tensor_coalesced([t4], "sum", [0], world):
            o.wait()
    try:
        case("funcol_older_torch", older_names, out)
        out["funcol_older_torch"]["created"] = seen["created"]
        out["funcol_older_torch"]["restored"] = all(getattr(funcol, old) is saved[new] for new, old in renamed.items())
    finally:
        for name, fn in saved.items():
            setattr(funcol, name, fn)

    # P2P: the global peer from a group peer; the blocking send recorded at its return.
    # A subgroup's group peer maps through its ranks; a keyword name built at run time (not interned) is
    # still recognised.
    built = "".join(["group_", "src"])
    case("p2p", lambda: (dist.isend(t, group_dst=3, group=world).wait(), dist.send(t, dst=1),
                         dist.irecv(t, src=2).wait(), dist.isend(t, group_dst=1, group=sub).wait(),
                         dist.irecv(t, group=sub, **{built: 1}).wait()), out)
    # A batch as torch.distributed.pipelining issues it (the fake backend does not coalesce, as gloo):
    # one record per op, through the isend / irecv sites called by keyword, each timed by its wait; an op
    # built from torch's own isend (a name imported before attach) is accepted and swapped to ours.
    def batched() -> None:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1), dist.P2POp(dist.irecv, t, group_peer=2)])
        for work in works:
            work.wait()
        early = dist.P2POp(original_isend, t, 3)
        for work in dist.batch_isend_irecv([early]):
            work.wait()
        # another group, then the first again: each batch's group is its own (the last one is remembered)
        for ops in ([dist.P2POp(dist.irecv, t, group=sub, group_peer=1)], [dist.P2POp(dist.isend, t, 2)]):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    original_isend = dist.isend
    case("p2p_batch", batched, out)
    # An async op never waited in Python: completed by the step-end flush.
    case("async_never_waited", lambda: dist.all_reduce(t, async_op=True), out)
    # A funcol op inside torch.compile'd code is a graph node: the wrappers step aside before anything of
    # theirs is traced (no graph break, no guard on a flag that changes between compile and run, so no
    # recompile), and nothing is recorded from inside the graph.
    import torch._dynamo.utils as dynamo_utils

    @torch.compile(backend="eager")
    def compiled(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", world) + 1

    def run_compiled() -> None:
        for _ in range(12):
            compiled(torch.ones(4))
    case("compiled_funcol", run_compiled, out)
    out["compiled_funcol"]["dynamo"] = {"unique_graphs": dynamo_utils.counters["stats"]["unique_graphs"],
                                        "graph_breaks": sum(dynamo_utils.counters["graph_break"].values()),
                                        "recompiles": sum(dynamo_utils.counters["recompiles"].values())}
    # A funcol call that raises after the wait torch makes inside it: the next op on the thread is its own.
    def raising_then_next() -> None:
        try:
            funcol.all_gather_single(t, 5, world)  # waits, then torch.cat on a dim the tensor lacks
        except IndexError:
            pass
        funcol.all_reduce(t, "sum", world).wait()
    case("funcol_raises_after_inner_wait", raising_then_next, out)
    # Which form ran: the patched functions are the C sites' objects, or Python functions.
    tracer = CollectiveTracer(ListRecorder(clock=PerfClock()))
    tracer.attach(None)
    try:
        out["_form"] = {"c10d": type(dist.all_reduce).__name__, "wait": type(vars(dist.Work)["wait"]).__name__,
                        "active": native.active(tracer)}
    finally:
        tracer.detach()
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
