"""The functional collectives through a real telemetry core (its flusher, its steps), on the ``fake`` backend in
one process: what each case records and what each step's row says, with whichever form traces them —
the dispatcher kernels (agent/instrument/funcol_kernels.py) or, with ``MESHSCOPE_FUNCOL_KERNELS=0``, the
sites of comm_funcol. Prints one JSON object. Used by tests/test_hooks_funcol_kernels.py."""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig
from tests.support.records import capture_records

KEEP = ("op", "dim", "group", "group_size", "nbytes", "peer", "source", "seq", "t_start", "t_end", "wait_s")


def run_case(steps: list[Callable[[], Any]], *, between: Callable[[], Any] | None = None, mesh: Any = None) -> dict:
    """Each callable one step of a fresh telemetry core (``between``: called after the first step's end,
    outside any step); the collectives it recorded, with their step, and the step rows."""
    tel = Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(prefix="meshscope-kernels-"), run="k"),
                    rank=0, world_size=4)
    records = capture_records(tel)
    tel.attach(model_parts=[], mesh=mesh)
    tracer = tel._tracers[0]
    form = {"kernels": tracer._kernels is not None,
            "patched": type(funcol.all_reduce).__name__ != "function" or hasattr(funcol.all_reduce, "__meshscope_tracer__")}
    for i, fn in enumerate(steps):
        with tel.step(i):
            fn()
        if i == 0 and between is not None:
            between()
    stats = dict(tracer.stats)
    tel.close()
    got = records()
    colls, step_rows = got["collective"], got["step"]
    return {"records": [{k: c[k if k != "nbytes" else "bytes"] for k in KEEP} | {"step": c["step"]} for c in colls],
            "steps": [{"step": s["step"], "n_collectives": s["n_collectives"], "exposed_comm_s": s["exposed_comm_s"],
                       "wall_s": s["wall_s"]} for s in step_rows],
            "stats": {k: v for k, v in stats.items() if v}, "form": form}


def main() -> None:
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    world = dist.group.WORLD
    t = torch.ones(2, 8)  # 64 bytes
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}

    def every_op() -> None:
        funcol.all_reduce(t, "sum", world).wait()
        funcol.all_gather_single(t, 0, world).wait()
        funcol.all_gather_single(t, 1, world)  # gather_dim 1: torch waits inside the call, then cats
        funcol.reduce_scatter_single(torch.ones(8, 8), "sum", 0, world).wait()
        funcol.all_to_all_single(torch.ones(8, 2), None, None, world).wait()
        funcol.broadcast(t, 0, world).wait()

    out["every_op"] = run_case([every_op, every_op])

    def coalesced() -> None:
        for o in funcol.all_reduce_coalesced([t, torch.ones(4)], "sum", world):
            o.wait()
        for o in funcol.all_gather_single_coalesced([t, t], world):
            o.wait()
        for o in funcol.reduce_scatter_single_coalesced([torch.ones(8, 2)], "sum", [0], world):
            o.wait()

    out["coalesced"] = run_case([coalesced])

    def mixed() -> None:  # c10d and funcol on one group: one sequence
        funcol.all_reduce(t, "sum", world).wait()
        dist.all_reduce(t)
        funcol.all_reduce(t, "sum", world).wait()
        dist.all_reduce(t, async_op=True).wait()

    out["mixed_with_c10d"] = run_case([mixed, mixed])

    def tp_dims() -> None:  # DTensor's designators: (mesh, dim), a new tuple per call; a rank list
        for dim in (1, 0, 1):
            funcol.all_reduce(t, reduceOp="sum", group=(mesh, dim)).wait()
        funcol.all_reduce(t, reduceOp="sum", group=[0, 1, 2, 3]).wait()

    out["mesh_dims"] = run_case([tp_dims], mesh=mesh)

    held: dict[str, Any] = {}

    def issue_only() -> None:  # issued in step 0, waited in step 1: the op completes in step 1
        held["a"] = funcol.all_reduce(t, "sum", world)

    def wait_later() -> None:
        held.pop("a").wait()
        funcol.all_reduce(t, "sum", world).wait()

    out["across_steps"] = run_case([issue_only, wait_later])

    def between() -> None:  # outside any step: the record carries the last step
        funcol.all_reduce(t, "sum", world).wait()

    out["between_steps"] = run_case([lambda: funcol.all_reduce(t, "sum", world).wait(), lambda: None],
                                    between=between)

    def raising() -> None:  # the op ran (its wait inside the call), then torch.cat fails on a missing dim
        try:
            funcol.all_gather_single(t, 5, world)
        except IndexError:
            pass
        funcol.all_reduce(t, "sum", world).wait()

    out["raises_after_inner_wait"] = run_case([raising])

    def autograd_formula() -> None:  # its backward issues the op through torch.ops itself (all_reduce_backward)
        x = torch.ones(2, 8, requires_grad=True)
        funcol.all_reduce(x, "sum", world).wait().sum().backward()

    out["autograd_backward"] = run_case([autograd_formula])

    @torch.compile(backend="eager")
    def compiled(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", world) + 1

    import torch._dynamo.utils as dynamo_utils

    def run_compiled() -> None:
        for _ in range(6):
            compiled(torch.ones(4))

    out["compiled"] = run_case([run_compiled])
    out["compiled"]["dynamo"] = {"unique_graphs": dynamo_utils.counters["stats"]["unique_graphs"],
                                 "graph_breaks": sum(dynamo_utils.counters["graph_break"].values())}
    out["life"] = life(world, t)
    print(json.dumps(out))
    dist.destroy_process_group()


def life(world: Any, t: torch.Tensor) -> dict:
    """Over a telemetry's attach / detach / attach: what is recorded when, and what detach drops."""
    tel = Telemetry(config=TelemetryConfig(store=tempfile.mkdtemp(prefix="meshscope-kernels-"), run="k"),
                    rank=0, world_size=4)
    seen: list = []
    record = tel.record_collective

    def capture(**kw: Any) -> None:
        seen.append((kw["op"], kw.get("seq"), kw["source"]))
        record(**kw)

    tel.record_collective = capture
    got: dict[str, Any] = {}
    tel.attach(model_parts=[])
    first = tel._tracers[0]
    funcol.all_reduce(t, "sum", world).wait()
    left = funcol.all_reduce(t, "sum", world)  # issued, not waited before the detach
    tel.detach()
    got["attached"], got["dropped_pending"] = list(seen), first.stats["dropped_pending"]
    left.wait()
    funcol.all_reduce(t, "sum", world).wait()  # detached: torch's call, nothing recorded
    tel._drain()
    got["detached"] = seen[len(got["attached"]):]
    tel.attach(model_parts=[])  # a new tracer: its groups count from 1 again, as a new tracer's sites do
    funcol.all_reduce(t, "sum", world).wait()
    dist.all_reduce(t)
    got["kernels_again"] = tel._tracers[0]._kernels is not None
    tel.close()
    got["reattached"] = seen[len(got["attached"]) + len(got["detached"]):]
    return got


if __name__ == "__main__":
    sys.exit(main())
