"""The in-process telemetry core: what a training loop calls.

    tel = Telemetry(config=TelemetryConfig(store="runs", run="exp1"), rank=rank, world_size=world)
    tel.start(run_info)                                  # one `run` record
    tel.attach(model_parts=parts, mesh=mesh, schedule=schedule)
    for step in range(steps):
        with tel.step(step) as s:
            with tel.phase("data"): ...
            with tel.phase("forward"): ...
            with tel.phase("backward"): ...
            with tel.phase("optimizer"): ...
            s.update(loss=loss, tokens=tokens, flops=flops)
    tel.close()

Step time accounting (per rank), wall = compute + exposed_comm + bubble + other:
- exposed_comm: time the training thread was blocked on collectives (not a stage waiting for the other
  stages: P2P sends/receives and collectives over the pp dim; hooks report each op's ``wait_s`` on the
  thread that waited);
- bubble: the pipeline phase's time − Σ compute spans − its non-pipeline waits outside spans, i.e. the
  stage's idle time including its P2P waits (on CPU a P2P wait cannot be split into transfer and idle;
  both are time the stage had nothing to compute), plus its waits in collectives over pp after the
  schedule (the drain: the last stage waiting for the first one's final backward;
  ``agent.contract.is_stage_wait``);
- compute: time in compute phases (forward, backward, optimizer, pipeline, compute) minus the waits and
  bubble inside them (``optimizer_s`` likewise: the optimizer phase minus its waits);
- other: the rest (data loading, logging, host overhead between phases).

The training thread does only what cannot be deferred: per step, a clock read and a read of its own CPU
time at each boundary (one for both when a step begins within ``SHARED_BOUNDARY_S`` of the last one's end,
on the same thread: back-to-back steps tile time) and one append of the ended step; per phase, a clock
read; per traced op or pipeline span, what ``CollectiveTracer`` / ``PipelineTracer`` say. The flusher
thread builds every record: the ops' and spans' rows, each op's share of its step (``account_deferred``),
the step row (tensor values such as a CUDA loss read there: no device sync on the training thread), the
memory sample, then hands the rows to the spool writer. Every buffer is bounded: what does not fit is
counted as dropped, never raised.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from meshscope.agent import version
from meshscope.agent.contract import (
    SCHEMAS, AnchoredClock, Clock, StepRecord, collective_record, event_record, hang_record, run_record, span_record,
    algbw, busbw_factor, spool_path,
)
from meshscope.agent.instrument import flightrec, hangdump, memory, runenv
from meshscope.agent.instrument.cpu import ThreadCPU
from meshscope.agent.instrument.deeptrace import for_telemetry as deeptrace_for
from meshscope.agent.instrument.config import TelemetryConfig
from meshscope.agent.instrument.readout import hang_message, take_all, tracer_losses
from meshscope.agent.instrument.recorder import DIRECT
from meshscope.agent.instrument.stepstate import (
    Live, PendingSteps, StepContext, StepState, account, flat_segments, pop_phase as _pop_phase, ready_steps,
    span_microbatch, step_rows,
)

# A step that begins this soon after the last one ended begins at that end (see the module docstring): what
# separates them then is the loop's own turn-around, not work of its own.
SHARED_BOUNDARY_S = 50e-6
CUDA_HOLD_S = 2.0  # how long an ended step waits for its CUDA ops still on the GPU (stepstate.ready_steps)
# A run record's fields the caller's info does not give: empty, not NULL (every rank writes the same columns).
_RUN_DEFAULTS = {f.name: ("" if f.type == "string" else 0) for f in SCHEMAS["run"]}
# Where a built step row (a tagged tuple: ``records.record_factory``) holds its loss and its flag.
_LOSS, _NONFINITE = (1 + StepRecord._fields.index(f) for f in ("loss", "loss_nonfinite"))


class Telemetry:
    """Per-rank recorder. Implements ``agent.instrument.recorder.Recorder`` for the hooks."""

    def __init__(self, *, config: TelemetryConfig, rank: int, world_size: int, local_rank: int = 0, attempt: int = 0,
                 clock: Clock | None = None, writer: Any = None, device: Any = None) -> None:
        self.config = config
        self.rank, self.world_size, self.local_rank, self.attempt = rank, world_size, local_rank, attempt
        self.clock = clock or AnchoredClock()
        self._device = device
        self._cpu = ThreadCPU()
        self._bufs = {kind: collections.deque() for kind in SCHEMAS}
        self.dropped_records = 0  # rows refused by the bounded buffers
        self.errors = 0
        self._peak_flops = 0.0
        self._cur: StepState | None = None
        self._last_step = -1
        self._last_end: tuple[float, Any, int] | None = None  # the last step end's (t_end, CPU reading, thread)
        self._tracers: list[Any] = []
        # the tracers' flush / drain methods; every tracer ever attached, kept after detach: the losses they
        # count are part of each step row's dropped_records_total, a counter in /metrics that only grows
        self._flushes = self._drains = self._counted = ()
        self._ptracer: Any = None  # the pipeline tracer whose spans each step takes (attach)
        # What to add to a perf_counter reading for this clock's time: hot paths (collective tracer, pipeline
        # spans, phases) take raw perf_counter readings; records are stamped in the clock's time.
        self.epoch = (self.clock.offset() if type(self.clock) is AnchoredClock
                      else self.clock.now() - time.perf_counter())
        self.live = Live()  # the open step, read by the collective tracer's hot path
        # Ended steps waiting for the flusher to build their records (the end's figures held on each)
        self._ended: collections.deque[StepState] = collections.deque()
        self._held: list[StepState] = []  # ended, waiting for their CUDA ops (the flusher's own)
        self._pending = PendingSteps()  # steps begun and not built yet, by key (their ops name them so)
        self._writer = writer if writer is not None else self._open_writer()
        # Hang watchdog state: the training thread (the one that builds the Telemetry), the last time it
        # made progress (a step boundary or a completed collective), and whether this stall was reported.
        self._train_thread = threading.get_ident()
        self._progress_t = self.clock.now()
        self._hang_reported = False
        self._loss_bad = False  # the last built step's loss was non-finite (one event per streak)
        self._last_coll: tuple[str, str, int] | None = None
        # per group name: the last completed op's (op, seq, t_end, dim, size), and the recent steps' walls
        # (the flusher's own): what the hang record and the adaptive threshold read
        self._completed: dict[str, tuple] = {}
        self._walls: collections.deque[float] = collections.deque(maxlen=hangdump.RECENT_STEPS)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._census = memory.TensorCensus(on_error=self.record_error)
        # ``meshscope trace``: the flusher looks for a request and arms a session here, which the training
        # thread runs at its step boundaries (agent.instrument.deeptrace); None costs one check per boundary
        self._tracing: Any = None
        self._deeptrace = deeptrace_for(self)
        self._flusher = threading.Thread(target=self._flush_loop, name="meshscope-flush", daemon=True)
        self._flusher.start()

    # ------------------------------------------------------------------------------------ lifecycle
    def _open_writer(self):
        from meshscope.agent.transport import SpoolWriter

        run, rank, attempt = self.config.run, self.rank, self.attempt
        return SpoolWriter(path=spool_path(self.config.store, run=run, rank=rank, attempt=attempt), run=run, rank=rank,
                           attempt=attempt, host=socket.gethostname(), max_hold_bytes=self.config.spool_hold_bytes)

    def start(self, info: dict[str, Any]) -> None:
        """Write this rank's ``run`` record. ``info`` holds run-level fields of agent.contract's 'run'
        (strategy, mesh, schedule, model sizes, flops_per_token, peak_flops, ...); the rest is filled here."""
        self._peak_flops = float(info.get("peak_flops") or 0.0) if self.config.flops != "off" else 0.0
        if self.config.flops == "off":
            info = {**info, "flops_per_token": 0.0, "flops_method": "off"}
        import torch

        row = {
            "rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
            "host": socket.gethostname(), "pid": os.getpid(), "attempt": self.attempt, "t_start": self.clock.now(),
            "torch_version": torch.__version__, "meshscope_version": version(),
            "python_version": platform.python_version(),
            "environment": self._environment(info),
        }
        for key, value in info.items():
            row.setdefault(key, json.dumps(value, sort_keys=True) if isinstance(value, dict) else value)
        self._push("run", run_record(**{name: row.get(name, default) for name, default in _RUN_DEFAULTS.items()}))
        self.event("start", f"rank {self.rank} of {self.world_size} attempt {self.attempt}")

    def _environment(self, info: dict[str, Any]) -> str:
        """The run record's ``environment`` (JSON); "{}" where reading it failed (counted, never raised)."""
        cuda = str(info.get("device") or "cpu") != "cpu" or getattr(self._device, "type", "") == "cuda"
        try:
            return json.dumps(runenv.environment(cuda=cuda), sort_keys=True)
        except Exception as e:  # noqa: BLE001 - a probe of the host never fails the job
            self.record_error("environment", e)
            return "{}"

    def attach(self, *, model_parts: list | None = None, mesh: Any = None, schedule: Any = None,
               stages: list | None = None) -> None:
        """Attach collective tracing to the model (DDP / FSDP2 / TP / plain c10d) and span tracing to a
        pipeline schedule. Safe to call once per component; every hook is reversible (``close``)."""
        from meshscope.agent.instrument.collectives import CollectiveTracer
        from meshscope.agent.instrument.meshinfo import MeshInfo
        from meshscope.agent.instrument.pipeline import PipelineTracer

        try:
            self._census.add_modules(model_parts or [])
            # One tracer patches the process: a later call (the zero-code driver, as it finds each model)
            # adds the models' hooks to it.
            tracer = next((t for t in self._tracers if isinstance(t, CollectiveTracer)), None)
            if tracer is None:
                tracer = CollectiveTracer(self, mesh_info=MeshInfo(mesh), ddp_comm_hook=self.config.ddp_comm_hook)
                self._tracers.append(tracer)
                self._index_tracers()
            tracer.attach(model_parts or [])
            if schedule is not None:
                ptracer = PipelineTracer(self, deferred=True)
                ptracer.attach(schedule, stages)
                self._tracers.append(ptracer)
                self._index_tracers()
                self._ptracer = ptracer
        except Exception as exc:  # instrumentation must never take training down
            self.record_error("attach", exc)

    def detach(self) -> None:
        """Remove every hook ``attach`` installed (the recorder stays open; ``attach`` may be called again)."""
        for tracer in reversed(self._tracers):
            try:
                tracer.detach()
            except Exception as exc:
                self.record_error("detach", exc)
        self._loose_spans(self._last_step)
        self._ptracer = None
        self._tracers.clear()
        self._index_tracers()

    def close(self, timeout_s: float = 5.0) -> None:
        self._call_each((self._deeptrace.close,), "deeptrace")  # a trace still running ends with what it has
        self.detach()
        self._census.close()
        self._stop.set()
        self._wake.set()
        self._flusher.join(timeout_s)
        self._drain()
        self._cpu.close()
        try:
            self._writer.close(timeout_s=timeout_s)
        except Exception:
            self.errors += 1

    # ------------------------------------------------------------------------------------ step API
    def begin_step(self, step: int) -> StepContext:
        """Start step ``step`` now (the explicit ``step()`` and the zero-code driver both use this)."""
        if self._tracing is not None:  # a deep trace armed or running: its profiler starts before the clock read
            self._tracing = self._tracing.begin_step(step)
        t_start, last, self._last_end = self.clock.now(), self._last_end, None
        if last is not None and t_start - last[0] <= SHARED_BOUNDARY_S and last[2] == threading.get_ident():
            # Back to back with the step that just ended (same thread): it begins at that end, with that
            # end's CPU reading. The steps tile time, and the one /proc read saved is a fifth of this
            # boundary's cost to the training thread.
            t_start, cpu0 = last[0], last[1]
        else:
            cpu0 = self._cpu.read()
        state = self._pending.begin(step, t_start, cpu0)
        self._cur = self.live.step = state
        self.live.key = state.key
        if t_start >= self._progress_t:  # _progress, inline
            self._progress_t, self._hang_reported = t_start, False
        return StepContext(state)

    def end_step(self) -> None:
        """End the current step now (its record is built here); nothing when no step is open."""
        if self._cur is not None:
            self._end_step(self._cur)

    def step_keys(self) -> Any:  # at(t): Live.key at clock time t, among the steps not built yet
        return self._pending.key_finder()

    def update_step(self, **values: Any) -> None:
        """``StepContext.update`` for the open step (nothing when none is open)."""
        if self._cur is not None:
            self._cur.values.update(values)

    def open_phases(self) -> list[str]:
        """The open step's phases, outermost first."""
        state = self._cur
        return [] if state is None or state.phase is None else [*state.outer, state.phase]

    def discard_step(self) -> None:
        """Drop the open step without a record (zero-code: an iteration that made no optimizer step). Its
        pipeline spans are recorded, not left for the next step's accounting."""
        state, self._cur, self.live.step, self.live.key = self._cur, None, None, None
        self._last_end = None
        if state is not None:
            self._pending.forget(state)
            self._loose_spans(state.step)

    def _loose_spans(self, step: int) -> None:
        """Spans of a step that did not end (aborted, discarded, detached mid-step): recorded, not accounted."""
        if self._ptracer is None:
            return
        for stage, microbatch, kind, t0, t1 in self._ptracer.take():
            self._push("span", span_record(step=step, stage=stage, microbatch=span_microbatch(microbatch), kind=kind,
                                           t_start=t0 + self.epoch, t_end=t1 + self.epoch))

    def abort_step(self, exc: BaseException) -> None:
        """An aborted step (e.g. a peer died and the collective failed) is not a completed step: no step
        record (it would run ahead of the failed rank and report a non-finite loss that never happened),
        an event saying why."""
        state, self._cur, self._last_end = self._cur, None, None
        self.live.step = self.live.key = None
        if state is not None:
            self._pending.forget(state)
            self._loose_spans(state.step)
            self.event("aborted_step", f"step {state.step} aborted: {type(exc).__name__}: {exc}"[:500], step=state.step)
            self._wake.set()

    @contextmanager
    def step(self, step: int) -> Iterator[StepContext]:
        ctx = self.begin_step(step)
        try:
            yield ctx
        except BaseException as exc:  # goes on to the user's code
            self.abort_step(exc)
            raise
        self._end_step(ctx._state)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        state = self._cur
        if state is None or state.phase is not None:  # outside a step, or nested: time the outer only
            yield
            return
        self.push_phase(name)
        try:
            yield
        finally:
            self.pop_phase()

    def push_phase(self, name: str) -> None:
        """Enter phase ``name``; a phase already open is paused until the matching ``pop_phase`` (the
        zero-code driver nests: Lightning runs forward and backward inside ``optimizer.step``)."""
        state = self._cur
        if state is None:
            return
        now = time.perf_counter()
        if state.phase is not None:
            state.phases[state.phase] = state.phases.get(state.phase, 0.0) + now - state.phase_t0
            state.segments.append((state.phase, state.phase_t0, now))
            state.outer += (state.phase,)
        state.phase, state.phase_t0 = name, now

    def pop_phase(self) -> None:
        """Leave the innermost phase and resume the one it paused."""
        if self._cur is not None:
            _pop_phase(self._cur)

    def event(self, kind: str, message: str = "", *, step: int | None = None) -> None:
        self._push("event", event_record(t=self.clock.now(), step=self._last_step if step is None else step, kind=kind,
                                        message=message))

    def flush(self) -> None:  # the flusher drains now (e.g. before an intentional exit); no wait for disk
        self._wake.set()

    # ------------------------------------------------------------------------------- Recorder API
    def record_collective(self, *, op: str, dim: str, group: str, group_size: int, nbytes: int, t_start: float,
                          t_end: float, wait_s: float, peer: int = -1, source: str, seq: int = 0,
                          context: Any = DIRECT, mesh_dim: str = "") -> None:
        """One collective record. A direct caller's op is accounted to the open step now; the tracer's
        deferred records (``context``: the ``live.key`` of the step the op completed in, or for a CUDA op
        was queued in) are accounted when their step's record is built (``_build_step``)."""
        if context is DIRECT:
            state = self._cur
            if state is not None:
                account(state, op, dim, wait_s, state.phase, state.span_depth == 0)
            step = state.step if state is not None else self._last_step
        elif context is not None:  # a StepState.key: that step's record is not built yet, unless gone
            state = self._pending.get(context)
            if state is not None:
                if state.colls is None:
                    state.colls = []
                state.colls.append((op, dim, t_end - self.epoch, wait_s))
                step = state.step
            else:
                step = self._pending.step_of(context, self._last_step)
        else:
            step = self._last_step
        duration = t_end - t_start
        try:
            alg = algbw(nbytes, duration)
            bus = alg * busbw_factor(op, max(1, group_size))
        except ValueError:  # an op outside the nccl-tests table: no bus-bandwidth figure
            alg = bus = float("nan")
        seq = seq or self._next_seq(group)
        self._push("collective", collective_record(
            step=step, op=op, dim=dim, group=group, group_size=group_size, seq=seq, bytes=nbytes, t_start=t_start,
            t_end=t_end, duration_s=duration, wait_s=wait_s, algbw=alg, busbw=bus, peer=peer, source=source,
            mesh_dim=mesh_dim))
        self._last_coll = (op, dim, seq)
        done = self._completed.get(group)
        if done is None or seq >= done[1]:
            self._completed[group] = (op, seq, t_end, dim, group_size)
        self._progress(t_end)

    def record_span(self, *, stage: int, microbatch: int, kind: str, t_start: float, t_end: float) -> None:
        state = self._cur
        self._push("span", span_record(step=state.step if state else self._last_step, stage=stage, microbatch=microbatch,
                                      kind=kind, t_start=t_start, t_end=t_end))
        if state is not None:
            state.span_time += t_end - t_start
            state.span_kind_time[kind] = state.span_kind_time.get(kind, 0.0) + t_end - t_start

    def record_error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors <= 20:  # a broken hook must not flood the spool
            self.event("telemetry_error", f"{where}: {type(exc).__name__}: {exc}"[:500])

    def _span_enter(self) -> None:
        if self._cur is not None:
            self._cur.span_depth += 1

    def _span_exit(self) -> None:
        if self._cur is not None and self._cur.span_depth > 0:
            self._cur.span_depth -= 1

    # ----------------------------------------------------------------------------------- internals
    _seq: dict[str, int]

    def _next_seq(self, group: str) -> int:
        seqs = self.__dict__.setdefault("_seq", {})
        n = seqs[group] = seqs.get(group, 0) + 1
        return n

    def _push(self, kind: str, row: tuple) -> None:
        """Buffer one record of ``kind`` (its ``agent.contract.RECORDS`` type, not checked here: the writer
        thread rejects and counts anything else, so the training thread pays one append)."""
        buf = self._bufs[kind]
        if len(buf) >= self.config.max_rows_per_kind:
            self.dropped_records += 1
            return
        buf.append(row)

    def _end_step(self, state: StepState) -> None:
        """The training thread's part of a step's end: close its phases, read the two clocks, take the
        step's pipeline spans, queue it all for the flusher, which builds the records (``_build_step``)."""
        try:
            while state.phase is not None:  # phases still open (zero-code: a step ended inside one) end here
                _pop_phase(state)
            for pending, flush in self._flushes:  # async ops completed without a Python-visible wait
                if pending is None or pending:  # (none pending: not called, ~0.2 µs a step)
                    self._call_each((flush,), "tracer_flush")
            state.t_end = self.clock.now()
            state.cpu_end = self._cpu.read()
            self._last_end = (state.t_end, state.cpu_end, threading.get_ident())
            state.segments = flat_segments(state.segments)
            if self._ptracer is not None:
                state.spans = self._ptracer.take()
            state.tensors = self._census.take()
            if len(self._ended) >= self.config.max_rows_per_kind:
                self.dropped_records += 1
                self._pending.forget(state)
            else:
                self._ended.append(state)
        except Exception as exc:
            self.record_error("end_step", exc)
            self._pending.forget(state)  # no record: it gets no ops either
        finally:
            self._last_step = state.step
            self._cur = self.live.step = self.live.key = None
            self._progress(state.t_end or self.clock.now())  # the end just read: no third clock reading per step
            if self._tracing is not None:  # a deep trace's step ends after the clock read; its N-th stops it
                self._tracing = self._tracing.end_step(state.step)

    def _build_step(self, state: StepState, *, memory_now: dict) -> None:
        """Runs on the flusher thread: the step's span rows, its step row (the accounting of the module
        docstring, ``stepstate.step_rows``) and its memory sample. ``memory_now`` holds this drain's
        ``memory.readings``, read by the first step that samples."""
        self._pending.forget(state)
        try:
            lost = tracer_losses(self._counted)
            dropped = self.dropped_records + int(getattr(self._writer, "dropped_records", 0)) + lost
            span_rows, step_row = step_rows(state, t_end=state.t_end, cpu_end=state.cpu_end, spans=state.spans,
                                            epoch=self.epoch, peak_flops=self._peak_flops, dropped=dropped)
            for row in span_rows:
                self._push("span", row)
            self._push("step", step_row)
            if state.t_end is not None:
                self._walls.append(state.t_end - state.t_start)
            bad = bool(step_row[_NONFINITE])
            if bad and not self._loss_bad:  # the first of a streak: a diverged job is one event, not one a step
                self.event("nonfinite_loss", f"loss {step_row[_LOSS]} at step {state.step}", step=state.step)
            self._loss_bad = bad
            # Sampled here, not at the step's end on the training thread: /proc reads and the allocator's
            # stats are process-wide, so the flusher reads them later, once per drain (memory.readings).
            if state.step % self.config.memory_every == 0 or state.tensors != memory.NOT_MEASURED:
                if not memory_now:
                    memory_now.update(memory.readings(self._device_or_cpu()))
                self._push("memory", memory.sample(state.step, state.t_end, memory_now, state.tensors))
        except Exception as exc:
            self.record_error("end_step", exc)

    def _index_tracers(self) -> None:
        # Bound methods, gathered once: a getattr loop cost every step boundary 0.4 µs (bench/hooks_overhead.py)
        # (what a tracer's flush works on, its step-end call skipped while empty; None: always called), flush
        self._flushes = tuple((getattr(t, "flush_pending", None), t.flush) for t in self._tracers if hasattr(t, "flush"))
        self._drains = tuple(t.drain for t in self._tracers if hasattr(t, "drain"))
        self._counted = tuple(dict.fromkeys((*self._counted, *self._tracers)))

    def _call_each(self, calls: tuple, where: str) -> None:
        for call in calls:
            try:
                call()
            except Exception as exc:  # counted, never the caller's end
                self.record_error(where, exc)

    def _device_or_cpu(self):
        if self._device is None:
            import torch

            self._device = torch.device("cpu")
        return self._device

    def _flush_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.flush_interval_s)
            self._wake.clear()
            self._drain()
            self._check_hang()
            self._call_each((self._deeptrace.poll,), "deeptrace")  # one stat a second at most

    def _progress(self, t: float) -> None:
        if t >= self._progress_t:  # records drained late carry older times: progress never goes back
            self._progress_t, self._hang_reported = t, False

    def _check_hang(self) -> None:
        """Runs on the flusher thread. After the hang threshold (``hangdump.hang_threshold_s``) without
        progress, one ``hang`` event per stall that says where the training thread is: blocked in a
        collective (a torch.distributed frame is on its stack, or the autograd engine, where DDP's reducer
        waits) or not in a collective — in synchronous training the rank that is NOT in a collective is
        the one the others wait for — and one ``hang`` record with every thread's stack and each group's
        entered and completed sequence numbers (``hangdump``), from which dashboard.hang names the culprit."""
        if self._hang_reported:
            return
        c = self.config
        stalled = self.clock.now() - self._progress_t
        limit = hangdump.hang_threshold_s(after_s=c.hang_after_s, first_step_s=c.hang_first_step_s,
                                          min_s=c.hang_min_s, walls=tuple(self._walls))
        if not limit or stalled < limit:
            return
        self._hang_reported = True
        try:
            state = self._cur
            step = state.step if state else self._last_step
            self.event("hang", hang_message(sys._current_frames().get(self._train_thread), state=state,
                                            last_step=self._last_step, last_coll=self._last_coll,
                                            stalled_s=stalled), step=step)
            tables = [t.groups for t in self._tracers if hasattr(t, "groups")]
            self._push("hang", hang_record(t=self.clock.now(), step=step, since_s=stalled,
                                           phase=(state.phase or "") if state else "",
                                           **hangdump.hang_fields(train_thread=self._train_thread, tables=tables,
                                                                  completed=dict(self._completed))))
            self._wake.set()
        except Exception as exc:
            self.record_error("hang_watchdog", exc)
        if c.flight_recorder_dir:  # torch's own record of the same stall, for its analyser
            try:
                flightrec.dump(c.flight_recorder_dir, rank=self.rank)
            except Exception as exc:
                self.record_error("flight_recorder", exc)

    def _drain(self) -> None:
        # Records whose building was deferred off the training thread. The ended steps are taken first: every
        # collective of a step was queued before the step itself, so once the tracers are drained below, each
        # step taken here has its collectives accounted before its record is built (CUDA ops: ready_steps).
        ended = self._held + take_all(self._ended)
        self._call_each(self._drains, "tracer_drain")
        try:
            ready, self._held = ready_steps(ended, tracers=self._tracers, now=self.clock.now(),
                                            hold_s=CUDA_HOLD_S)
        except Exception as exc:  # never the flusher's end: the steps are built as they are
            self.record_error("ready_steps", exc)
            ready, self._held = ended, []
        memory_now: dict = {}
        for state in ready:
            self._build_step(state, memory_now=memory_now)
        for kind, buf in self._bufs.items():
            if not buf:
                continue
            rows = take_all(buf)
            try:
                if not self._writer.submit(kind, rows):
                    pass  # the writer counted the drop
            except Exception:
                self.errors += 1
                self.dropped_records += len(rows)

