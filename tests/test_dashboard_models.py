"""Analytic memory model and scaling analysis on hand-computed cases (formulas brief)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from meshscope.dashboard.memory_model import ModelSpec, memory_model, spec_from_meta
from meshscope.dashboard.scaling import amdahl_fit, scaling_table

N = 1e9


def _model(**kw) -> dict[str, float]:
    base = dict(n_params=N, n_layers=4, d_model=16, seq_len=8, global_batch=4, strategy="ddp", mesh={"dp": 2})
    base.update(kw)
    return memory_model(ModelSpec(**base)).set_index("component")["bytes"].to_dict()


# ---------------------------------------------------------------------------------------- memory
def test_ddp_mixed_precision_is_16_bytes_per_parameter():
    m = _model()
    assert (m["parameters"], m["gradients"], m["optimizer state"]) == (2 * N, 2 * N, 12 * N)


def test_fp32_is_4_4_8():
    m = _model(dtype="float32")
    assert (m["parameters"], m["gradients"], m["optimizer state"]) == (4 * N, 4 * N, 8 * N)


def test_zero_stages_shard_what_they_say():
    z1 = _model(strategy="zero1", mesh={"dp": 8})
    assert (z1["parameters"], z1["gradients"], z1["optimizer state"]) == (2 * N, 2 * N, 12 * N / 8)
    z2 = _model(strategy="zero2", mesh={"dp": 8})
    assert (z2["parameters"], z2["gradients"], z2["optimizer state"]) == (2 * N, 2 * N / 8, 12 * N / 8)


def test_fsdp_shards_everything_plus_layers_in_flight():
    m = _model(strategy="fsdp", mesh={"fsdp": 8})
    assert m["parameters"] + m["gradients"] + m["optimizer state"] == pytest.approx(16 * N / 8)
    assert m["unsharded params in flight"] == pytest.approx(2 * N / 4 * 2)  # 2 layers of N/L at 2 B
    # A mesh that calls the FSDP dim "dp" shards the same way.
    assert _model(strategy="fsdp", mesh={"dp": 8})["parameters"] == pytest.approx(2 * N / 8)


def test_tp_and_pp_divide_the_parameters():
    m = _model(strategy="pp+tp", mesh={"pp": 4, "tp": 2}, n_layers=8, microbatches=8, schedule="1F1B")
    assert m["parameters"] == pytest.approx(2 * N / 8)


def test_activations_hand_computed():
    # b = global 4 / dp 2 = 2; 34 b s h = 34 * 2 * 8 * 16 = 8704 B per layer; 4 layers; 1 microbatch.
    assert _model()["activations"] == pytest.approx(4 * 8704)
    assert _model(mesh={"dp": 2, "tp": 2})["activations"] == pytest.approx(4 * 8704 / 2)
    # Checkpointing keeps 2 b s h per layer plus one layer's full activations.
    assert _model(activation_checkpoint=True)["activations"] == pytest.approx(4 * 2 * 2 * 8 * 16 + 8704)


@pytest.mark.parametrize(("schedule", "v", "in_flight"), [
    ("1F1B", 1, 4), ("GPipe", 1, 8), ("Interleaved1F1B", 2, 4 * (1 + 3 / 8))])
def test_pipeline_activations_in_flight(schedule, v, in_flight):
    # p = 4, m = 8, L = 8 -> 2 layers per stage; b = global 32 / dp 1 / m 8 = 4 per microbatch.
    m = _model(strategy="pp", mesh={"pp": 4}, n_layers=8, global_batch=32, microbatches=8, schedule=schedule,
               virtual_stages=v)
    per_microbatch = 2 * 34 * 4 * 8 * 16
    assert m["activations"] == pytest.approx(per_microbatch * in_flight)


def test_spec_from_run_record_parses_json_and_validates():
    meta = {"n_params": 1e9, "n_layers": 4, "d_model": 16, "seq_len": 8, "global_batch": 4, "strategy": "fsdp",
            "mesh": json.dumps({"fsdp": 4}), "config": json.dumps({"activation_checkpoint": "full"}),
            "microbatches": None, "schedule": None}
    spec = spec_from_meta(meta)
    assert spec.mesh == {"fsdp": 4} and spec.activation_checkpoint and spec.microbatches == 1
    with pytest.raises(ValueError, match="n_params"):
        spec_from_meta({**meta, "n_params": 0})
    # The reference trainer's config nests the flag under "model".
    nested = {**meta, "config": json.dumps({"model": {"activation_checkpoint": True}})}
    assert spec_from_meta(nested).activation_checkpoint
    off = {**meta, "config": json.dumps({"model": {"activation_checkpoint": False}})}
    assert not spec_from_meta(off).activation_checkpoint


# --------------------------------------------------------------------------------------- scaling
def _family(rows, **kw) -> pd.DataFrame:
    t = pd.DataFrame(rows, columns=["run", "world_size", "global_batch", "tokens_per_s"])
    return t.assign(model="m", seq_len=8, strategy="ddp", schedule="", microbatches=0, virtual_stages=1, **kw)


def test_strong_scaling_table():
    # No 1-rank run: the baseline is the family's smallest world size (8), speedup 1 there.
    runs = _family([("a", 8, 64, 800.0), ("b", 16, 64, 1440.0), ("c", 32, 64, 2400.0)])
    t = scaling_table(runs).set_index("run")
    assert set(t["family"]) == {"strong · ddp · global batch 64"} and set(t["baseline"]) == {"a"}
    assert t["speedup"].tolist() == pytest.approx([1, 1.8, 3])
    assert t["efficiency"].tolist() == pytest.approx([1.0, 0.9, 0.75])  # speedup · n0 / n


def test_weak_scaling_table():
    runs = _family([("a", 8, 64, 800.0), ("b", 32, 256, 2880.0)])
    t = scaling_table(runs)
    assert set(t["kind"]) == {"weak"}
    assert t["efficiency"].tolist() == pytest.approx([1.0, 0.9])  # per-device throughput ratio


def test_amdahl_fit_recovers_c():
    n = np.array([1, 2, 4, 8, 16, 64])
    c, t1 = 0.05, 2.0
    throughput = 1 / (t1 * (c + (1 - c) / n))
    fit = amdahl_fit(n=n, throughput=throughput)
    assert fit.c == pytest.approx(c) and fit.t1 == pytest.approx(t1) and fit.rmse == pytest.approx(0, abs=1e-12)
    assert fit.r2 == pytest.approx(1)
    assert fit.speedup(8) == pytest.approx(1 / (0.05 + 0.95 / 8))


def test_amdahl_fit_from_a_baseline_above_one():
    n = np.array([8, 16, 32])
    throughput = 1 / (3.0 * (0.1 + 0.9 / n))
    assert amdahl_fit(n=n, throughput=throughput).c == pytest.approx(0.1)


def test_amdahl_fit_constrains_c_and_needs_three_sizes():
    superlinear = amdahl_fit(n=np.array([1, 2, 4]), throughput=np.array([1.0, 2.2, 4.8]))
    assert superlinear.c == 0.0  # better than ideal: no serial part, not a negative one
    # Time per token that does not fall with n: no parallel part, so no fit (not c clipped to 1 with R² 0).
    assert amdahl_fit(n=np.array([1, 2, 4]), throughput=np.array([1.0, 0.9, 0.8])) is None
    assert amdahl_fit(n=np.array([8, 8]), throughput=np.array([1.0, 1.1])) is None
    assert amdahl_fit(n=np.array([1, 2, 2]), throughput=np.array([1.0, 1.5, 1.6])) is None  # two sizes fit anything
