"""Scaling families take clean runs only (``dashboard.runs_clean``): the rule on frames shaped as the store's
(the runs table's ``config`` as the trainer writes it, events as ``data.run_events`` returns them, with the
messages real interrupted jobs left), and once on real torchrun jobs: a clean family beside a straggler run
and a run stopped by SIGTERM, both left out with why, and back in when asked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import psutil
import pytest

from meshscope.dashboard import runs_clean
from meshscope.trainer import config as trainer_config
from tests.support.jobs import ROOT, STEP_LINE, ingest, run_job, single, trainer_env


def _config(*flags: str) -> str:
    """The ``run.config`` JSON the trainer writes for these flags (``trainer.train.run_info``)."""
    return trainer_config.dumps(trainer_config.from_args(trainer_config.parser("t").parse_args(list(flags))))


def _events(run: str, rows: list[tuple]) -> pd.DataFrame:
    """``data.run_events``' rows: (kind, rank, step, message) per (run, kind, rank)."""
    t = pd.DataFrame(rows, columns=["kind", "rank", "step", "message"]).assign(run=run, n=1, t=1.8e9)
    return t[["run", "kind", "rank", "n", "step", "message", "t"]]


def _ranks(kind: str, ranks, step: int, message: str) -> list[tuple]:
    return [(kind, r, step, message) for r in ranks]


def _finished(ranks=(0, 1), steps: int = 30) -> list[tuple]:
    return (_ranks("start", ranks, -1, "rank r of 2 attempt 0") +
            _ranks("end", ranks, steps - 1, f"finished {steps} steps"))


def _judge(runs: dict[str, tuple[str, list[tuple]]], *, device: str = "cpu",
           shares: pd.DataFrame | None = None) -> pd.DataFrame:
    table = pd.DataFrame({"run": list(runs), "config": [c for c, _ in runs.values()], "device": device})
    events = pd.concat([_events(run, ev) for run, (_, ev) in runs.items()], ignore_index=True)
    return runs_clean.clean_runs(table, events, shares=shares).set_index("run")


def test_what_real_runs_leave_decides_clean_and_says_why():
    plain = _config("--model", "tiny", "--steps", "30")
    got = _judge({
        "clean": (plain, _finished()),
        # --straggler-ranks 1 --straggler-seconds 0.05: a complete run, its config says what was injected
        "straggler": (_config("--model", "tiny", "--steps", "30", "--straggler-ranks", "1",
                              "--straggler-seconds", "0.05"), _finished()),
        # SIGTERM to torchrun (forwarded to the ranks): each rank's open step aborted by SystemExit(143), no end
        "sigterm": (plain, _ranks("start", (0, 1), -1, "") +
                    _ranks("aborted_step", (0, 1), 13, "step 13 aborted: SystemExit: 143")),
        # Ctrl-C: KeyboardInterrupt on each rank, no end
        "ctrl-c": (plain, _ranks("start", (0, 1), -1, "") +
                   _ranks("aborted_step", (0, 1), 11, "step 11 aborted: KeyboardInterrupt: ")),
        # --crash-rank 1 --crash-step 5: the crash event on rank 1, the peer's collective aborted
        "crash": (_config("--model", "tiny", "--steps", "30", "--crash-rank", "1", "--crash-step", "5"),
                  _ranks("start", (0, 1), -1, "") + [("crash", 1, 5, "injected crash of rank 1 at step 5"),
                  ("aborted_step", 0, 5, "step 5 aborted: RuntimeError: [gloo] Read error: Connection reset by peer")]),
        # SIGKILL (or still running): starts, and nothing else
        "killed": (plain, _ranks("start", (0, 1), -1, "")),
        "restarted": (plain, _finished() + [("restart", 0, 4, "resumed from step-4"), ("restart", 1, 4, "")]),
        "nan": (plain, _finished() + [("skipped_step", 0, 7, "non-finite gradient norm at step 7")]),
        # a fault set for a step the run never reached injected nothing
        "crash-later": (_config("--model", "tiny", "--steps", "30", "--crash-rank", "1", "--crash-step", "100"),
                        _finished()),
    })
    reasons = got["reason"].to_dict()
    assert got.loc["clean", "clean"] and reasons["clean"] == ""
    assert got.loc["crash-later", "clean"] and reasons["crash-later"] == ""
    assert reasons["straggler"] == "fault injected (straggler rank 1, +0.05 s/step)"
    assert reasons["sigterm"] == "interrupted (SIGTERM: step 13 aborted, no end event)"
    assert reasons["ctrl-c"] == "interrupted (Ctrl-C: step 11 aborted, no end event)"
    assert reasons["crash"] == "fault injected (crash of rank 1 at step 5); crashed (rank 1 at step 5)"
    assert reasons["killed"] == "not finished (no end event from ranks 0, 1: still running, or killed)"
    assert reasons["restarted"] == "restarted (resumed at step 4)"
    assert reasons["nan"] == "non-finite loss (from step 7)"
    assert not got.drop(index=["clean", "crash-later"])["clean"].any()
    assert not got["cpu_contention"].any() and got["cpu_wait_share"].isna().all()


def test_raw_events_and_runs_without_events():
    # One row per event (``data.events`` with its run) reads as the per-rank summary does.
    table = pd.DataFrame({"run": ["a", "b"], "config": [None, "{not json"]})
    raw = pd.DataFrame({"run": ["a"] * 4, "rank": [0, 0, 1, 1], "step": [-1, 9, -1, 9],
                        "kind": ["start", "end", "start", "end"], "message": ""})
    got = runs_clean.clean_runs(table, raw).set_index("run")
    assert got.loc["a", "clean"] and got.loc["a", "reason"] == ""  # no config, no fault
    assert not got.loc["b", "clean"] and got.loc["b", "reason"].startswith("not known to have finished")
    assert list(runs_clean.clean_runs(table.iloc[:0], raw.iloc[:0]).columns) == list(runs_clean.COLUMNS)


@pytest.mark.parametrize("device, contended", [("cpu", True), ("NVIDIA H100 80GB HBM3", False)])
def test_cpu_contention_keeps_a_run_in_and_marks_it(device, contended):
    # environment's rule: a rank that waited for a core more than CPU_WAIT_MAX of its busy time, on a CPU.
    shares = pd.DataFrame({"run": ["w4"] * 4, "rank": [0, 1, 2, 3], "cpu_wait_share": [0.52, 0.51, 0.05, 0.44]})
    got = _judge({"w4": (_config("--model", "tiny"), _finished(range(4)))}, device=device, shares=shares)
    assert got.loc["w4", "clean"] and got.loc["w4", "reason"] == ""
    assert got.loc["w4", "cpu_contention"] == contended
    if contended:  # the highest contended rank's share, for the page's mark
        assert got.loc["w4", "cpu_wait_share"] == pytest.approx(0.52)
    else:  # the rule is for CPU devices only
        assert np.isnan(got.loc["w4", "cpu_wait_share"])
    quiet = shares.assign(cpu_wait_share=0.02)
    calm = _judge({"w4": (_config("--model", "tiny"), _finished(range(4)))}, shares=quiet)
    assert not calm.loc["w4", "cpu_contention"]


def test_sweep_has_the_switch():
    from meshscope.dashboard import sweep

    assert sweep._parser().parse_args(["--store", "x", "--include-unclean"]).include_unclean
    assert not sweep._parser().parse_args(["--store", "x"]).include_unclean


# ------------------------------------------------------------------------------------- real jobs
def _stop_with_sigterm(store, run: str, *args: str, after_step: int = 3) -> str:
    """A torchrun job sent SIGTERM (to torchrun, as ``kill`` does) once rank 0 printed ``after_step``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "meshscope.trainer.train", "--store", str(store), "--run-name", run, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ranks: list[psutil.Process] = []
    out = []
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            out.append(line)
            m = STEP_LINE.match(line)
            if m and int(m.group(1)) >= after_step:
                ranks = psutil.Process(proc.pid).children(recursive=True)
                proc.send_signal(signal.SIGTERM)
                break
            assert time.monotonic() < deadline, "".join(out[-40:])
        out.append(proc.communicate(timeout=120)[0])
        return "".join(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in ranks:  # torchrun forwards the signal; a rank it left behind is ended here
            if p.is_running():
                p.kill()


@pytest.mark.gloo
def test_families_take_clean_runs_and_list_the_others(tmp_path, monkeypatch, reference_runs):
    from streamlit.testing.v1 import AppTest

    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import sweep, views

    # A family of tiny-wide, global batch 8: the reference DDP run (2 ranks) and a 1-rank run; beside them, at
    # 2 ranks, a straggler run and a run stopped by SIGTERM.
    store = reference_runs.store_of("ddp", into=tmp_path / "store")
    common = ("--model", "tiny-wide", "--batch-size", "8", "--seed", "11")
    single("--store", str(store), "--run-name", "w1", *common, "--steps", "6")
    stopped = _stop_with_sigterm(store, "stopped", *common, "--steps", "5000")
    run_job(store, "straggler", 2, *common, "--steps", "6", "--straggler-ranks", "1", "--straggler-seconds", "0.05")
    ingest(store)
    assert "got signal: 15" in stopped, stopped[-3000:]

    load = views.direct_loader(Store.open(store))
    runs = ["ddp", "w1", "straggler", "stopped"]
    clean = views.run_cleanliness(load, runs=runs).set_index("run")
    assert clean["clean"].to_dict() == {"ddp": True, "w1": True, "straggler": False, "stopped": False}
    assert clean.loc["straggler", "reason"] == "fault injected (straggler rank 1, +0.05 s/step)"
    assert clean.loc["stopped", "reason"].startswith("interrupted (SIGTERM: step "), clean.loc["stopped", "reason"]
    assert clean.loc["stopped", "reason"].endswith(" aborted, no end event)")

    # The page's view and the sweep's table: the family from the clean runs, the others listed with why.
    family = "strong · ddp · global batch 8"
    view = views.scaling(load, selected=runs, focus=None)
    assert sorted(view.table["run"]) == ["ddp", "w1"] and set(view.table["family"]) == {family}
    assert sorted(view.per_run["run"]) == ["ddp", "w1"]
    assert view.left_out.set_index("run")["reason"].to_dict() == clean.loc[["straggler", "stopped"], "reason"].to_dict()
    assert view.fits.set_index("family").loc[family, "note"].startswith("No Amdahl fit: 2 clean world sizes (1, 2)")
    rep = sweep.report(store, runs)
    text = sweep.format_report(rep)
    assert sorted(rep["table"]["run"]) == ["ddp", "w1"]
    for run in ("straggler", "stopped"):
        assert any(line.startswith(run) and line.endswith(clean.loc[run, "reason"]) for line in text.splitlines()), text
    assert "--include-unclean to include them" in text

    # The switch brings them back, marked.
    every = views.scaling(load, selected=runs, focus=None, include_unclean=True)
    assert sorted(every.table["run"]) == ["ddp", "stopped", "straggler", "w1"] and every.left_out.empty
    assert set(every.table.loc[~every.table["clean"], "run"]) == {"straggler", "stopped"}
    assert sorted(sweep.report(store, runs, include_unclean=True)["table"]["run"]) == sorted(runs)
    symbols = [s for t in every.figures["speedup"].data if t.mode == "markers" and t.x[0] is not None
               for s in t.marker.symbol]
    assert symbols.count("x") == 2

    # The page: the left-out table, and the checkbox.
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", str(store)])
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=60).run()
    at.switch_page("app_pages/scaling.py").run()
    assert not at.exception
    left = next(df.value for df in at.dataframe if "why left out" in df.value.columns)
    assert left.set_index("run")["why left out"].to_dict() == view.left_out.set_index("run")["reason"].to_dict()
    at.checkbox(key="scaling.include_unclean").check().run()
    assert not at.exception and all("why left out" not in df.value.columns for df in at.dataframe)
    fam = next(df.value for df in at.dataframe if "family" in df.value.columns)
    assert sorted(fam["run"]) == sorted(runs)
    assert np.isfinite(fam["speedup"]).all()

    # The planner takes the same rule: ``plan`` leaves the two out and lists them, the What-if view too;
    # the switch calibrates from them.
    from meshscope.dashboard.planner import whatif

    plan = [sys.executable, "-m", "meshscope.cli", "plan", "--store", str(store), "--run", "ddp", "--run", "straggler",
            "--run", "stopped", "--layout", "dp=2", "--json"]
    proc = subprocess.run(plan, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["calibration_runs"] == ["ddp"]
    assert {r["run"]: r["reason"] for r in out["left_out"]} == clean.loc[["straggler", "stopped"], "reason"].to_dict()
    for run in ("straggler", "stopped"):
        assert f"meshscope plan: left out: {run}: {clean.loc[run, 'reason']} (--include-unclean" in proc.stderr
    both = subprocess.run(plan + ["--include-unclean"], capture_output=True, text=True, timeout=120)
    assert both.returncode == 0 and json.loads(both.stdout)["calibration_runs"] == ["ddp", "straggler", "stopped"]
    alone = subprocess.run(plan[:6] + ["--run", "stopped", "--layout", "dp=2"], capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "every named run is left out" in alone.stderr and "Traceback" not in alone.stderr
    page = whatif.whatif(load, runs=runs, world_size=2)
    assert set(page.runs) == {"ddp", "w1"} and "straggler" not in set(page.measured["run"])
    assert set(page.cleanliness.loc[~page.cleanliness["clean"], "run"]) == {"straggler", "stopped"}


def test_a_stall_the_job_got_over_is_no_hang_and_the_new_faults_are_faults():
    # A hang event on a rank of a run every rank of which ended (a long checkpoint save, an evaluation
    # pass beyond the watchdog's threshold) is a stall, not a hang; one without every end is a hang.
    ends = {"run": ["a"] * 5, "rank": [0, 0, 1, 1, 1], "step": [-1, 9, -1, 4, 9],
            "kind": ["start", "end", "start", "hang", "end"], "message": ""}
    stuck = {"run": ["b"] * 4, "rank": [0, 0, 1, 1], "step": [-1, 9, -1, 4],
             "kind": ["start", "end", "start", "hang"], "message": ""}
    table = pd.DataFrame({"run": ["a", "b", "c", "d"], "config": [
        None, None, '{"steps": 20, "faults": {"desync_rank": 1, "desync_step": 6}}',
        '{"steps": 20, "faults": {"first_step_seconds": 20.0}}']})
    raw = pd.concat([pd.DataFrame(ends), pd.DataFrame(stuck),
                     *(pd.DataFrame({"run": [r] * 2, "rank": [0, 0], "step": [-1, 19], "kind": ["start", "end"],
                                     "message": ""}) for r in ("c", "d"))])
    got = runs_clean.clean_runs(table, raw).set_index("run")
    assert got.loc["a", "clean"], got.loc["a", "reason"]
    assert not got.loc["b", "clean"] and got.loc["b", "reason"].startswith("hung (rank 1")
    assert got.loc["c", "reason"] == "fault injected (desync of rank 1 at step 6)"
    assert got.loc["d", "reason"] == "fault injected (first step +20 s)"
