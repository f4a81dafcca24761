"""Zero-code on the frameworks people train with: a Hugging Face ``Trainer`` and a Lightning ``Trainer``
(tests/jobs/, no meshscope in them) under ``meshscope run -- torchrun``, which adds meshscope's callback
to each trainer by itself. Compared with what each framework itself reports: its global step, its
logged loss, its model's gradient bytes; then ``report`` and every dashboard page on the run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from meshscope.agent.store.reader import read_table
from tests.test_dashboard_real_run import every_page_renders
from tests.test_zerocode import assert_breakdown_sums_to_wall, ingest, meshscope_run, report, torchrun

pytestmark = pytest.mark.gloo


def ddp_in_dispatcher() -> bool:
    """Whether a job here has DDP's buckets recorded in torch's dispatcher (funcol_kernels: built, no CUDA),
    which also sees the all-reduce of DDP's used-parameter map (find_unused_parameters) a comm hook cannot."""
    import torch

    from meshscope.agent.instrument import funcol_kernels, native

    return (funcol_kernels.built() is not None and native.switched_on() and not torch.cuda.is_available()
            and os.environ.get("MESHSCOPE_DDP_KERNEL", "1") != "0")


def ddp_bytes_per_step(store: Path, run: str):
    coll = read_table(store, "collective", run=run)
    dp = coll[coll["source"] == "ddp_comm_hook"]
    return dp.groupby(["rank", "step"])["bytes"].sum()


# What a rank prints when its interpreter exits with one of the job's own C++ threads still joinable (HF's
# Trainer leaves the gloo process group to the interpreter's teardown): std::terminate, SIGABRT, the
# launcher fails the job. Seen in the plain run, without meshscope (full suite 2026-12-08 00:32 UTC, and once
# on 2026-11-29).
TEARDOWN_ABORT = "terminate called without an active exception"


def plain_run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    """The same job without meshscope (the environment ``meshscope_run`` gives it, less meshscope). It is the
    baseline the observed run is held to, so a plain run that the job's own teardown aborted is run again
    (twice at most): the baseline must be a run that ended as the job means to end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(3):
        proc = subprocess.run(list(argv), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0 or TEARDOWN_ABORT not in proc.stderr:
            return proc
    return proc


def test_a_hugging_face_trainer_with_accumulation(tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    store, out, plain_out = tmp_path / "store", tmp_path / "out", tmp_path / "plain"
    res = meshscope_run(tmp_path, "--store", str(store), "--run", "hf", "--",
                        *torchrun("hf_trainer.py", "--out", str(out), "--steps", "5", "--accumulate", "2"))
    assert res.returncode == 0, res.stderr[-3000:]
    history = json.loads((out / "log_history.json").read_text())
    # meshscope changes nothing the job does: without it, the same exit and the same log, step for step
    # (loss, grad norm, learning rate; HF's own timing figures differ run to run and are left out)
    plain = plain_run(tmp_path, *torchrun("hf_trainer.py", "--out", str(plain_out), "--steps", "5", "--accumulate", "2"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    own = json.loads((plain_out / "log_history.json").read_text())
    assert own["global_step"] == history["global_step"]
    assert [h for h in own["log"] if "loss" in h] == [h for h in history["log"] if "loss" in h]
    ingest(store)
    steps = read_table(store, "step", run="hf")
    assert len(steps) == history["global_step"] * 2 == 10  # every optimizer step of every rank
    assert_breakdown_sums_to_wall(steps)
    # HF logs each step's loss averaged over the ranks (logging_steps=1): the ranks' losses, averaged, agree
    logged = [h["loss"] for h in history["log"] if "loss" in h]
    measured = steps.groupby("step")["loss"].mean().tolist()
    assert measured == pytest.approx(logged, abs=2e-4)
    assert (steps["tokens"] == 2 * 4 * 32).all()  # 2 micro-batches of 4 × 32 token ids per rank
    # DDP all-reduces every gradient once per optimizer step (HF syncs only the last micro-batch); HF has DDP
    # find unused parameters, so DDP also all-reduces its map of the parameters used (an int32 each), which
    # only the dispatcher sees
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    grads = 4 * sum(p.numel() for p in model.parameters())
    used_map = 4 * len(list(model.parameters())) if ddp_in_dispatcher() else 0
    assert (ddp_bytes_per_step(store, "hf") == grads + used_map).all()
    run = read_table(store, "run", run="hf").iloc[0]
    assert json.loads(run["config"])["framework"] == "transformers"  # the callback was added by itself
    assert (run["strategy"], run["model"], run["n_params"]) == ("ddp", "GPT2LMHeadModel", grads // 4)
    # the model's shape: 6 per matmul parameter (all but the position embedding: the output head is tied to
    # the token embedding and multiplies) + 12·L·D·S of attention (2 GPT2Attention of width 64, 32 tokens)
    assert run["flops_per_token"] == 6 * (grads // 4 - 64 * 64) + 12 * 2 * 64 * 32, run["flops_method"]
    assert (steps["mfu"] > 0).all()
    rep = report(store, "hf")
    assert rep["steps"] == [0, 4]
    charts = every_page_renders(monkeypatch, store, focus="hf")
    assert charts["overview"] >= 1 and charts["communication"] >= 1, charts


def test_a_lightning_trainer_ddp_with_accumulation(tmp_path, monkeypatch):
    store, out, plain_out = tmp_path / "store", tmp_path / "out", tmp_path / "plain"
    out.mkdir()
    plain_out.mkdir()
    res = meshscope_run(tmp_path, "--store", str(store), "--run", "pl", "--",
                        *torchrun("lightning_job.py", "--out", str(out), "--steps", "5", "--accumulate", "2"))
    assert res.returncode == 0, res.stderr[-3000:]
    # meshscope changes nothing the job does: without it, the same exit, output and losses on every rank
    plain = plain_run(tmp_path, *torchrun("lightning_job.py", "--out", str(plain_out), "--steps", "5", "--accumulate", "2"))
    assert plain.returncode == 0 and plain.stdout == res.stdout, (plain.stdout, res.stdout)
    for rank in (0, 1):
        name = f"lightning-rank{rank}.json"
        assert json.loads((plain_out / name).read_text()) == json.loads((out / name).read_text()), rank
    ingest(store)
    steps = read_table(store, "step", run="pl")
    for rank in (0, 1):
        own = json.loads((out / f"lightning-rank{rank}.json").read_text())
        mine = steps[steps["rank"] == rank].sort_values("step")
        assert len(mine) == own["global_step"] == 5
        # Lightning divides each micro-batch's loss by the accumulation before backward: the step's loss is
        # the mean of the job's own two micro-batch losses
        expected = [sum(own["losses"][2 * i:2 * i + 2]) / 2 for i in range(5)]
        assert mine["loss"].tolist() == pytest.approx(expected, abs=1e-5)
    assert_breakdown_sums_to_wall(steps)
    n = 256 * 64 + (64 * 256 + 256) + (256 * 64 + 64) + (64 * 256 + 256)
    assert (ddp_bytes_per_step(store, "pl") == 4 * n).all()  # one all-reduce of every gradient per step
    run = read_table(store, "run", run="pl").iloc[0]
    assert json.loads(run["config"])["framework"] == "lightning" and run["n_params"] == n
    assert report(store, "pl")["steps"] == [0, 4]
    every_page_renders(monkeypatch, store, focus="pl")


def test_the_one_line_callback_without_the_launcher(tmp_path):
    """``callbacks=[meshscope.TransformersCallback()]`` under plain torchrun: the ranks agree on one run name
    (rank 0's, through the process group's store) in the default store."""
    out = tmp_path / "out"
    res = subprocess.run(torchrun("hf_trainer.py", "--out", str(out), "--steps", "3", "--meshscope-callback"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    store = tmp_path / "meshscope-runs"
    (run,) = [p.name for p in (store / "spool").iterdir()]
    assert run.startswith("hf_trainer-")
    ingest(store)
    steps = read_table(store, "step", run=run)
    assert sorted(steps["rank"].unique()) == [0, 1] and len(steps) == 3 * 2
    assert json.loads(read_table(store, "run", run=run).iloc[0]["config"])["framework"] == "transformers"
