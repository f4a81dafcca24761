"""``meshscope trace``: torch.profiler armed on a running job for N steps (agent.deeptrace, the rank side in
agent.instrument.deeptrace, the protocol in agent.contract.deeptrace).

One live 2-rank DDP job of the reference trainer (``tiny``, gloo) runs for the whole module; the trace is
taken once and read by the tests that check it. The rank side's own path without a process group (the
``distributedInfo`` meshscope adds) and the mistakes the CLI refuses run against spools written here.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshscope.agent.contract import EventRecord, RunRecord, spool_path
from meshscope.agent.contract.deeptrace import REQUEST, TraceRequest, new_trace_id, write_atomic
from meshscope.agent.contract.storelayout import StoreLayout
from meshscope.agent.deeptrace import main, read_records, trace
from meshscope.agent.instrument.deeptrace import add_distributed_info
from meshscope.agent.transport.writer import SpoolWriter
from tests.support.harness import ROOT, Job, env, poll_until, private_dir, spool_truth

WORLD, RUN, STEPS = 2, "live", 3
HTA_RANK = re.compile(r'"rank":\s+(\d+)')  # how HTA finds a trace file's rank (hta.common.trace_file)


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshscope.cli", "trace", *map(str, args)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def _last_step(store: Path, rank: int) -> int:
    path = spool_path(store, run=RUN, rank=rank, attempt=0)
    tables = read_records(path, 0, ("step",))["step"] if path.exists() else []
    return max((max(t.column("step").to_pylist()) for t in tables if t.num_rows), default=-1)


# ---------------------------------------------------------------------------------- without a process group
def test_a_rank_without_a_process_group_gets_distributed_info(tmp_path):
    """A loop observed in one process (no torch.distributed): meshscope's telemetry answers the same
    request, and its trace gets the ``distributedInfo`` torch writes only under a process group."""
    import torch

    from meshscope.agent.instrument.config import TelemetryConfig
    from meshscope.agent.instrument.telemetry import Telemetry

    stop, errors = threading.Event(), []

    def loop() -> None:
        try:
            tel = Telemetry(config=TelemetryConfig(store=str(tmp_path), run="solo"), rank=0, world_size=1)
            tel.start({"strategy": "ddp"})
            model = torch.nn.Linear(64, 64)
            step = 0
            while not stop.is_set():
                with tel.step(step):
                    with tel.phase("forward"):
                        loss = model(torch.randn(16, 64)).sum()
                    with tel.phase("backward"):
                        loss.backward()
                step += 1
                time.sleep(0.005)
            tel.close()
        except Exception as exc:  # the assertion below says what
            errors.append(exc)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        poll_until(lambda: spool_path(tmp_path, run="solo", rank=0, attempt=0).exists(), timeout_s=30)
        time.sleep(1.0)  # a few steps in the spool
        result = trace(tmp_path, run="solo", steps=2, out=tmp_path / "out", timeout_s=60)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors and result.ok, (errors, result.as_dict())
    text = (tmp_path / "out" / "rank0.json").read_text()
    info = json.loads(text)["distributedInfo"]
    assert (info["rank"], info["world_size"]) == (0, 1)
    assert int(HTA_RANK.search(text[:100_000]).group(1)) == 0


def test_add_distributed_info_splices_into_the_head_once(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{\n  "schemaVersion": 1,\n  "traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 2}]\n}')
    assert add_distributed_info(path, {"rank": 3, "world_size": 4, "backend": ""})
    got = json.loads(path.read_text())
    assert got["distributedInfo"] == {"rank": 3, "world_size": 4, "backend": ""} and got["schemaVersion"] == 1
    assert int(HTA_RANK.search(path.read_text()).group(1)) == 3
    assert not add_distributed_info(path, {"rank": 5})
    assert json.loads(path.read_text())["distributedInfo"]["rank"] == 3


# ---------------------------------------------------------------------------------------- mistakes
def _spool(store: Path, run: str, *, rank: int = 0, pid: int, events: tuple[str, ...] = (), started: bool = True):
    w = SpoolWriter(path=spool_path(store, run=run, rank=rank, attempt=0), run=run, rank=rank, attempt=0,
                    host=socket.gethostname(), start=False)
    if started:
        w.submit("run", [RunRecord(
            rank=rank, world_size=1, local_rank=rank, host=socket.gethostname(), pid=pid, attempt=0,
            t_start=time.time(), strategy="ddp", mesh="{}", coords="{}", schedule="", microbatches=0,
            virtual_stages=1, model="tiny", n_params=1, n_params_nonembedding=1, n_layers=1, d_model=1, seq_len=1,
            global_batch=1, flops_per_token=1.0, peak_flops=1.0, peak_source="", device="cpu", backend="gloo",
            dtype="fp32", torch_version="", meshscope_version="", python_version="", config="{}",
            flops_method="", environment="{}")])
    for kind in events:
        w.submit("event", [EventRecord(t=time.time(), step=5, kind=kind, message="")])
    w.flush()
    assert w.close()


@pytest.fixture(scope="module")
def stale(tmp_path_factory):
    """A store of runs no trace can reach: ended, never started, a process that is gone."""
    store = tmp_path_factory.mktemp("stale")
    gone = subprocess.Popen(["true"])
    gone.wait()
    _spool(store, "ended", pid=os.getpid(), events=("start", "end"))
    _spool(store, "unstarted", pid=os.getpid(), events=("telemetry_error",), started=False)  # no run record
    _spool(store, "exited", pid=gone.pid, events=("start",))
    return store


def _one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshscope trace: error: "), err
    assert "Traceback" not in err and out == ""
    for needle in needles:
        assert needle in lines[0], lines[0]


def refused(capsys, *args, needles: tuple[str, ...]) -> None:
    """``meshscope trace ARGS`` in this process: exit 2 and one line naming each of ``needles``."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    _one_line_error(code, *capsys.readouterr(), *needles)


def test_the_command_refuses_a_run_that_ended(stale):
    proc = cli("--store", stale, "--run", "ended", "--steps", 3)  # the real command line, once
    _one_line_error(proc.returncode, proc.stdout, proc.stderr, "'ended'", "recorded its end")


@pytest.mark.parametrize("run, needle", [("unstarted", "has not started"), ("exited", "has exited"),
                                         ("nosuch", "has no spool")])
def test_a_run_that_is_not_live_is_refused(stale, capsys, run, needle):
    refused(capsys, "--store", stale, "--run", run, "--steps", 3, needles=(repr(run), needle))


# ---------------------------------------------------------------------------------------- the live job
@pytest.fixture(scope="module")
def live():
    """The running job (its store) and the trace taken of it: ``meshscope trace --steps 3 --json``."""
    with private_dir("meshscope-deeptrace-") as base:
        store, out = base / "store", base / "out"
        job = Job(WORLD, "--model", "tiny", "--steps", 1_000_000, "--batch-size", 8, "--log-every", 1000,
                  "--store", store, "--run-name", RUN, log=base / "job.log")
        try:
            poll_until(lambda: min(_last_step(store, r) for r in range(WORLD)) >= 3, timeout_s=120,
                       what=lambda: f"steps of the live job:\n{job.tail()}")
            t0 = time.monotonic()
            proc = cli("--store", store, "--run", RUN, "--steps", STEPS, "--out", out, "--json", "--timeout", 90)
            took = time.monotonic() - t0
            assert proc.returncode == 0, proc.stdout + proc.stderr + job.tail()
            assert job.running(), job.tail()
            yield {"store": store, "out": out, "job": job, "result": json.loads(proc.stdout), "took_s": took}
        finally:
            job.kill()


@pytest.mark.gloo
def test_every_rank_traces_exactly_the_same_n_steps(live):
    res, out = live["result"], live["out"]
    assert res["ok"] and res["missing"] == [] and set(res["ranks"]) == {"0", "1"}
    first = res["start_step"]
    truth = spool_truth(live["store"], RUN)["step"]
    for rank, r in res["ranks"].items():
        assert (r["first_step"], r["last_step"], r["steps"]) == (first, first + STEPS - 1, STEPS), r
        kineto = json.loads((out / f"rank{rank}.json").read_text())
        info = kineto["distributedInfo"]
        assert (info["rank"], info["world_size"], info["backend"]) == (int(rank), WORLD, "gloo")
        assert any(pg["pg_size"] == WORLD for pg in info["pg_config"])
        marks = sorted((e for e in kineto["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")),
                       key=lambda e: e["ts"])
        assert [e["name"] for e in marks] == [f"ProfilerStep#{s}" for s in range(first, first + STEPS)]
        # Each mark spans meshscope's own record of that step (one clock: Unix time on both sides).
        base = kineto["baseTimeNanoseconds"] / 1e9
        mine = truth[truth["rank"] == int(rank)].set_index("step")
        for e in marks:
            step = mine.loc[int(e["name"].split("#")[1])]
            start, end = base + e["ts"] / 1e6, base + (e["ts"] + e["dur"]) / 1e6
            assert start <= step["t_start"] + 2e-3 and end >= step["t_end"] - 2e-3, (e, step)
            assert (end - start) - step["wall_s"] < 0.25 * step["wall_s"] + 5e-3
        # ... and no op outside the traced steps' window (the profiler ran for them only)
        ops = [e for e in kineto["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        lo, hi = marks[0]["ts"], marks[-1]["ts"] + marks[-1]["dur"]
        assert ops and all(lo - 1e3 <= e["ts"] <= hi for e in ops)
    # the store keeps the traces; the control files beside the spools are gone
    kept = StoreLayout.of(live["store"]).trace(RUN, res["id"])
    assert {p.name for p in Path(kept).iterdir()} >= {"rank0.json", "rank1.json", "merged.json"}
    assert not (Path(StoreLayout.of(live["store"]).deeptrace(RUN)) / REQUEST).exists()
    print(f"\ndeeptrace: steps {first}..{first + STEPS - 1} on both ranks in {live['took_s']:.1f} s; profiler "
          + ", ".join(f"rank {k}: start {r['profiler_start_s'] * 1e3:.1f} ms stop {r['profiler_stop_s'] * 1e3:.1f} ms "
                      f"export {r['export_s'] * 1e3:.1f} ms" for k, r in res["ranks"].items()))


@pytest.mark.gloo
def test_merged_timeline_has_ranks_as_processes_with_meshscope_and_profiler_tracks(live):
    merged = json.loads((live["out"] / "merged.json").read_text())
    first = live["result"]["start_step"]
    ev = merged["traceEvents"]
    assert {e["pid"] for e in ev} == {0, 1}
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert set(procs) == {0, 1} and procs[0].startswith("rank 0")
    for pid in (0, 1):
        threads = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}
        assert {"steps", "phases", "comm dp"} <= threads and any(t.startswith("torch") for t in threads)
        steps = sorted(e["args"]["step"] for e in ev if e["pid"] == pid and e.get("cat") == "step")
        marks = sorted(int(e["name"].split("#")[1]) for e in ev
                       if e["pid"] == pid and e.get("name", "").startswith("ProfilerStep#"))
        assert steps == marks == list(range(first, first + STEPS))
        assert any(e["pid"] == pid and e.get("cat") == "comm,dp" for e in ev)  # DDP's all-reduces
        assert any(e["pid"] == pid and e.get("cat") == "cpu_op" for e in ev)
    assert min(e["ts"] for e in ev if "ts" in e) >= 0
    assert merged["metadata"]["steps"] == {"0": [first, first + STEPS - 1], "1": [first, first + STEPS - 1]}


@pytest.mark.gloo
def test_hta_reads_the_traces(live):
    """HTA (HolisticTraceAnalysis) reads each rank's trace by its distributedInfo. It is pointed at the rank
    files: it takes every ``*.json`` of a folder for a rank's trace, merged.json included."""
    from hta.trace_analysis import TraceAnalysis

    out, first = live["out"], live["result"]["start_step"]
    for rank in range(WORLD):
        head = (out / f"rank{rank}.json").read_text()[:100_000]
        assert int(HTA_RANK.search(head).group(1)) == rank
    analysis = TraceAnalysis(trace_dir=str(out), trace_files={r: f"rank{r}.json" for r in range(WORLD)})
    assert sorted(analysis.t.traces) == list(range(WORLD))
    # HTA's iterations are the ProfilerStep# marks (it leaves out the last, which it takes for unfinished)
    assert set(analysis.get_profiler_steps()) <= set(range(first, first + STEPS))
    for rank in range(WORLD):
        df = analysis.t.get_trace(rank)
        assert len(df) and set(df["iteration"]) - {-1} <= set(range(first, first + STEPS))
    if not (analysis.t.get_trace(0)["stream"] >= 0).any():
        pytest.skip("HTA's temporal breakdown and comm/comp overlap measure GPU kernels (events on a CUDA "
                    "stream); a CPU trace has none: HTA 0.5 raises IndexError on the empty kernel frame "
                    "(breakdown_analysis._get_idle_time_for_kernels) and returns NaN overlap")
    breakdown = analysis.get_temporal_breakdown(visualize=False)
    assert sorted(breakdown["rank"]) == list(range(WORLD))
    overlap = analysis.get_comm_comp_overlap(visualize=False)
    assert sorted(overlap["rank"]) == list(range(WORLD))


@pytest.mark.gloo
@pytest.mark.parametrize("args, needle", [(("--steps", 0), "--steps 0"), (("--steps", -3), "--steps -3"),
                                          (("--steps", 2, "--ranks", "0,2"), "rank 2 is outside the world of 2"),
                                          (("--steps", 2, "--ranks", "one"), "'one'")])
def test_bad_steps_or_ranks_are_refused(live, capsys, args, needle):
    refused(capsys, "--store", live["store"], "--run", RUN, *args, needles=(needle,))


@pytest.mark.gloo
def test_a_second_trace_while_one_is_armed_is_refused(live, capsys):
    control = Path(StoreLayout.of(live["store"]).deeptrace(RUN))
    now = time.time()
    # armed for a rank outside the world: no rank of the live job takes it, so it stays armed
    request = TraceRequest(id=new_trace_id(now), run=RUN, steps=2, ranks=(7,), start_step=None, created=now,
                           expires=now + 60)
    write_atomic(control / REQUEST, request.dumps())
    try:
        refused(capsys, "--store", live["store"], "--run", RUN, "--steps", 2, needles=("already armed", request.id))
    finally:
        (control / REQUEST).unlink()




@pytest.mark.gloo
def test_the_overview_page_arms_a_trace_and_lists_it(live, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(live["store"])])
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=60).run()
    at.switch_page("app_pages/overview.py")
    at.run()
    assert not at.exception, at.exception
    at.number_input(key=f"deeptrace.steps.{RUN}").set_value(2)
    at.button(key=f"deeptrace.go.{RUN}").click()
    at.run()
    assert not at.exception, at.exception

    def said() -> str | None:
        at.run()
        assert not at.exception, at.exception
        return next((c.value for c in at.caption if c.value.startswith(("Traced", "Incomplete", "meshscope"))), None)

    text = poll_until(said, timeout_s=90, interval_s=1.0, what="the panel's outcome")
    assert text.startswith("Traced (2 steps): rank 0 steps "), text
    listed = [c.value for c in at.caption if c.value.startswith("Trace ")]
    assert len(listed) == 2 and all("on ranks 0, 1" in c for c in listed), listed  # the module's first trace too
    assert any(b.label == "merged.json" for b in at.get("download_button"))
