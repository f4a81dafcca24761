"""A run name is one launch: ``meshscope run --run NAME`` into a store that holds NAME is refused before the
job starts (one line, exit 2, nothing written), or, with ``--new-attempt``, recorded as the run's next
attempt, whose steps the reader and ``report`` keep apart from the first launch's (never merged)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshscope.agent.store.reader import read_table
from meshscope.agent.contract import spool_path
from meshscope.agent.zerocode import cli
from tests.test_zerocode import ingest, meshscope_run, report, torchrun

# A plain single-process loop: its steps from argv, its seed too (so two launches differ), and a file it
# writes when it runs (a refused launch must not start it).
JOB = ("import sys, torch\nsteps, seed, mark = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
       "open(mark, 'w').close()\ntorch.manual_seed(seed)\nm = torch.nn.Linear(8, 8)\n"
       "opt = torch.optim.SGD(m.parameters(), lr=0.1)\nfor i in range(steps):\n"
       "    loss = m(torch.randn(4, 8)).pow(2).mean()\n    loss.backward()\n    opt.step()\n    opt.zero_grad()\n"
       "    print(f'step {i} loss {loss.item():.6f}')\n")


def launch(tmp_path: Path, store: Path, *flags: str, steps: int, seed: int, mark: str):
    return meshscope_run(tmp_path, "--store", str(store), *flags, "--", sys.executable, "-c", JOB, str(steps),
                         str(seed), str(tmp_path / mark))


def listing(store: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(store)): (p.stat().st_size, p.stat().st_mtime_ns) for p in store.rglob("*")}


@pytest.mark.parametrize("ingested", [False, True], ids=["spools", "tables"])
def test_the_same_name_twice_is_refused_in_one_line_and_nothing_is_written(tmp_path, ingested):
    store = tmp_path / "s"
    first = launch(tmp_path, store, "--run", "x", steps=3, seed=0, mark="first")
    assert first.returncode == 0, first.stderr[-2000:]
    if ingested:  # the spools gone into the tables (what the agent or `report` does): still the same run
        ingest(store)
    before = listing(store)
    again = launch(tmp_path, store, "--run", "x", steps=3, seed=1, mark="second")
    assert again.returncode == 2 and again.stdout == ""
    (line,) = again.stderr.strip().splitlines()
    assert "--run 'x'" in line and str(store) in line and "--new-attempt" in line and "attempt 2" in line, line
    assert "Traceback" not in again.stderr
    assert not (tmp_path / "second").exists()  # the job never started
    assert listing(store) == before  # nothing written into the store
    ingest(store)
    assert sorted(read_table(store, "step", run="x", all_attempts=True)["step"]) == [0, 1, 2]  # the first launch alone


@pytest.mark.gloo
def test_new_attempt_is_the_next_attempt_and_each_attempts_steps_count_once(tmp_path):
    store = tmp_path / "s"
    first = meshscope_run(tmp_path, "--store", str(store), "--run", "ddp", "--",
                          *torchrun("plain_ddp.py", "--steps", "4"))
    assert first.returncode == 0, first.stderr[-3000:]
    second = meshscope_run(tmp_path, "--store", str(store), "--run", "ddp", "--new-attempt", "--",
                           *torchrun("plain_ddp.py", "--steps", "6"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "as attempt 2" in second.stderr
    for rank in (0, 1):  # each launch's ranks wrote spools of their own attempt
        for attempt in (0, 1):
            assert spool_path(store, run="ddp", rank=rank, attempt=attempt).is_file()
    rep = report(store, "ddp")  # ingests the spools first
    assert rep["attempts"] == 2
    assert rep["attempt_steps"] == [{"attempt": 1, "ranks": 2, "rank_steps": 8, "steps": [0, 3]},
                                    {"attempt": 2, "ranks": 2, "rank_steps": 12, "steps": [0, 5]}]
    assert rep["steps"] == [0, 5]
    # Kept apart in the store: 20 rows, not 20 rows read as 10 (rank, step) pairs twice over; the readers
    # count each (rank, step) once, the newest attempt's: its losses are the second launch's own.
    every = read_table(store, "step", run="ddp", all_attempts=True)
    assert len(every) == 20
    steps = read_table(store, "step", run="ddp")
    assert len(steps) == 12 and not steps.duplicated(["rank", "step"]).any()
    runs = read_table(store, "run", run="ddp", all_attempts=True)
    assert sorted(zip(runs["rank"], runs["attempt"])) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "attempts: 2" in report_text(store, "ddp")


def report_text(store: Path, run: str) -> str:
    out = subprocess.run([sys.executable, "-m", "meshscope", "report", "--store", str(store), "--run", run],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_a_default_name_the_store_holds_gets_a_suffix(tmp_path):
    store = tmp_path / "s"
    for run, attempt in (("train-20260101-000000", 0), ("train-20260101-000000-2", 3)):
        path = spool_path(store, run=run, rank=0, attempt=attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    assert cli.stored_attempts(store, "train-20260101-000000-2") == {3}
    assert cli.stored_attempts(store, "train-20260101-000000-3") == set()
    assert cli._free_name(store, "train-20260101-000000") == "train-20260101-000000-3"
    assert cli._free_name(store, "other-20260101-000000") == "other-20260101-000000"


def test_the_launch_attempt_adds_torchrun_restarts():
    from meshscope.agent.zerocode import ENV_ATTEMPT, launch_attempt

    assert launch_attempt({}) == 0
    assert launch_attempt({ENV_ATTEMPT: "2"}) == 2
    assert launch_attempt({ENV_ATTEMPT: "2", "TORCHELASTIC_RESTART_COUNT": "1"}) == 3
