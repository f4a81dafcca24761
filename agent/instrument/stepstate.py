"""One step's accumulators, the handle ``Telemetry.step`` hands out, and how a step's accumulators become
its records (pure functions, run on the telemetry's flusher thread; the accounting is the one the
``telemetry`` module docstring states)."""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import threading
import time
from typing import Any

from meshscope.agent.contract import mfu as model_flops_utilisation
from meshscope.agent.contract import is_stage_wait, span_record, step_record
from meshscope.agent.instrument.cpu import parse as parse_cpu
from meshscope.agent.instrument.readout import as_float, read_loss

_chain = itertools.chain.from_iterable
COMPUTE_PHASES = frozenset({"forward", "backward", "optimizer", "pipeline", "compute"})


class StepState:
    __slots__ = (
        "step", "t_start", "phases", "phase", "waits_in_phase", "exposed", "pp_wait", "stage_wait_outside", "span_time",
        "span_depth", "nonpp_wait_outside_spans", "span_kind_time", "n_collectives", "values", "cpu0",
        "phase_t0", "outer", "segments", "colls", "t_end", "cpu_end", "spans", "tensors", "key",
    )

    def __init__(self, step: int, t_start: float, cpu0: Any, *, serial: int = 0) -> None:
        self.step = step
        # What an op that completes in this step carries (``Live.key``): an int, so that the op's entry,
        # waiting up to ``flush_interval_s`` for the flusher, is a tuple the cyclic GC stops tracking the
        # first time it sees it (a reference to this object kept each entry tracked: 2-3 µs of full
        # collections per op; a nested tuple may need two looks, the second in an older generation).
        self.key = serial
        self.t_start = t_start
        self.cpu0 = cpu0
        # A step lives until the flusher builds it (up to flush_interval_s), long enough for the cyclic GC
        # to promote what it holds to the oldest generation, whose full collections then come sooner: the
        # training thread paid 12 µs per step for them in a tight loop of step boundaries (20,000 steps,
        # GC on) with eight such objects per step, 6 µs with two. So it tracks one per step (this
        # object): plain dicts of floats (a defaultdict is always tracked), a tuple for the rare nesting,
        # ``segments`` made one flat tuple at the step's end (``flat_segments``), ``colls`` made by the
        # flusher when it has any, the end's figures held here rather than in a tuple that holds this.
        self.phases: dict[str, float] = {}
        self.phase: str | None = None
        self.phase_t0 = 0.0  # perf_counter when the current phase (re)started
        self.outer: tuple[str, ...] = ()  # phases paused by a nested one (push_phase)
        self.waits_in_phase: dict[str, float] = {}
        self.exposed = 0.0
        self.pp_wait = 0.0
        # waits of collectives over the pipeline dim outside the pipeline phase: the drain (is_stage_wait)
        self.stage_wait_outside = 0.0
        self.span_time = 0.0
        self.span_depth = 0
        self.nonpp_wait_outside_spans = 0.0
        self.span_kind_time: dict[str, float] = {}
        self.n_collectives = 0
        self.values: dict[str, Any] = {}
        # (phase, t0, t1) for every stretch of time a phase was the innermost open one, in order (raw
        # perf_counter times): the flusher finds the phase a collective completed in from these.
        self.segments: list[tuple[str, float, float]] | tuple = []  # flat once the step ended
        # Collectives of this step as (op, dim, t_end, wait_s), gathered by the flusher until the step is built.
        self.colls: list[tuple[str, str, float, float]] | None = None
        # Set at the step's end (``Telemetry._end_step``): the clocks, the pipeline spans, the tensor census.
        self.t_end = 0.0
        self.cpu_end: Any = cpu0  # a ThreadCPU reading (cpu.parse makes it seconds)
        self.spans: Any = ()
        self.tensors: tuple[int, int, int] = (-1, -1, -1)


class PendingSteps:
    """The steps begun whose records are not built yet, by ``StepState.key``, for the flusher to account
    their deferred ops to; and the step numbers of the last 4096 that are gone (built, discarded, aborted
    or dropped), so that an op drained after its step (CUDA timing completes later) keeps its number.
    The training thread begins steps; both threads forget them."""

    def __init__(self) -> None:
        self._serial = 0
        self._open: dict[int, StepState] = {}
        # An O(1) pop of the oldest: deleting a plain dict's first key again and again leaves dummies that each
        # next ``iter`` walks (2.5 µs per forget on the flusher after 50,000 steps, against 0.7 now).
        self._gone: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._recent: collections.deque = collections.deque(maxlen=16)  # the last steps gone: key_finder
        self._lock = threading.Lock()

    def begin(self, step: int, t_start: float, cpu0: Any) -> StepState:
        self._serial += 1
        state = self._open[self._serial] = StepState(step, t_start, cpu0, serial=self._serial)
        return state

    def get(self, key: int) -> StepState | None:
        return self._open.get(key)

    def key_finder(self) -> Any:
        """``at(t)``: the key of the step open at clock time ``t`` (begun, and not ended before ``t``) among the
        steps open now, or None — what ``Live.key`` read then, for an op whose completion is only known later
        (funcol_kernels). One look-up table per drain, a bisection per op. Any thread."""
        # The steps open now and the last ones gone (a step discarded at exit may go before the ops begun
        # in it are drained: they keep its number, ``step_of``), as (t_start, t_end, key); t_end 0: not ended.
        with self._lock:
            spans = list(self._recent)
        spans += [(state.t_start, state.t_end, state.key) for state in list(self._open.values())]
        spans.sort()
        starts = [span[0] for span in spans]

        def at(t: float) -> int | None:
            i = bisect.bisect_right(starts, t) - 1
            if i < 0:
                return None
            _, t_end, key = spans[i]
            return key if t_end == 0.0 or t <= t_end else None

        return at

    def step_of(self, key: int, default: int) -> int:
        return self._gone.get(key, default)

    def forget(self, state: StepState) -> None:
        self._open.pop(state.key, None)
        with self._lock:
            self._gone[state.key] = state.step
            self._recent.append((state.t_start, state.t_end, state.key))
            if len(self._gone) > 4096:
                self._gone.popitem(last=False)


class Live:
    """What the collective tracer reads on its hot path (``Telemetry.live``): the open step, or None, and
    its ``key`` (``StepState.key``), the context an op completing now carries."""

    __slots__ = ("step", "key")

    def __init__(self) -> None:
        self.step: StepState | None = None
        self.key: int | None = None


class StepContext:
    """Handed out by ``Telemetry.step``; ``update`` attaches the step's results."""

    __slots__ = ("_state",)

    def __init__(self, state: StepState) -> None:
        self._state = state

    def update(self, **values: Any) -> None:
        """Known keys: loss, tokens, flops, grad_norm, lr, skipped. Values may be tensors: they are read when
        the step's record is built, on the telemetry's flusher thread (a CUDA loss costs the training
        thread no device synchronisation); do not modify them in place afterwards."""
        self._state.values.update(values)


def pop_phase(state: StepState) -> None:
    if state.phase is None:
        return
    now = time.perf_counter()
    state.phases[state.phase] = state.phases.get(state.phase, 0.0) + now - state.phase_t0
    state.segments.append((state.phase, state.phase_t0, now))
    if state.outer:
        state.phase, state.outer = state.outer[-1], state.outer[:-1]
    else:
        state.phase = None
    state.phase_t0 = now


def ready_steps(ended: list[StepState], *, tracers: list, now: float, hold_s: float
                ) -> tuple[list[StepState], list[StepState]]:
    """(the ended steps whose records can be built now, those held): a step with CUDA ops still running on
    the GPU (a tracer's ``unresolved_steps()``: the CPU runs ahead of it), or a value still to come (one
    with a true ``pending``: a framework logs its loss after the step's optimizer step), waits for them, up
    to ``hold_s`` after its end; past that it is built without them (their records still carry the step)."""
    if not ended:
        return [], []
    waiting = frozenset().union(*(t.unresolved_steps() for t in tracers if hasattr(t, "unresolved_steps")))
    held = [s for s in ended if (s.key in waiting or _pending_value(s.values)) and now - s.t_end < hold_s]
    return ([s for s in ended if s not in held] if held else ended), held


def _pending_value(values: dict) -> bool:
    return any(getattr(v, "pending", False) for v in values.values()) if values else False


def span_microbatch(value: Any) -> int:
    """A span's microbatch as the schedule passed it: an int, else -1 (never an error in the record)."""
    return value if type(value) is int else -1


def account(state: StepState, op: str, dim: str, wait_s: float, phase: str | None, outside_spans: bool) -> None:
    """One collective's share of its step: exposed communication (the thread's blocked time), per phase
    (compute phases subtract it) and, in the pipeline phase outside compute spans, what the bubble must not
    count. A stage waiting for the other stages (``is_stage_wait``) is bubble: inside the pipeline phase it
    is already that phase's idle time; outside it (the drain, waited for in the first reduction over pp; a
    send or receive a loop makes outside its schedule) it is added to the bubble and taken out of its
    phase's compute. On a mesh of pp alone every collective is over pp: all of them are stages waiting for
    each other."""
    state.n_collectives += 1
    if wait_s != wait_s:  # NaN: exposure unknown for this op (e.g. FSDP on NCCL): not summed
        return
    if is_stage_wait(op, dim):
        if phase == "pipeline":
            state.pp_wait += wait_s
            return
        state.stage_wait_outside += wait_s
        if phase is not None:
            state.waits_in_phase[phase] = state.waits_in_phase.get(phase, 0.0) + wait_s
        return
    state.exposed += wait_s
    if phase is not None:
        state.waits_in_phase[phase] = state.waits_in_phase.get(phase, 0.0) + wait_s
        # only the pipeline phase's own time holds the bubble: a wait in another phase (the optimizer's
        # all-reduce) is not in it and must not shorten it
        if outside_spans and phase == "pipeline":
            state.nonpp_wait_outside_spans += wait_s


def flat_segments(segments: list[tuple[str, float, float]]) -> tuple:
    """A step's phase segments as one flat tuple ``(phase, t0, t1, phase, t0, t1, ...)``: plain values,
    which the GC stops tracking the first time it sees them (``StepState``)."""
    if len(segments) == 1:  # one phase in the step: its segment is that tuple already
        return segments[0]
    return tuple(_chain(segments))


def account_deferred(state: StepState, spans: Any) -> None:
    """Account the step's deferred collectives: the phase each completed in and whether the thread was
    inside a pipeline compute span then come from the step's phase segments and spans (raw perf_counter
    times, like the ops' ``t_end`` here), exactly what the thread's state said at completion."""
    segs = state.segments  # flat: (phase, t0, t1, phase, t0, t1, ...)
    seg_starts = segs[1::3]
    span_starts = [s[3] for s in spans]
    for op, dim, t_end, wait_s in state.colls:
        i = bisect.bisect_right(seg_starts, t_end) - 1
        phase = segs[3 * i] if i >= 0 and t_end <= segs[3 * i + 2] else None
        j = bisect.bisect_right(span_starts, t_end) - 1
        in_span = j >= 0 and t_end <= spans[j][4]
        account(state, op, dim, wait_s, phase, not in_span)
    state.colls = None


def step_rows(state: StepState, *, t_end: float, cpu_end: Any, spans: Any, epoch: float,
              peak_flops: float, dropped: int) -> tuple[list[tuple], tuple]:
    """The step's span rows and its step row. ``spans``: the step's ``(stage, microbatch, kind, t0, t1)``
    in raw perf_counter times (``epoch`` added for the records); ``cpu_end``: the thread's ``ThreadCPU`` reading at
    the step's end (``state.cpu0`` at its start); ``dropped``: records dropped so far."""
    span_rows = []
    for stage, microbatch, kind, t0, t1 in spans:
        span_rows.append(span_record(step=state.step, stage=stage, microbatch=span_microbatch(microbatch),
                                     kind=kind, t_start=t0 + epoch, t_end=t1 + epoch))
        state.span_time += t1 - t0
        state.span_kind_time[kind] = state.span_kind_time.get(kind, 0.0) + t1 - t0
    if state.colls:
        account_deferred(state, spans)
    cpu, cpu_wait = (now - then for now, then in zip(parse_cpu(cpu_end), parse_cpu(state.cpu0)))
    wall = t_end - state.t_start
    v = state.values
    pipeline_time = state.phases.get("pipeline", 0.0)
    pipeline_bubble = 0.0
    if pipeline_time > 0:
        pipeline_bubble = max(0.0, pipeline_time - state.span_time - state.nonpp_wait_outside_spans)
    # the drain's wait is already out of its phase's compute (waits_in_phase)
    bubble = pipeline_bubble + state.stage_wait_outside
    compute = sum(t - state.waits_in_phase.get(p, 0.0) for p, t in state.phases.items() if p in COMPUTE_PHASES)
    compute = max(0.0, compute - pipeline_bubble)
    other = max(0.0, wall - compute - state.exposed - bubble)
    if state.span_time > 0:
        fwd = state.span_kind_time.get("forward", 0.0)
        bwd = state.span_kind_time.get("backward", 0.0) + state.span_kind_time.get("weight", 0.0)
    else:
        fwd, bwd = state.phases.get("forward", 0.0), state.phases.get("backward", 0.0)
    given = read_loss(v.get("loss"))
    loss = float("nan") if given is None else given
    flops = as_float(v.get("flops"), 0.0)
    mfu = model_flops_utilisation(flops=flops, seconds=wall, peak_flops=peak_flops)
    return span_rows, step_record(
        step=state.step, t_start=state.t_start, t_end=t_end, wall_s=wall, compute_s=compute,
        exposed_comm_s=state.exposed, bubble_s=bubble, other_s=other, data_s=state.phases.get("data", 0.0),
        # the optimizer's own time: its waits (a gradient norm's reduction) are communication or bubble
        forward_s=fwd, backward_s=bwd,
        optimizer_s=max(0.0, state.phases.get("optimizer", 0.0) - state.waits_in_phase.get("optimizer", 0.0)),
        tokens=int(v.get("tokens", 0)), flops=flops, mfu=mfu, loss=loss,
        # a loss given and not finite; no loss given (None) is absent, not a NaN loss
        loss_nonfinite=given is not None and not math.isfinite(given),
        grad_norm=as_float(v.get("grad_norm")), lr=as_float(v.get("lr"), 0.0),
        skipped=bool(v.get("skipped", False)),
        n_collectives=state.n_collectives, dropped_records_total=dropped, cpu_s=cpu, cpu_wait_s=cpu_wait,
    )
