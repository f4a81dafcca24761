"""Why a job hangs, named while it is alive (issue 43): real torchrun jobs of the reference trainer on gloo
hang on purpose (``trainer.faults``), and ``meshscope hang`` — over the store the ranks' watchdogs write,
with the default thresholds — must name, within 30 s of the hang's start and with the job still running:

- the culprit rank (the one the injected fault stopped),
- the collective the others wait in (op, group, sequence number: one past the last the culprit completed),
- a frame of the culprit's stack inside the trainer's fault injection;

for a 4-rank FSDP2 job, a 2-rank DDP job and a 2-rank pipeline (a stage that stops sending), and a desync
(rank 1 all-gathers where the others all-reduce) as a mismatch on that group and sequence number. A clean
run whose first step takes 20 s (a ``torch.compile``-like first step) gets no hang.

torch's Flight Recorder, dumped by the same watchdogs (``telemetry.flight_recorder_dir``) and read by torch's
own analyser, names the same culprit — except for the pipeline, whose send / recv it does not record on
gloo (torch 2.13): there it must find nothing to blame, and the test says so.

The independent truth is the fault itself (which rank, which step, where in the code) and the collective
records of the ranks (the seq they completed before the hang).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshscope.agent.collector.catchup import catch_up
from meshscope.agent.store.reader import Store, read_table
from meshscope.dashboard import hangcli, views
from tests.support.flightrec import torch_findings
from tests.support.harness import Job, poll_until, private_dir

pytestmark = pytest.mark.gloo

HANG_STEP = 6
DETECT_S = 30.0  # the acceptance bound: from the hang's start to the verdict
# name → (ranks, trainer arguments, culprit, the op the others wait in)
CASES = {
    "fsdp4": (4, ("--fsdp", "--hang-rank", "2", "--hang-step", str(HANG_STEP)), 2, "all_gather"),
    "ddp2": (2, ("--hang-rank", "1", "--hang-step", str(HANG_STEP)), 1, "all_reduce"),
    "pp2": (2, ("--pp", "2", "--hang-rank", "1", "--hang-step", str(HANG_STEP)), 1, "send/recv"),
    "desync3": (3, ("--desync-rank", "1", "--desync-step", str(HANG_STEP)), 1, "all_reduce"),
}


def _verdict(store, run: str) -> dict:
    catch_up(store)  # what the CLI does without an agent: the spools' new records into the store
    return hangcli.build(views.direct_loader(Store.open_many([str(store)])), run=run, now=time.time())


@pytest.fixture(scope="module", params=list(CASES))
def hung(request):
    name = request.param
    world, args, culprit, op = CASES[name]
    with private_dir() as store:
        fr = store / "flight-recorder"
        job = Job(world, "--steps", 400, "--batch-size", 4 * world, "--log-every", 1, "--store", store,
                  "--run-name", name, *args, "--set", f"telemetry.flight_recorder_dir={fr}", log=store / "job.log")
        try:
            # the hang starts when the last step before it has ended: rank 0 prints it
            poll_until(lambda: (HANG_STEP - 1) in job.printed_steps(), timeout_s=120,
                       what=lambda: f"step {HANG_STEP - 1} printed; log: {job.tail(600)}")
            t0 = time.time()

            def named():
                try:
                    h = _verdict(store, name)
                except hangcli.ConfigError:  # the run's first records not in the store yet
                    return None
                return h if h["status"] == "hung" and h["culprit_ranks"] and len(h["ranks"]) == world else None

            h = poll_until(named, timeout_s=DETECT_S + 30, interval_s=1.0, what=f"{name}: a hang verdict")
            detected_s = time.time() - t0
            alive = job.running()
            cli = subprocess.run([sys.executable, "-m", "meshscope.cli", "hang", "--store", str(store), "--run", name,
                                  "--json"], capture_output=True, text=True, timeout=60)
            colls = read_table(store, "collective", run=name)
            poll_until(lambda: len(list(fr.glob("rank_*"))) == world, timeout_s=30,
                       what=lambda: f"every rank's Flight Recorder dump: {sorted(p.name for p in fr.glob('*'))}")
            yield {"fr": torch_findings(fr), "store": store,"name": name, "world": world, "culprit": culprit, "op": op, "h": h, "detected_s": detected_s,
                   "alive": alive, "cli": cli, "colls": colls}
        finally:
            job.kill()


def test_the_culprit_and_the_collective_the_others_wait_in_are_named_while_the_job_lives(hung):
    h, culprit, world = hung["h"], hung["culprit"], hung["world"]
    print(f"\n{hung['name']}: named after {hung['detected_s']:.1f} s: {h['verdict']}")
    assert hung["alive"], "the verdict must come while the job still runs"
    assert hung["detected_s"] <= DETECT_S, hung["detected_s"]
    assert h["culprit_ranks"] == [culprit], h["verdict"]
    others = [r for r in range(world) if r != culprit]
    w = h["waiting"]
    if hung["name"] == "desync3":  # every rank is in a collective: the odd one is named by its op
        m = h["mismatch"]
        assert m is not None and m["odd_ranks"] == [culprit] and m["ops"][str(culprit)] == "all_gather"
        assert {m["ops"][str(r)] for r in others} == {"all_reduce"} and m["dim"] == "dp"
        assert sorted(w["ranks"]) == list(range(world))
    else:
        assert h["mismatch"] is None
        assert w["ranks"] == others and w["op"] == hung["op"]
    # the sequence number waited for is one past the last the group completed before the hang (the
    # collective records: every rank's last seq on that group; the culprit's too, which it never passed)
    c = hung["colls"]
    done = c[c["group"] == w["group"]].groupby("rank")["seq"].max()
    if hung["name"] != "pp2":  # P2P: each rank numbers its own sends and receives
        assert set(done) == {w["seq"] - 1}, (done.to_dict(), w)
    else:
        assert int(done[others[0]]) == w["seq"] - 1
    # a frame of the culprit's stack inside the trainer's fault injection
    assert any("meshscope/trainer/faults.py" in f and (" before_step" in f or " _desync" in f)
               for f in h["stacks"][str(culprit)]), h["stacks"][str(culprit)]
    assert h["culprit_frames"][str(culprit)].startswith(("meshscope/trainer/faults.py", "torch/distributed/"))


def test_flight_recorder_names_the_same_culprit(hung):
    found = hung["fr"]
    print(f"\n{hung['name']}: torch's Flight Recorder analyser: {found[:1]}")
    if hung["name"] == "pp2":  # gloo's recorder has no send / recv: the stall is invisible to it
        assert all(not f["culprits"] for f in found), found
        return
    assert found, "torch's analyser flagged no collective"
    first = found[0]
    assert first["culprits"] == hung["h"]["culprit_ranks"] == [hung["culprit"]], first
    if hung["name"] == "desync3":
        assert first["mismatch"] == {hung["culprit"]: "gloo:all_gather"} and first["op"] == "gloo:all_reduce"
    else:
        assert first["missing"] == [hung["culprit"]]


def test_the_cli_prints_the_same_verdict_as_json(hung):
    cli = hung["cli"]
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout)
    assert out["culprit_ranks"] == hung["h"]["culprit_ranks"] and out["waiting"]["seq"] == hung["h"]["waiting"]["seq"]
    assert out["status"] == "hung" and out["since_s"] >= hung["h"]["since_s"] - 1.0
    assert re.search(rf"Rank {hung['culprit']} holds the job|rank {hung['culprit']} differs", out["verdict"])


def test_the_overview_page_shows_the_hang_panel(hung, monkeypatch):
    """What the Overview's Hang panel says on the hung run's store (Streamlit's AppTest runs the page)."""
    if hung["name"] != "fsdp4":
        pytest.skip("one page run is enough: the panel renders the same view for every case")
    from streamlit.testing.v1 import AppTest

    app = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(hung["store"])])
    at = AppTest.from_file(str(app), default_timeout=90)
    at.run()
    at.switch_page("app_pages/overview.py")
    at.run()
    assert not at.exception, at.exception
    errors = [e.value for e in at.error]
    assert any("Hang." in e and f"Rank {hung['culprit']} holds the job" in e and "all_gather" in e for e in errors), errors
    table = at.dataframe[0].value
    assert table.loc[table["culprit"] == "✕", "rank"].tolist() == [hung["culprit"]]
    assert any("faults.py" in c.value for c in at.code)


def test_a_slow_first_step_is_no_hang_and_a_clean_run_reports_none():
    """Every rank's first step takes 20 s longer (``--first-step-seconds``): with the default thresholds no
    watchdog fires, the run ends, and ``meshscope hang`` says there is none (exit 0)."""
    with private_dir() as store:
        run = "slow-first"
        job = Job(2, "--steps", 12, "--batch-size", 8, "--log-every", 1, "--store", store, "--run-name", run,
                  "--first-step-seconds", 20, log=store / "job.log")
        try:
            assert job.proc.wait(timeout=150) == 0, job.tail()
        finally:
            job.kill()
        catch_up(store)
        assert read_table(store, "hang", run=run).empty
        ev = read_table(store, "event", run=run)
        assert "hang" not in set(ev["kind"])
        steps = read_table(store, "step", run=run)
        assert steps[steps["step"] == 0]["wall_s"].min() >= 20.0  # the slow first step did happen
        cli = subprocess.run([sys.executable, "-m", "meshscope.cli", "hang", "--store", str(store), "--run", run],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and "No hang" in cli.stdout, cli.stdout + cli.stderr


def test_a_frozen_rank_of_an_unmodified_hugging_face_job_is_named():
    """Third-party code under ``meshscope run``: Hugging Face's Trainer (tests/jobs/hf_trainer.py, no meshscope
    in it) on 2 DDP ranks, and rank 1's process frozen (SIGSTOP: a host swapping, a stuck driver call). The
    frozen rank writes nothing, its watchdog included; rank 0's names the all-reduce it waits in, and the
    verdict names rank 1 as the rank that sent no record."""
    import os
    import signal

    import psutil

    jobs = Path(__file__).resolve().parent / "jobs"
    with private_dir() as store:
        run = "hf-frozen"
        cmd = [sys.executable, "-m", "meshscope", "run", "--store", str(store / "s"), "--run", run, "--",
               sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(jobs / "hf_trainer.py"), "--out", str(store / "out"), "--steps", "100000"]
        log = open(store / "job.log", "w")
        proc = subprocess.Popen(cmd, cwd=store, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        frozen = None
        try:
            def ranks() -> dict[int, psutil.Process] | None:
                found = {}
                for p in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        if "hf_trainer.py" in " ".join(p.cmdline()) and "RANK" in p.environ():
                            found[int(p.environ()["RANK"])] = p
                    except psutil.Error:
                        continue
                return found if len(found) == 2 else None

            procs = poll_until(ranks, timeout_s=90, interval_s=0.5, what="the job's two ranks")

            def stepping() -> bool:
                catch_up(store / "s")
                steps = read_table(store / "s", "step", run=run) if (store / "s" / "tables").exists() else None
                return steps is not None and len(steps) and steps.groupby("rank")["step"].max().min() >= 20

            poll_until(stepping, timeout_s=120, interval_s=1.0, what=lambda: (store / "job.log").read_text()[-2000:])
            frozen = procs[1]
            frozen.send_signal(signal.SIGSTOP)
            t0 = time.time()

            def named():
                h = _verdict(store / "s", run)
                return h if h["status"] == "hung" and h["culprit_ranks"] else None

            h = poll_until(named, timeout_s=60, interval_s=1.0, what="a verdict on the frozen rank")
            print(f"\nfrozen HF rank named after {time.time() - t0:.1f} s: {h['verdict']}")
            assert time.time() - t0 <= DETECT_S
            assert h["culprit_ranks"] == [1] and h["missing_ranks"] == [1]
            # where the freeze lands: DDP's gradient all-reduce, or the Trainer's gather of the loss it logs
            assert h["waiting"]["ranks"] == [0] and h["waiting"]["op"] in ("all_reduce", "all_gather")
            assert "sent no hang record" in h["verdict"]
        finally:
            if frozen is not None:
                try:
                    frozen.send_signal(signal.SIGCONT)
                except psutil.Error:
                    pass
            for p in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            proc.kill()
            proc.wait(timeout=30)
            log.close()
