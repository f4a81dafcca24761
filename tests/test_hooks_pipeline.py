"""PipelineTracer on stand-in stages (no process group): spans, callbacks, failures, detach, planned order.
The real schedules are covered by tests/test_hooks_gloo.py."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from meshscope.agent.instrument.pipeline import PipelineTracer
from meshscope.agent.instrument.recorder import ListRecorder


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        self.t += 1.0
        return self.t


class Stage:
    def __init__(self, stage_index: int) -> None:
        self.stage_index = stage_index
        self.group_rank = stage_index
        self.calls: list[tuple[str, int]] = []

    def forward_one_chunk(self, fwd_chunk_id, args=(), kwargs=None, save_forward_output=True):
        self.calls.append(("F", fwd_chunk_id))
        return f"out{fwd_chunk_id}"

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if loss == "explode":
            raise RuntimeError("bad microbatch")
        self.calls.append(("B", bwd_chunk_id))

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        self.calls.append(("W", bwd_chunk_id))


class Schedule:
    def __init__(self, stages: list[Stage], order: dict | None = None, rank: int | None = None) -> None:
        self._stages = stages
        self.pipeline_order = order
        if rank is not None:
            self.rank = rank


def make(stages: list[Stage]) -> tuple[PipelineTracer, ListRecorder, list[str]]:
    rec = ListRecorder(clock=FakeClock())
    events: list[str] = []
    tracer = PipelineTracer(rec, on_span_enter=lambda: events.append("enter"),
                            on_span_exit=lambda: events.append("exit"))
    return tracer, rec, events


def test_spans_per_call_with_kind_stage_and_microbatch() -> None:
    stages = [Stage(0), Stage(2)]
    tracer, rec, events = make(stages)
    tracer.attach(Schedule(stages))
    assert stages[0].forward_one_chunk(0, ("x",)) == "out0"  # return value passes through
    stages[1].forward_one_chunk(fwd_chunk_id=3)  # keyword microbatch
    stages[1].backward_one_chunk(3, full_backward=False)
    stages[1].backward_weight_one_chunk(3)
    assert [(s["stage"], s["microbatch"], s["kind"]) for s in rec.spans] == [
        (0, 0, "forward"), (2, 3, "forward"), (2, 3, "backward"), (2, 3, "weight")]
    assert all(s["t_end"] - s["t_start"] == 1.0 for s in rec.spans)  # one clock tick around the call
    assert events == ["enter", "exit"] * 4
    assert stages[1].calls == [("F", 3), ("B", 3), ("W", 3)]


def test_in_span_is_true_only_inside_compute() -> None:
    stage = Stage(0)
    tracer, _, _ = make([stage])
    seen = []
    stage.forward_one_chunk = lambda *a, **k: seen.append(tracer.in_span)  # an instance attr, wrapped too
    tracer.attach(Schedule([stage]))
    assert not tracer.in_span
    stage.forward_one_chunk(0)
    assert seen == [True] and not tracer.in_span


def test_compute_error_propagates_and_span_still_closes() -> None:
    stage = Stage(1)
    tracer, rec, events = make([stage])
    tracer.attach(Schedule([stage]))
    with pytest.raises(RuntimeError, match="bad microbatch"):
        stage.backward_one_chunk(2, loss="explode")
    assert events == ["enter", "exit"] and not tracer.in_span
    assert [(s["microbatch"], s["kind"]) for s in rec.spans] == [(2, "backward")]


def test_broken_recorder_and_callbacks_never_break_compute() -> None:
    class Broken(ListRecorder):
        def record_span(self, **kw) -> None:
            raise OSError("disk full")

    stage = Stage(0)
    rec = Broken()

    def explode() -> None:
        raise ValueError("callback bug")

    tracer = PipelineTracer(rec, on_span_enter=explode, on_span_exit=explode)
    tracer.attach(Schedule([stage]))
    assert stage.forward_one_chunk(5) == "out5"
    assert stage.calls == [("F", 5)]
    assert [where for where, _ in rec.errors] == ["pipeline.span_enter", "pipeline.span_exit"]


def test_detach_restores_methods_and_attach_is_idempotent() -> None:
    stage = Stage(0)
    own = stage.__dict__.setdefault("backward_weight_one_chunk", lambda *a, **k: "user's own")
    tracer, rec, _ = make([stage])
    schedule = Schedule([stage])
    tracer.attach(schedule)
    tracer.attach(schedule)
    stage.forward_one_chunk(0)
    assert len(rec.spans) == 1  # wrapped once, not twice
    tracer.detach()
    assert "forward_one_chunk" not in vars(stage) and "backward_one_chunk" not in vars(stage)
    assert stage.backward_weight_one_chunk is own
    stage.forward_one_chunk(1)
    assert len(rec.spans) == 1
    tracer.detach()  # twice is fine


def test_single_stage_schedule_default_stages() -> None:
    class Single:
        def __init__(self, stage: Stage) -> None:
            self._stage = stage
            self.pipeline_order = None

    stage = Stage(1)
    tracer, rec, _ = make([stage])
    tracer.attach(Single(stage))
    stage.forward_one_chunk(0)
    assert rec.spans[0]["stage"] == 1
    assert tracer.planned_order() == []  # schedule publishes no order


def test_planned_order_keeps_bubbles_and_compute_only() -> None:
    F, B, W, I = (_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_WEIGHT,
                  _ComputationType.BACKWARD_INPUT)
    order = {
        0: [_Action(0, F, 0), _Action(0, F, 1), None, _Action(0, B, 0), _Action(0, _ComputationType.SEND_F, 0),
            _Action(0, I, 1), _Action(0, W, 1), _Action(0, _ComputationType.REDUCE_GRAD, None)],
        1: [None, _Action(1, F, 0)],
    }
    stages = [Stage(0)]
    tracer, _, _ = make(stages)
    tracer.attach(Schedule(stages, order, rank=0))
    assert tracer.planned_order() == [(0, 0, "forward"), (0, 1, "forward"), None, (0, 0, "backward"),
                                      (0, 1, "backward"), (0, 1, "weight")]
    assert tracer.planned_order(1) == [None, (1, 0, "forward")]
