"""The telemetry path end to end on real torchrun jobs of the reference trainer (gloo, 2 ranks):
trainer → spool → agent → Parquet store / Prometheus, checked against independent truths (an injected
delay, the analytic bubble, promtool, the catalog)."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshscope.agent import catalog
from meshscope.agent.store.reader import read_table
from tests.support.jobs import PROFILED, REFERENCE_STEPS, ROOT, run_job, trainer_env

pytestmark = pytest.mark.gloo


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank. torch 2.13's elastic agent starts each rank in a session of its
    own, so killing torchrun's group alone would orphan the ranks: take the whole process tree."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in [psutil.Process(proc.pid)] + tree if proc.poll() is None else tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


STEPS = REFERENCE_STEPS
# The ops and mesh dims each reference run must record, and whether it records pipeline spans.
STRATEGIES = {
    "ddp": ({("all_reduce", "dp")}, False),
    "fsdp2": ({("all_gather", "fsdp"), ("reduce_scatter", "fsdp")}, False),
    "tp": ({("all_reduce", "tp")}, False),
    "pp-1f1b": ({("send", "pp"), ("recv", "pp")}, True),
    "pp-gpipe": ({("send", "pp"), ("recv", "pp")}, True),
}


@pytest.fixture(params=list(STRATEGIES))
def profiled_run(request, reference_runs):
    """The session's reference run of each strategy (tests/support/jobs.py: 2 ranks, ``tiny-wide``, a
    torch.profiler trace of steps 2..9 on every rank): (name, store, ops, spans). ``tiny-wide``, not
    ``tiny``: its ops take 2-120 ms, so the tracer's fixed Python cost per op (35-90 µs on a 2-vCPU VM) is
    a few % of an op; on tiny (0.3-2 ms ops) the medians already reach 1.09 here
    (bench/profiler_agreement.py reports both models), and the test must not hinge on CI's speed."""
    ops, spans = STRATEGIES[request.param]
    return request.param, reference_runs[request.param].store, ops, spans


def test_store_holds_every_step_collective_and_span(profiled_run):
    name, tmp_path, expect_ops, expect_spans = profiled_run
    steps = STEPS
    runs = read_table(tmp_path, "run", run=name)
    assert sorted(runs["rank"]) == [0, 1] and set(runs["world_size"]) == {2}
    step = read_table(tmp_path, "step", run=name)
    assert sorted(zip(step["rank"], step["step"])) == [(r, s) for r in (0, 1) for s in range(steps)]
    parts = step["compute_s"] + step["exposed_comm_s"] + step["bubble_s"] + step["other_s"]
    assert ((parts - step["wall_s"]).abs() < 1e-6).all()  # the breakdown adds up
    assert (step["compute_s"] > 0).all() and (step["mfu"] > 0).all()
    coll = read_table(tmp_path, "collective", run=name)
    seen = set(zip(coll["op"], coll["dim"]))
    assert expect_ops <= seen, seen
    # Every step of every rank has its collectives, and each step's count matches the step record.
    counts = coll.groupby(["rank", "step"]).size()
    for row in step.itertuples():
        assert counts.get((row.rank, row.step), 0) == row.n_collectives > 0
    # Per-group sequence numbers have no gaps: nothing lost between hooks and store.
    for _, g in coll.groupby(["rank", "group"]):
        assert sorted(g["seq"]) == list(range(1, len(g) + 1))
    spans = read_table(tmp_path, "span", run=name)
    if expect_spans:
        per = spans.groupby(["rank", "step", "kind"]).size()
        assert set(per.values) == {4}  # 4 microbatches forward and backward, every step, both stages
        assert len(per) == 2 * steps * 2
    else:
        assert spans.empty
    assert set(read_table(tmp_path, "event", run=name)["kind"]) >= {"start", "end"}


@pytest.mark.parametrize("layout", [(), ("--fsdp",)], ids=["ddp", "fsdp2"])
def test_injected_straggler_is_the_compute_outlier_and_others_wait_for_it(tmp_path, layout):
    # The growth reads low by up to the baseline's own exposed communication (FSDP2 on gloo: 0.03-0.06 s),
    # which the long wait absorbs; 0.6 s keeps that bias well inside the 20 % (at 0.3 s FSDP2 read 0.237).
    delay, first, steps = 0.6, 6, 10
    run_job(tmp_path, "s", 2, "--steps", str(steps), "--straggler-ranks", "1", "--straggler-seconds", str(delay),
            "--straggler-from-step", str(first), *layout)
    step = read_table(tmp_path, "step", run="s").set_index(["rank", "step"]).sort_index()
    # Steps 0-1 are warm-up (allocations, bucket rebuilds, FSDP2's lazy init: up to twice the steady
    # compute, and the peer waits for that too); compare 4 steady steps before the onset with 4 after.
    # With steps 1-2 as the baseline the exposed-comm growth read 0.20-0.27 s for 0.3 s in some runs.
    base = [s for s in range(2, first)]
    slow = [s for s in range(first, steps)]

    def med(rank, col, steps_):
        return statistics.median(step.loc[(rank, s), col] for s in steps_)

    cols = ["wall_s", "compute_s", "exposed_comm_s", "bubble_s", "other_s"]
    print(f"\n{layout} medians, base steps {base} then slow steps {slow}:\n"
          + step[cols].groupby([step.index.get_level_values("rank"), step.index.get_level_values("step") >= first])
          .median().round(4).to_string())
    # Rank 1 is the outlier in compute: by about the injected delay.
    assert med(1, "compute_s", slow) - med(0, "compute_s", slow) == pytest.approx(delay, rel=0.2)
    # Rank 0 waits for it: its exposed communication grows by about the injected delay.
    assert med(0, "exposed_comm_s", slow) - med(0, "exposed_comm_s", base) == pytest.approx(delay, rel=0.2)
    # And its own compute does not change (the delay is not its fault).
    assert abs(med(0, "compute_s", slow) - med(0, "compute_s", base)) < 0.2 * delay


def _bubble(tmp_path, run: str, *args: str, schedule: str, p: int, m: int, v: int = 1):
    """Median measured bubble per stage over steady steps: 1 − Σ(own spans) / pipeline extent, the extent
    running from the first span start to the last span end over all stages (the window the theory
    describes). The per-rank ``bubble_s`` of the step record is local to each rank: the drain at the end of
    a step (the last stage waiting for the first one's final backward) is that rank's wait in its first
    reduction over pp after the schedule, which the record counts as bubble (tests/test_diff_runs.py holds
    the record's bubble to the schedule).

    Beside it, ``replay_bubble``: the schedule simulator fed each step's measured op times and transfer
    time (``pipeline_sim.replay``), an independent model of what the schedule makes the stages wait; and
    whether the run had a core per rank (``contended``: the product's CPU-contention warning, from the
    run-queue delay)."""
    from meshscope.dashboard import environment
    from meshscope.dashboard.analysis import measured_bubble
    from meshscope.dashboard.pipeline_sim import replay

    # tiny-wide's blocks dominate its embedding and head (balanced stages), and 8-sequence microbatches
    # (~120 ms forward) keep each P2P hop's fixed cost (~1 ms on gloo loopback) small against compute.
    run_job(tmp_path, run, 2, "--model", "tiny-wide", "--steps", "7", "--pp", "2", "--batch-size", "32", *args)
    spans = read_table(tmp_path, "span", run=run)
    steady = spans[spans["step"] >= 2]  # warm-up steps excluded
    measured = measured_bubble(steady).merge(replay(steady, schedule=schedule, p=p, m=m, v=v), on="step")
    assert measured["step"].nunique() == 5, measured  # every steady step replayed: its spans fit the schedule
    steps = read_table(tmp_path, "step", run=run)
    shares = environment.run_queue_share(steps[steps["step"] >= 2])
    contended = [w for w in environment.warnings(device="cpu", shares=shares, n_steady=5)
                 if w.startswith("CPU contention")]
    frac = measured.groupby("rank")[["bubble", "schedule_bubble", "replay_bubble", "schedule_idle", "hop_s",
                                          "imbalance", "busy_s", "balanced_idle"]].median()
    print(f"\n{schedule}: CPU wait share {shares.round(3).to_dict('records')}\n{frac.round(4).to_string()}")
    return frac, contended


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_fraction_matches_theory(tmp_path, schedule):
    p, m = 2, 4
    frac, contended = _bubble(tmp_path, schedule, "--schedule", schedule, "--microbatches", str(m),
                              schedule=schedule, p=p, m=m)
    theory = (p - 1) / (m + p - 1)
    # The theory is for balanced stages. The last stage also runs the final norm, the head and the loss:
    # measured 3-5 % more busy time than stage 0 here, so the extent follows the last stage and stage 0
    # idles that much longer (raw 21.5-23.9 % against 20 % on stage 0, 19.8-20.5 % on the last stage).
    # measured_bubble splits that imbalance off: what is left is the schedule's fill and drain.
    # Per step, the schedule share is exactly the raw bubble of that step's slowest stage (and raw =
    # schedule + imbalance on every stage); medians over steps are taken per column. Which stage is the
    # slowest can change from step to step when the stages are this close (1F1B), so the check is on the
    # schedule share, not on the raw bubble of one fixed rank.
    # The closed form treats P2P transfers as free: it is the replay's idle share (schedule_idle: fill and
    # drain from the measured op times, transfers left out), as the interleaved and zero-bubble tests
    # compare it; the schedule share carries the hops on top (GPipe's reached 23.4 % against 20 % on
    # 2026-11-25 with its idle share at 20.7 %).
    for rank, row in frac.iterrows():
        # What the schedule implies for the op and transfer times measured.
        assert abs(row["schedule_bubble"] - row["replay_bubble"]) <= 0.03, (rank, row.to_dict())
        assert row["schedule_bubble"] >= row["schedule_idle"] - 1e-9, (rank, row.to_dict())  # hops on top
    _closed_form_holds_where_its_assumptions_did(frac, theory=theory, contended=contended)


# Stages whose busy times differ by less than this share of the step count as balanced. Interleaved p2 m4
# v2 is this sensitive: stages 3.6 % apart (rank 0 the heavier) read 7.8 % fill & drain against 11.1 %
# (full suite, 2026-11-29 08:50), 18.5 % apart 3.9 %.
BALANCED = 0.015


def _closed_form_holds_where_its_assumptions_did(frac, *, theory: float, contended: list[str]) -> None:
    """The closed form is the schedule's fill and drain for balanced stages, equal op times and free
    transfers. The theory the product shows (balanced_idle: the run's own order replayed under exactly
    those assumptions) must equal it on every run. The measured fill and drain (schedule_idle: the order
    replayed with the op times measured, transfers left out) and the raw bubble meet it only where the
    run met the assumptions:

    - stages balanced: on this 2-vCPU machine the two ranks' busy times differ by 0.6 % in one run and
      by 18-21 % in the next on the same code (2026-11-29, three runs in a row; CI failed on one at 18.5 %).
      When the first stage is the heavier one it never waits for the last, so its idle share falls far
      below the theory (fill & drain 2.6 % and 3.9 % against 11.1 % for interleaved p2 m4 v2); the
      product reports that difference as stage imbalance, and the replay above still holds the measured
      share to the schedule. A heavier stage only ever shortens the busiest rank's idle: the measured fill
      and drain never exceed the theory by more than the op times' own spread.
    - no CPU contention: with ranks sharing cores, fill and drain, where one stage runs alone, get a core
      to themselves and run faster (a busy loop on one of 2 cores: 1F1B's schedule share 14.7 % against
      20 %). The product then warns that bubble vs theory describes the machine's load."""
    assert (frac["balanced_idle"] - theory).abs().max() <= 1e-6, (frac["balanced_idle"].tolist(), theory)
    if contended:
        assert any(w.startswith("CPU contention") for w in contended), contended
        print(f"contended: closed form {theory:.4f} not asserted; replay {frac['replay_bubble'].round(4).tolist()}")
        return
    assert (frac["schedule_idle"] <= theory + 0.03).all(), (frac.to_dict("index"), theory)
    imbalance = float(frac["imbalance"].max())
    if imbalance > BALANCED:
        print(f"stages {imbalance:.1%} apart: closed form {theory:.4f} held as an upper bound only")
        return
    for rank, row in frac.iterrows():
        assert abs(row["schedule_idle"] - theory) <= 0.03, (rank, row.to_dict(), theory)
        assert row["bubble"] >= theory - 0.03, (rank, row.to_dict(), theory)


def test_interleaved_bubble_is_reported_against_its_theory(tmp_path):
    p, m, v = 2, 4, 2
    both, contended = _bubble(tmp_path, "il", "--schedule", "interleaved", "--microbatches", str(m),
                              schedule="interleaved", p=p, m=m, v=v)
    theory = (p - 1) / (v * m + p - 1)
    # Interleaving trades bubble for more P2P hops (2·v per microbatch instead of 2); each hop has a fixed
    # cost the theory treats as free, so the schedule's share sits above (p-1)/(v·m+p-1) by what the hops
    # cost on the day (+1.1 to +1.4 pp measured once, +1.8 to +3.7 pp on 2026-11-25, failing a 3 pp check
    # on the unchanged code 3 times in 4), and well below the non-interleaved (p-1)/(m+p-1). The closed
    # form is the schedule's fill and drain with free transfers and balanced stages: the replay's idle
    # share (schedule_idle, measured op times, transfers left out) where the stages were balanced.
    for rank, row in both.iterrows():
        assert abs(row["schedule_bubble"] - row["replay_bubble"]) <= 0.03, (rank, row.to_dict())
        assert row["schedule_bubble"] < (p - 1) / (m + p - 1) - 0.03, (rank, row.to_dict())
        assert row["schedule_bubble"] >= row["schedule_idle"] - 1e-9, (rank, row.to_dict())  # hops on top
    _closed_form_holds_where_its_assumptions_did(both, theory=theory, contended=contended)


def test_zero_bubble_is_reported_against_the_theory_of_its_own_order(tmp_path):
    """torch's ScheduleInterleavedZeroBubble has no closed form: the theory is its own order (taken from the
    spans) replayed with balanced stages, F = I = W and free transfers. The page and report show that
    number, it is below interleaved 1F1B's closed form (the split weight gradients fill the drain), and the
    measured schedule share is what the replay of the measured op times implies."""
    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import views

    p, m, v = 2, 4, 2
    frac, contended = _bubble(tmp_path, "zb", "--schedule", "interleaved-zb", "--microbatches", str(m),
                              schedule="interleaved-zb", p=p, m=m, v=v)
    view = views.pipeline(views.direct_loader(Store.open(tmp_path)), run="zb", steps=None)
    interleaved = (p - 1) / (v * m + p - 1)
    assert view.theory_source.startswith("the run's own order") and view.theory < interleaved - 0.03, view.theory
    spans = read_table(tmp_path, "span", run="zb")
    assert set(spans["kind"]) == {"forward", "backward", "weight"}  # the weight gradients are split off
    for rank, row in frac.iterrows():
        # Fill and drain as the theory says; the transfers (4·v hops per microbatch) come on top.
        assert abs(row["schedule_bubble"] - row["replay_bubble"]) <= 0.03, (rank, row.to_dict())
        assert row["schedule_bubble"] < (p - 1) / (m + p - 1) - 0.03, (rank, row.to_dict())
    _closed_form_holds_where_its_assumptions_did(frac, theory=view.theory, contended=contended)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make install-servers)")
def test_metrics_of_a_running_job_pass_promtool_and_stay_in_budget(tmp_path):
    agent = subprocess.Popen(
        [sys.executable, "-m", "meshscope.cli", "agent", "--store", str(tmp_path), "--port", "0",
         "--poll-interval", "0.2", "--gpu-interval", "0"],
        cwd=ROOT, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = agent.stdout.readline()
        assert "serving http://127.0.0.1:" in line, line
        port = int(line.split("127.0.0.1:")[1].split("/")[0])
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
             "meshscope.trainer.train", "--steps", "400", "--log-every", "50", "--tp", "2", "--store", str(tmp_path),
             "--run-name", "live"], cwd=ROOT, env=trainer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)  # its own process group: killing it must take the ranks too
        try:
            deadline = time.monotonic() + 120
            text = ""
            while time.monotonic() < deadline:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
                if 'meshscope_rank_last_step{rank="1",run="live"}' in text and job.poll() is None:
                    # let a few more steps land while the job is still running
                    time.sleep(1.0)
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                        text = resp.read().decode()
                    break
                time.sleep(0.3)
            assert job.poll() is None, "job ended before the check: raise --steps"
        finally:
            kill_group(job)
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        names = catalog.sample_names()
        per_rank: dict[str, int] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                assert s.name in names, s.name
                assert not s.name.endswith("_created")
                if s.labels.get("run") == "live" and "rank" in s.labels:
                    per_rank[s.labels["rank"]] = per_rank.get(s.labels["rank"], 0) + 1
        assert set(per_rank) == {"0", "1"}
        assert max(per_rank.values()) <= 40, per_rank
        # The live figures are real: rank steps advance and the tp all-reduces are counted.
        assert 'meshscope_rank_collectives_total{dim="tp",op="all_reduce",rank="0",run="live"}' in text
    finally:
        agent.terminate()
        agent.wait(timeout=20)


WAKEUP_FLOOR_S = 250e-6  # see test_collective_time_per_op_agrees_with_the_profiler
CONTENDED_WAKEUP_S = 1e-3  # the same when ranks wait for a CPU (the page warns of CPU contention)


def test_clean_runs_flag_no_straggler(profiled_run):
    """No injected delay, every strategy: the Overview's verdict names nobody (PP ranks are each alone in
    their stage: no peers, no verdict; the rule must not mistake the last stage's head for a straggler)."""
    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import views

    strategy, store, _, _ = profiled_run
    ov = views.overview(views.direct_loader(Store.open(store)), run=strategy, runs=[strategy], steps=None)
    assert ov.verdict_steps >= 5 and ov.stragglers is not None
    if _contended(ov.warnings):
        # A rank that shares its core with another process is slower than its peer, truly: the verdict may
        # name it, but only with the machine as the cause (a busy loop on one of 2 cores flagged DDP's
        # rank 0), and the page says the figures include waiting for a CPU.
        assert all(c.startswith("CPU contention") for c in ov.stragglers["cause"]), (strategy, ov.stragglers.to_string())
        return
    assert ov.stragglers.empty, (strategy, ov.stragglers.to_string())
    assert ov.metrics["cost_s"] == 0.0


def test_memory_model_states_match_the_tensors(profiled_run):
    """The Memory page's comparison, every strategy: the analytic parameters, gradients and optimizer state
    per device against the bytes of each rank's own tensors (AdamW in fp32: 4 + 4 + 8 B per parameter,
    divided as the strategy shards them) agree within 1 %, and the page draws it."""
    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import views

    strategy, store, _, _ = profiled_run
    view = views.memory(views.direct_loader(Store.open(store)), run=strategy, steps=None)
    assert view.states is not None and "states" in view.figures, strategy
    assert list(view.states["component"]) == ["parameters", "gradients", "optimizer state"]
    assert (view.states["error"].abs() < 0.01).all(), (strategy, view.states.to_string())
    assert (view.states["measured_min"] > 0).all()


def _contended(warnings: list[str]) -> bool:
    """Whether the product warned that ranks waited for a CPU (dashboard.environment): then the truths
    that assume a core per rank do not hold, and the tests say what holds instead."""
    hit = any(w.startswith("CPU contention") for w in warnings)
    if hit:
        print("\n" + "\n".join(warnings))
    return hit


def test_collective_time_per_op_agrees_with_the_profiler(profiled_run):
    """Ground truth: a torch.profiler trace of the same steps of the same job. Per rank, step, op and path,
    the telemetry's Σ(issue → observed completion) against the profiler's: c10d issue event start → gloo
    range end for hooks, FSDP comms and ``torch.distributed`` calls, ``_c10d_functional::<op>`` start →
    ``wait_tensor`` end for TP's functional collectives (``profiler_op_refs`` in
    tests/support/profiler.py says why). The median of the 8 profiled steps must agree within 10 %.

    The median, not every step: the profiler's gloo range ends on gloo's worker thread after it has woken
    the waiting training thread, and on a 2-core machine running 2 ranks the OS often runs the woken thread
    first; the range end then lands up to a scheduler slice (~4 ms) after the op completed. That happens
    with no telemetry at all (DDP's C++ all-reduce: gloo range end after backward's return by up to 4.3 ms
    in 4-5 of 30 steps, bench/profiler_agreement.py --reference-check), so single steps read 0.35-0.6.

    Ops shorter than 2.5 ms agree within ``WAKEUP_FLOOR_S`` (0.25 ms) per op rather than 10 %: a blocking
    call's completion is the return of its wait, so the waiting thread's wake-up is in it. That costs
    12-62 us per op on a quiet 2-core machine (PP's ~1.4 ms all-reduces: ratio 1.03-1.05), and ~0.15 ms
    in a fresh-clone `make test` run (1.10, the strict 10 % failed there)."""
    from tests.support.profiler import OP_TO_GLOO, chrome_trace_events, profiler_op_refs, tracer_op_refs

    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import views

    strategy, tmp_path, _, _ = profiled_run
    first, last = PROFILED
    coll = read_table(tmp_path, "collective", run=strategy)
    # A blocking op's end is its waiting thread's wake-up; when the ranks share cores with other work that
    # wake-up waits for a CPU too: with a busy loop on one of 2 cores the per-op medians read +0.28 ms on
    # TP's 0.33 ms all-reduce (ratio 1.85) and +0.5 ms on PP's ~4 ms one (1.12). The page then warns that
    # timings include waiting for a CPU, and the floor becomes CONTENDED_WAKEUP_S per op: still a failure
    # for an op mispaired or stamped off by its own duration once ops take a few ms.
    ov = views.overview(views.direct_loader(Store.open(tmp_path)), run=strategy, runs=[strategy], steps=(first, last - 1))
    floor_s = CONTENDED_WAKEUP_S if _contended(ov.warnings) else WAKEUP_FLOOR_S
    for rank in (0, 1):
        events = chrome_trace_events(tmp_path / "prof" / f"rank-{rank}.json")
        refs = profiler_op_refs(events, window_prefix="train_step_", first_step=first, n_steps=last - first)
        mine = coll[coll["rank"] == rank]
        ratios: dict[tuple[str, str], list[float]] = {}
        diffs: dict[tuple[str, str], list[float]] = {}
        refs_s: dict[tuple[str, str], list[float]] = {}
        for i, step in enumerate(range(first, last)):
            recs = mine[mine["step"] == step][["op", "source", "t_start", "t_end"]].to_dict("records")
            for key, t in tracer_op_refs(recs).items():
                p = refs[i].get(key)
                assert p is not None and p["count"] == t["count"], (rank, step, key, t, p)
                # NaN: the profiler's events of this step do not pair one-to-one (no reference).
                ratios.setdefault(key, []).append(t["duration_s"] / p["issue_to_done_s"])
                diffs.setdefault(key, []).append((t["duration_s"] - p["issue_to_done_s"]) / t["count"])
                refs_s.setdefault(key, []).append(p["issue_to_done_s"] / t["count"])
        assert {OP_TO_GLOO[op] for op in set(mine["op"])} == {name for name, _ in ratios}
        print(f"\n{strategy} rank {rank}: " + ", ".join(
            f"{name}/{path} {[round(v, 3) for v in values]}" for (name, path), values in sorted(ratios.items())))
        print("  per op, median: " + ", ".join(
            f"{n}/{pth} ref {statistics.median(refs_s[(n, pth)]) * 1e6:.0f} us, diff {statistics.median(d) * 1e6:+.0f} us"
            for (n, pth), d in sorted(diffs.items()) if all(x == x for x in d)))
        compared = 0
        for key, values in ratios.items():
            paired = [v for v in values if v == v]
            if len(paired) < 4:
                continue
            compared += 1
            # 10 %, or the wake-up floor for short ops (see the docstring): the median op's reference time
            # sets which applies.
            ref_s = statistics.median(x for x, v in zip(refs_s[key], values) if v == v)
            tolerance = max(0.10, floor_s / ref_s)
            assert abs(statistics.median(paired) - 1) <= tolerance, (rank, key, ref_s, tolerance, sorted(paired))
        assert compared >= 1, (rank, ratios)
