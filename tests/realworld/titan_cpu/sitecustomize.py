"""CPU shim for torchtitan 0.3.0 (unchanged, from PyPI) on a machine without an accelerator: CPU ranks on gloo.

The harness (``tests/realworld/titan.py``) puts this folder on the job's PYTHONPATH, so ``site`` imports this
file at start-up in every process of the job; under ``meshscope run`` meshscope's own bootstrap
``sitecustomize`` comes first on PYTHONPATH and runs this one as the next ``sitecustomize`` on ``sys.path``.

It imports nothing at start-up: a finder on ``sys.meta_path`` waits for the four torchtitan modules below and
patches each right after it has executed, before its importer sees it. Every patch is a device-selection
workaround for torchtitan's GPU-only assumptions (each found by running it; file:line are torchtitan
0.3.0's), and none applies where torch sees an accelerator. Deliberately NOT touched: nn.Module, the
optimizer, autograd, torch.distributed's collectives (all things meshscope observes) and torchtitan's
training loop, model, data or metrics output.

Other CPU choices are torchtitan's own command-line options, set by the harness, not here:
``--parallelism.spmd-backend partial_dtensor`` (the default ``spmd_types`` fails inside ``fully_shard``),
``--training.disable-cuda-graphs`` (pipeline parallel), the data set path and tokenizer folder.
"""

import importlib.abc
import importlib.util
import sys
import types

_PATCHES = {}


def _patch(module_name):
    def register(fn):
        _PATCHES[module_name] = fn
        return fn

    return register


def _no_accelerator():
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None


# 1. torchtitan/tools/utils.py:55 ``device_type = _get_available_device_type() or "cuda"`` falls back to
#    "cuda" (and ``device_module`` to torch.cuda) when no accelerator is found, so every rank would ask for
#    a CUDA device. On CPU it must read "cpu". The module-level ``device_type, device_module`` (line 60) are
#    imported by name elsewhere (parallel_dims, distributed/utils, metrics, ...), so they are rebound here,
#    right after tools/utils.py executes and before any of those imports it.
# 2. torchtitan/components/metrics.py:42-62 (DeviceMemoryMonitor) calls ``device_module.get_device_name``,
#    ``get_device_properties(...).total_memory``, ``reset_peak_memory_stats``, ``empty_cache`` and
#    ``memory_stats``: CUDA-only functions that ``torch.cpu`` lacks. The CPU device module below is
#    ``torch.cpu`` plus those five, answering "no allocator statistics" (an empty ``memory_stats``, which
#    torchtitan itself maps to -1) and the machine's physical memory as the capacity.
def _cpu_device_module():
    import os

    import torch

    mod = types.ModuleType("titan_cpu_device")
    mod.__getattr__ = lambda name: getattr(torch.cpu, name)  # set_device, current_device, synchronize, ...
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=total)
    mod.memory_stats = lambda device=None: {}
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.empty_cache = lambda: None
    return mod


@_patch("torchtitan.tools.utils")
def _tools_utils(utils):
    if not _no_accelerator():
        return
    device_module = _cpu_device_module()
    utils.device_type, utils.device_module = "cpu", device_module
    utils.get_device_info = lambda: ("cpu", device_module)


# 3. torchtitan/distributed/utils.py:586 ``barrier(device_ids=[device_module.current_device()])``: on CPU
#    ``current_device()`` is the string "cpu", which c10d's BarrierOptions.device_ids (a list of ints,
#    NCCL's) rejects; gloo needs no device id.
# 4. torchtitan/distributed/utils.py:595 ``torch.distributed.set_timeout(timeout, group)``: torch 2.13 has
#    no public ``set_timeout``; its ``distributed_c10d._set_pg_timeout(timeout, group)`` (same signature,
#    sets gloo's and NCCL's default timeout) is what that call means.
#    ``set_pg_timeouts`` (called once, after the first step, trainer.py:1062) is therefore replaced by the
#    same steps with those two calls fixed: log, barrier, synchronize, set each mesh group's timeout.
@_patch("torchtitan.distributed.utils")
def _distributed_utils(dist_utils):
    if not _no_accelerator():
        return
    import torch
    from torch.distributed.distributed_c10d import _set_pg_timeout

    def set_pg_timeouts(timeout, parallel_dims):
        dist_utils.logger.info(f"Synchronizing and adjusting timeout for all ProcessGroups to {timeout}")
        torch.distributed.barrier()
        dist_utils.device_module.synchronize()
        groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        for group in groups:
            _set_pg_timeout(timeout, group)

    set_pg_timeouts.__doc__ = dist_utils.set_pg_timeouts.__doc__
    dist_utils.set_pg_timeouts = set_pg_timeouts


# 5. Flex attention on CPU. The llama3 models use flex attention (sdpa is refused for language models,
#    torchtitan/models/common/config_utils.py:97), which fails on CPU in two ways:
#    a. torchtitan/models/common/attention.py:277 ``_compiled_flex_attn = torch.compile(flex_attention, ...)``
#       (max_autotune, triton options): inductor fails compiling it on CPU with autograd ("InductorError:
#       IndexError: tuple index out of range", torch 2.13): run the same function eagerly, uncompiled (torch's
#       eager flex_attention is its reference implementation; slower, same math).
#    b. torch/nn/attention/flex_attention.py ``_validate_device`` raises "FlexAttention does not support
#       backward on CPU" for any CPU input that requires grad: a device check only; eager flex attention's
#       backward (the dense math backward of the flex_attention higher-order op) runs on CPU once the check
#       lets it through. The check is kept for every other device and for CPU inputs without grad.
@_patch("torchtitan.models.common.attention")
def _attention(attention):
    if not _no_accelerator():
        return
    import torch.nn.attention.flex_attention as flex

    attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    validate_device = flex._validate_device

    def _validate_device(query, key, value):
        if query.device.type == "cpu":
            return
        validate_device(query, key, value)

    flex._validate_device = _validate_device


# 6. torchtitan/distributed/fsdp.py:41 ``module.set_gradient_divide_factor(1.0)`` (torchtitan scales the
#    gradients itself by the global token count) makes FSDP2 reduce-scatter with ReduceOp.PREMUL_SUM(1.0),
#    which gloo does not implement. FSDP2's own switch ``set_force_sum_reduction_for_comms(True)`` (what
#    torchtitan's enable_fsdp_symm_mem at fsdp.py:51 uses) makes it reduce with SUM and apply the factor
#    itself: the same math. Set on every module torchtitan sets the factor on, right after it does.
@_patch("torchtitan.distributed.fsdp")
def _fsdp(fsdp):
    if not _no_accelerator():
        return
    original = fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model):
        original(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    disable_fsdp_gradient_division.__doc__ = original.__doc__
    fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


# 7. Not a workaround: the test's own count of the collectives, from c10d itself, where the harness asks for
#    it (TITAN_C10D_COUNTS, a folder; in the plain and the observed run alike). Each process group's sequence
#    number (c10d increments it once per collective it issues) is read at the first and at the last optimizer
#    step of the run, through torch's global optimizer-step hook (reading it issues nothing); the two readings
#    per group, with the group's description (DeviceMesh names its groups ``mesh_<dim>``) and size, are
#    written per rank at exit. What meshscope records between the same two points must match, group by group.
def _c10d_counts(optimizer_module):
    import atexit
    import json
    import os

    folder = os.environ.get("TITAN_C10D_COUNTS")
    if not folder:
        return
    readings, hooks = [], [0]

    def reading():
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            return None
        world = c10d.GroupMember.WORLD
        groups = {}
        for pg in list(c10d._world.pg_map):
            try:
                seq = int(pg._get_sequence_number_for_group())
            except RuntimeError:  # a backend without sequence numbers (a mesh dim of size 1 gets a fake one)
                continue
            groups[pg.group_name] = {"seq": seq, "desc": str(pg.group_desc), "size": pg.size(), "world": pg is world}
        return {"rank": dist.get_rank(), "groups": groups}

    def after_step(optimizer, args, kwargs):
        now = reading()
        if now is not None:
            hooks[0] += 1
            readings[min(len(readings), 1):] = [now]  # the first reading stays; the second is the latest

    def write():
        if readings:
            last = readings[-1]
            path = os.path.join(folder, f"rank{last['rank']}.json")
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as f:
                json.dump({"first": readings[0], "last": last, "hooks": hooks[0]}, f)

    optimizer_module.register_optimizer_step_post_hook(after_step)
    atexit.register(write)


if __import__("os").environ.get("TITAN_C10D_COUNTS"):
    _PATCHES["torch.optim.optimizer"] = _c10d_counts


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of the modules in _PATCHES: the patch runs once the module has executed."""

    def __init__(self):
        self._finding = set()

    def find_spec(self, name, path=None, target=None):
        if name not in _PATCHES or name in self._finding:
            return None
        self._finding.add(name)  # find the real spec with the other finders, not ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, _PATCHES.pop(name))
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        self.patch(module)  # a failing patch fails the import: a half-patched torchtitan is worse

    def __getattr__(self, name):
        return getattr(self.inner, name)


sys.meta_path.insert(0, _Finder())
