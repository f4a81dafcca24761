"""``make gpu-check`` (bench/gpu_check.py) without a GPU: the one-line exit on a machine without CUDA, the
one-line errors for bad flags, the section runner (budgets, the global deadline, failures that do not
stop the rest) and the pure analysis of each section's measurements. The GPU sections themselves run only
on a GPU machine; their wiring to NVML and the allocator is checked here against fakes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is a folder of scripts, not an installed package
    sys.path.insert(0, str(ROOT))

from bench import gpu_check, gpu_check_analysis as analysis, gpu_check_sections as sections  # noqa: E402

MIB = 1 << 20


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------------------ the CLI
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_one_line_exit_0_and_no_report(tmp_path):
    proc = cli(cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and proc.stderr == ""
    assert "no CUDA GPU" in lines[0] and torch.__version__ in lines[0] and "is False" in lines[0]
    assert list(tmp_path.iterdir()) == []  # no gpu-check.md, nothing else


@pytest.mark.parametrize(("args", "named"), [
    (["--steps", "0"], "--steps 0 must be >= 1"),
    (["--steps", "ten"], "'ten'"),
    (["--out", "missing/report.md"], "directory 'missing' does not exist"),
    (["--out", "."], "is a directory"),
    (["--timeout-s", "5"], "--timeout-s 5 must be at least 60"),
    (["--timeout-s", "nan"], "--timeout-s nan"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_input_is_one_line_naming_it_and_exit_2(tmp_path, args, named):
    proc = cli(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("gpu-check: error: ") and named in proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_makefile_target_and_readme():
    make = (ROOT / "Makefile").read_text()
    phony = next(line for line in make.splitlines() if line.startswith(".PHONY:"))
    assert "gpu-check" in phony.split()
    assert "make gpu-check" in (ROOT / "README.md").read_text()  # one line in its Tests section
    assert "make gpu-check" in (ROOT / "docs" / "testing.md").read_text()  # the kit's checks and its runs
    # A lent GPU machine may have no route to PyPI: the target installs meshscope without dependencies and
    # only the kit's own imports (offline wheels through GPU_CHECK_PIP), never the whole test extra.
    # Under `make test` the outer make's MAKELEVEL/MAKEFLAGS would add "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    dry = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", f"PY={sys.executable}", "GPU_CHECK_PIP=--no-index --find-links W"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert dry.returncode == 0, dry.stderr
    assert ".[test]" not in dry.stdout and "--no-deps" in dry.stdout and "--no-index --find-links W duckdb" in dry.stdout
    assert dry.stdout.rstrip().endswith("bench/gpu_check.py")
    # And as a user runs it here (everything importable already, so nothing is installed): the one line.
    run = subprocess.run(["make", "--no-print-directory", "-s", "gpu-check", f"PY={sys.executable}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and run.stdout.startswith("gpu-check: no CUDA GPU") and run.stdout.count("\n") == 1, (
        run.stdout, run.stderr)


# --------------------------------------------------------------------------------------- the runner
def py_section(key: str, code: str, *, budget_s: float = 30, min_s: float = 0) -> gpu_check.Section:
    """A section whose command is ``python -c code``; the runner appends ``--result FILE`` (sys.argv[2])."""
    return gpu_check.Section(key=key, title=key, budget_s=budget_s, min_s=min_s,
                             argv=(sys.executable, "-c", textwrap.dedent(code)))


WRITES = "import json, sys; open(sys.argv[2], 'w').write(json.dumps({'x': 1}))"


def test_a_failing_or_overrunning_section_is_reported_and_the_rest_still_run(tmp_path):
    pid_file = tmp_path / "child.pid"
    sleeper = f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(60)
    """
    lines: list[str] = []
    t0 = time.monotonic()
    out = gpu_check.run_sections(
        [py_section("ok", WRITES), py_section("boom", "print('partial'); raise RuntimeError('boom')"),
         py_section("slow", sleeper, budget_s=3), py_section("silent", "pass"), py_section("after", WRITES)],
        deadline=time.monotonic() + 100, workdir=tmp_path / "w", progress=lines.append)
    assert time.monotonic() - t0 < 40
    assert [o.status for o in out] == ["done", "FAILED", "FAILED", "FAILED", "done"]
    assert out[0].data == {"x": 1} and out[4].data == {"x": 1}
    assert out[1].reason.startswith("exited with status 1: RuntimeError: boom") and "partial" in out[1].log_tail
    assert out[2].reason == "ran out of its 3 s budget" and "started" in out[2].log_tail
    assert out[3].reason == "exited 0 without writing its result"
    # The whole session was killed: the section's own child does not outlive it.
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)
    assert len(lines) == 10 and "FAILED" in lines[5]


def test_a_sections_own_environment_reaches_its_process_only(tmp_path):
    """Sections 9 and 10 set TORCH_NCCL_ENABLE_TIMING for their own process (it must be set before the
    process group exists); the sections around them run without it."""
    reads = ("import json, os, sys; "
             "open(sys.argv[2], 'w').write(json.dumps({'v': os.environ.get('TORCH_NCCL_ENABLE_TIMING')}))")
    timed = gpu_check.Section(key="timed", title="timed", budget_s=30, min_s=0, argv=(sys.executable, "-c", reads),
                              env=(("TORCH_NCCL_ENABLE_TIMING", "1"),))
    env = {k: v for k, v in gpu_check.worker_env().items() if k != "TORCH_NCCL_ENABLE_TIMING"}
    out = gpu_check.run_sections([py_section("before", reads), timed, py_section("after", reads)],
                                 deadline=time.monotonic() + 100, workdir=tmp_path / "w", env=env)
    assert [o.data for o in out] == [{"v": None}, {"v": "1"}, {"v": None}]
    plan = {s.key: s for s in gpu_check.plan(steps=50, workdir=tmp_path)}
    assert dict(plan["opcost_timing"].env) == dict(plan["ddp_timing"].env) == {"TORCH_NCCL_ENABLE_TIMING": "1"}
    assert plan["opcost_timing"].argv[2] == "opcost" and plan["ddp_timing"].argv[2] == "ddp"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of the killed section is re-parented and reaped by init; until then it is a zombie.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_the_global_deadline_skips_what_no_longer_fits_and_caps_budgets(tmp_path):
    now = [1000.0]
    out = gpu_check.run_sections(
        [py_section("big", WRITES, min_s=50), py_section("small", WRITES, min_s=1)],
        deadline=1020.0, workdir=tmp_path, clock=lambda: now[0])
    assert out[0].status == "SKIPPED"
    assert out[0].reason == "20 s left before the global deadline; it needs at least 50 s"
    assert out[1].status == "done"


def test_worker_env_leaves_the_callers_job_behind():
    env = gpu_check.worker_env({"RANK": "3", "WORLD_SIZE": "8", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x",
                                "CUDA_VISIBLE_DEVICES": "1", "PATH": "/bin"})
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "PATH": "/bin", "PYTHONUNBUFFERED": "1"}


def test_default_plan_fits_the_default_deadline(tmp_path):
    plan = gpu_check.plan(steps=50, workdir=tmp_path)
    assert [s.key for s in plan] == list(gpu_check.RENDERERS)
    assert sum(s.budget_s for s in plan) <= 480 - gpu_check.RESERVE_S
    assert plan[0].argv[1:] == (str(gpu_check.WORKER), "train", "--workdir", str(tmp_path / "train"), "--steps", "50")


def test_header_tolerates_a_copy_without_git_and_a_machine_without_nvml(tmp_path):
    assert gpu_check.git_commit(tmp_path, environ={}).startswith("unknown (")
    assert len(gpu_check.git_commit(ROOT, environ={}).split()[0]) >= 7
    named = gpu_check.git_commit(ROOT, environ={"MESHSCOPE_COMMIT": "abc1234"})
    assert named.startswith("abc1234 (MESHSCOPE_COMMIT; the copy's git: ")
    assert gpu_check.git_commit(ROOT, environ={}) in named
    if not torch.cuda.is_available():
        assert gpu_check._driver().startswith("unknown (")


# --------------------------------------------------------------------------------------- the report
def _steps(mfu_wall: float, *, n: int = 10) -> list[dict]:
    flops = 0.45e15  # with a 1e15 FLOP/s peak: MFU 45 % at 1 s per step
    return ([{"step": 0, "wall_s": 9.0, "tokens": 1000, "flops": flops, "mfu": flops / 9.0 / 1e15}]
            + [{"step": i, "wall_s": mfu_wall, "tokens": 1000, "flops": flops, "mfu": flops / mfu_wall / 1e15,
                "cpu_s": 0.25 * mfu_wall, "cpu_wait_s": 0.001} for i in range(1, n)])


def _train_data(wall: float) -> dict:
    return {"run_name": "r", "requested_steps": 10, "steps": _steps(wall),
            "run": {"model": "1b", "n_params": 1.04e9, "seq_len": 2048, "global_batch": 8, "peak_flops": 1e15,
                    "peak_source": "table:H100", "device": "NVIDIA H100", "backend": "nccl", "dtype": "bf16-autocast"},
            "compiled": True,
            "memory": {"reserved_peak_bytes": 60 * 2**30, "alloc_retries": 3, "device_total_bytes": 80 * 2**30}}


def test_train_summary_leaves_warmup_out_and_judges_mfu_against_45_percent():
    s = analysis.train_summary(_steps(1.0), peak_flops=1e15)
    assert s["warmup"] == 1 and s["steady_steps"] == 9 and s["tokens_per_s"] == pytest.approx(1000.0)
    assert s["mfu"] == pytest.approx(0.45) and s["trainer_mfu"] == pytest.approx(0.45) and s["verdict"] == "PASS"
    assert analysis.train_summary(_steps(1.1), peak_flops=1e15)["verdict"] == "FAIL"
    unknown = analysis.train_summary(_steps(1.0), peak_flops=0.0)
    assert math.isnan(unknown["mfu"]) and unknown["verdict"] == "FAIL"
    with pytest.raises(ValueError, match="no steps"):
        analysis.train_summary([], peak_flops=1e15)


def test_report_header_summary_and_exit_status(tmp_path):
    sec = {s.key: s for s in gpu_check.plan(steps=10, workdir=tmp_path)}
    facts = {"date": "2026-01-01 00:00:00 UTC", "host": "node7", "gpu": "NVIDIA H100 80GB HBM3 (sm_90)",
             "driver": "550.54 (driver CUDA 12.4)", "torch": "2.13.0 (CUDA 12.6)", "nccl": "2.21.5",
             "meshscope": "abc1234"}
    done = gpu_check.Outcome(section=sec["train"], status="done", data=_train_data(1.0), seconds=40)
    report, code = gpu_check.render_report(facts, outcomes=[done])
    assert code == 0
    for text in facts.values():
        assert text in report
    assert "| 1 | Trainer `1b`, 10 steps, bf16 on NCCL, telemetry on | done | PASS | median MFU 45.0 %" in report
    assert "**PASS**" in report and "bf16" in report
    assert "compiled with `torch.compile`" in report
    assert "Training thread per step (median): 250.0 ms of CPU, 1.0 ms runnable but waiting for a core, of 1000.0 ms" in report
    assert "peak reserved 60.0 GiB (75 % of the device's 80.0 GiB), 3 allocation retries" in report

    outcomes = [
        gpu_check.Outcome(section=sec["train"], status="done", data=_train_data(1.5), seconds=40),
        gpu_check.Outcome(section=sec["collectives"], status="FAILED", reason="ran out of its 70 s budget",
                          log_tail="Traceback ...\nRuntimeError: NCCL error", seconds=70),
        gpu_check.Outcome(section=sec["memory"], status="done", data={"unexpected": 1}, seconds=3),
        gpu_check.Outcome(section=sec["nvml"], status="SKIPPED", reason="2 s left before the global deadline"),
    ]
    report, code = gpu_check.render_report(facts, outcomes=outcomes)
    assert code == 1
    assert "| 1 | Trainer `1b`, 10 steps, bf16 on NCCL, telemetry on | done | FAIL |" in report
    assert "**FAILED**: ran out of its 70 s budget." in report and "RuntimeError: NCCL error" in report
    assert "**FAILED**: its results could not be analysed: KeyError" in report
    assert "| 4 | NVML sampler vs nvidia-smi | SKIPPED | — | 2 s left before the global deadline | 0 s |" in report
    assert [line[3:] for line in report.splitlines() if line.startswith("## ")] == [
        "Summary", *(f"{i}. {o.section.title}" for i, o in enumerate(outcomes, 1))]


# ---------------------------------------------------------------------- 2. collectives vs profiler
def _x(cat: str, name: str, ts: float, dur: float, *, tid: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_gpu_work_is_attributed_to_the_region_that_launched_it():
    a = analysis.label(op="all_gather", nbytes=MIB, variant="queued-sync", rep=0)
    b = analysis.label(op="all_reduce_avg", nbytes=MIB, variant="idle-sync", rep=0)
    c = analysis.label(op="all_reduce_sum", nbytes=MIB, variant="idle-sync", rep=0)
    d = analysis.label(op="all_reduce_sum", nbytes=MIB, variant="idle-sync", rep=1)
    events = [
        _x("user_annotation", a, 100, 50), _x("user_annotation", b, 200, 50), _x("user_annotation", c, 300, 50),
        _x("user_annotation", d, 400, 50), _x("user_annotation", "other", 0, 1000),
        _x("cuda_runtime", "cudaMemcpyAsync", 110, 5, correlation=1),
        _x("cuda_driver", "cuLaunchKernel", 120, 5, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 210, 5, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 215, 5, tid=2, correlation=4),  # another thread: not b's
        _x("cuda_runtime", "cudaLaunchKernel", 260, 5, correlation=5),  # after b ended
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 1000, 30, tid=20, correlation=1),
        _x("kernel", "copy_kernel", 1040, 10, tid=20, correlation=2),
        _x("kernel", "void oneRankReduce<float>", 1100, 80, tid=20, correlation=3),
        _x("kernel", "elsewhere", 1200, 80, tid=20, correlation=4),
        _x("kernel", "later", 1300, 80, tid=20, correlation=5),
        _x("gpu_user_annotation", c, 2000, 12, tid=20),
    ]
    got = analysis.gpu_work_by_label(events)
    assert set(got) == {a, b, c, d}
    assert got[a] == {"span_us": 50.0, "busy_us": 40.0, "names": ["Memcpy DtoD (Device -> Device)", "copy_kernel"],
                      "source": "correlation"}
    assert got[b]["span_us"] == 80.0 and got[b]["names"] == ["void oneRankReduce<float>"]
    assert got[c] == {"span_us": 12.0, "busy_us": 12.0, "names": [], "source": "gpu_user_annotation"}
    assert got[d] == {"span_us": None, "busy_us": 0.0, "names": [], "source": "none"}
    assert analysis.parse_label(a) == ("all_gather", MIB, "queued-sync", 0) and analysis.parse_label("x|1") is None


def test_collective_ratios_per_cell_and_their_verdict():
    def lab(op, variant, rep=0):
        return analysis.label(op=op, nbytes=16 * MIB, variant=variant, rep=rep)

    gpu, durations = {}, {}

    def cell(op, variant, ours, theirs, names=("k",), rep=0):
        durations[lab(op, variant, rep)] = list(ours)
        gpu[lab(op, variant, rep)] = {"span_us": theirs, "names": list(names)}

    for rep, ours in enumerate([110e-6, 100e-6, 300e-6]):  # median ratio 1.1: one slow repetition is not the cell
        cell("ok", "queued-sync", [ours], 100.0, ["ncclDevKernel_AllGather"], rep=rep)
    cell("slow", "queued-async", [200e-6], 100.0, ["Memcpy DtoD"])
    cell("noop", "queued-sync", [5e-6], None, [])
    cell("unseen", "queued-sync", [], 10.0)
    cell("twice", "queued-sync", [1e-5, 1e-5], 10.0)
    cell("host", "idle-sync", [300e-6], 100.0)  # issue time on an idle GPU: shown, not judged
    cell("tiny", "queued-async", [6e-6], 2.0)  # ratio 3, but 4 µs: the event pair's launch gap, within 5 µs
    rows = {r["op"]: r for r in analysis.compare_collectives(durations, gpu=gpu)}
    assert rows["ok"]["reps"] == 3 and rows["ok"]["ratio"] == pytest.approx(1.1) and rows["ok"]["status"] == "ok"
    assert rows["ok"]["meshscope_us"] == pytest.approx(110.0) and rows["ok"]["nccl_kernel"]
    assert rows["slow"]["ratio"] == pytest.approx(2.0) and rows["slow"]["status"] == "out of band"
    assert rows["noop"]["status"] == "no GPU work" and math.isnan(rows["noop"]["ratio"])
    assert rows["unseen"]["status"] == "missing record" and rows["twice"]["status"] == "extra records"
    assert rows["host"]["status"] == "out of band" and not analysis.judged_cell(rows["host"])
    assert rows["tiny"]["ratio"] == pytest.approx(3.0) and rows["tiny"]["status"] == "ok"
    data = {"durations": durations, "gpu": gpu, "reps": 3, "nccl_version": "2.21.5"}
    r = analysis.render_collectives(data)
    assert r.verdict == "FAIL" and r.summary == "2 of 5 op/size/variant cells within 0.8–1.25 or ±5 µs"
    assert "| ok | 16 MiB | queued-sync | 110.0 | 100.0 | +10.0 | 1.100 | ok | ncclDevKernel_AllGather |" in r.markdown
    assert "| host | 16 MiB | idle-sync | 300.0 | 100.0 | +200.0 | 3.000 | out of band (not judged) | k |" in r.markdown

    def only(*ops):
        keep = [k for k in durations if analysis.parse_label(k)[0] in ops]
        return {**data, "durations": {k: durations[k] for k in keep}, "gpu": {k: gpu[k] for k in keep}}

    assert analysis.render_collectives(only("ok", "noop", "host")).verdict == "PASS"
    assert analysis.render_collectives(only("noop", "host")).verdict == "FAIL"  # nothing judged


# ------------------------------------------------------------------------------- 3. allocator fields
def test_memory_point_reads_what_the_sampler_reads(monkeypatch):
    """The section's wiring against a fake allocator: every sampler field lines up with its direct read."""
    stats = {"allocated_bytes.all.current": 1 << 30, "allocated_bytes.all.peak": 3 << 29,
             "reserved_bytes.all.current": 2 << 30, "reserved_bytes.all.peak": 2 << 30,
             "active_bytes.all.current": 1 << 30, "active_bytes.all.peak": 3 << 29,
             "num_alloc_retries": 1, "num_ooms": 1}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda.memory, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 << 30, 80 << 30))
    point = sections._memory_point("now", device=torch.device("cuda", 0))
    assert point["sampled"] == point["direct"] and point["direct"]["ooms"] == 1
    rows = analysis.compare_memory([point])
    assert len(rows) == len(analysis.MEMORY_SOURCES) and all(r["ok"] for r in rows)
    assert analysis.render_memory({"points": [point]}).verdict == "PASS"


def test_memory_comparison_flags_a_difference_and_tolerates_free_memory_drift():
    same = {k: 100 for k in analysis.MEMORY_SOURCES}
    drift = {**same, "device_free_bytes": 100 + 10 * MIB}
    assert all(r["ok"] for r in analysis.compare_memory([{"when": "t", "sampled": same, "direct": drift}]))
    wrong = {**same, "allocated_peak_bytes": 99}
    r = analysis.render_memory({"points": [{"when": "t", "sampled": same, "direct": wrong}]})
    assert r.verdict == "FAIL" and r.summary == "1 of 10 readings differ: allocated_peak_bytes"
    missing = analysis.compare_memory([{"when": "t", "sampled": {}, "direct": same}])
    assert not any(row["ok"] for row in missing)


# ----------------------------------------------------------------------------- 4. NVML vs nvidia-smi
SMI_OUT = "GPU-ABCD-1, 97, 41000, 612.35, 66\nGPU-other, 0, 3, [N/A], 30\n"


def test_parse_smi_and_the_nvml_comparison():
    smi = analysis.parse_smi(SMI_OUT + "garbage line\n")
    assert smi == {"abcd-1": {"util_pct": 97.0, "mem_used_mib": 41000.0, "power_w": 612.35, "temp_c": 66.0},
                   "other": {"util_pct": 0.0, "mem_used_mib": 3.0, "power_w": None, "temp_c": 30.0}}
    assert analysis.norm_uuid("GPU-ABCD-1") == analysis.norm_uuid("abcd-1") == "abcd-1"
    ours = {"util_ratio": 0.99, "mem_used_bytes": 41500 * MIB, "power_watts": float("nan"),
            "temperature_celsius": 66.0}
    rows = analysis.compare_nvml([{"phase": "load", "meshscope": ours, "smi": smi["abcd-1"]},
                                  {"phase": "idle", "meshscope": None, "smi": smi["other"]}])
    by = {(r["reading"], r["quantity"]): r for r in rows}
    assert by[1, "utilization (%)"]["ok"] and by[1, "temperature (°C)"]["ok"]
    assert by[1, "memory used (MiB)"]["ok"] is False and by[1, "memory used (MiB)"]["meshscope"] == 41500
    assert by[1, "power (W)"]["ok"] is None and by[2, "utilization (%)"]["ok"] is None
    r = analysis.render_nvml({"pairs": [{"phase": "load", "meshscope": ours, "smi": smi["abcd-1"],
                                         "nvml_reserved_bytes": 500 * MIB}]})
    assert r.verdict == "FAIL" and r.summary == "2 of 3 readings within tolerance; off: memory used (MiB)"
    assert "500 MiB" in r.markdown


def test_nvml_pair_matches_the_torch_device_by_uuid(tmp_path):
    """``_nvml_pair`` against a fake NVML module and a fake nvidia-smi: the GPU is picked by UUID on both
    sides, in whatever order NVML and nvidia-smi list them."""
    from meshscope.agent.collector.gpu import GpuSampler

    class NVMLError(Exception):
        pass

    uuids = ["GPU-other", "GPU-ABCD-1"]
    nvml = SimpleNamespace(
        NVMLError=NVMLError, NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0, nvmlMemory_v2=0x2000028,
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetHandleByUUID=lambda u: uuids.index(u), nvmlDeviceGetUUID=lambda h: uuids[h],
        nvmlDeviceGetName=lambda h: "NVIDIA H100", nvmlDeviceGetMaxClockInfo=lambda h, c: 1980,
        nvmlDeviceGetClockInfo=lambda h, c: 1980,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=95 * h, memory=10),
        nvmlDeviceGetMemoryInfo=lambda h, version=None: (
            SimpleNamespace(used=(40000 + h) * MIB, total=80 << 30, free=1 << 30) if version is None
            else SimpleNamespace(used=39500 * MIB, reserved=(500 + h) * MIB, total=80 << 30, free=1 << 30)),
        nvmlDeviceGetPowerUsage=lambda h: 600_000, nvmlDeviceGetTemperature=lambda h, s: 66,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0, nvmlDeviceGetTotalEccErrors=lambda h, *a: 0,
        nvmlShutdown=lambda: None,
    )
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{SMI_OUT.replace(chr(10), chr(92) + 'n')}'\n")
    smi.chmod(0o755)
    sampler = GpuSampler(nvml, host="h", clock=SimpleNamespace(now=lambda: 1.0))
    pair = sections._nvml_pair("load", sampler=sampler, nvml=nvml, smi=str(smi), uuid="abcd-1")
    assert pair == {"phase": "load", "nvml_reserved_bytes": 501 * MIB,
                    "meshscope": {"util_ratio": 0.95, "mem_used_bytes": 39500 * MIB, "power_watts": 600.0,
                                  "temperature_celsius": 66.0},
                    "smi": {"util_pct": 97.0, "mem_used_mib": 41000.0, "power_w": 612.35, "temp_c": 66.0}}
    assert json.loads(json.dumps(pair)) == pair  # what the section writes as its result


# ------------------------------------------------------------------------------------- 5. overhead
def test_overhead_is_the_median_over_ab_pairs():
    def block(pair, arm, seconds):
        return {"pair": pair, "arm": arm, "steps": 5, "seconds": seconds}

    blocks = [block(0, "on", 5.04), block(0, "off", 5.0), block(1, "off", 5.0), block(1, "on", 5.2),
              block(2, "on", 4.9), block(2, "off", 5.0), block(3, "on", 9.9)]  # pair 3 unfinished: left out
    s = analysis.overhead_summary(blocks)
    assert s["pairs"] == 3 and s["median"] == pytest.approx(0.008) and s["verdict"] == "PASS"
    r = analysis.render_overhead({"blocks": blocks, "warmup": 3, "block": 5, "dropped": 0, "errors": 0})
    assert r.summary == "median overhead +0.80 % per step (goal ≤ 1 %)"
    worse = [dict(b, seconds=b["seconds"] * 1.1) if b["arm"] == "on" else b for b in blocks]
    assert analysis.overhead_summary(worse)["verdict"] == "FAIL"
    with pytest.raises(ValueError, match="no complete"):
        analysis.overhead_summary(blocks[-1:])


def _mode(mode: str, step_ms: float) -> dict:
    # Shaped as bench/gpu_mfu_probe.measure returns it (figures of the H100 run of 2026-11-26).
    return {"mode": mode, "step_ms": step_ms, "run_loop_step_ms": step_ms + 1.0, "mfu": 0.599, "thread_cpu_ms": 40.0, "gpu_busy_ms": 179.4,
            "by_kind_ms": {"matmul": 131.7, "triton (fused)": 31.8}, "warmup_steps_s": [1.4, 0.19, 0.19],
            "top": [{"kernel": "nvjet_sm90_tst_256x128", "ms_per_step": 33.4, "calls_per_step": 108}]}


def test_breakdown_sets_the_trainers_command_against_its_bare_loop(tmp_path):
    from bench.gpu_check_breakdown import render_breakdown

    train = _train_data(0.2082)  # section 1: 208.2 ms per step, compiled
    data = {"modes": [_mode("eager", 249.5), _mode("compiled", 186.3)]}
    slow = render_breakdown(data, train)
    assert slow.verdict == "FAIL" and "208.2 ms per step (section 1) against the bare compiled loop's 186.3 ms: +11.8 %" in slow.summary
    assert "| compiled | 186.3 | 187.3 | 59.9 % | 40.0 | 179.4 | 6.9 | matmul 131.7, triton (fused) 31.8 |" in slow.markdown
    assert "`nvjet_sm90_tst_256x128`" in slow.markdown
    assert render_breakdown(data, _train_data(0.19)).verdict == "PASS"  # +2.0 %
    eager_train = {**train, "compiled": False}
    assert render_breakdown(data, eager_train).verdict == "PASS"  # nothing compiled to compare with
    broken = {"modes": [_mode("eager", 249.5), {"mode": "compiled", "error": "BackendCompilerFailed: x"}]}
    assert render_breakdown(broken, train).verdict == "FAIL"
    # Through the report: the breakdown's renderer is handed section 1's data.
    sec = {s.key: s for s in gpu_check.plan(steps=10, workdir=tmp_path)}
    outcomes = [gpu_check.Outcome(section=sec["train"], status="done", data=_train_data(1.0), seconds=40),
                gpu_check.Outcome(section=sec["breakdown"], status="done",
                                  data={"modes": [_mode("compiled", 1000.0 / 1.2)]}, seconds=50)]
    report, code = gpu_check.render_report({}, outcomes=outcomes)
    assert code == 1 and "+20.0 % (limit +5 %)" in report
