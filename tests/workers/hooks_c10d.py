"""Plain c10d collectives and P2P on 2 gloo ranks with the collective tracer: every API path, bytes,
peers, per-group sequence numbers, mesh dims, nesting, flush, failure isolation, detach.
Usage: ``python tests/workers/hooks_c10d.py OUT_DIR``."""

from __future__ import annotations

import sys

from tests.support import profiler as hc


class BrokenRecorder:
    """A recorder whose record_collective always raises: the tracer must count it and carry on."""

    def __init__(self) -> None:
        from meshscope.agent.contract import AnchoredClock

        self.clock = AnchoredClock()
        self.errors: list[str] = []

    def record_collective(self, **_: object) -> None:
        raise RuntimeError("recorder is broken")

    def record_span(self, **_: object) -> None:
        raise RuntimeError("recorder is broken")

    def record_error(self, where: str, exc: BaseException) -> None:
        self.errors.append(where)


def run(rank: int, world_size: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.meshinfo import MeshInfo
    from meshscope.agent.instrument.recorder import ListRecorder

    hc.init(rank, world_size, port)
    peer = 1 - rank
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp_shard", "tp"))
    info = MeshInfo(mesh)
    other = dist.new_group([0, 1])
    dims = {
        "dp_shard": info.lookup(mesh.get_group("dp_shard")).dim,
        "tp": info.lookup(mesh.get_group("tp")).dim,
        "tp_size": info.lookup((mesh, 1)).size,
        "none": info.lookup(None).dim,
        "new_group": info.lookup(other).dim,
        "by_name": info.lookup(other.group_name).dim,
        "world_without_mesh": MeshInfo(None).lookup(None).dim,
    }

    # P2POps built before attach hold the original isend / irecv.
    early = [dist.P2POp(dist.isend, torch.full((8,), float(rank)), peer),
             dist.P2POp(dist.irecv, torch.empty(8), peer)]
    originals = hc.patch_targets()
    rec = ListRecorder()
    tracer = CollectiveTracer(rec, mesh_info=MeshInfo(None))
    tracer.attach(None)
    second_refused = False
    try:
        CollectiveTracer(ListRecorder()).attach(None)
    except RuntimeError:
        second_refused = True

    t = torch.ones(1000)
    dist.all_reduce(t)                                                   # blocking
    dist.all_reduce(t, dist.ReduceOp.SUM, None, True).wait()             # async, positional
    dist.broadcast(t, src=0)
    gathered = [torch.empty(1000) for _ in range(world_size)]
    dist.all_gather(gathered, t)
    dist.all_gather_into_tensor(torch.empty(2000), t)                    # deprecated → all_gather_single
    dist.reduce_scatter_tensor(torch.empty(500), t)
    dist.barrier()
    unwaited = dist.all_reduce(torch.ones(10), async_op=True)           # never waited in Python
    unwaited.get_future().wait()
    n_before_flush = len(rec.collectives)
    flushed = tracer.flush()
    works = dist.batch_isend_irecv(early)                                # P2POps from before attach
    for w in works:
        w.wait()
    early_swapped = [early[0].op is dist.isend, early[1].op is dist.irecv]  # now the wrappers
    if rank == 0:
        dist.send(torch.ones(16), dst=1)
        dist.recv(torch.empty(32), src=1)
    else:
        dist.recv(torch.empty(16), src=0)
        dist.send(torch.ones(32), dst=0)
    send_work = dist.isend(torch.ones(4), peer)
    recv_work = dist.irecv(torch.empty(4), peer)
    send_work.wait()
    recv_work.wait()
    late = [dist.P2POp(dist.isend, torch.ones(8), peer), dist.P2POp(dist.irecv, torch.empty(8), peer)]
    traced = list(rec.collectives)

    # Failure isolation: a recorder that raises, and a group lookup that raises.
    tracer.detach()
    broken = BrokenRecorder()
    btracer = CollectiveTracer(broken)
    btracer.attach(None)
    x = torch.ones(4)
    dist.all_reduce(x)
    broken_result = x.tolist()

    class ExplodingMesh(MeshInfo):
        def lookup(self, group):
            raise KeyError("no such group")

    btracer.detach()
    erec = ListRecorder()
    etracer = CollectiveTracer(erec, mesh_info=ExplodingMesh(None))
    etracer.attach(None)
    y = torch.ones(4)
    dist.all_reduce(y)
    w = dist.isend(torch.ones(2), peer) if rank == 0 else dist.irecv(torch.empty(2), 0)
    w.wait()
    exploding_result = y.tolist()
    etracer.detach()

    # After detach: nothing recorded, P2POps made while attached still work with the original batch API.
    n_after = len(rec.collectives)
    for w in dist.batch_isend_irecv(late):
        w.wait()
    dist.all_reduce(torch.ones(4))
    result = {
        "dims": dims,
        "records": traced,
        "second_refused": second_refused,
        "flushed": flushed,
        "n_before_flush": n_before_flush,
        "errors": [f"{w}: {e!r}" for w, e in rec.errors],
        "stats": dict(tracer.stats),
        "broken_errors": broken.errors,
        "broken_result": broken_result,
        "exploding_errors": [w for w, _ in erec.errors],
        "exploding_result": exploding_result,
        "exploding_records": len(erec.collectives),
        "changed_after_detach": hc.changed_targets(originals),
        "records_after_detach": len(rec.collectives) - n_after,
        "early_ops_swapped": early_swapped,
    }
    hc.write(out, rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    hc.spawn(run, args=(sys.argv[1],))
