"""The telemetry core's step accounting against injected, known delays (unit tier: no processes)."""

from __future__ import annotations

import threading
import json
import time

import pytest

from meshscope.agent.contract import SCHEMAS
from meshscope.agent.instrument.nulltelemetry import NullTelemetry
from meshscope.agent.instrument.telemetry import Telemetry, TelemetryConfig
from meshscope.agent.transport.frame import rows_to_batch
from tests.support.harness import poll_until

# serial: the step breakdown of timed sleeps to ±10-15 ms
pytestmark = pytest.mark.serial


class MemoryWriter:
    """Stands in for the spool writer (the transport has its own tests): keeps rows per kind."""

    def __init__(self, *, fail: bool = False) -> None:
        self.rows: dict[str, list[tuple]] = {k: [] for k in SCHEMAS}
        self.fail = fail
        self.dropped_records = 0
        self.lock = threading.Lock()

    def submit(self, kind: str, rows: list[tuple]) -> bool:
        if self.fail:
            raise OSError("disk on fire")
        with self.lock:
            self.rows[kind].extend(rows)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        pass

    def table(self, kind: str) -> list[dict]:
        """The rows as the spool writer would encode them (so each must be the kind's record type)."""
        rows = self.rows[kind]
        return rows_to_batch(kind, rows).to_pylist() if rows else []


def make(writer=None, **cfg) -> tuple[Telemetry, MemoryWriter]:
    w = writer or MemoryWriter()
    tel = Telemetry(config=TelemetryConfig(store="unused", run="r", **cfg), rank=0, world_size=1, writer=w)
    return tel, w


def test_step_breakdown_adds_up_and_matches_injected_times():
    tel, w = make()
    tel.start({"strategy": "ddp", "mesh": {"dp": 1}, "peak_flops": 1e9})
    with tel.step(0) as s:
        with tel.phase("data"):
            time.sleep(0.02)
        with tel.phase("forward"):
            time.sleep(0.03)
        with tel.phase("backward"):
            time.sleep(0.03)
            now = tel.clock.now()
            # a collective whose wait blocked the training thread for 20 ms (exposed)
            tel.record_collective(op="all_reduce", dim="dp", group="g", group_size=2, nbytes=4096,
                                  t_start=now - 0.05, t_end=now, wait_s=0.02, source="test")
        with tel.phase("optimizer"):
            time.sleep(0.01)
        s.update(loss=1.5, tokens=100, flops=1e7)
    tel.close()
    (step,) = w.table("step")
    assert step["wall_s"] == pytest.approx(step["compute_s"] + step["exposed_comm_s"] + step["bubble_s"] + step["other_s"])
    assert step["exposed_comm_s"] == pytest.approx(0.02)
    # forward 30 + backward 30 + optimizer 10 ms, minus the 20 ms blocked inside backward
    assert step["compute_s"] == pytest.approx(0.05, abs=0.015)
    assert step["data_s"] == pytest.approx(0.02, abs=0.01)
    assert step["mfu"] == pytest.approx(1e7 / step["wall_s"] / 1e9)
    (coll,) = w.table("collective")
    assert coll["busbw"] == pytest.approx(coll["algbw"] * 1.0)  # 2(n-1)/n = 1 for n=2
    assert coll["seq"] == 1 and coll["step"] == 0
    assert [e["kind"] for e in w.table("event")] == ["start"]
    (run,) = w.table("run")
    assert run["strategy"] == "ddp" and '"dp": 1' in run["mesh"]
    assert len(w.table("memory")) == 1 and w.table("memory")[0]["rss_bytes"] > 0


def _pipeline_phase(tel, *, stage: int) -> float:
    """A pipeline phase of one 0.03 s forward span, then 0.04 s idle (waiting for the other stage): its start."""
    with tel.phase("pipeline"):
        t0 = tel.clock.now()
        tel._span_enter()
        time.sleep(0.03)
        tel._span_exit()
        tel.record_span(stage=stage, microbatch=0, kind="forward", t_start=t0, t_end=t0 + 0.03)
        time.sleep(0.04)
    return t0


def test_pipeline_bubble_is_region_minus_spans_and_p2p_waits_are_not_exposed():
    tel, w = make()
    with tel.step(0):
        t0 = _pipeline_phase(tel, stage=0)
        with tel.phase("pipeline"):  # the receive that waited, completing in the same phase
            tel.record_collective(op="recv", dim="pp", group="pp", group_size=2, nbytes=10, t_start=t0,
                                  t_end=tel.clock.now(), wait_s=0.04, peer=1, source="test")
    tel.close()
    (step,) = w.table("step")
    assert step["exposed_comm_s"] == 0.0
    assert step["bubble_s"] == pytest.approx(0.04, abs=0.015)
    assert step["compute_s"] == pytest.approx(0.03, abs=0.01)
    assert step["forward_s"] == pytest.approx(0.03)


def test_a_wait_over_pp_after_the_schedule_is_bubble_and_other_phases_waits_do_not_shorten_it():
    """The drain: the last stage leaves the schedule and waits in the gradient norm's all-reduce over pp for the
    first stage's final backward. That wait is bubble (a stage waiting for the others), not exposed
    communication; a data-parallel all-reduce in the optimizer stays exposed and leaves the pipeline's own
    idle time whole; the optimizer's own time is its phase less both waits."""
    tel, w = make()
    with tel.step(0):
        _pipeline_phase(tel, stage=1)
        with tel.phase("optimizer"):
            t1 = tel.clock.now()
            time.sleep(0.05)
            tel.record_collective(op="all_reduce", dim="pp", group="pp", group_size=2, nbytes=4, t_start=t1,
                                  t_end=tel.clock.now(), wait_s=0.05, source="test")
            t2 = tel.clock.now()
            time.sleep(0.02)
            tel.record_collective(op="all_reduce", dim="dp", group="dp", group_size=2, nbytes=4, t_start=t2,
                                  t_end=tel.clock.now(), wait_s=0.02, source="test")
            time.sleep(0.01)  # the optimizer's own work
    tel.close()
    (step,) = w.table("step")
    assert step["bubble_s"] == pytest.approx(0.04 + 0.05, abs=0.015)
    assert step["exposed_comm_s"] == pytest.approx(0.02)
    assert step["optimizer_s"] == pytest.approx(0.01, abs=0.01)
    assert step["compute_s"] == pytest.approx(0.03 + 0.01, abs=0.015)
    assert step["wall_s"] == pytest.approx(step["compute_s"] + step["exposed_comm_s"] + step["bubble_s"]
                                           + step["other_s"])


def test_bounded_buffers_count_drops_and_writer_failures_never_raise():
    tel, w = make(MemoryWriter(fail=True), max_rows_per_kind=3)
    tel._stop.set()  # hold the flusher so the buffer fills
    for i in range(10):
        tel.record_span(stage=0, microbatch=i, kind="forward", t_start=0.0, t_end=1.0)
    assert tel.dropped_records == 7
    tel.close()  # the writer raises on submit: counted, not raised
    assert tel.errors >= 1


def test_hook_errors_are_recorded_not_raised():
    tel, w = make()
    tel.record_error("hook", RuntimeError("boom"))
    tel.close()
    (ev,) = w.table("event")
    assert ev["kind"] == "telemetry_error" and "boom" in ev["message"]


def test_null_telemetry_has_the_same_api():
    tel = NullTelemetry()
    tel.start({})
    tel.attach(model_parts=[], mesh=None, schedule=None)
    with tel.step(0) as s, tel.phase("forward"):
        s.update(loss=1.0)
    tel.event("end")
    tel.close()


def test_config_names_bad_values():
    with pytest.raises(ValueError, match=r"run name '../x'.*flush_interval_s=0"):
        TelemetryConfig(store="s", run="../x", flush_interval_s=0)


def test_hang_watchdog_says_where_the_training_thread_is_stuck():
    tel, w = make(hang_after_s=0.3, hang_first_step_s=0.3, flush_interval_s=0.05)
    with tel.step(0), tel.phase("forward"):
        time.sleep(0.6)  # no progress: the watchdog fires once, from the flusher thread
    time.sleep(0.1)
    tel.close()
    hangs = [e for e in w.table("event") if e["kind"] == "hang"]
    assert len(hangs) == 1, hangs
    msg = hangs[0]["message"]
    assert msg.startswith("not in a collective: test_hang_watchdog_says_where"), msg
    assert "step 0 phase forward" in msg and hangs[0]["step"] == 0
    (rec,) = w.table("hang")  # the record: every thread's stack, the training thread first
    assert rec["step"] == 0 and rec["phase"] == "forward" and not rec["in_collective"] and rec["op"] == ""
    assert rec["since_s"] >= 0.3 and rec["where"].startswith("test_hang_watchdog_says_where")
    threads = json.loads(rec["stacks"])
    assert threads[0]["training"] and threads[0]["frames"][-1][2] == "test_hang_watchdog_says_where_the_training_thread_is_stuck"
    assert "meshscope-flush" in {t["thread"] for t in threads[1:]}
    assert json.loads(rec["groups"]) == []  # no collective tracer, no op


def test_hang_threshold_waits_for_the_first_step_then_follows_the_steps():
    """Before any step has ended the watchdog waits hang_first_step_s (compilation is not a hang); then
    HANG_STEPS median steps, at least hang_min_s, at most hang_after_s."""
    from meshscope.agent.instrument.hangdump import HANG_STEPS, hang_threshold_s

    assert hang_threshold_s(after_s=60, first_step_s=300, min_s=10, walls=[]) == 300
    assert hang_threshold_s(after_s=60, first_step_s=300, min_s=10, walls=[0.2, 0.3, 0.25]) == 10
    assert hang_threshold_s(after_s=60, first_step_s=300, min_s=10, walls=[3.0, 2.0]) == HANG_STEPS * 2.5
    assert hang_threshold_s(after_s=60, first_step_s=300, min_s=10, walls=[20.0]) == 60
    assert hang_threshold_s(after_s=2, first_step_s=300, min_s=10, walls=[0.1]) == 2
    assert hang_threshold_s(after_s=0, first_step_s=300, min_s=10, walls=[0.1]) == 0  # off
    tel, w = make(hang_after_s=5.0, hang_min_s=0.3, hang_first_step_s=5.0, flush_interval_s=0.05)
    with tel.step(0):
        time.sleep(0.8)  # the first step: slower than the later threshold, not a hang
    for step in (1, 2, 3):
        with tel.step(step):
            time.sleep(0.01)
    t0 = time.perf_counter()
    with tel.step(4):
        while not [e for e in w.table("hang")] and time.perf_counter() - t0 < 3.0:
            time.sleep(0.02)
    waited = time.perf_counter() - t0
    tel.close()
    assert [e["step"] for e in w.table("event") if e["kind"] == "hang"] == [4]
    assert 0.3 <= waited < 1.5, waited  # hang_min_s, not hang_after_s


def test_sigterm_during_close_is_held_until_the_records_are_written():
    """torchrun SIGTERMs the surviving ranks when one fails, often while a survivor's own error is
    already closing its telemetry: the trainer holds the signal back until close has written everything,
    then exits as the signal asks."""
    import os
    import signal

    from meshscope.trainer.train import _sigterm_deferred

    class SlowWriter(MemoryWriter):
        def close(self, timeout_s: float = 5.0) -> None:  # the signal lands in the middle of close
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # Python runs the handler here: a plain SystemExit would end close now
            self.closed = True

    writer = SlowWriter()
    tel, _ = make(writer)
    tel.start({"strategy": "ddp", "mesh": {"dp": 1}})
    with tel.step(0):
        pass
    before = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    try:
        with pytest.raises(SystemExit) as exc:
            with _sigterm_deferred():
                tel.close()
        assert exc.value.code == 128 + signal.SIGTERM
        assert getattr(writer, "closed", False) and len(writer.rows["step"]) == 1
        assert signal.getsignal(signal.SIGTERM) is not None and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_tensor_census_counts_parameters_gradients_and_optimizer_state_once():
    """The bytes the Memory page compares with the model: from the tensors, after the first optimizer step
    that leaves state (found through torch's global hook, no reference to the optimizer needed), once."""
    import torch

    from meshscope.agent.instrument.memory import NOT_MEASURED, TensorCensus

    errors = []
    census = TensorCensus(on_error=lambda where, exc: errors.append((where, exc)))
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        model[1].weight = torch.nn.Parameter(torch.zeros(4, 16))
        census.add_modules([model])
        opt = torch.optim.AdamW(model.parameters())
        assert census.take() == NOT_MEASURED  # no optimizer step yet
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        n = sum(p.numel() for p in model.parameters())
        params, grads, state = census.take()
        assert params == grads == 4 * n
        # exp_avg and exp_avg_sq per parameter (8 B), plus one 4-byte step counter per parameter tensor
        assert state == 8 * n + 4 * len(list(model.parameters()))
        assert census.take() == NOT_MEASURED  # once
        assert errors == []
    finally:
        census.close()


def test_tensor_census_taken_inside_an_optimizer_post_hook_leaves_the_step_alone():
    """The zero-code driver ends a step in its own global optimizer post hook, so the census is taken while
    torch iterates those hooks: taking it must not remove a hook then ("OrderedDict mutated during
    iteration" raised into the user's optimizer.step() once, in CI)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from meshscope.agent.instrument.memory import NOT_MEASURED, TensorCensus

    errors, taken = [], []
    census = TensorCensus(on_error=lambda where, exc: errors.append((where, exc)))
    handle = register_optimizer_step_post_hook(lambda *_: taken.append(census.take()))
    later = register_optimizer_step_post_hook(lambda *_: None)  # a hook after ours: the dict's next() checks
    try:
        model = torch.nn.Linear(8, 4)
        census.add_modules([model])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        assert [t != NOT_MEASURED for t in taken] == [True, False, False]
        assert errors == []
    finally:
        handle.remove()
        later.remove()
        census.close()


def test_ddp_comm_hook_off_leaves_ddp_models_to_the_builtin_all_reduce():
    tel, _ = make(ddp_comm_hook=False)
    tel.attach(model_parts=[])
    (tracer,) = tel._tracers
    assert tracer.ddp_comm_hook is False  # comm_ddp.attach is never called for a DDP module
    tel.close()


def test_collectives_are_accounted_to_the_phase_and_step_they_completed_in():
    """The deferred path: the tracer queues each op with the open step, the flusher accounts it from the
    phase segments' times — the same figures the direct path gives."""
    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.meshinfo import GroupInfo, MeshInfo

    class FixedMesh(MeshInfo):
        def lookup(self, group):
            return GroupInfo(dim="dp", size=2, name="g", ranks=(0, 1))

    tel, w = make()
    tracer = CollectiveTracer(tel, mesh_info=FixedMesh())
    tel._tracers.append(tracer)
    tel._index_tracers()
    with tel.step(0):
        with tel.phase("forward"):
            p = tracer.begin("all_reduce", "g", 64, "test")
            time.sleep(0.02)
            t1 = tracer.now()
            tracer.emit(p, t1, 0.02)  # blocked 20 ms inside forward
        with tel.phase("optimizer"):
            time.sleep(0.01)
    q = tracer.begin("all_reduce", "g", 64, "test")
    tracer.emit(q, tracer.now(), 0.005)  # between steps: step 0's record, not its accounting
    tel.close()
    (step,) = w.table("step")
    assert step["exposed_comm_s"] == pytest.approx(0.02) and step["n_collectives"] == 1
    assert step["compute_s"] == pytest.approx(step["forward_s"] + step["optimizer_s"] - 0.02, abs=1e-6)
    colls = w.table("collective")
    assert [c["step"] for c in colls] == [0, 0] and [c["seq"] for c in colls] == [1, 2]


def test_back_to_back_steps_share_their_boundary_and_a_gap_does_not():
    """A step begun right after the last one ended (same thread) begins at that end, with that end's CPU
    reading (one /proc read saved: ``SHARED_BOUNDARY_S``); after a gap, after an aborted step, or on another
    thread it takes its own. Either way every step's CPU time is its own interval's."""
    from meshscope.agent.instrument.cpu import parse
    from meshscope.agent.instrument.telemetry import SHARED_BOUNDARY_S

    tel, w = make()

    def step(n: int, *, end: bool = True):
        tel.begin_step(n)
        state = tel._cur  # kept here: the flusher takes ended steps from the telemetry's queue
        if end:
            tel.end_step()
        return state

    try:
        tel.begin_step(0)
        first = tel._cur
        sum(i * i for i in range(100_000))  # CPU time in the step
        tel.end_step()
        second = step(1)  # back to back
        # On a loaded machine the flusher can take the GIL between the two calls for longer than the window:
        # then the rule says the step takes its own readings. Each pair follows the rule; one of a few shares.
        shared = 0
        for n in range(8):
            prev, nxt = (first, second) if n == 0 else (step(100 + 2 * n), step(101 + 2 * n))
            if nxt.t_start == prev.t_end:
                assert nxt.cpu0 is prev.cpu_end
                shared += 1
            else:  # not shared: a gap over the window, and readings of its own
                assert nxt.t_start - prev.t_end > SHARED_BOUNDARY_S and nxt.cpu0 is not prev.cpu_end
        assert shared >= 1
        time.sleep(SHARED_BOUNDARY_S * 20)
        third = step(2, end=False)  # after a gap: its own readings
        assert third.t_start > nxt.t_end and third.cpu0 is not nxt.cpu_end
        tel.abort_step(RuntimeError("peer died"))
        fourth = step(3)  # right after an aborted step: nothing to share
        assert fourth.cpu0 is not third.cpu0 and fourth.t_start > third.t_start
        got: list = []
        worker = threading.Thread(target=lambda: got.append(step(4, end=False)))  # another thread
        worker.start()
        worker.join()
        assert got[0].t_start > fourth.t_end and got[0].cpu0 is not fourth.cpu_end
        tel.end_step()
        cpu_first = parse(first.cpu_end)[0] - parse(first.cpu0)[0]
        assert 0 < cpu_first <= first.t_end - first.t_start + 1e-3
    finally:
        tel.close()


def test_cuda_ops_resolved_on_the_flusher_are_accounted_to_the_step_they_were_queued_in(monkeypatch):
    """CUDA ops (stand-in events: no GPU here) are resolved where the tracer is drained, the flusher, each
    for the step it was queued in. An ended step whose ops are still running on the GPU waits for them
    (up to CUDA_HOLD_S), then is built without them; detach waits for the last ones (up to its own
    bound) and counts those that never complete."""
    from meshscope.agent.instrument import collectives, telemetry
    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.comm_nccl import _CudaOp
    from meshscope.agent.instrument.meshinfo import GroupInfo, MeshInfo

    monkeypatch.setattr(telemetry, "CUDA_HOLD_S", 0.5)
    monkeypatch.setattr(collectives, "_CUDA_SETTLE_S", 0.2)

    class FixedMesh(MeshInfo):
        def lookup(self, group):
            return GroupInfo(dim="dp", size=2, name="g", ranks=(0, 1))

    class Event:  # a GPU timestamp in ms, and whether it has completed
        def __init__(self, ms, done=True):
            self.ms, self.done = ms, done

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return end.ms - self.ms

    def blocking_op(t0_ms, t1_ms, done=True):  # as comm_nccl's sync path leaves it: start and end events
        p = tracer.begin("all_reduce", "g", 64, "c10d")
        p.cuda = _CudaOp(Event(t0_ms))
        p.cuda.end = Event(t1_ms, done)
        tracer.cuda_timer().queue(p)
        return p

    tel, w = make(flush_interval_s=0.02)
    tracer = CollectiveTracer(tel, mesh_info=FixedMesh())
    tel._tracers.append(tracer)
    tel._index_tracers()
    with tel.step(0):
        with tel.phase("forward"):
            blocking_op(0.0, 2.0)  # stalled the stream 2 ms; complete when the flusher looks
            late = blocking_op(5.0, 8.0, done=False)  # still running on the GPU when step 0 ends
    time.sleep(0.15)  # several drains: step 0 waits for its op
    assert not w.rows["step"]
    late.cuda.end.done = True
    poll_until(lambda: w.rows["step"], timeout_s=10, interval_s=0.01, what="step 0 to be built")
    with tel.step(1):
        with tel.phase("forward"):
            blocking_op(10.0, 11.0, done=False)  # never completes
    poll_until(lambda: len(w.rows["step"]) == 2, timeout_s=10, interval_s=0.01, what="step 1 to be built after its hold")
    tel.close()
    steps = {s["step"]: s for s in w.table("step")}
    assert steps[0]["exposed_comm_s"] == pytest.approx(0.005) and steps[0]["n_collectives"] == 2
    assert steps[1]["exposed_comm_s"] == 0 and steps[1]["n_collectives"] == 0
    colls = sorted(w.table("collective"), key=lambda c: c["seq"])
    assert [(c["step"], round(c["wait_s"], 6), round(c["duration_s"], 6)) for c in colls] == [
        (0, 0.002, 0.002), (0, 0.003, 0.003)]
    assert tracer.stats["dropped_pending"] == 1  # step 1's op: counted at detach, never recorded


def test_a_gone_step_keeps_its_number_for_the_last_4096_steps():
    """An op drained after its step was built keeps the step's number (``step_of``) for the last 4096 steps
    gone; older ones fall back to the default. (The oldest is popped in O(1): deleting a plain dict's first
    key again and again made each ``next(iter(...))`` walk the dummies before it, 126 ms of the flusher's
    CPU for 50,000 steps on the dev VM against 34 ms now.)"""
    from meshscope.agent.instrument.stepstate import PendingSteps

    pending = PendingSteps()
    states = [pending.begin(100 + i, float(i), b"") for i in range(6000)]
    for state in states:
        pending.forget(state)
    assert pending.get(states[-1].key) is None
    assert pending.step_of(states[-1].key, -1) == 6099
    assert pending.step_of(states[6000 - 4096].key, -1) == 100 + 6000 - 4096
    assert pending.step_of(states[6000 - 4097].key, -1) == -1  # evicted: the caller's default
    assert len(pending._gone) == 4096


def test_what_the_tracers_could_not_record_is_in_the_step_rows_dropped_count_which_only_grows(monkeypatch):
    """Ops a tracer had to drop (its pending map full, still pending at detach) and pipeline spans beyond
    its bound are records lost: each step row's ``dropped_records_total`` (a counter in /metrics, watched
    by the dropped-records alert) includes them, and keeps them after the tracers detach."""
    from meshscope.agent.instrument import collectives
    from meshscope.agent.instrument.collectives import CollectiveTracer
    from meshscope.agent.instrument.meshinfo import GroupInfo, MeshInfo

    class FixedMesh(MeshInfo):
        def lookup(self, group):
            return GroupInfo(dim="dp", size=2, name="g", ranks=(0, 1))

    class Running:  # an async op's work that has not completed
        def is_completed(self):
            return False

        def get_future(self):
            raise RuntimeError("no future")

    monkeypatch.setattr(collectives, "_MAX_PENDING", 2)
    tel, w = make(flush_interval_s=0.02)
    tracer = CollectiveTracer(tel, mesh_info=FixedMesh())

    class Spans:  # a pipeline tracer that dropped spans beyond its bound
        dropped = 4

    tel._tracers += [tracer, Spans()]
    tel._index_tracers()
    works = [Running() for _ in range(3)]
    with tel.step(0):
        for work in works:  # the third drops the oldest
            tracer.track_work(work, [tracer.begin("all_reduce", "g", 64, "test")])
    with tel.step(1):
        pass
    time.sleep(0.15)  # several drains: steps 0 and 1 are built (each row counts what was lost by then)
    tel.detach()  # the two still pending are counted as lost
    with tel.step(2):
        pass
    tel.close()
    rows = {r["step"]: r["dropped_records_total"] for r in w.table("step")}
    assert rows == {0: 1 + 4, 1: 1 + 4, 2: 3 + 4}, rows
    assert tracer.stats["dropped_pending"] == 3
