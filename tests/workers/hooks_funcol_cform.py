"""The functional collectives' C sites over a tracer's life, on the ``fake`` backend (one process): which
form is patched in before and after ``torch._dynamo`` is imported, a second tracer refused while the first is
attached, detach restoring torch's functions and unbinding the sites, a reference kept past detach calling
through, re-attach binding again. Prints one JSON object. Used by tests/test_hooks_funcol_cform.py."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshscope.agent.instrument import native
from meshscope.agent.instrument.collectives import CollectiveTracer
from meshscope.agent.instrument.recorder import ListRecorder


class PerfClock:
    now = staticmethod(time.perf_counter)


def form() -> str:
    return type(funcol.all_reduce).__name__ + "/" + type(funcol.wait_tensor).__name__


def seqs(rec: ListRecorder) -> list[Any]:
    return [(r["op"], r["seq"], r["nbytes"]) for r in rec.collectives]


def main() -> None:
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    world, t = dist.group.WORLD, torch.ones(16)
    original, original_wait = funcol.all_reduce, funcol.wait_tensor
    out: dict[str, Any] = {"dynamo_at_attach": "torch._dynamo" in sys.modules}
    rec = ListRecorder(clock=PerfClock())
    a = CollectiveTracer(rec)
    a.attach(None)
    out["forms"] = [form()]
    for _ in range(3):  # the first imports torch._dynamo; the second puts the C sites in; the third is C's
        funcol.all_reduce(t, "sum", world).wait()
        out["forms"].append(form())
    kept = funcol.all_reduce
    try:
        CollectiveTracer(ListRecorder(clock=PerfClock())).attach(None)
        out["second_tracer"] = "attached"
    except RuntimeError as exc:
        out["second_tracer"] = str(exc)
    a.flush()
    out["a"] = {"records": seqs(rec), "errors": [w for w, _ in rec.errors], "pending": len(a._pending_tensors)}
    a.detach()
    out["restored"] = funcol.all_reduce is original and funcol.wait_tensor is original_wait
    out["bound_after_detach"] = sorted(name for name, site in native._FUNCOL.items() if site.bound)
    out["kept_call"] = kept(t, "sum", world).wait().tolist()[:2]  # a reference kept past detach: torch's call
    out["a_after_detach"] = len(rec.collectives)

    rec_b = ListRecorder(clock=PerfClock())
    b = CollectiveTracer(rec_b)
    b.attach(None)
    out["b_form"] = form()
    funcol.all_reduce(t, reduceOp="sum", group=world).wait()
    b.enabled = False  # the sites pass through
    funcol.all_reduce(t, "sum", world).wait()
    b.enabled = True
    b.flush()
    b.detach()
    out["b"] = {"records": seqs(rec_b), "errors": [w for w, _ in rec_b.errors], "pending": len(b._pending_tensors)}
    out["sites"] = sorted(native._FUNCOL)
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
