"""``meshscope diff`` on real runs (2 gloo ranks) against what was done to them: five runs of one layout and
seed (every pair: no significant difference, the gate passes), an injected straggler (found, attributed to
the parts that wait for it, named, the gate fails), 1F1B with 8 microbatches against 4 (the bubble grows as
the schedule says and is named, the change list names microbatches), DDP against FSDP2 (each one's exposed collectives shown).
Serial: runs timed at different moments are compared, so both must see the same machine."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from meshscope.agent.store.reader import Store
from meshscope.dashboard import diff, diffcli, views
from tests.support.jobs import ROOT, run_job, trainer_env

pytestmark = [pytest.mark.gloo, pytest.mark.serial, pytest.mark.timeout(900)]

ARGS = ("--model", "tiny", "--steps", "40", "--seed", "5", "--batch-size", "8")
SAME = 5
# Microbatches of 8 and 4 sequences: big enough that a microbatch's compute scales with its size on this CPU
# (at 2 and 1 sequences, 4 microbatches computed 10-17 % faster than 8 and that carried the difference)
PP = ("--model", "tiny-wide", "--steps", "12", "--seed", "5", "--batch-size", "32", "--pp", "2",
      "--schedule", "1f1b")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    base = tmp_path_factory.mktemp("diff")
    for k in range(SAME):
        run_job(base, f"same-{k}", 2, *ARGS)
    # an environment flag set for this job alone (NCCL's: no effect on gloo) that the change list must name
    run_job(base, "straggler", 2, *ARGS, "--straggler-ranks", "1", "--straggler-seconds", "0.05",
            env={"NCCL_ALGO": "Tree"})
    run_job(base, "pp-m4", 2, *PP, "--microbatches", "4")
    run_job(base, "pp-m8", 2, *PP, "--microbatches", "8")
    return base


@pytest.fixture(scope="module")
def load(store):
    return views.direct_loader(Store.open(store))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshscope.cli", "diff", *args], cwd=ROOT, env=trainer_env(),
                          capture_output=True, text=True, timeout=120)


def test_every_pair_of_runs_of_one_layout_and_seed_is_no_significant_difference(load, store):
    verdicts = []
    for a, b in itertools.combinations(range(SAME), 2):
        c = diffcli.build(load, load, run_a=f"same-{a}", run_b=f"same-{b}", resamples=2000)
        w = diff.whole(c)
        verdicts.append((a, b, round(w["lo_pct"], 2), round(w["hi_pct"], 2)))
        assert c["unit"] == "step" and c["changes"] == [], c["changes"]
        assert not diff.gate(c, fail_above_pct=5.0)
    covered = [v for v in verdicts if v[2] <= 0 <= v[3]]
    assert len(covered) == len(verdicts) == 10, verdicts
    # several runs against one baseline: each one's comparison and gate; the straggler's fails the command
    proc = _cli("--store", str(store), "same-0", "same-1", "straggler", "--fail-above", "5")
    assert proc.returncode == 1, proc.stderr
    first, second = proc.stdout.split("\n\n")
    assert first.startswith("same-1 against same-0: no significant difference"), first
    assert "gate: same-1 is not slower than same-0 by more than 5 % with confidence" in first, first
    assert second.startswith("straggler against same-0: B is "), second
    assert "gate: straggler is slower than same-0 by more than 5 % with confidence (exit 1)" in second, second


def test_a_straggler_is_found_attributed_to_the_waiting_parts_named_and_fails_the_gate(load, store):
    c = diffcli.build(load, load, run_a="same-0", run_b="straggler")
    w = diff.whole(c)
    base = w["a_s"]
    # rank 1 computes 0.05 s more per step; rank 0 waits for it in the gradient all-reduce: the mean over the
    # two ranks grows by ~0.05 s, half of it compute (rank 1's) and half exposed all-reduce (rank 0's)
    assert w["significant"] and w["lo_s"] > 0.03 and w["diff_s"] == pytest.approx(0.05, rel=0.35), w
    by = {p["part"]: p for p in c["parts"]}
    comm = sum(p["diff_s"] for name, p in by.items() if name.startswith("exposed all_reduce"))
    assert comm == pytest.approx(0.025, rel=0.5) and by["compute"]["diff_s"] == pytest.approx(0.025, rel=0.5), by
    assert comm + by["compute"]["diff_s"] > 0.8 * w["diff_s"]
    assert [s["rank"] for s in c["new_stragglers"]] == [1] and "new straggler: rank 1" in c["verdict"]
    assert {ch["key"]: (ch["a"], ch["b"]) for ch in c["changes"]} == {
        "config.faults.straggler_ranks": ([], [1]), "config.faults.straggler_seconds": (0.0, 0.05),
        "env.flags.NCCL_ALGO": (None, "Tree")}, c["changes"]
    assert "NCCL_ALGO none → Tree" in c["verdict"], c["verdict"]
    named = c["verdict"].split("; ")[1]  # "<x> points of it <part>, <y> <part>": the two that carry it
    assert "compute" in named and "exposed all_reduce on dp" in named, c["verdict"]
    proc = _cli("--store", str(store), "same-0", "straggler", "--fail-above", "5", "--json")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["gate"] == {"fail_above_pct": 5.0, "failed": True} and out["verdict"].startswith("B is ")
    assert w["diff_pct"] == pytest.approx(w["diff_s"] / base * 100)


def test_fewer_microbatches_grow_the_bubble_as_the_schedule_says_and_are_named(load, store):
    """1F1B on 2 stages, 8 microbatches against 4 of the same global batch. The schedule's idle time per stage
    is (p − 1) microbatches' forward and backward, compute / m on 2 stages: the bubble part of the difference
    must be what that predicts from each run's own measured compute, significant, the largest of the parts
    the schedule moves, and among the two parts the verdict names where the whole is significant. The change is named once; each part's means are the step records' own (the bubble:
    the mean over steady steps of the ranks' ``bubble_s``, computed here in SQL by the store's reader)."""
    c = diffcli.build(load, load, run_a="pp-m8", run_b="pp-m4")
    assert {"key": "microbatches", "a": 8, "b": 4} in c["changes"], c["changes"]
    assert not any(ch["key"].endswith(".microbatches") for ch in c["changes"]), c["changes"]  # listed once
    assert "microbatches 8 → 4" in c["verdict"]
    by = {p["part"]: p for p in c["parts"]}
    predicted = by["compute"]["b_s"] / 4 - by["compute"]["a_s"] / 8  # (p − 1) · compute / m, p = 2
    bubble = by["bubble"]
    assert bubble["significant"] and bubble["diff_s"] == pytest.approx(predicted, rel=0.4), (bubble, predicted)
    assert not any(name.startswith("exposed") and name.endswith(" on pp") for name in by), list(by)  # the drain
    # Of the parts the schedule moves, the bubble carries the change. Compute is the runs' own: on this VM it
    # moves by up to ±10 % between identical runs (the noise the whole's interval carries), so the whole is
    # not always significant; where it is, the verdict names the bubble.
    assert all(abs(bubble["diff_s"]) > abs(p["diff_s"]) for name, p in by.items()
               if name not in ("bubble", "compute", "step")), c["parts"]
    w = diff.whole(c)
    if w["significant"] and w["diff_s"] > 0:
        named = c["verdict"].split("; ")[1]  # "<x> points of it <part>, <y> <part>": the two that carry it
        assert "bubble" in named, c["verdict"]
    for run, key in (("pp-m8", "a_s"), ("pp-m4", "b_s")):
        first = diffcli.run_frame(load, run=run)[0].index.min()
        mean = Store.open(store).query("SELECT avg(b) AS b FROM (SELECT step, avg(bubble_s) AS b FROM step "
                                       "WHERE step >= ? GROUP BY step)", kinds=("step",), runs=[run],
                                       params=[int(first)])["b"].iloc[0]
        assert by["bubble"][key] == pytest.approx(mean, rel=1e-9), (run, by["bubble"], mean)
    total = sum(p["diff_s"] for p in c["parts"] if p["part"] != "step")
    assert total == pytest.approx(diff.whole(c)["diff_s"], abs=1e-9)


def test_ddp_against_fsdp2_shows_each_ones_exposed_collectives(reference_runs, tmp_path):
    store = reference_runs.store_of("ddp", "fsdp2", into=tmp_path / "store")
    load = views.direct_loader(Store.open(store))
    c = diffcli.build(load, load, run_a="ddp", run_b="fsdp2")
    by = {p["part"]: p for p in c["parts"]}
    ar = [n for n in by if n.startswith("exposed all_reduce")]
    ag = [n for n in by if n.startswith("exposed all_gather")]
    rs = [n for n in by if n.startswith("exposed reduce_scatter")]
    assert ar and ag and rs, list(by)
    assert by["exposed all_reduce on dp"]["a_s"] > 0 and by["exposed all_reduce on dp"]["b_s"] == 0, by
    assert all(by[n]["a_s"] == 0 and by[n]["b_s"] > 0 for n in ag + rs), {n: by[n] for n in ag + rs}
    assert any(ch["key"] == "strategy" for ch in c["changes"]), c["changes"]
    total = sum(p["diff_s"] for p in c["parts"] if p["part"] != "step")
    assert total == pytest.approx(diff.whole(c)["diff_s"], abs=1e-9)


def test_bad_input_is_one_line_and_exit_2(store, tmp_path):
    for args, needle in [((str(store), "same-0", "nope"), "no run 'nope'"),
                         ((str(tmp_path / "missing"), "a", "b"), "missing"),
                         ((str(store), "same-0", "same-1", "--fail-above", "-3"), "--fail-above")]:
        proc = _cli("--store", *args)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
