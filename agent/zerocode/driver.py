"""The zero-code driver: steps, phases, tokens, loss and FLOPs of an unmodified job, from torch's own
hooks, fed to the same ``Telemetry`` the reference trainer uses.

What it hooks (installed once torch is imported; nothing is imported before):
- **steps**: torch's global optimizer step hooks. A step ends at the step of the iteration's last
  optimizer (``_optimizer_done``), at once, so a loss all-reduce after ``optimizer.step()`` belongs to the
  next step, inside its wall. Gradient accumulation needs nothing (one optimizer step per step); a step
  that ``GradScaler`` skips ends when ``GradScaler.step`` returns without an optimizer step (``skipped``).
- **forward**: the outermost module calls with parameters and grad enabled ("roots": the DDP wrapper,
  the FSDP2 root, a plain model). A global forward hook finds them during the first step, then each root
  gets its own hooks and the global ones are removed (a global hook costs a call on every module).
- **backward**: ``torch.autograd.backward`` (what ``Tensor.backward`` calls), where DDP's reducer waits.
- **optimizer**: between the optimizer hooks, less the forward and backward inside (Lightning runs them
  in ``optimizer.step``'s closure).
- **collectives**: the existing tracers (``Telemetry.attach``) on each root as it is found.
- **tokens**: the root's integer (batch, sequence) input (``input_ids`` or the first such tensor).
- **loss**: what the step optimises: the scalars handed to backward in the step (``GradScaler.scale``'s
  input when scaled), summed (gradient accumulation), a scalar equal to the sum of the ones before it
  standing for them (a chunked loss hands each chunk to backward, then their sum to drive the backbone's
  backward: torchtitan's ``ChunkedLossWrapper``); a framework's own logged loss where an integration
  reports one (``framework_loss``). Read when the step's record is built, on the telemetry's flusher
  thread: a CUDA loss never makes the training thread wait for the device.
- **FLOPs**: counted from the modules' parameter shapes at the end of the first step (``census``), never
  inside the job's forward or backward; ``MESHSCOPE_FLOPS=off`` leaves them out.
- **layout**: from the wrappers, the DeviceMesh and the schedules (``census.layout``).
- **pipeline**: each schedule's ``step`` is the ``pipeline`` phase, its stages' spans come from the
  existing ``PipelineTracer``; the roots' forward / backward are not timed inside it (the spans are).

Every hook body is guarded: a failure is counted (``errors``), written as a ``telemetry_error`` event and
said once on stderr; the job runs on unchanged."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any

from meshscope.agent.zerocode import census, detect

_NAN = float("nan")
_IN_FORWARD = "_meshscope_in_forward"  # a root module's open forward calls (an instance attribute)
_MAX_MESHES = 256  # DeviceMeshes remembered (a job that builds them in a loop must not grow the list)
_MAX_LOSSES = 1024  # backward scalars kept for one step (a loop that never steps must not grow)


class Driver:
    def __init__(self, *, store: str, run: str | None, stderr: Any = None, flops: str = "analytic") -> None:
        self.store, self.run = store, run
        self.flops_mode = flops
        self.errors = 0
        self._stderr = stderr
        self._tel: Any = None
        self._closed = False
        self._torch: Any = None
        self._handles: list[Any] = []  # global hooks (removed after the first step)
        self._root_handles: list[Any] = []
        self._roots: dict[int, Any] = {}
        self._inside: set[int] = set()  # the roots' modules: a submodule called on its own is no new root
        self._depth = 0  # module call depth while the global hooks are on
        self._step = self._first_step = 0
        self._last_optimizer: int | None = None  # id of the optimizer whose step ends an iteration
        self._optimizers: set[int] = set()
        self._tokens = 0
        self._seq_len = 0
        self._losses: list[Any] = []
        self._scaled: dict[int, Any] = {}  # id(GradScaler.scale output) -> the unscaled loss
        self._expect_logged = False  # a framework will log this step's loss after its end (framework_loss)
        self._framework = ""
        self._flops = census.Flops(0.0, "absent: no step ended")
        self._late_loss: Any = None  # the ended step's loss, for a framework that logs it after the step
        self._info_written = False
        self._opt_total = 0
        self._lr = 0.0
        self._skipped = False
        self._schedules: list[Any] = []  # pipeline schedules seen, in order (attached once telemetry runs)
        self._meshes: list[Any] = []  # weak references to the DeviceMeshes the job built (_MAX_MESHES)
        self._in_pipeline = 0  # > 0 inside a schedule's step: its spans time the compute, not the roots
        self._thread = 0

    # ------------------------------------------------------------------------------ installation
    def install(self, torch: Any) -> None:
        """Called once ``torch`` is imported: the global hooks and patches."""
        try:
            from torch.nn.modules import module as nn_module
            from torch.optim import optimizer as optim

            self._torch = torch
            self._find_tokens = detect.TokenFinder()
            atexit.register(self.close)
            self._handles += [
                nn_module.register_module_forward_pre_hook(self._find_root_pre),
                nn_module.register_module_forward_hook(self._find_root_post, always_call=True),
            ]
            optim.register_optimizer_step_pre_hook(self._opt_pre)
            optim.register_optimizer_step_post_hook(self._opt_post)
        except Exception as exc:
            self.error("install", exc)
            return
        # Each of the rest on its own: what a torch lacks costs that part only.
        for where, install in (("backward", lambda: detect.patch(torch.autograd, "backward", self._wrap_backward)),
                               ("grad_scaler", self._patch_grad_scaler), ("distributed", self._patch_distributed),
                               ("excepthook", self._chain_excepthook), ("fork", self._on_fork)):
            try:
                install()
            except Exception as exc:
                self.error(f"install.{where}", exc)

    def _on_fork(self) -> None:
        """A forked child (a data-loader worker, a user's fork) is not the rank: it records nothing, and never
        writes the parent's buffered records into the parent's spool at its exit."""
        def in_child() -> None:
            self._closed, self._tel = True, None

        os.register_at_fork(after_in_child=in_child)

    def _patch_grad_scaler(self) -> None:
        detect.patch(self._torch.amp.GradScaler, "scale", self._wrap_scale)
        detect.patch(self._torch.amp.GradScaler, "step", self._wrap_scaler_step)

    def _patch_distributed(self) -> None:
        if not self._torch.distributed.is_available():
            return
        from torch.distributed import distributed_c10d

        from meshscope.agent.zerocode.imports import when_imported

        for owner in (self._torch.distributed, distributed_c10d):
            detect.patch(owner, "destroy_process_group", self._wrap_destroy)
        # pipelining imports dynamo, FSDP and DTensor: only in a job that imports it itself
        when_imported("torch.distributed.pipelining.schedules", self._patch_schedules)
        when_imported("torch.distributed.device_mesh", self._patch_device_mesh)

    def _patch_device_mesh(self, device_mesh: Any) -> None:
        """Each DeviceMesh the job builds is kept (weakly): a mesh no parameter lives on still names a dim of
        the layout (torchtitan's context-parallel mesh is used only inside its attention's code)."""
        import weakref

        meshes = self._meshes

        def make(original):
            def __init__(mesh, *args, **kwargs):
                original(mesh, *args, **kwargs)
                try:
                    if len(meshes) < _MAX_MESHES:
                        meshes.append(weakref.ref(mesh))
                except Exception as exc:
                    self.error("device_mesh", exc)
            return __init__

        try:
            cls = getattr(device_mesh, "DeviceMesh", None)
            if isinstance(cls, type) and "__init__" in vars(cls):
                detect.patch(cls, "__init__", make)
        except Exception as exc:
            self.error("install.device_mesh", exc)

    def job_meshes(self) -> list[Any]:
        """The DeviceMeshes the job built that are still alive, in the order it built them."""
        return [m for m in (ref() for ref in self._meshes) if m is not None]

    def _patch_schedules(self, schedules: Any) -> None:
        try:
            for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
                detect.patch(cls, "step", self._wrap_schedule_step)
        except Exception as exc:
            self.error("install.pipeline", exc)

    def _chain_excepthook(self) -> None:
        """An exception that ends the process is an event: raised inside a collective, the step was aborted
        (a peer failed, or the collective timed out): ``aborted_step``, as the explicit API records it;
        raised anywhere else, the rank ``crash``-ed: the Failures banner's key event. The job's own hook
        (Python's: the traceback) runs after, unchanged."""
        previous = sys.excepthook

        def excepthook(etype, value, tb):
            try:
                if self._tel is not None and not self._closed and not issubclass(etype, KeyboardInterrupt):
                    kind = "aborted_step" if _raised_by_a_collective(self._torch, value, tb) else "crash"
                    self._tel.event(kind, f"{etype.__name__}: {value}"[:500], step=self._step)
            except Exception:
                pass
            previous(etype, value, tb)

        sys.excepthook = excepthook

    def framework(self, *, name: str, step: int = 0, loss_is_sum: bool = False) -> None:
        """A framework integration's word: its name and its global step at the start of training (a resumed
        run keeps its numbering). ``loss_is_sum`` is accepted for the integrations that say so: the backward
        scalars are summed in any case (module docstring)."""
        self._framework = name
        if self._tel is None and step > 0:
            self._step = self._first_step = step

    # ------------------------------------------------------------------------------ hooks
    def _find_root_pre(self, module: Any, args: tuple) -> None:
        self._depth += 1
        if self._depth != 1 or self._closed:
            return
        try:
            if id(module) in self._inside or not self._torch.is_grad_enabled() \
                    or self._torch._C._current_graph_task_id() != -1:
                return  # known, evaluation, or a recompute inside backward (activation checkpointing)
            if not any(p.requires_grad for p in module.parameters()):
                return  # a loss module or a frozen part: not the model
            self._add_root(module)
            self._root_pre(module, args)  # its own pre-hook runs from the next call on
        except Exception as exc:
            self.error("find_root", exc)

    def _find_root_post(self, module: Any, args: tuple, output: Any) -> None:
        self._depth -= 1

    def _add_root(self, module: Any) -> None:
        self._roots[id(module)] = module
        self._inside.update(id(m) for m in module.modules())
        self._root_handles += [
            module.register_forward_pre_hook(self._root_pre, prepend=True),
            # with kwargs: the token ids of a Hugging Face model come as input_ids=...
            module.register_forward_hook(self._root_post, with_kwargs=True, always_call=True),
        ]
        started = self._tel is None
        tel = self._ensure_started(module)
        if tel is not None:
            mesh = None
            if started:  # the first root's mesh labels the collectives with the job's own dims
                try:  # the meshes its parameters live on name a group first, then the others the job built
                    mesh = census.mesh_of(module)
                    mesh += [m for m in self.job_meshes() if all(m is not k for k in mesh)]
                except Exception as exc:
                    self.error("mesh", exc)
            tel.attach(model_parts=[module], mesh=mesh)
            if started:  # the first stage module runs inside the first schedule step
                for schedule in self._schedules:
                    tel.attach(schedule=schedule)

    def _root_pre(self, module: Any, args: tuple) -> None:
        if self._tel is None or self._closed or self._in_pipeline or not self._torch.is_grad_enabled() \
                or threading.get_ident() != self._thread:
            return  # not started, evaluation (no grad), a pipeline stage (its spans are the compute), or
            # a call from another thread than the training thread's (its phases are that thread's)
        try:
            self._tel.push_phase("forward")
            d = module.__dict__
            d[_IN_FORWARD] = d.get(_IN_FORWARD, 0) + 1  # re-entrant calls each pop their own push
        except Exception as exc:
            self.error("forward_pre", exc)

    def _root_post(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        d = module.__dict__
        if not d.get(_IN_FORWARD):
            return
        d[_IN_FORWARD] -= 1
        try:
            self._tel.pop_phase()
            tokens, seq = self._find_tokens(args, kwargs)
            self._tokens += tokens
            self._seq_len = self._seq_len or seq
        except Exception as exc:
            self.error("forward_post", exc)

    def _wrap_backward(self, original):
        def backward(tensors, *args, **kwargs):
            timed = False
            if self._tel is not None and not self._closed and not self._in_pipeline:
                try:
                    self._take_loss(tensors)
                    self._tel.push_phase("backward")
                    timed = True
                except Exception as exc:
                    self.error("backward", exc)
            try:
                return original(tensors, *args, **kwargs)
            finally:
                if timed:
                    self._tel.pop_phase()
        return backward

    def _wrap_scale(self, original):
        def scale(scaler, outputs, *args, **kwargs):
            out = original(scaler, outputs, *args, **kwargs)
            if self._torch is not None and isinstance(out, self._torch.Tensor) and out is not outputs:
                if len(self._scaled) > 64:  # scaled losses never handed to backward
                    self._scaled.clear()
                self._scaled[id(out)] = outputs
            return out
        return scale

    def _wrap_scaler_step(self, original):
        def step(scaler, optimizer, *args, **kwargs):
            before, active = self._opt_total, self._tel is not None and not self._closed
            if active:  # unscaling and its inf check are the optimizer's work (on CUDA: where backward syncs)
                try:
                    self._tel.push_phase("optimizer")
                except Exception as exc:
                    active = False
                    self.error("grad_scaler", exc)
            try:
                return original(scaler, optimizer, *args, **kwargs)
            finally:
                if active:
                    try:
                        self._tel.pop_phase()
                        if self._opt_total == before and not self._closed:
                            self._optimizer_done(optimizer, skipped=True)  # inf/NaN gradients: skipped
                    except Exception as exc:
                        self.error("grad_scaler", exc)
        return step

    def _wrap_schedule_step(self, original):
        def step(schedule, *args, **kwargs):
            pushed = False
            if not self._closed:
                try:
                    if all(schedule is not known for known in self._schedules):
                        self._schedules.append(schedule)
                        if self._tel is not None:
                            self._tel.attach(schedule=schedule)
                    if self._tel is not None:
                        self._tel.push_phase("pipeline")
                        pushed = True
                        tokens, seq = detect.pipeline_tokens(schedule, args, kwargs, self._find_tokens)
                        self._tokens += tokens
                        self._seq_len = self._seq_len or seq
                except Exception as exc:
                    self.error("pipeline", exc)
            self._in_pipeline += 1
            try:
                return original(schedule, *args, **kwargs)
            finally:
                self._in_pipeline -= 1
                if pushed and self._tel is not None:
                    self._tel.pop_phase()
        return step

    def _wrap_destroy(self, original):
        def destroy_process_group(group=None, *args, **kwargs):
            if group is None or group is getattr(self._torch.distributed.group, "WORLD", None):
                self.close()  # the collectives' hooks come off before their groups are gone
            return original(group, *args, **kwargs)
        return destroy_process_group

    def _opt_pre(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if self._tel is None or self._closed:
            return
        try:
            self._tel.push_phase("optimizer")
        except Exception as exc:
            self.error("optimizer_pre", exc)

    def _opt_post(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        self._opt_total += 1
        if self._tel is None or self._closed:
            return
        try:
            self._tel.pop_phase()
            lr = optimizer.param_groups[0].get("lr", 0.0) if optimizer.param_groups else 0.0
            # a tensor lr on the device would cost a synchronisation per step to read: not read
            self._lr = lr if not isinstance(lr, self._torch.Tensor) else float(lr) if lr.is_cpu else _NAN
            self._optimizer_done(optimizer, skipped=False)
        except Exception as exc:
            self.error("optimizer_post", exc)

    # ------------------------------------------------------------------------------ steps
    def _optimizer_done(self, optimizer: Any, *, skipped: bool) -> None:
        """The step ends with the iteration's last optimizer: the first optimizer to step is taken as the
        last one; an optimizer never seen before steps later in the iteration, and becomes the last one
        (it does not end a step: its work belongs to the iteration the previous end cut, which the next
        step then holds with the following iteration). One optimizer: every step ends at its step.
        Several: from the second step on, each step is one iteration."""
        self._skipped = self._skipped or skipped
        key = id(optimizer)
        if key not in self._optimizers:
            self._optimizers.add(key)
            first = self._last_optimizer is None
            self._last_optimizer = key
            if not first:
                return
        if key != self._last_optimizer:
            return
        self._end_step()

    def _end_step(self) -> None:
        tel = self._tel
        try:  # the step's figures: each one that fails is absent, the step itself is still recorded
            if not self._info_written:
                self._remove(self._handles)  # the roots are known: no hook on every module call from now on
                self._write_info()
            tokens = self._tokens
            expect = self._expect_logged
            loss = (StepLoss(self._losses, expect_logged=expect, several_models=len(self._optimizers) > 1)
                    if self._losses or expect else None)
            self._late_loss, self._expect_logged = loss, False
            tel.update_step(tokens=tokens, flops=self._flops.per_step(tokens), loss=loss, lr=self._lr,
                            skipped=self._skipped)
        except Exception as exc:
            self.error("step_values", exc)
        open_phases = tel.open_phases()  # e.g. Lightning's next optimizer.step, already entered
        tel.end_step()
        self._tokens, self._losses, self._skipped = 0, [], False
        self._step += 1
        tel.begin_step(self._step)
        for name in open_phases:
            tel.push_phase(name)

    def _take_loss(self, tensors: Any) -> None:
        torch = self._torch
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1 and len(self._losses) < _MAX_LOSSES:
            # detached: the flusher reads the value, the job's graph is not kept alive by it
            self._losses.append(self._scaled.pop(id(tensors), tensors).detach())

    def expect_logged_loss(self, *, framework: str) -> None:
        """The framework will log the open step's loss after the step ends (``framework_loss``)."""
        self._framework = self._framework or framework
        self._expect_logged = True

    def framework_loss(self, value: Any) -> None:
        """A framework's own logged loss for the step that just ended (torchtitan logs it after the
        optimizer step, with its cross-rank reduction): it replaces the backward scalars' sum in that
        step's record, if the record is not built yet (the flusher holds a step with an open ``StepLoss``
        for up to its hold time)."""
        loss = self._late_loss
        if loss is not None:
            loss.logged = value

    # ------------------------------------------------------------------------------ lifecycle
    def _ensure_started(self, module: Any) -> Any:
        if self._tel is not None or self._closed:
            return self._tel
        from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig

        if detect.instrumented_by_api(self._torch):  # e.g. the reference trainer under meshscope run
            self._stand_down("this process records through meshscope's API already")
            return None
        where = detect.process(module)
        self._where = where
        self._thread = threading.get_ident()  # the training thread: the one that runs the model first
        run = self.run or detect.shared_run_name()
        self._tel = Telemetry(config=TelemetryConfig(store=self.store, run=run, flops=self.flops_mode), rank=where.rank,
                              world_size=where.world_size, local_rank=where.local_rank, attempt=where.attempt,
                              device=where.device)
        self._tel.begin_step(self._step)
        return self._tel

    def _write_info(self) -> None:
        self._info_written = True
        roots = list(self._roots.values())
        try:
            lay = census.layout(roots, world_size=self._where.world_size, rank=self._where.rank,
                                pipeline=detect.pipeline(self._schedules), meshes=self.job_meshes())
        except Exception as exc:
            self.error("layout", exc)
            lay = None
        try:
            self._flops = census.flops(roots, seq_len=self._seq_len, layout=lay or census.JobLayout(),
                                       mode=self.flops_mode) if lay is not None else \
                census.Flops(0.0, "absent: the layout could not be read")
        except Exception as exc:
            self.error("flops", exc)
            self._flops = census.Flops(0.0, f"absent: {type(exc).__name__} while counting")
        try:
            info = detect.run_info(roots=roots, where=self._where, seq_len=self._seq_len, tokens=self._tokens,
                                   flops=self._flops, layout=lay, framework=self._framework,
                                   schedules=self._schedules)
        except Exception as exc:  # the run still gets its record: what Telemetry knows of the process
            self.error("run_info", exc)
            info = {"config": {"zero_code": True, "framework": self._framework}}
        self._tel.start(info)

    def close(self) -> None:
        """At exit or ``destroy_process_group``: an iteration that made no optimizer step is not a step."""
        if self._closed:
            return
        self._closed = True
        tel = self._tel
        try:
            self._remove(self._handles)
            self._remove(self._root_handles)
            if tel is None:
                return
            tel.discard_step()  # the open iteration made no optimizer step
            if not self._info_written:
                self._write_info()
            tel.event("end", f"{self._step} steps observed (zero-code)")
        except Exception as exc:
            self.error("close", exc)
        if tel is None:
            return
        try:
            tel.close()  # whatever failed above: the buffered records are written, the patches removed
            writer = tel._writer
            dropped = tel.dropped_records + int(getattr(writer, "dropped_records", 0))
            if dropped:  # the job went on; say once what telemetry lost, and why
                why = getattr(writer, "last_error", "") or "buffers full"
                self._say(f"rank {self._where.rank}: {dropped} telemetry records could not be written to "
                          f"{self.store} ({why}); the job was not affected")
        except Exception as exc:
            self.error("close", exc)

    def _stand_down(self, why: str) -> None:
        self._closed = True
        self._remove(self._handles)
        self._remove(self._root_handles)
        self._say(f"zero-code observation stands down: {why}")

    def _say(self, message: str) -> None:
        """One ``meshscope:`` line on stderr, in one write: the ranks share the job's stderr, and ``print``'s
        separate write of the newline let two ranks' lines run together (and leave an empty line)."""
        stream = self._stderr or sys.stderr
        stream.write(f"meshscope: {message}\n")
        stream.flush()

    @staticmethod
    def _remove(handles: list[Any]) -> None:
        while handles:
            handles.pop().remove()

    def error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        try:
            if self._tel is not None:
                self._tel.record_error(f"zerocode.{where}", exc)
            if self.errors == 1:
                self._say(f"telemetry error in {where} ({type(exc).__name__}: {exc}); counted, the job goes on")
        except Exception:
            pass


# where a collective's failure is raised: torch's c10d and functional collectives, and meshscope's wrappers
# of them (an async op's wait raises there)
_COLLECTIVE_CODE = ("torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives",
                    "torch/distributed/c10d_logger.py", "/agent/instrument/comm_", "/agent/instrument/traced_call.py")


def _raised_by_a_collective(torch: Any, exc: BaseException, tb: Any) -> bool:
    """torch's distributed error types, or an error raised in the innermost frame of a collective call
    (gloo's errors are plain RuntimeErrors): a peer failed or the collective timed out."""
    dist_error = getattr(torch.distributed, "DistError", None) if torch is not None else None
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    import traceback

    frames = list(traceback.walk_tb(tb))
    if not frames:
        return False
    path = frames[-1][0].f_code.co_filename.replace("\\", "/")
    return any(part in path for part in _COLLECTIVE_CODE)


class StepLoss:
    """A step's loss, read when its record is built (``readout.read_loss`` calls ``item``) on the flusher
    thread: the scalars handed to backward, summed, a scalar equal to the sum of the ones since the last
    such one standing for them (a chunked loss: module docstring of ``driver``); or ``logged``, the
    framework's own figure when an integration reported one in time. ``item`` raises ``LookupError`` when
    the step has no single loss: none handed to backward, or several models each with its own optimizer
    and its own loss (a GAN's discriminator and generator: their sum is no loss the job optimises)."""

    __slots__ = ("tensors", "logged", "expect_logged", "several_models")

    def __init__(self, tensors: list[Any], *, expect_logged: bool = False, several_models: bool = False) -> None:
        self.tensors, self.logged, self.expect_logged = tensors, None, expect_logged
        self.several_models = several_models

    @property
    def pending(self) -> bool:
        """A framework that logs its loss after the step has not yet (``stepstate.ready_steps`` holds the
        step's record for it, a bounded time)."""
        return self.expect_logged and self.logged is None

    def item(self) -> float:
        import math

        if self.logged is not None:
            return float(self.logged)
        terms = loss_terms([float(t) for t in self.tensors])
        if not terms or (self.several_models and len(terms) > 1):
            raise LookupError("no single loss in this step")
        return math.fsum(terms)


def loss_terms(values: list[float]) -> list[float]:
    """A step's backward scalars, each one equal (to 1e-5) to the sum of at least two before it since the
    last such one replacing them (a chunked loss's total after its chunks): what the step's loss sums."""
    import math

    done: list[float] = []
    pending: list[float] = []
    for v in values:
        if len(pending) >= 2 and math.isclose(v, math.fsum(pending), rel_tol=1e-5, abs_tol=1e-9):
            done.append(v)
            pending = []
        else:
            pending.append(v)
    return done + pending
