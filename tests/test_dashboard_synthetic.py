"""The pipeline-schedule simulator and the synthetic store: layout, schema, internal consistency."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from meshscope.agent.store.schema import stored_schema
from meshscope.agent.contract import SCHEMAS
from meshscope.dashboard import analysis
from meshscope.dashboard.pipeline_sim import simulate
from tests.support.store import Straggler, SyntheticConfig, main, write_store


# --------------------------------------------------------------------------------- pipeline_sim
@pytest.mark.parametrize(("schedule", "p", "m", "v"), [
    ("GPipe", 4, 8, 1), ("1F1B", 4, 8, 1), ("1F1B", 4, 4, 1), ("1F1B", 4, 3, 1), ("1F1B", 2, 8, 1),
    ("Interleaved1F1B", 4, 8, 2), ("Interleaved1F1B", 2, 4, 2), ("Interleaved1F1B", 4, 4, 4)])
def test_simulated_makespan_matches_the_textbook_bubble(schedule, p, m, v):
    f, b = 1.0, 2.0  # per chunk
    spans = simulate(schedule=schedule, p=p, m=m, v=v, f=f, b=b)
    assert spans["t_end"].max() == pytest.approx((v * m + p - 1) * (f + b))
    busy = (spans["t_end"] - spans["t_start"]).groupby(spans["rank"]).sum()
    idle = 1 - busy / spans["t_end"].max()
    assert idle.tolist() == pytest.approx([analysis.bubble_theory(schedule=schedule, p=p, m=m, v=v)] * p)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"])
def test_simulated_schedule_respects_dependencies(schedule):
    p, m, v = 4, 8, 2
    spans = simulate(schedule=schedule, p=p, m=m, v=v, f=1.0, b=1.0, w=1.0)
    v = v if schedule.startswith("Interleaved") else 1
    per_rank = 3 if "Zero" in schedule else 2
    assert (spans.groupby("rank").size() == per_rank * m * v).all()
    for _, g in spans.sort_values("t_start").groupby("rank"):  # one action at a time per rank
        assert (g["t_start"].to_numpy()[1:] >= g["t_end"].to_numpy()[:-1] - 1e-9).all()
    end = {(r.kind, r.stage, r.microbatch): r.t_end for r in spans.itertuples()}
    for r in spans.itertuples():
        if r.kind == "forward" and r.stage > 0:
            assert r.t_start >= end[("forward", r.stage - 1, r.microbatch)] - 1e-9
        if r.kind == "backward":
            assert r.t_start >= end[("forward", r.stage, r.microbatch)] - 1e-9
            if r.stage < p * v - 1:
                assert r.t_start >= end[("backward", r.stage + 1, r.microbatch)] - 1e-9


def test_zero_bubble_fills_idle_time():
    zb = simulate(schedule="InterleavedZeroBubble", p=4, m=8, v=1, f=1.0, b=1.0, w=1.0)
    one = simulate(schedule="1F1B", p=4, m=8, f=1.0, b=2.0)
    assert zb["t_end"].max() < one["t_end"].max()


def test_simulate_rejects_unknown_schedules():
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate(schedule="Magic", p=2, m=2)


# ------------------------------------------------------------------------------------ synthetic
@pytest.fixture(scope="module")
def pp_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    cfg = SyntheticConfig(run="pp", mesh={"pp": 2, "fsdp": 2, "tp": 2}, steps=6, microbatches=4,
                          straggler=Straggler(rank=5, factor=1.3, cause="throttle"))
    rows = write_store(root, config=cfg)
    return root, cfg, rows


def _read(root, kind, run="pp") -> pd.DataFrame:
    parts = []
    for f in sorted((root / "tables" / kind / f"run={run}").glob("rank=*/*.parquet")):
        parts.append(pq.read_table(f).to_pandas().assign(rank=int(f.parent.name.split("=")[1])))
    return pd.concat(parts, ignore_index=True)


def test_layout_and_schema_are_the_agents(pp_store):
    root, cfg, rows = pp_store
    for kind, schema in SCHEMAS.items():
        if kind == "hang":  # a watchdog's record of a stall: a healthy run has none
            continue
        files = sorted((root / "tables" / kind / "run=pp").glob("rank=*/part-*.parquet"))
        assert files, kind
        ranks = {f.parent.name for f in files}
        assert ranks == ({"rank=-1"} if kind == "gpu" else {f"rank={r}" for r in range(cfg.world_size)})
        for f in files:
            assert pq.read_schema(f).equals(stored_schema(kind)), f
    assert rows["step"] == cfg.world_size * cfg.steps
    assert rows["span"] == cfg.world_size * cfg.steps * 2 * cfg.microbatches


def test_step_records_add_up_and_are_synchronous(pp_store):
    root, cfg, _ = pp_store
    step = _read(root, "step")
    parts = step[["compute_s", "exposed_comm_s", "bubble_s", "other_s"]].sum(axis=1)
    assert np.allclose(parts, step["wall_s"])
    assert (step.groupby("step")["wall_s"].nunique() == 1).all()
    assert np.allclose(step["mfu"], step["flops"] / step["wall_s"] / 989e12)
    slow = step[step["rank"] == 5]["compute_s"].mean() / step[step["rank"] != 5]["compute_s"].mean()
    assert slow == pytest.approx(1.3, rel=0.03)
    # Only the last pipeline stage computes the loss.
    assert step[step["rank"] < 4]["loss"].isna().all() and step[step["rank"] >= 4]["loss"].notna().all()


def test_run_records_describe_the_mesh(pp_store):
    root, cfg, _ = pp_store
    run = _read(root, "run")
    assert set(run["strategy"]) == {"pp+fsdp+tp"} and set(run["world_size"]) == {8}
    assert json.loads(run["mesh"].iloc[0]) == {"pp": 2, "fsdp": 2, "tp": 2}
    coords = run.set_index("rank")["coords"].map(json.loads)
    assert coords[5] == {"pp": 1, "fsdp": 0, "tp": 1}  # tp innermost, pp outermost


def test_collectives_pair_up_and_follow_the_busbw_definition(pp_store):
    root, cfg, _ = pp_store
    coll = _read(root, "collective")
    per_rank_step = coll.groupby(["rank", "step"]).size().rename("n").reset_index()
    step = _read(root, "step").merge(per_rank_step, on=["rank", "step"])
    assert (step["n"] == step["n_collectives"]).all()
    factor = np.array([analysis.busbw_factor(o, n) for o, n in zip(coll["op"], coll["group_size"])])
    assert np.allclose(coll["busbw"], coll["bytes"] / coll["duration_s"] * factor)
    members = coll[coll["peer"] < 0].groupby(["group", "seq"]).agg(n=("rank", "size"), size=("group_size", "max"))
    assert (members["n"] == members["size"]).all()  # every member recorded each collective once
    # Collectives end together on all members, a transfer time after the last arrival.
    assert (analysis.collective_instances(coll)["net_s"] > 0).all()
    assert set(coll.loc[coll["peer"] >= 0, "op"]) == {"send", "recv"}


@pytest.mark.parametrize(("schedule", "m", "v"), [("1F1B", 8, 1), ("GPipe", 4, 1), ("Interleaved1F1B", 8, 2)])
def test_spans_have_the_schedules_bubble(tmp_path, schedule, m, v):
    write_store(tmp_path, config=SyntheticConfig(run="pp", mesh={"pp": 4}, steps=3, schedule=schedule,
                                                 microbatches=m, virtual_stages=v))
    spans = _read(tmp_path, "span")
    # Over the pipeline's extent the idle fraction is the schedule's (within the 1 % compute noise and
    # the ranks' data-loading offsets).
    measured = analysis.measured_bubble(spans)["bubble"].mean()
    assert measured == pytest.approx(analysis.bubble_theory(schedule=schedule, p=4, m=m, v=v), abs=0.02)


def test_gpu_samples_show_the_throttled_gpu(pp_store):
    root, cfg, _ = pp_store
    gpu = _read(root, "gpu")
    hot = gpu[(gpu["host"] == "node0000") & (gpu["gpu"] == 5)]
    cold = gpu[(gpu["host"] == "node0000") & (gpu["gpu"] != 5)]
    assert ((hot["throttle_reasons"] & 0x40) != 0).mean() > 0.5
    assert hot["sm_clock_hz"].mean() < 0.8 * cold["sm_clock_hz"].mean()


def test_config_validation():
    with pytest.raises(ValueError, match="mesh dims"):
        SyntheticConfig(mesh={"ep": 2})
    with pytest.raises(ValueError, match="outside world size"):
        SyntheticConfig(mesh={"dp": 4}, straggler=Straggler(rank=4))
    with pytest.raises(ValueError, match="cause"):
        Straggler(rank=0, cause="cosmic rays")
    with pytest.raises(ValueError, match="unknown schedule"):
        SyntheticConfig(mesh={"pp": 2}, schedule="Magic")


def test_command_line(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--mesh", "dp=2", "--steps", "3", "--straggler", "1:1.5:compute"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 2 and out["rows"]["step"] == 6
    assert (tmp_path / "tables" / "step" / "run=synthetic" / "rank=1" / "part-00000.parquet").is_file()
