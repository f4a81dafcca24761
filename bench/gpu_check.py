"""One-command GPU check of meshscope (``make gpu-check``): on a machine with an NVIDIA GPU and its own torch,
ten sections, then a Markdown report written to ``--out`` and printed:

1. the trainer's ``1b`` flavor for ``--steps`` steps, bf16 autocast on NCCL (world size 1), telemetry on:
   median tokens/s and MFU after warm-up, PASS when MFU >= 45 % (the goal on one H100);
2. meshscope's CUDA-event collective timing against torch.profiler's GPU work of the same ops, PASS when
   every ratio is within 0.8-1.25;
3. the memory sampler's allocator fields against torch.cuda's own reads;
4. the agent's NVML sampler against nvidia-smi read at the same time;
5. telemetry overhead, on vs off in alternating blocks of the same trainer steps;
6. where a step goes: ``Trainer.train_step`` in a bare loop, eager and compiled (kernel time by kind, thread
   CPU), PASS when section 1's command runs within 5 % of the bare compiled loop per step;
7. the training thread's CPU per traced collective on CUDA tensors (c10d and functional), PASS when every
   path is at most 2 µs per op (``bench/gpu_check_opcost.py``);
8. DDP's buckets on CUDA as meshscope records them, against DDP's reducer's own bucket list
   (``bench/gpu_check_ddp.py``);
9. and 10. sections 7 and 8 again with NCCL's own per-op timing on (``TORCH_NCCL_ENABLE_TIMING=1``).

Each section runs in a process of its own (``bench/gpu_check_sections.py``) under its own time budget,
all within one global deadline (``--timeout-s``): a section that crashes or outlives its budget is
reported FAILED (its process group is killed), one that no longer fits before the deadline SKIPPED, and
the others still run. Exit status: 0 when every section ran and passed, 1 otherwise, 2 for a bad command
line. Without a CUDA GPU it prints one line and exits 0, writing nothing.

    python3 bench/gpu_check.py [--out gpu-check.md] [--steps 50] [--timeout-s 480]
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_check_analysis import RENDERERS as CHECK_RENDERERS, Rendered, md_table  # noqa: E402
from bench.gpu_check_breakdown import render_breakdown  # noqa: E402
from bench.gpu_check_ddp import render_ddp  # noqa: E402
from bench.gpu_check_opcost import render_opcost  # noqa: E402
from meshscope.agent.cliargs import ArgParser, UsageError, run_command  # noqa: E402

PROG = "gpu-check"
RENDERERS = {**CHECK_RENDERERS, "breakdown": render_breakdown, "opcost": render_opcost, "ddp": render_ddp,
             "opcost_timing": render_opcost, "ddp_timing": render_ddp}
# A section whose verdict sets its figures against another section's: key -> the other's key.
COMPARED_WITH = {"breakdown": "train"}
WORKER = ROOT / "bench" / "gpu_check_sections.py"
RESERVE_S = 15.0  # kept back from the deadline for the header and the report
MIN_TIMEOUT_S = 60.0
KILL_WAIT_S = 10.0
# What a launcher set for its own job: a section makes its own world of one, never joins the caller's.
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True, slots=True)
class Section:
    key: str  # RENDERERS key
    title: str
    budget_s: float
    min_s: float  # with less time than this left before the deadline, the section is skipped
    argv: tuple[str, ...]  # the command; the runner appends ``--result FILE``
    env: tuple[tuple[str, str], ...] = ()  # set for this section's process only (before its process group)


@dataclass(kw_only=True, slots=True)
class Outcome:
    section: Section
    status: str  # done | FAILED | SKIPPED
    reason: str = ""
    seconds: float = 0.0
    data: dict | None = None
    log_tail: str = ""


def plan(*, steps: int, workdir: Path, python: str = sys.executable) -> list[Section]:
    def argv(key: str) -> tuple[str, ...]:
        return (python, str(WORKER), key, "--workdir", str(workdir / key), "--steps", str(steps))

    # Budgets: 1.5-2x what one H100 took on 2026-11-26 and -27 (train 38 s eager / 44-66 s compiling,
    # collectives 9-14 s, memory 4-6 s, NVML 15-18 s, overhead 33-55 s, breakdown 48-69 s, op cost 21-25 s,
    # DDP 10-12 s), together within the default deadline; the deadline caps each in any case.
    # The last two run sections 7 and 8 again with NCCL's own per-op timing on (TORCH_NCCL_ENABLE_TIMING=1,
    # set before the process group exists): what it costs the issuing thread, and DDP's per-bucket durations
    # from ``Work._get_duration`` (NaN without it), for the design that would time ops without Python events.
    timing = (("TORCH_NCCL_ENABLE_TIMING", "1"),)
    return [
        Section(key="train", title=f"Trainer `1b`, {steps} steps, bf16 on NCCL, telemetry on",
                budget_s=90 + 0.6 * steps, min_s=60, argv=argv("train")),
        Section(key="collectives", title="Collective timing: CUDA events vs torch.profiler", budget_s=30, min_s=20,
                argv=argv("collectives")),
        Section(key="memory", title="CUDA allocator fields: meshscope's sample vs torch.cuda", budget_s=15, min_s=10,
                argv=argv("memory")),
        Section(key="nvml", title="NVML sampler vs nvidia-smi", budget_s=30, min_s=25, argv=argv("nvml")),
        Section(key="overhead", title="Telemetry overhead on GPU, on vs off", budget_s=75, min_s=60,
                argv=argv("overhead")),
        Section(key="breakdown", title="Where a step goes: the bare train_step loop, eager vs compiled",
                budget_s=85, min_s=50, argv=argv("breakdown")),
        Section(key="opcost", title="Training-thread CPU per traced CUDA collective", budget_s=28, min_s=20,
                argv=argv("opcost")),
        Section(key="ddp", title="DDP's buckets on CUDA: meshscope's records vs DDP's own", budget_s=22, min_s=15,
                argv=argv("ddp")),
        Section(key="opcost_timing", title="Training-thread CPU per traced CUDA collective, NCCL's own timing on",
                budget_s=28, min_s=20, argv=argv("opcost"), env=timing),
        Section(key="ddp_timing", title="DDP's buckets on CUDA, NCCL's own timing on", budget_s=22, min_s=15,
                argv=argv("ddp"), env=timing),
    ]


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
    env["PYTHONUNBUFFERED"] = "1"  # the log holds everything up to a kill
    return env


def _tail(path: Path, *, lines: int = 15) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-lines:])


def _kill(proc: subprocess.Popen) -> str:
    """SIGKILL the section's whole session (its children too: NCCL helpers, nvidia-smi); "" once it is
    gone, else a note for the reason (a process stuck in the driver can take a while)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        return f"; still running {KILL_WAIT_S:.0f} s after SIGKILL"
    return ""


def run_one(section: Section, *, budget_s: float, workdir: Path, env: dict[str, str] | None = None,
            clock: Callable[[], float] = time.monotonic) -> Outcome:
    """Run one section's command with ``--result FILE`` appended, in a session of its own, for at most
    ``budget_s``; its output goes to ``<workdir>/<key>.log``."""
    result, log = workdir / f"{section.key}.json", workdir / f"{section.key}.log"
    t0 = clock()
    with open(log, "wb") as out:
        try:
            if section.env:
                env = {**(os.environ if env is None else env), **dict(section.env)}
            proc = subprocess.Popen([*section.argv, "--result", str(result)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True)
        except OSError as exc:
            return Outcome(section=section, status="FAILED", reason=f"could not start: {exc}")
        try:
            code = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            reason = f"ran out of its {budget_s:.0f} s budget" + _kill(proc)
            return Outcome(section=section, status="FAILED", reason=reason, seconds=clock() - t0,
                           log_tail=_tail(log))
        except BaseException:  # Ctrl-C: in a session of its own, the section would go on holding the GPU
            _kill(proc)
            raise
    seconds, tail = clock() - t0, _tail(log)
    if code != 0:
        last = tail.splitlines()[-1].strip() if tail else ""
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return Outcome(section=section, status="FAILED", reason=f"{how}{': ' + last[:300] if last else ''}",
                       seconds=seconds, log_tail=tail)
    if not result.is_file():
        return Outcome(section=section, status="FAILED", reason="exited 0 without writing its result",
                       seconds=seconds, log_tail=tail)
    return Outcome(section=section, status="done", seconds=seconds, data=json.loads(result.read_text()), log_tail=tail)


def run_sections(sections: list[Section], *, deadline: float, workdir: Path, env: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 progress: Callable[[str], None] = lambda line: None) -> list[Outcome]:
    """Every section in order, each within min(its budget, the time left before ``deadline``); one that no
    longer gets ``min_s`` is skipped. A failure never stops the sections after it."""
    workdir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for i, section in enumerate(sections, 1):
        left = deadline - clock()
        where = f"[{i}/{len(sections)}] {section.title}"
        if left < section.min_s:
            reason = (f"{max(left, 0):.0f} s left before the global deadline; it needs at least "
                      f"{section.min_s:.0f} s")
            outcomes.append(Outcome(section=section, status="SKIPPED", reason=reason))
            progress(f"{where}: SKIPPED ({reason})")
            continue
        budget = min(section.budget_s, left)
        progress(f"{where}: running (budget {budget:.0f} s)")
        outcome = run_one(section, budget_s=budget, workdir=workdir, env=env, clock=clock)
        outcomes.append(outcome)
        why = f" ({outcome.reason})" if outcome.reason else ""
        progress(f"{where}: {outcome.status} in {outcome.seconds:.0f} s{why}")
    return outcomes


# --------------------------------------------------------------------------------------------- report
def git_commit(root: Path = ROOT, *, environ: dict[str, str] | None = None) -> str:
    """``git rev-parse --short HEAD`` of the checkout, with a mark for uncommitted changes; what went wrong
    otherwise (the check runs from an unpacked copy too). ``MESHSCOPE_COMMIT``, where set, names the commit
    first: a copy of a working tree sent to a GPU machine can carry a ``.git`` older than its files (seen:
    the report of a fixed tree named the commit before the fix, "+ uncommitted changes")."""
    named = (os.environ if environ is None else environ).get("MESHSCOPE_COMMIT", "").strip()
    found = _git_commit(root)
    return f"{named} (MESHSCOPE_COMMIT; the copy's git: {found})" if named else found


def _git_commit(root: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return f"unknown ({head.stderr.strip().splitlines()[-1] if head.stderr.strip() else 'git failed'})"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__}: {exc})"
    return head.stdout.strip() + (" (+ uncommitted changes)" if dirty else "")


def _driver() -> str:
    """Driver and driver-CUDA versions from NVML: the header is written even where NVML is broken."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # ImportError, NVMLError_*: say why instead of losing the report
        return f"unknown ({type(exc).__name__}: {exc})"
    return f"{driver} (driver CUDA {cuda // 1000}.{cuda % 1000 // 10})"


def header_facts() -> dict[str, str]:
    """What the report's header says about the machine. Read after the sections, so that this process
    holds no CUDA context while they run."""
    import torch
    import torch.distributed as dist

    facts = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), "host": socket.gethostname(),
             "torch": f"{torch.__version__} (CUDA {torch.version.cuda})", "driver": _driver(),
             "meshscope": git_commit()}
    try:
        props = torch.cuda.get_device_properties(0)
        major, minor = torch.cuda.get_device_capability(0)
        facts["gpu"] = (f"{torch.cuda.get_device_name(0)} (sm_{major}{minor}, {props.total_memory / 2**30:.1f} GiB; "
                        f"{torch.cuda.device_count()} visible)")
    except RuntimeError as exc:  # a GPU torch sees but cannot initialise: the sections' logs say more
        facts["gpu"] = f"unknown ({exc})"
    facts["nccl"] = (".".join(str(v) for v in torch.cuda.nccl.version()) if dist.is_nccl_available()
                     else "not in this torch build")
    return facts


def _rendered(outcome: Outcome, others: dict[str, dict]) -> Rendered | str:
    """The section's verdict, or why its results could not be analysed (a FAILED section then); ``others``:
    the data of the sections that ran, by key (``COMPARED_WITH``)."""
    key = outcome.section.key
    try:
        if key in COMPARED_WITH:
            return RENDERERS[key](outcome.data, others.get(COMPARED_WITH[key]))
        return RENDERERS[key](outcome.data)
    except Exception as exc:  # one section's odd results must not cost the report of the others
        return f"its results could not be analysed: {type(exc).__name__}: {exc}"


def render_report(facts: dict[str, str], *, outcomes: list[Outcome]) -> tuple[str, int]:
    """The Markdown report and the exit status (0 when every section ran and passed)."""
    header = [["date", facts.get("date", "?")], ["host", facts.get("host", "?")], ["GPU", facts.get("gpu", "?")],
              ["driver", facts.get("driver", "?")], ["torch", facts.get("torch", "?")],
              ["NCCL", facts.get("nccl", "?")], ["meshscope commit", facts.get("meshscope", "?")]]
    if "elapsed" in facts:
        header.append(["time", facts["elapsed"]])
    summary, bodies, ok = [], [], True
    others = {o.section.key: o.data for o in outcomes if o.status == "done" and o.data is not None}
    for i, outcome in enumerate(outcomes, 1):
        status, reason, verdict, detail = outcome.status, outcome.reason, "—", outcome.reason
        body = []
        if status == "done":
            got = _rendered(outcome, others)
            if isinstance(got, str):
                status, reason, detail = "FAILED", got, got
            else:
                verdict, detail = got.verdict, got.summary
                body.append(got.markdown)
        if status != "done":
            body.append(f"**{status}**: {reason}.")
            if outcome.log_tail:
                body += ["", "Last lines of its output:", "", "```", outcome.log_tail, "```"]
        ok = ok and status == "done" and verdict == "PASS"
        summary.append([i, outcome.section.title, status, verdict, detail, f"{outcome.seconds:.0f} s"])
        bodies += [f"## {i}. {outcome.section.title}", "", *body, ""]
    lines = ["# meshscope GPU check", "", md_table(["", ""], header), "", "## Summary", "",
             md_table(["#", "section", "ran", "verdict", "detail", "time"], summary), "", *bodies]
    return "\n".join(lines).rstrip() + "\n", 0 if ok else 1


# ----------------------------------------------------------------------------------------------- CLI
def parser() -> ArgParser:
    p = ArgParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-check.md", help="where the Markdown report goes (default: ./gpu-check.md)")
    p.add_argument("--steps", type=int, default=50, help="trainer steps of section 1 (default: 50)")
    p.add_argument("--timeout-s", type=float, default=480.0,
                   help=f"global deadline in seconds (default: 480; at least {MIN_TIMEOUT_S:.0f})")
    p.add_argument("--only", default="", metavar="KEY[,KEY...]",
                   help="run only these sections (keys: " + ", ".join(s.key for s in plan(steps=1, workdir=Path(".")))
                   + "; default: all)")
    return p


def validate(ns) -> None:
    """A bad value is a UsageError naming it (one line, exit 2)."""
    if ns.steps < 1:
        raise UsageError(f"--steps {ns.steps} must be >= 1")
    if not math.isfinite(ns.timeout_s) or ns.timeout_s < MIN_TIMEOUT_S:
        raise UsageError(f"--timeout-s {ns.timeout_s:g} must be at least {MIN_TIMEOUT_S:.0f} seconds")
    keys = [s.key for s in plan(steps=1, workdir=Path("."))]
    for key in filter(None, ns.only.split(",")):
        if key not in keys:
            raise UsageError(f"--only {ns.only!r}: no section {key!r} (one of {', '.join(keys)})")
    out = Path(ns.out)
    if out.is_dir():
        raise UsageError(f"--out {ns.out!r} is a directory, not a file")
    parent = out.parent
    if not parent.is_dir():
        raise UsageError(f"--out {ns.out!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--out {ns.out!r}: directory {str(parent)!r} is not writable")


def check(ns) -> int:
    t0 = time.monotonic()
    validate(ns)
    import torch  # after the flags: a bad value is reported without waiting for torch

    if not torch.cuda.is_available():
        print(f"{PROG}: no CUDA GPU on this machine (torch {torch.__version__}, torch.cuda.is_available() is "
              "False); nothing to check")
        return 0
    deadline = t0 + ns.timeout_s - RESERVE_S
    with tempfile.TemporaryDirectory(prefix="meshscope-gpu-check-") as tmp:
        only = set(filter(None, ns.only.split(",")))
        sections = [s for s in plan(steps=ns.steps, workdir=Path(tmp)) if not only or s.key in only]
        outcomes = run_sections(sections, deadline=deadline, workdir=Path(tmp),
                                env=worker_env(), progress=lambda line: print(f"{PROG}: {line}", file=sys.stderr,
                                                                              flush=True))
    facts = header_facts()
    facts["elapsed"] = f"{time.monotonic() - t0:.0f} s (deadline {ns.timeout_s:g} s)"
    report, code = render_report(facts, outcomes=outcomes)
    Path(ns.out).write_text(report)
    print(report, end="")
    print(f"{PROG}: report written to {ns.out}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    return run_command(prog=PROG, parser=parser(), argv=argv, body=check)


if __name__ == "__main__":
    sys.exit(main())
