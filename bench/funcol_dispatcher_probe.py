"""A probe for the next design of the functional-collective sites: a wrapper kernel in torch's dispatcher.

    python bench/funcol_dispatcher_probe.py [--key ADInplaceOrView|AutogradCPU] [--rounds 4] [--blocks 12]

Builds a small torch C++ extension (``torch.utils.cpp_extension.load_inline``: a C++ compiler and torch's
headers; ~30 s the first time, cached after) whose boxed kernels for ``_c10d_functional::all_reduce`` and
``wait_tensor``, registered at ``--key``, take a CLOCK_MONOTONIC reading, redispatch to torch's kernel, key
the output by its data pointer and, at the wait, write (t0, t1, wait, bytes) into a ring: what a meshscope
site records, with no Python. Measured in the funcol loop of ``tests.support.hookcost`` (the ``fake``
backend, ``funcol.all_reduce(t, "sum", group).wait()``), training-thread CPU per op:

- ``record``: in one process with the kernels registered, a global flag on / off in alternating blocks
  (``hookcost._ab``): what recording costs over the kernels passing the call through;
- ``passthrough``: processes without the extension against processes with it loaded and off, alternating
  (a registration cannot be undone in a process): what the extra kernel in the dispatch chain costs.

At ``AutogradCPU`` the kernels run instead of the autograd fallback torch runs for an op with no autograd
kernel (the untraced op gets faster, and an input that requires grad loses the fallback's handling: a
behaviour change meshscope must not make); at ``ADInplaceOrView`` the fallback still runs before them.
The measurement behind meshscope's design (``bench/results/funcol-dispatcher-probe-*.json``), which puts its
kernels at the CPU key instead (agent/instrument/_funcol_kernels.cpp: a wait made inside ``__torch_dispatch__``
runs with ADInplaceOrView excluded). A process
lands in a fast or a slow state (the untraced op 55-68 or 85-120 µs on the dev VM, 2026-11-28) that moves every
figure in it: ``record`` is within one process, ``passthrough`` across processes, and is only as good as the
states its processes landed in (its lists show them). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SOURCE = r'''
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <atomic>
#include <time.h>
#include <unordered_map>
static std::atomic<bool> on{false};
struct Rec { int64_t t0, t1, wait_ns, nbytes; };
static std::vector<Rec> ring(1 << 16);
static size_t head = 0;
static std::unordered_map<uintptr_t, std::pair<int64_t, int64_t>> pending;
static inline int64_t now_ns() {
  timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static void ar_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!on.load(std::memory_order_relaxed)) { op.redispatchBoxed(ks & BELOW, stack); return; }
  int64_t t0 = now_ns();
  int64_t nbytes = (int64_t)(*stack)[stack->size() - 3].toTensor().nbytes();
  op.redispatchBoxed(ks & BELOW, stack);
  pending[(uintptr_t)stack->back().toTensor().data_ptr()] = {t0, nbytes};
}
static void wait_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!on.load(std::memory_order_relaxed)) { op.redispatchBoxed(ks & BELOW, stack); return; }
  uintptr_t key = (uintptr_t)stack->back().toTensor().data_ptr();
  int64_t w0 = now_ns();
  op.redispatchBoxed(ks & BELOW, stack);
  int64_t w1 = now_ns();
  auto it = pending.find(key);
  if (it != pending.end()) {
    ring[head++ & 0xffff] = {it->second.first, w1, w1 - w0, it->second.second};
    pending.erase(it);
  }
}
TORCH_LIBRARY_IMPL(_c10d_functional, KEY, m) {
  m.impl("all_reduce", torch::CppFunction::makeFromBoxedFunction<&ar_kernel>());
  m.impl("wait_tensor", torch::CppFunction::makeFromBoxedFunction<&wait_kernel>());
}
void set_on(bool v) { on = v; }
int64_t recorded() { return (int64_t)head; }
'''
BELOW = {"AutogradCPU": "c10::after_autograd_keyset", "ADInplaceOrView": "c10::after_ADInplaceOrView_keyset"}


def _op():
    """One traced-path op of hookcost's funcol loop, on a ``fake`` group of its own."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    group, t = dist.group.WORLD, torch.ones(16)
    return lambda: funcol.all_reduce(t, "sum", group).wait()


def _extension(key: str):
    from torch.utils.cpp_extension import load_inline

    source = SOURCE.replace("BELOW", BELOW[key]).replace("TORCH_LIBRARY_IMPL(_c10d_functional, KEY",
                                                         f"TORCH_LIBRARY_IMPL(_c10d_functional, {key}")
    return load_inline(name=f"meshscope_funcol_probe_{key}", cpp_sources=source, functions=["set_on", "recorded"],
                       extra_cflags=["-O2"], verbose=False)


def child(key: str, mode: str, calls: int, blocks: int) -> dict:
    """Training-thread CPU per op, as ``hookcost._ab`` measures it (ABBA blocks, the GC paused)."""
    from tests.support.hookcost import _ab

    ext = None if mode == "none" else _extension(key)
    op = _op()
    if mode != "record":  # one arm: both of _ab's arms the same
        return {"us": _ab(op, lambda: None, lambda: None, calls=calls, blocks=blocks)["without_cpu_us"]}
    made = {"on": False, "ops": 0}

    def run() -> None:
        made["ops"] += made["on"]
        op()

    def switch(on: bool) -> None:
        made["on"] = on
        ext.set_on(on)

    row = _ab(run, lambda: switch(True), lambda: switch(False), calls=calls, blocks=blocks)
    switch(False)
    return {"off_us": row["without_cpu_us"], "record_us": row["overhead_cpu_us"], "record_iqr_us": row["iqr_us"],
            "recorded": ext.recorded(), "ops_on": made["ops"]}


def run_child(key: str, mode: str, calls: int, blocks: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--key", key, "--calls", str(calls),
                          "--blocks", str(blocks)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--key", choices=sorted(BELOW), default="ADInplaceOrView")
    parser.add_argument("--rounds", type=int, default=4, help="alternating process pairs (passthrough)")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--calls", type=int, default=2500)
    parser.add_argument("--child", choices=("none", "off", "record"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag in ("rounds", "blocks", "calls"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)} must be >= 1")
    if args.child:
        print(json.dumps(child(args.key, args.child, args.calls, args.blocks)))
        return
    import torch

    load = os.getloadavg()
    run_child(args.key, "off", 10, 1)  # builds the extension once, outside the timed processes
    record = run_child(args.key, "record", args.calls, args.blocks)
    without, passing = [], []
    for r in range(args.rounds):
        for mode in (("none", "off") if r % 2 == 0 else ("off", "none")):
            (without if mode == "none" else passing).append(run_child(args.key, mode, args.calls, args.blocks)["us"])
    print(json.dumps({
        "torch": torch.__version__, "key": args.key, "load_avg_start": load, "load_avg_end": os.getloadavg(),
        "record": record,
        "passthrough": {"untraced_us": [round(x, 2) for x in without], "kernels_off_us": [round(x, 2) for x in passing],
                        "median_difference_us": round(statistics.median(passing) - statistics.median(without), 2)},
    }, indent=1))


if __name__ == "__main__":
    main()
