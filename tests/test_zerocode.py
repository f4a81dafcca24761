"""Zero-code observation (``meshscope run -- COMMAND``) of unmodified jobs: the scripts in tests/jobs/ have
no meshscope in them. Each run is compared with what the job itself knows: its optimizer steps, its
gradient bytes, its own printed loss, the step's wall time."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from meshscope.agent.store.reader import read_table
from tests.test_dashboard_real_run import every_page_renders

JOBS = Path(__file__).resolve().parent / "jobs"
TIMEOUT = 240


def meshscope_run(cwd: Path, *argv: str, env: dict | None = None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "meshscope", "run", *argv], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=timeout)


def torchrun(script: str, *args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(JOBS / script), *args]


def ingest(store: Path) -> None:
    subprocess.run([sys.executable, "-m", "meshscope", "ingest", "--store", str(store)], check=True,
                   capture_output=True, timeout=120)


def report(store: Path, run: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "meshscope", "report", "--store", str(store), "--run", run, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def assert_breakdown_sums_to_wall(steps: pd.DataFrame) -> None:
    parts = steps["compute_s"] + steps["exposed_comm_s"] + steps["bubble_s"] + steps["other_s"]
    assert (parts - steps["wall_s"]).abs().max() < 1e-6, steps[["wall_s", "compute_s", "exposed_comm_s", "other_s"]]
    assert (steps[["compute_s", "exposed_comm_s", "other_s"]] >= 0).all().all()


def printed_losses(stdout: str) -> dict[int, float]:
    return {int(line.split()[1]): float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")}


# ----------------------------------------------------------------------------------------- unit tier
def test_a_bad_run_name_or_store_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "file").write_text("")
    for argv, needle in ((["--run", "run-ü", "--", "true"], "run-ü"),
                         (["--store", str(tmp_path / "file" / "x"), "--", "true"], "file/x"),
                         (["--"], "no command"), (["--", "no-such-command-x"], "no-such-command-x")):
        out = meshscope_run(tmp_path, *argv)
        assert out.returncode == 2, out
        assert len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr and "Traceback" not in out.stderr


def test_a_bad_flops_mode_is_one_line_and_exit_2_before_the_job(tmp_path):
    out = meshscope_run(tmp_path, "--store", str(tmp_path / "s"), "--", "touch", str(tmp_path / "ran"),
                        env={"MESHSCOPE_FLOPS": "bogus"})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out
    assert "MESHSCOPE_FLOPS='bogus'" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "ran").exists()


def test_the_default_run_name_is_the_scripts_and_the_time():
    from meshscope.agent.contract import check_run_name
    from meshscope.agent.zerocode.detect import default_run_name

    when = 1795600000.0
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    for command, stem in ((["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "a/train.py"], "train"),
                          (["torchrun", "--nproc_per_node", "2", "-m", "pkg.fine_tune"], "fine_tune"),
                          (["accelerate", "launch", "x/sft.py", "--lr", "1"], "sft"),
                          (["./my job"], "my-job"), (["python", "-c", "pass"], "python")):
        name = default_run_name(command, now=when)
        assert name == f"{stem}-{stamp}", command
        check_run_name(name)


def test_the_jobs_exit_code_output_and_its_own_sitecustomize_are_kept(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['JOB_SITE'] = 'kept'\n")
    script = ("import os, sys\nprint('out', os.environ.get('JOB_SITE'), 'meshscope.agent.zerocode' in sys.modules)\n"
              "print('err', file=sys.stderr)\nraise SystemExit(7)\n")
    out = meshscope_run(tmp_path, "--store", str(tmp_path / "s"), "--run", "exit7", "--", sys.executable, "-c", script,
                        env={"PYTHONPATH": str(own)})
    assert out.returncode == 7
    assert out.stdout == "out kept True\n"  # the job's own stdout, untouched; its sitecustomize ran too
    assert "err" in out.stderr and "recorded nothing" in out.stderr  # it trained no model


def test_a_job_that_raises_keeps_its_traceback_and_exit_code(tmp_path):
    out = meshscope_run(tmp_path, "--store", str(tmp_path / "s"), "--run", "boom", "--", sys.executable, "-c",
                        "import torch\nraise ValueError('the job failed')")
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "ValueError: the job failed" in out.stderr


def test_meshscope_disable_leaves_the_job_untouched(tmp_path):
    script = "import sys, torch\nprint(sorted(m for m in sys.modules if m.startswith('meshscope')))"
    out = meshscope_run(tmp_path, "--store", str(tmp_path / "s"), "--", sys.executable, "-c", script,
                        env={"MESHSCOPE_DISABLE": "1"})
    assert out.returncode == 0 and out.stdout == "[]\n", out
    # set for one process only: its sitecustomize imports nothing of meshscope either
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "agent" / "zerocode" / "bootstrap"),
           "MESHSCOPE_DISABLE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout == "[]\n", out


def test_the_bootstrap_imports_no_torch(tmp_path):
    out = meshscope_run(tmp_path, "--store", str(tmp_path / "s"), "--", sys.executable, "-c",
                        "import sys; print('torch' in sys.modules, 'meshscope.agent.zerocode' in sys.modules)")
    assert out.stdout == "False True\n", out


def test_a_single_process_loop_is_observed(tmp_path):
    script = ("import torch\nm = torch.nn.Linear(8, 8)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              "for i in range(5):\n    loss = m(torch.randn(4, 8)).pow(2).mean()\n    loss.backward()\n"
              "    opt.step()\n    opt.zero_grad()\n    print(f'step {i} loss {loss.item():.6f}')\n")
    store = tmp_path / "s"
    out = meshscope_run(tmp_path, "--store", str(store), "--run", "single", "--", sys.executable, "-c", script)
    assert out.returncode == 0, out.stderr
    ingest(store)
    steps = read_table(store, "step", run="single")
    assert list(steps["step"]) == [0, 1, 2, 3, 4]
    assert steps["loss"].round(6).tolist() == list(printed_losses(out.stdout).values())
    assert_breakdown_sums_to_wall(steps)
    run = read_table(store, "run", run="single").iloc[0]
    assert (run["strategy"], run["world_size"], run["n_params"]) == ("single", 1, 72)


# ----------------------------------------------------------------------------------------- gloo tier
@pytest.mark.gloo
def test_a_plain_ddp_script_is_observed_without_changes(tmp_path, monkeypatch):
    store = tmp_path / "store"
    out = meshscope_run(tmp_path, "--store", str(store), "--", *torchrun("plain_ddp.py", "--steps", "8", "--accumulate", "2"))
    assert out.returncode == 0, out.stderr[-3000:]
    # the default run name: the script's and the time, said before and after the job
    (name,) = set(re.findall(r"run '(plain_ddp-\d{8}-\d{6})'", out.stderr))
    assert f"meshscope report --store {store} --run {name}" in out.stderr
    ingest(store)
    steps = read_table(store, "step", run=name)
    assert sorted(steps.groupby("rank")["step"].apply(list).tolist()) == [list(range(8))] * 2  # 8 optimizer steps × 2
    assert_breakdown_sums_to_wall(steps)
    # two backwards per step that the script divides itself: the step's loss is their sum, what it optimises
    optimised = {int(s): float(v) for s, v in re.findall(r"rank 0 step (\d+) optimised (\S+)", out.stdout)}
    r0 = steps[steps["rank"] == 0].set_index("step")["loss"]
    assert len(optimised) == 8 and all(r0[s] == pytest.approx(v, abs=1e-6) for s, v in optimised.items())
    grads = 4 * (256 * 512 + 512 + 512 * 16 + 16)  # fp32 gradient bytes of ToyModel
    coll = read_table(store, "collective", run=name)
    dp = coll[coll["source"] == "ddp_comm_hook"]
    per_step = dp[dp["step"] >= 1].groupby(["rank", "step"])["bytes"].sum()
    # DDP all-reduces the gradients on every backward the script does not wrap in no_sync(): twice a step
    assert (per_step == 2 * grads).all(), per_step
    # the script's own loss all-reduce after optimizer.step() belongs to the next step, inside its wall
    own = coll[(coll["source"] == "c10d") & (coll["op"] == "all_reduce")]
    assert len(own) == 2 * 8
    run = read_table(store, "run", run=name).iloc[0]
    assert (run["strategy"], json.loads(run["mesh"])["dp"], run["model"]) == ("ddp", 2, "ToyModel")
    assert json.loads(run["config"])["zero_code"] is True
    rep = report(store, name)
    assert rep["world_size"] == 2 and rep["steps"] == [0, 7]
    assert rep["tokens_per_s"] is None  # the model takes no token ids: not known, not 0
    every_page_renders(monkeypatch, store, focus=name)


@pytest.mark.gloo
def test_a_plain_fsdp2_script_is_observed_with_tokens_flops_and_its_loss(tmp_path, monkeypatch):
    store = tmp_path / "store"
    out = meshscope_run(tmp_path, "--store", str(store), "--run", "fsdp0", "--", *torchrun("plain_fsdp2.py", "--steps", "6"))
    assert out.returncode == 0, out.stderr[-3000:]
    ingest(store)
    steps = read_table(store, "step", run="fsdp0")
    assert len(steps) == 6 * 2
    assert_breakdown_sums_to_wall(steps)
    assert (steps["tokens"] == 8 * 32).all()
    r0 = steps[steps["rank"] == 0].set_index("step")
    printed = printed_losses(out.stdout)
    assert {s: round(v, 4) for s, v in r0["loss"].items()} == printed
    run = read_table(store, "run", run="fsdp0").iloc[0]
    assert (run["strategy"], run["model"], run["seq_len"]) == ("fsdp", "TinyLM", 32)  # not fully_shard's FSDPTinyLM
    n = 256 * 64 + 2 * (2 * 64 + 64 * 256 + 256 + 256 * 64 + 64) + 64 * 256 + 256
    assert run["n_params"] == n
    # the model's shape: 6 FLOPs per non-embedding parameter per token (forward 2, backward 4; the embedding
    # is a lookup), no attention module
    assert run["flops_per_token"] == 6 * (n - 256 * 64) and run["flops_method"].startswith("analytic: 6*N")
    assert (steps["mfu"] > 0).all()
    coll = read_table(store, "collective", run="fsdp0")
    rs = coll[(coll["source"] == "fsdp_comm") & (coll["op"] == "reduce_scatter") & (coll["step"] == 2)]
    grads = 4 * n
    per_rank = rs.groupby("rank")["bytes"].sum()
    assert ((per_rank >= grads) & (per_rank <= grads + 4 * 2 * 16)).all(), per_rank  # padding to the world size
    charts = every_page_renders(monkeypatch, store, focus="fsdp0")
    assert charts["overview"] >= 1 and charts["communication"] >= 1, charts


@pytest.mark.gloo
def test_a_rank_that_raises_keeps_the_jobs_exit_and_is_the_key_event(tmp_path):
    store = tmp_path / "store"
    out = meshscope_run(tmp_path, "--store", str(store), "--run", "crash", "--",
                        *torchrun("plain_ddp.py", "--steps", "8", "--fail-at", "3"))
    assert out.returncode == 1  # torchrun's own status for a failed worker
    assert "RuntimeError: injected failure at step 3" in out.stderr and "Traceback" in out.stderr
    rep = report(store, "crash")
    # rank 1 raised after its 4th optimizer step; rank 0 then failed inside a collective: an aborted step
    assert rep["events"]["key_event"]["kind"] == "crash" and rep["events"]["key_event"]["rank"] == 1, rep["events"]
    assert "injected failure" in rep["events"]["key_event"]["message"]
    steps = read_table(store, "step", run="crash")
    assert sorted(steps[steps["rank"] == 1]["step"]) == [0, 1, 2, 3]


def _run_loop(tmp_path, name: str, script: str) -> tuple:
    store = tmp_path / name
    out = meshscope_run(tmp_path, "--store", str(store), "--run", name, "--", sys.executable, "-c", script)
    assert out.returncode == 0, out.stderr
    ingest(store)
    return read_table(store, "step", run=name).sort_values("step"), out


def test_two_optimizers_per_iteration_are_one_step(tmp_path):
    """A GAN-style loop: the discriminator's and the generator's optimizer step in each iteration, with a
    forward and backward between them. From the second step on, each step is one iteration."""
    script = ("import torch\ng, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)\n"
              "og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)\n"
              "for i in range(6):\n"
              "    d(g(torch.randn(2, 4)).detach()).mean().backward(); od.step(); od.zero_grad()\n"
              "    (-d(g(torch.randn(2, 4))).mean()).backward(); og.step(); og.zero_grad()\n")
    steps, _ = _run_loop(tmp_path, "gan", script)
    assert steps["step"].tolist() == list(range(6))  # six iterations, six steps
    assert_breakdown_sums_to_wall(steps)
    assert steps["loss"].iloc[1:].isna().all()  # two backwards of two models per iteration: no single loss


def test_gradscaler_skipped_steps_and_unscaled_loss(tmp_path):
    """GradScaler on CPU: the loss handed to backward is scaled (65536 x); meshscope records the unscaled
    one; a step whose gradients are not finite is skipped by GradScaler (no optimizer step) and recorded
    ``skipped``."""
    script = ("import torch\nm = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.01)\n"
              "scaler = torch.amp.GradScaler('cpu')\n"
              "for i in range(5):\n"
              "    loss = m(torch.randn(8, 4)).pow(2).mean() * (float('inf') if i == 2 else 1.0)\n"
              "    scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()\n    opt.zero_grad()\n"
              "    print(f'step {i} loss {loss.item():.6f}')\n")
    steps, out = _run_loop(tmp_path, "scaler", script)
    assert steps["step"].tolist() == list(range(5))
    assert steps["skipped"].tolist() == [False, False, True, False, False]
    printed = printed_losses(out.stdout)
    finite = steps[~steps["skipped"]]
    assert finite["loss"].round(6).tolist() == [printed[s] for s in finite["step"]]


def test_the_agent_option_runs_an_agent_for_the_jobs_lifetime(tmp_path):
    script = ("import torch, time\nm = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              "for i in range(12):\n    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
              "    time.sleep(0.05)\nprint('job done')\n")
    store = tmp_path / "s"
    out = meshscope_run(tmp_path, "--store", str(store), "--run", "withagent", "--agent", "--agent-port", "0", "--",
                        sys.executable, "-c", script)
    assert out.returncode == 0 and out.stdout == "job done\n", out  # the agent's lines are on stderr
    assert re.search(r"serving http://127\.0\.0\.1:\d+/metrics", out.stderr)
    # the agent wrote the store (no ingest here) and is gone
    assert len(read_table(store, "step", run="withagent")) == 12
    ps = subprocess.run(["pgrep", "-f", f"collector.cli --store {store}"], capture_output=True)
    assert ps.returncode == 1, ps.stdout


@pytest.mark.gloo
def test_a_plain_pipeline_script_has_its_schedule_spans_and_bubble(tmp_path):
    store = tmp_path / "store"
    out = meshscope_run(tmp_path, "--store", str(store), "--run", "pp0", "--",
                        *torchrun("plain_pipeline.py", "--steps", "6", "--schedule", "1f1b", "--microbatches", "4"))
    assert out.returncode == 0, out.stderr[-3000:]
    ingest(store)
    steps = read_table(store, "step", run="pp0")
    assert len(steps) == 6 * 2
    assert_breakdown_sums_to_wall(steps)
    spans = read_table(store, "span", run="pp0")
    # every microbatch's forward and backward on each stage, every step: the schedule's own work
    assert spans.groupby(["rank", "kind"]).size().to_dict() == {(r, k): 6 * 4 for r in (0, 1)
                                                               for k in ("forward", "backward")}
    later = steps[steps["step"] >= 1]
    assert (later["bubble_s"] > 0).all()  # a stage waits for its neighbour in fill and drain
    span_time = (spans["t_end"] - spans["t_start"]).groupby([spans["rank"], spans["step"]]).sum()
    compute = later.set_index(["rank", "step"])["compute_s"]
    assert (span_time.loc[compute.index] <= compute + 1e-3).all()  # the spans are inside the compute
    run = read_table(store, "run", run="pp0").sort_values("rank")
    assert run["strategy"].tolist() == ["pp", "pp"] and run["schedule"].tolist() == ["1f1b", "1f1b"]
    assert [json.loads(c)["pp"] for c in run["coords"]] == [0, 1]
    rep = report(store, "pp0")["pipeline"]
    assert (rep["schedule"], rep["p"], rep["m"]) == ("1f1b", 2, 4)


def test_an_unwritable_store_costs_the_job_nothing_but_the_records(tmp_path):
    """The store's path turns out unusable inside the job (here: under a file): the job's output and exit
    status are unchanged, and one line says how many records were lost and why."""
    (tmp_path / "afile").write_text("")
    script = ("import torch\nm = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
              "for i in range(4):\n    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
              "print('job done')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "agent" / "zerocode" / "bootstrap"),
           "MESHSCOPE_STORE": str(tmp_path / "afile" / "store"), "MESHSCOPE_RUN": "lost"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, "job done\n")
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "telemetry records could not be written" in lines[0] and "Not a directory" in lines[0]


@pytest.mark.gloo
def test_a_job_that_uses_the_api_is_not_recorded_twice(tmp_path):
    """The reference trainer (explicit API) under meshscope run: zero-code stands down in each rank."""
    out = meshscope_run(tmp_path, "--store", str(tmp_path / "zc"), "--run", "zc", "--", sys.executable, "-m", "meshscope",
                        "train", "--nproc", "2", "--steps", "3", "--store", str(tmp_path / "ex"), "--run", "ex")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("zero-code observation stands down") == 2 and "recorded nothing" in out.stderr
    assert not (tmp_path / "zc" / "spool").exists()
    ingest(tmp_path / "ex")
    assert len(read_table(tmp_path / "ex", "step", run="ex")) == 3 * 2


@pytest.mark.gloo
def test_an_observed_job_computes_exactly_what_it_computes_alone(tmp_path):
    """Byte-for-byte the same output, observed or not: the hooks, the DDP comm hook (the default
    all-reduce) and the first step's FLOP count under a dispatch mode change no number of the job. Its
    model uses fused attention (the FLOP count's SDPA formulas run) and clips gradients."""
    job = torchrun("attention_lm.py", "--steps", "5")
    alone = meshscope_run(tmp_path, "--", *job, env={"MESHSCOPE_DISABLE": "1"})
    observed = meshscope_run(tmp_path, "--store", str(tmp_path / "s"), "--run", "lm", "--", *job)
    # Each run's own status and stderr: a failure of the job alone is the job's (or torch's), not meshscope's.
    assert alone.returncode == 0, f"the job alone exited {alone.returncode}: {alone.stderr[-3000:]}"
    assert observed.returncode == 0, f"the observed job exited {observed.returncode}: {observed.stderr[-3000:]}"
    assert alone.stdout.count("step ") == 5 and observed.stdout == alone.stdout
    ingest(tmp_path / "s")
    run = read_table(tmp_path / "s", "run", run="lm").iloc[0]
    assert run["flops_per_token"] > 0 and "telemetry_error" not in set(read_table(tmp_path / "s", "event", run="lm")["kind"])


def test_ctrl_c_reaches_the_job_and_sigterm_is_passed_on(tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group: the job gets its KeyboardInterrupt
    (it could not, were SIGINT ignored when the job was started) and its exit status is run's."""
    import signal as sig

    # 'ready' printed inside the try: a Ctrl-C sent the moment it is read must still land in the handler
    # (printed before the try, the interrupt could be raised between the two, outside the handler).
    script = ("import sys, time\ntry:\n    print('ready', flush=True)\n    time.sleep(60)\n"
              "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n    sys.exit(3)\n")
    for signum, status, said in ((sig.SIGINT, 3, "interrupted\n"), (sig.SIGTERM, 128 + sig.SIGTERM, "")):
        p = subprocess.Popen([sys.executable, "-m", "meshscope", "run", "--store", str(tmp_path / "s"), "--",
                              sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        assert p.stdout.readline() == "ready\n"
        if signum == sig.SIGINT:
            os.killpg(p.pid, signum)  # the terminal's Ctrl-C: every process of the group
        else:
            p.send_signal(signum)  # a scheduler stopping meshscope run alone
        out, err = p.communicate(timeout=60)
        assert (p.returncode, out) == (status, said), err[-2000:]
