"""``meshscope run [--store DIR] [--run NAME] [--agent] -- COMMAND...``: run a training job as it is, with
every Python process of it observed (see ``meshscope.agent.zerocode``).

The job's standard output, standard error and exit status are its own: meshscope's lines go to stderr,
prefixed ``meshscope:``, before and after the job; a job killed by signal N exits 128 + N, as a shell
says. Ctrl-C reaches the job (it is in the terminal's process group) and this command waits for it;
SIGTERM is passed on to the job (``_wait``). ``--agent`` runs a node agent on 127.0.0.1 for the job's lifetime.

A run name is one launch: a name the store already holds (its spool folder, or the ingested tables) is
refused before anything starts, unless ``--new-attempt`` records this launch as the run's next attempt
(one past the largest stored; the reader then counts each re-executed step once, the newest attempt's).
The default name (the script's and the time) is never refused: a taken one gets a ``-2``, ``-3``... suffix."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshscope.agent.cliargs import ArgParser, UsageError, run_command
from meshscope.agent.contract import SPOOL_NAME, check_run_name, spool_path
from meshscope.agent.zerocode import DEFAULT_STORE, flops_mode, ENV_ATTEMPT, ENV_RUN, ENV_STORE, disabled
from meshscope.agent.zerocode.detect import default_run_name
from meshscope.agent.contract.storelayout import StoreLayout

BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"


def parser() -> ArgParser:
    p = ArgParser(prog="meshscope run", description=(
        "Run COMMAND (torchrun ..., python train.py ..., accelerate launch ...) unchanged, with meshscope "
        "observing every Python process of it: steps, phases, collectives, memory, tokens, FLOPs per rank. "
        "MESHSCOPE_DISABLE=1 runs it untouched."),
        usage="meshscope run [--store DIR] [--run NAME] [--new-attempt] [--agent] [--agent-port N] -- COMMAND [ARGS...]")
    p.add_argument("--store", type=Path, default=Path(DEFAULT_STORE), help=f"run store (default ./{DEFAULT_STORE})")
    p.add_argument("--run", default=None, help="run name (default: the script's name and the time)")
    p.add_argument("--new-attempt", action="store_true",
                   help="the store holds --run already: record this launch as its next attempt (else refused)")
    p.add_argument("--agent", action="store_true", help="also run a node agent (/metrics, the store) for the job")
    p.add_argument("--agent-port", type=int, default=9477, metavar="N", help="the agent's /metrics port (0: any)")
    return p


def job_environment(*, environ: dict[str, str], store: Path, run: str, attempt: int = 0) -> dict[str, str]:
    """The job's environment: the bootstrap first on PYTHONPATH (the job's own entries kept after it), the
    store, the run and the launch's first attempt."""
    env = dict(environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BOOTSTRAP), environ.get("PYTHONPATH", "")) if p)
    env[ENV_STORE] = str(store)
    env[ENV_RUN] = run
    env[ENV_ATTEMPT] = str(attempt)
    return env


def stored_attempts(store: Path, run: str) -> set[int]:
    """The attempts of ``run`` that ``store`` holds: its ranks' spool files (``contract.spool_path``'s folder,
    names matched by ``contract.SPOOL_NAME``) and the run records already ingested (read by the store's one
    reader, every attempt). Empty when the store has nothing of the run; {0} for records of it without
    a run record."""
    spools = spool_path(store, run=run, rank=0, attempt=0).parent
    found = {int(m[2]) for f in (spools.iterdir() if spools.is_dir() else ()) if (m := SPOOL_NAME.match(f.name))}
    if not Path(StoreLayout.of(store).tables).is_dir():  # nothing ingested: no need to load the reader (DuckDB, pandas)
        return found
    from meshscope.agent.store.reader import Store, StoreError, read_table

    try:
        opened = Store.open(store)
        if run in opened.runs():
            records = read_table(opened, "run", run=run, columns=["attempt"], all_attempts=True)["attempt"]
            found |= {int(a) for a in records.dropna()} or {0}
    except StoreError as e:
        raise UsageError(f"--store {str(store)!r}: cannot tell whether it holds run {run!r} ({e})") from None
    return found


def _free_name(store: Path, name: str) -> str:
    """``name``, or the first of ``name-2``, ``name-3``... that the store does not hold."""
    for k in range(1, 1000):
        candidate = name if k == 1 else f"{name}-{k}"
        if not stored_attempts(store, candidate):
            return candidate
    raise UsageError(f"--store {str(store)!r}: holds runs {name!r} to {name}-999 already; pass --run")


def _say(message: str) -> None:
    print(f"meshscope: {message}", file=sys.stderr, flush=True)


def _start_agent(*, store: Path, port: int) -> subprocess.Popen:
    # its lines (the /metrics URL first) go to stderr: the job's stdout is the job's
    return subprocess.Popen([sys.executable, "-m", "meshscope.agent.collector.cli", "--store", str(store),
                             "--host", "127.0.0.1", "--port", str(port)], stdin=subprocess.DEVNULL, stdout=sys.stderr)


def _stop(proc: subprocess.Popen | None, *, timeout_s: float = 15.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


def _wait(command: list[str], env: dict[str, str]) -> int:
    """Run the job and wait for it. Ctrl-C goes to the whole foreground process group, the job included:
    here it is caught and does nothing (a caught signal is reset to its default in the job at exec, where
    an ignored one would stay ignored, and the job could not be interrupted), and SIGTERM is passed on."""
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        try:
            job = subprocess.Popen(command, env=env)
        except OSError as e:
            raise UsageError(f"cannot run {command[0]!r}: {e.strerror}") from None
        signal.signal(signal.SIGTERM, lambda *_: job.send_signal(signal.SIGTERM))
        return _status(job.wait())
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run(args, command: list[str]) -> int:
    if not command:
        raise UsageError("no command: meshscope run [options] -- COMMAND [ARGS...]")
    if shutil.which(command[0]) is None:
        raise UsageError(f"cannot run {command[0]!r}: no such command")
    if disabled():
        _say("MESHSCOPE_DISABLE is set: running the command untouched")
        return _wait(command, dict(os.environ))
    try:
        flops_mode()  # a bad MESHSCOPE_FLOPS is said here, before any rank starts
    except ValueError as e:
        raise UsageError(str(e)) from None
    run_name = args.run if args.run is not None else default_run_name(command)
    try:
        check_run_name(run_name)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not 0 <= args.agent_port <= 65535:
        raise UsageError(f"--agent-port {args.agent_port}: not a TCP port (0-65535)")
    store = args.store.expanduser().absolute()
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--store {str(args.store)!r}: cannot create it ({e.strerror})") from None
    if not os.access(store, os.W_OK | os.X_OK):
        raise UsageError(f"--store {str(args.store)!r}: not writable")
    attempt = 0
    if args.run is None:
        run_name = _free_name(store, run_name)  # two launches in one second: the second gets a suffix
    elif stored := stored_attempts(store, run_name):
        attempt = max(stored) + 1
        if not args.new_attempt:
            raise UsageError(f"--run {run_name!r}: run already in {store}; choose another name, or pass "
                             f"--new-attempt to record this launch as attempt {attempt + 1}")
    env = job_environment(environ=dict(os.environ), store=store, run=run_name, attempt=attempt)
    _say(f"observing run {run_name!r} into {store}" + (f" as attempt {attempt + 1}" if attempt else ""))
    agent = _start_agent(store=store, port=args.agent_port) if args.agent else None
    t0 = time.monotonic()
    try:
        code = _wait(command, env)
    finally:
        _stop(agent)
    took = f"ended after {time.monotonic() - t0:.0f} s (exit {code})"
    spools = spool_path(str(store), run=run_name, rank=0, attempt=0).parent
    if not (spools.is_dir() and any(spools.iterdir())):
        _say(f"run {run_name!r} {took}; zero-code observation recorded nothing (no process ran a model with "
             "gradients, or each stood down, as said above)")
        return code
    _say(f"run {run_name!r} {took}. Next:\n  meshscope report --store {store} --run {run_name}\n"
         f"  meshscope dashboard --store {store}")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" is the job's, its -h included; without "--", from the first non-option on.
    if "--" in argv:
        i = argv.index("--")
        ours, command = argv[:i], argv[i + 1:]
    else:
        i = next((k for k, a in enumerate(argv) if not a.startswith("-")
                  and (k == 0 or argv[k - 1] not in ("--store", "--run", "--agent-port"))), len(argv))
        ours, command = argv[:i], argv[i:]
    return run_command(prog="meshscope run", parser=parser(), argv=ours, body=lambda args: run(args, command))
