"""Pipeline compute spans: one per stage, microbatch and kind (forward / backward / weight).

    ptracer = PipelineTracer(recorder, on_span_enter=core.enter, on_span_exit=core.exit)
    ptracer.attach(schedule, stages)   # after building the stages and the schedule
    ...
    ptracer.detach()

Every schedule of ``torch.distributed.pipelining`` (GPipe, 1F1B, Interleaved1F1B, the runtime / zero-bubble
schedules) runs a microbatch's compute through the stage object's ``forward_one_chunk``,
``backward_one_chunk`` (full backward, or input-gradient only in zero-bubble schedules) and
``backward_weight_one_chunk`` (weight gradient). The tracer wraps those three on each stage *instance*
(``detach`` removes the instance attributes, so the class methods show through again) and records the
wall time of each call.

What a span contains: the stage module's compute for that microbatch, plus anything the stage does inside
the call — an FSDP2 all-gather / reduce-scatter (recorded separately by ``CollectiveTracer``, so the core
can subtract it), the loss of the last stage in ``backward_one_chunk``'s autograd. What it does not
contain: P2P sends / receives and their waits (the schedules issue and wait them between the calls), the
last stage's loss function call (made by the schedule after ``forward_one_chunk``), optimizer steps.
Profiler ranges for cross-checks: GPipe ``Forward i`` / ``Backward i`` (these include P2P issue), runtime
schedules ``PP:<action>``; 1F1B has none.

``on_span_enter()`` / ``on_span_exit()`` are called on the training thread right around each span (the
exit also when the compute raises), so the core always knows whether the thread is inside compute;
``in_span`` says the same.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from meshscope.agent.instrument import native


_METHODS = (
    ("forward_one_chunk", "forward", "fwd_chunk_id"),
    ("backward_one_chunk", "backward", "bwd_chunk_id"),
    ("backward_weight_one_chunk", "weight", "bwd_chunk_id"),
)
# schedules._ComputationType values → span kinds (compute actions only).
_ACTION_KINDS = {"F": "forward", "B": "backward", "I": "backward", "W": "weight"}
_MAX_SPANS = 65536  # deferred spans not yet taken (a loop that never ends a step must not grow memory)


class PipelineTracer:
    """Records pipeline compute spans through ``recorder.record_span``, or, with ``deferred=True``, keeps
    them as ``(stage, microbatch, kind, t_start, t_end)`` tuples until ``take()`` (the telemetry core takes
    a step's spans at its end and builds their records on its flusher thread). Deferred timestamps are raw
    ``time.perf_counter`` readings (the recorder adds its ``epoch``). A deferred span costs the training
    thread two clock reads and one append (≤ 0.3 µs per span is the goal, bench/hooks_overhead.py); it
    keeps no ``depth`` and calls no enter / exit callbacks: the recorder finds what ran inside a span from
    the spans' times."""

    def __init__(self, recorder: Any, *, on_span_enter: Callable[[], None] | None = None,
                 on_span_exit: Callable[[], None] | None = None, deferred: bool = False) -> None:
        self.recorder = recorder
        self.now: Callable[[], float] = recorder.clock.now
        self.on_span_enter = on_span_enter
        self.on_span_exit = on_span_exit
        self.deferred = deferred
        self.spans: list[tuple[int, int, str, float, float]] = []
        self.depth = 0
        self.dropped = 0  # deferred spans beyond _MAX_SPANS
        self.schedule: Any = None
        self._wrapped: list[tuple[Any, str, Any]] = []  # (stage, method name, own attribute it replaced)

    @property
    def in_span(self) -> bool:
        return self.depth > 0

    def attach(self, schedule: Any, stages: list[Any] | None = None) -> None:
        """Wrap the compute methods of ``stages`` (default: the schedule's own stages). Idempotent."""
        self.schedule = schedule
        if stages is None:
            stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
        done = {(id(stage), name) for stage, name, _ in self._wrapped}
        for stage in stages:
            for name, kind, chunk_kw in _METHODS:
                if (id(stage), name) in done or not hasattr(stage, name):
                    continue
                own = stage.__dict__.get(name)  # an instance attribute someone set before us, if any
                setattr(stage, name, self._wrap(stage, getattr(stage, name), kind, chunk_kw))
                self._wrapped.append((stage, name, own))

    def detach(self) -> None:
        """Restore the stages' methods. Safe to call twice."""
        for stage, name, own in reversed(self._wrapped):
            if own is None:
                stage.__dict__.pop(name, None)
            else:
                setattr(stage, name, own)
        self._wrapped.clear()
        self.depth = 0

    def planned_order(self, rank: int | None = None) -> list[tuple[int, int, str] | None]:
        """The schedule's planned compute order for ``rank`` (default: this rank in the pipeline group):
        one entry per time step, ``(stage, microbatch, kind)`` or ``None`` for a planned idle step.
        Empty when the schedule publishes no order (``schedule.pipeline_order``).

        It is torch's own IR, passed on as is. In torch 2.13 the single-stage schedules (GPipe, 1F1B) run
        it through ``_add_reduce_grad``, which drops the ``None`` entries (no planned bubbles survive), and
        ``Schedule1F1B``'s IR numbers the last stage's forwards 1..m instead of 0..m−1; the runtime
        schedules (Interleaved1F1B, …) keep their ``None``s. For a theory line use the bubble formula
        (p − 1) / (v·m + p − 1); use this order to draw the plan, not to count bubbles."""
        order = getattr(self.schedule, "pipeline_order", None)
        if not order:
            return []
        if rank is None:
            rank = getattr(self.schedule, "rank", None)
            if rank is None:
                rank = self.schedule._stage.group_rank
        out: list[tuple[int, int, str] | None] = []
        for action in order.get(rank, []):
            if action is None:
                out.append(None)
                continue
            kind = _ACTION_KINDS.get(getattr(action.computation_type, "value", ""))
            if kind is not None:
                out.append((action.stage_index, action.microbatch_index, kind))
        return out

    def take(self) -> tuple[tuple[int, int, str, float, float], ...]:
        """The deferred spans recorded since the last ``take`` (call on the training thread; the wrappers
        hold ``self.spans`` itself, so it is emptied in place). A tuple: held until the flusher builds the
        step, and a tuple of plain values is one the cyclic GC stops tracking (see ``StepState``)."""
        spans = tuple(self.spans)
        self.spans.clear()
        return spans

    def _wrap(self, stage: Any, method: Callable, kind: str, chunk_kw: str) -> Callable:
        if self.deferred:
            return self._wrap_deferred(stage, method, kind, chunk_kw)
        recorder = self.recorder

        def span(*args: Any, **kwargs: Any) -> Any:
            microbatch, t0 = -1, 0.0
            try:
                microbatch = args[0] if args else kwargs.get(chunk_kw, -1)
                self.depth += 1
                if self.on_span_enter is not None:
                    self.on_span_enter()
                t0 = self.now()
            except Exception as exc:
                _error(recorder, "span_enter", exc)
            try:
                return method(*args, **kwargs)
            finally:
                try:
                    t1 = self.now()
                    self.depth = max(0, self.depth - 1)
                    if self.on_span_exit is not None:
                        self.on_span_exit()
                    recorder.record_span(stage=stage.stage_index, microbatch=int(microbatch), kind=kind,
                                         t_start=t0, t_end=t1)
                except Exception as exc:
                    _error(recorder, "span_exit", exc)

        span.__wrapped__ = method
        return span

    def _wrap_deferred(self, stage: Any, method: Callable, kind: str, chunk_kw: str) -> Callable:
        # Everything the span reads is a closure cell (no attribute lookups): it runs around every
        # microbatch's compute, and its goal is ≤ 0.3 µs.
        now, index, spans, limit, tracer = time.perf_counter, stage.stage_index, self.spans, _MAX_SPANS, self

        def span(*args: Any, **kwargs: Any) -> Any:
            t0 = now()
            try:
                return method(*args, **kwargs)
            finally:
                t1 = now()
                if len(spans) < limit:
                    # The microbatch: torch's first argument (an int); the record's writer checks its type.
                    spans.append((index, args[0] if args else kwargs.get(chunk_kw, -1), kind, t0, t1))
                else:
                    tracer.dropped += 1

        span.__wrapped__ = method
        fast = native.span(method, span, spans=spans, index=index, kind=kind, chunk_kw=chunk_kw, tracer=tracer,
                           limit=limit)
        if fast is not span:
            fast.__wrapped__ = method
        return fast


def _error(recorder: Any, where: str, exc: BaseException) -> None:
    try:
        recorder.record_error(f"pipeline.{where}", exc)
    except Exception:  # a broken recorder must not take training down either
        pass
