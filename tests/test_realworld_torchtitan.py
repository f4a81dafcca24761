"""Conformance against a real third-party trainer: torchtitan 0.3.0 (PyPI, unchanged) trains its llama3
``llama3_debugmodel`` on CPU/gloo ranks under torchrun in each parallel layout, once plainly and once under
``meshscope run`` (the zero-code launcher), ``STEPS`` (6) steps each (``tests/realworld/titan.py``; the CPU shim and why:
``tests/realworld/titan_cpu/sitecustomize.py``).

Per layout:
- both runs exit 0 and log every step;
- meshscope changes nothing the job prints: its own ``[rankN]:`` lines are identical once the timestamps,
  throughput (tps, tflops, mfu) and durations are masked (``titan.normalise``; the loss is never masked), and
  ``meshscope:`` lines are ours;
- the losses logged are identical: same seed, same data, and torchtitan's CPU runs are deterministic to the
  printed precision (5 decimals; measured: repeated plain runs print the same losses, so the tolerance is 0);
- the collectives meshscope recorded are c10d's own count (each process group's sequence number, read at the
  first and the last optimizer step: ``titan.c10d_counts``), group by group and rank by rank, and labelled with
  the job's own mesh dim; and meshscope issues none of its own (the counts are the plain run's);
- ``meshscope report --json`` of the observed run has every step of every rank, the layout's canonical
  ``strategy``, the job's last loss (1e-4), an MFU or the reason there is none, and a median step time within
  10 % of the job's own (the time between its consecutive step lines, which is torchtitan's end_to_end).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (make install installs it)")

from tests.realworld import titan  # noqa: E402

pytestmark = [pytest.mark.realworld, pytest.mark.gloo, pytest.mark.timeout(1200)]

STEPS = 6  # 5 step times per run for the median; 10 steps cost the tier 130 s more (2026-11-29)
RUN_TIMEOUT_S = 480

WORKING = ["fsdp", "ddp", "tp", "hsdp", "fsdp+tp", "cp"]
LAYOUT_PARAMS = [pytest.param(name, id=name) for name in WORKING] + [
    pytest.param(name, id=name, marks=pytest.mark.skip(reason=f"torchtitan 0.3.0 on torch 2.13 CPU: {reason}"))
    for name, reason in titan.SKIPPED.items()
]

@pytest.fixture(scope="session")
def titan_runs(tmp_path_factory):
    """Once per session and layout: (plain, observed), the layout trained ``STEPS`` steps without and with
    ``meshscope run``; every test of the layout reads the same two runs."""
    cache: dict[str, tuple[titan.TitanResult, titan.TitanResult]] = {}

    def get(layout: str) -> tuple[titan.TitanResult, titan.TitanResult]:
        if layout not in cache:
            name = f"titan-{layout.replace('+', '_')}"
            base = tmp_path_factory.mktemp(name)
            plain = titan.run(layout=layout, steps=STEPS, workdir=base / "plain", meshscope_store=None,
                              run_name=None, timeout_s=RUN_TIMEOUT_S)
            observed = titan.run(layout=layout, steps=STEPS, workdir=base / "observed",
                                 meshscope_store=base / "store", run_name=name, timeout_s=RUN_TIMEOUT_S)
            cache[layout] = (plain, observed)
        return cache[layout]

    return get


@pytest.fixture
def runs(layout, titan_runs) -> tuple[titan.TitanResult, titan.TitanResult]:
    return titan_runs(layout)


@pytest.fixture(scope="session")
def titan_reports(titan_runs):
    """Once per session and layout: ``meshscope report --json`` of the observed run."""
    cache: dict[str, dict] = {}

    def get(layout: str) -> dict:
        if layout not in cache:
            _, observed = titan_runs(layout)
            assert observed.returncode == 0, observed.failure()
            cache[layout] = titan.report_json(observed.meshscope_store, observed.run_name)
        return cache[layout]

    return get


@pytest.fixture
def report(layout, titan_reports) -> dict:
    return titan_reports(layout)


_SHIM_PROBE = """
import sys
import torchtitan.distributed.fsdp as fsdp
import torchtitan.distributed.utils as dist_utils
import torchtitan.models.common.attention as attention
import torchtitan.tools.utils as utils
print(utils.device_type, dist_utils.device_type, dist_utils.set_pg_timeouts.__module__,
      attention.FlexAttention._compiled_flex_attn.__qualname__, fsdp.disable_fsdp_gradient_division.__module__)
"""


@pytest.mark.parametrize("observed", [False, True], ids=["plain", "meshscope-run"])
def test_cpu_shim_is_active_with_and_without_meshscope_run(observed, tmp_path):
    """The shim is a ``sitecustomize``: under ``meshscope run`` meshscope's bootstrap ``sitecustomize`` comes
    first on PYTHONPATH and must run it as the next one on sys.path."""
    cmd = [sys.executable, "-c", _SHIM_PROBE]
    if observed:
        cmd = [sys.executable, "-m", "meshscope", "run", "--store", str(tmp_path / "store"), "--run", "probe", "--",
               *cmd]
    proc = subprocess.run(cmd, cwd=tmp_path, env=titan.environment(tmp_path), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["cpu", "cpu", "sitecustomize", "flex_attention", "sitecustomize"], proc.stdout


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_both_runs_train_every_step(layout, runs):
    plain, observed = runs
    for res in (plain, observed):
        assert res.returncode == 0, res.failure()
        assert [s.step for s in res.steps] == list(range(1, STEPS + 1)), res.failure()


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_job_output_is_unchanged_by_meshscope(layout, runs):
    plain, observed = runs
    assert plain.returncode == 0 and observed.returncode == 0, (plain.failure(), observed.failure())
    want = titan.normalise(plain.stdout, plain.workdir)
    got = titan.normalise(observed.stdout, observed.workdir)
    assert sorted(got) == sorted(want) == list(range(titan.LAYOUTS[layout].nproc))
    for rank in want:
        assert got[rank] == want[rank], f"rank {rank}'s log differs under meshscope run"


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_losses_are_identical_with_and_without_meshscope(layout, runs):
    plain, observed = runs
    assert plain.returncode == 0 and observed.returncode == 0, (plain.failure(), observed.failure())
    assert len(plain.losses) == STEPS
    assert observed.losses == plain.losses
    for rank, logs in observed.steps_by_rank.items():  # every rank that logs, not only rank 0
        assert {s.step: s.loss for s in logs} == {s.step: s.loss for s in plain.steps_by_rank[rank]}


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_collectives_recorded_are_c10ds_own_count_per_group_and_labelled_with_the_jobs_dims(layout, runs, report):
    from meshscope.agent.store.reader import read_table

    plain, observed = runs
    counted, plain_counted = titan.c10d_counts(observed.workdir), titan.c10d_counts(plain.workdir)
    world = titan.LAYOUTS[layout].nproc
    assert sorted(counted) == list(range(world)), observed.failure()
    # meshscope issues no collective: every group of the job counts the same with and without it
    assert {r: {g: c.ops for g, c in gs.items()} for r, gs in counted.items()} == \
        {r: {g: c.ops for g, c in gs.items()} for r, gs in plain_counted.items()}
    records = read_table(observed.meshscope_store, "collective", run=observed.run_name)  # report ingested them
    steps = read_table(observed.meshscope_store, "step", run=observed.run_name)
    for rank, groups in counted.items():
        last = int(steps.loc[steps["rank"] == rank, "step"].max())
        mine = records[(records["rank"] == rank) & records["step"].between(1, last)]  # as c10d's two readings
        assert mine.groupby("group").size().to_dict() == {g: c.ops for g, c in groups.items() if c.ops}, rank
        for name, group in groups.items():
            labels = set(mine.loc[mine["group"] == name, "mesh_dim"])
            if group.desc.startswith("mesh_"):  # a group DeviceMesh made for a dim: that dim's name
                assert labels <= {group.desc[len("mesh_"):]}, (rank, name, group, labels)
            else:  # the default group: a mesh dim over every rank reuses it (device_mesh), else "world"
                assert group.world and all(lab != "" for lab in labels), (rank, name, group, labels)
    total = sum(c.ops for gs in counted.values() for c in gs.values())
    assert total > 0


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_report_has_every_step_of_every_rank(layout, report):
    world = titan.LAYOUTS[layout].nproc
    steps = report["steps"]
    n_steps = steps[1] - steps[0] + 1 if isinstance(steps, list) else steps  # today [first, last]
    assert n_steps == STEPS, report
    assert report["world_size"] == world, report
    last = report["attempt_steps"][-1]  # the ranks that recorded steps, and their (rank, step) records
    assert last["ranks"] == world and last["rank_steps"] == world * STEPS, report


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_report_names_the_strategy(layout, report):
    assert report["strategy"] == titan.LAYOUTS[layout].strategy, report


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_report_loss_is_the_jobs_last_logged_loss(layout, runs, report):
    _, observed = runs
    assert report["loss"] == pytest.approx(observed.last_loss, abs=1e-4), report


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_report_has_mfu_or_the_reason(layout, report):
    mfu, reason = report.get("mfu"), report.get("mfu_reason")
    assert (isinstance(mfu, (int, float)) and math.isfinite(mfu)) or (isinstance(reason, str) and reason), report


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
def test_report_step_time_is_the_jobs(layout, runs, report):
    _, observed = runs
    own = observed.step_time_median_s
    assert own is not None and own > 0, observed.failure()
    assert report["step_time_s_median"] == pytest.approx(own, rel=0.10), (report, own)
