"""``dashboard.diff``'s arithmetic on frames with a known truth: the parts of a step sum to it, the bootstrap
interval covers a known shift and not 0, covers 0 between samples of one distribution, the gate fails only
on a confident slowdown, the change list, per-token comparison. Real runs: tests/test_diff_runs.py."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from meshscope.agent.instrument import runenv
from meshscope.dashboard import diff


def _rank_steps(n_steps: int, *, ranks: int = 2, compute: float = 0.05, comm: float = 0.01, seed: int = 0,
                noise: float = 0.002, optimizer: float = 0.005) -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(seed)
    rows, colls = [], []
    for step in range(n_steps):
        for rank in range(ranks):
            c = compute + rng.normal(0, noise)
            e_ag, e_rs = comm * 0.6, comm * 0.4
            other = 0.002
            rows.append({"rank": rank, "step": step, "compute_s": c, "optimizer_s": optimizer,
                         "exposed_comm_s": e_ag + e_rs, "bubble_s": 0.0, "other_s": other,
                         "wall_s": c + e_ag + e_rs + other, "tokens": 512})
            colls += [{"step": step, "op": "all_gather", "dim": "dp", "mesh_dim": "dp_shard", "wait_s": e_ag},
                      {"step": step, "op": "reduce_scatter", "dim": "dp", "mesh_dim": "dp_shard", "wait_s": e_rs},
                      {"step": step, "op": "send", "dim": "pp", "mesh_dim": "pp", "wait_s": 0.003}]
    c = pd.DataFrame(colls).groupby(["step", "op", "dim", "mesh_dim"], as_index=False)["wait_s"].sum()
    return pd.DataFrame(rows), c


META = {"model": "tiny", "global_batch": 8, "seq_len": 64, "n_params": 1000, "n_layers": 2, "d_model": 64,
        "strategy": "fsdp", "world_size": 2, "config": '{"microbatches": 4, "run_name": "a", "steps": 30}'}


def test_parts_of_each_step_sum_to_its_wall_time_and_p2p_is_not_exposed():
    rs, ex = _rank_steps(12)
    f = diff.step_parts(rs, ex, dp=2)
    parts = diff.parts_of(f)
    assert "exposed send on pp" not in parts  # the pipeline's waits are its bubble
    assert {"compute", "optimizer", "exposed all_gather on dp_shard", "exposed reduce_scatter on dp_shard",
            "exposed, unattributed", "bubble", "other", "unattributed"} == set(parts)
    np.testing.assert_allclose(f[parts].sum(axis=1), f["wall_s"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(f["exposed all_gather on dp_shard"], 0.006, atol=1e-12)
    np.testing.assert_allclose(f["exposed, unattributed"], 0.0, atol=1e-12)
    np.testing.assert_allclose(f["unattributed"], 0.0, atol=1e-12)
    np.testing.assert_allclose(f["optimizer"], 0.005)
    assert (f["tokens"] == 1024).all()  # each rank's record holds its replica's 512: two replicas
    assert (diff.step_parts(rs, ex, dp=1)["tokens"] == 512).all()  # one replica (TP): its 512


def test_a_known_slowdown_is_inside_its_interval_and_carried_by_its_part():
    a = diff.step_parts(*_rank_steps(40, seed=1))
    b = diff.step_parts(*_rank_steps(40, seed=2, comm=0.02))  # +0.01 s of exposed communication
    r = diff.compare(a, b, meta_a=META, meta_b=META, resamples=2000)
    w = diff.whole(r)
    assert w["lo_s"] < 0.01 < w["hi_s"] and w["significant"]
    assert w["diff_pct"] == pytest.approx(0.01 / a["wall_s"].mean() * 100, rel=0.2)
    assert diff.explaining(r)["part"] == "exposed all_gather on dp_shard"
    by = {p["part"]: p for p in r["parts"]}
    assert by["exposed all_gather on dp_shard"]["diff_s"] == pytest.approx(0.006, abs=1e-9)
    assert by["exposed reduce_scatter on dp_shard"]["diff_s"] == pytest.approx(0.004, abs=1e-9)
    assert sum(p["diff_s"] for p in r["parts"] if p["part"] != "step") == pytest.approx(w["diff_s"], abs=1e-12)
    assert r["verdict"].startswith("B is ") and "slower" in r["verdict"] and "exposed all_gather" in r["verdict"]
    assert diff.gate(r, fail_above_pct=5.0) and not diff.gate(r, fail_above_pct=w["hi_pct"] + 1)


def test_two_samples_of_one_distribution_are_no_significant_difference_and_never_fail_a_gate():
    covered = 0
    for k in range(12):
        a = diff.step_parts(*_rank_steps(30, seed=100 + k, noise=0.004))
        b = diff.step_parts(*_rank_steps(30, seed=200 + k, noise=0.004))
        r = diff.compare(a, b, meta_a=META, meta_b=META, resamples=1000)
        covered += not diff.whole(r)["significant"]
        assert not diff.gate(r, fail_above_pct=5.0)
    assert covered >= 10, covered  # a 95 % interval: about 11 or 12 of 12
    assert r["verdict"].startswith("no significant difference") or "slower" in r["verdict"] or "faster" in r["verdict"]


def test_changes_list_what_differs_but_names_and_places():
    b = {**META, "config": '{"microbatches": 8, "run_name": "b", "steps": 30}', "torch_version": "2.13.0"}
    a = {**META, "torch_version": "2.12.0"}
    ch = {c["key"]: (c["a"], c["b"]) for c in diff.changes(a, b)}
    assert ch == {"config.microbatches": (4, 8), "torch_version": ("2.12.0", "2.13.0")}
    rs, ex = _rank_steps(10)
    f = diff.step_parts(rs, ex)
    r = diff.compare(f, f, meta_a=a, meta_b=b, resamples=500)
    assert "microbatches 4 → 8" in r["verdict"] and r["verdict"].startswith("no significant difference")


def test_environment_changes_are_listed_where_both_records_have_one():
    env_a = {"cuda": "12.8", "nccl": "2.26.2", "driver": "570.1", "cpu": "x", "flags": {"NCCL_ALGO": "Ring"}}
    env_b = {"cuda": "12.8", "nccl": "2.28.9", "driver": "570.1", "cpu": "x",
             "flags": {"NCCL_ALGO": "Tree", "TORCH_NCCL_ENABLE_TIMING": "1"}}
    a = {**META, "environment": json.dumps(env_a)}
    b = {**META, "environment": json.dumps(env_b)}
    ch = {c["key"]: (c["a"], c["b"]) for c in diff.changes(a, b)}
    assert ch == {"env.nccl": ("2.26.2", "2.28.9"), "env.flags.NCCL_ALGO": ("Ring", "Tree"),
                  "env.flags.TORCH_NCCL_ENABLE_TIMING": (None, "1")}
    rs, ex = _rank_steps(10)
    f = diff.step_parts(rs, ex)
    r = diff.compare(f, f, meta_a=a, meta_b=b, resamples=200)
    assert "nccl 2.26.2 → 2.28.9, NCCL_ALGO Ring → Tree, TORCH_NCCL_ENABLE_TIMING none → 1" in r["verdict"], r["verdict"]
    # a record from before schema 6 has none: nothing is listed for it (not every key as "none → ...")
    assert diff.changes({**META}, b) == []


def test_the_environment_flags_are_bounded_and_hold_no_credentials():
    environ = {"NCCL_ALGO": "Tree", "TORCHELASTIC_RUN_ID": "x", "MASTER_PORT": "29500", "HF_TOKEN": "s",
               "NCCL_IB_SECRET_TOKEN": "s", "AWS_SECRET_ACCESS_KEY": "s", "OMP_NUM_THREADS": "1",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True" + "x" * 500,
               **{f"UCX_X{i:03d}": "1" for i in range(100)}}  # sorted after the others
    got = runenv.flags(environ)
    assert "NCCL_ALGO" in got and "OMP_NUM_THREADS" in got and "PYTORCH_CUDA_ALLOC_CONF" in got
    assert not {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "HF_TOKEN", "NCCL_IB_SECRET_TOKEN",
                "AWS_SECRET_ACCESS_KEY"} & set(got)
    places = runenv.flags({"CUDA_VISIBLE_DEVICES": "3", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x", "TORCH_HOME": "/h",
                           "NCCL_DEBUG_FILE": "/tmp/n", "NCCL_IB_PKEY": "0x2", "NCCL_AUTH_MODE": "s",
                           "NCCL_PROXY_URL": "http://user:pass@proxy:3128/"})
    assert places == {"NCCL_IB_PKEY": "0x2", "NCCL_PROXY_URL": "http://proxy:3128/"}, places
    assert len(got) == runenv.MAX_FLAGS and max(map(len, got.values())) == runenv.MAX_VALUE_CHARS
    env = runenv.environment(cuda=False, environ={"NCCL_ALGO": "Tree"})
    assert env["flags"] == {"NCCL_ALGO": "Tree"} and env["cpu"] and "nccl" not in env


def test_another_global_batch_is_compared_per_token_and_says_so():
    a = diff.step_parts(*_rank_steps(20, seed=3))
    rs, ex = _rank_steps(20, seed=4, compute=0.10)  # twice the work per step, twice the tokens
    rs["tokens"] = 1024
    b = diff.step_parts(rs, ex)
    r = diff.compare(a, b, meta_a=META, meta_b={**META, "global_batch": 16}, resamples=1000)
    assert r["unit"] == "token" and r["not_comparable"] == ["global_batch"]
    assert "per token" in r["verdict"] and "global_batch" in r["verdict"]
    w = diff.whole(r)
    per_tok_a, per_tok_b = (a["wall_s"] / a["tokens"]).mean(), (b["wall_s"] / b["tokens"]).mean()
    assert w["diff_s"] == pytest.approx(per_tok_b - per_tok_a)


def test_too_few_steps_give_no_interval():
    f = diff.step_parts(*_rank_steps(3))
    r = diff.compare(f, f, meta_a=META, meta_b=META)
    assert r["parts"] == [] and "too few steady steps" in r["verdict"] and not diff.gate(r, fail_above_pct=0)
