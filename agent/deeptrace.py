"""``meshscope trace``: torch.profiler on the ranks of a *running* job for exactly N steps, nothing restarted.

    meshscope trace --store DIR --run NAME --steps N [--ranks 0,1] [--out DIR] [--timeout S] [--json]

1. The run must be live here: its ranks' spools are in the store (the newest attempt of each rank), every
   rank wrote its start and none its end, and a rank whose process is on this host is still running.
2. The CLI writes ``request.json`` beside the spools (``agent.contract.deeptrace``): the ranks, N, and the
   step to start at, a few seconds of steps ahead of the last one the spools hold, so that every rank's
   flusher (one stat a second) sees it in time and all ranks trace the same steps.
3. Each rank starts torch.profiler at that step's start, stops it after the N-th step's end, exports its
   Kineto trace off the training thread and answers with the steps it traced (``agent.instrument.deeptrace``).
4. The CLI waits for every rank's answer (``--timeout``), reads meshscope's own records of those steps from
   the spools (no ingest, no agent needed), and writes ``<store>/traces/<run>/<id>/``: ``rank<k>.json``
   (Kineto, with ``distributedInfo``, for HTA) and ``merged.json`` (one Perfetto timeline: ranks as
   processes, meshscope's steps, phases and collectives beside the profiler's ops, ``agent.tracemerge``);
   ``--out DIR`` gets a copy.

Exit status 0 when every rank traced N steps; 1 when a rank did not answer in time or traced fewer; 2 for a
mistake (a run not live, N < 1, a rank outside the world, a trace already armed), one line naming it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa

from meshscope.agent.cliargs import ArgParser, UsageError, run_command
from meshscope.agent.contract import SPOOL_NAME, check_run_name
from meshscope.agent.contract.deeptrace import (
    MERGED, POLL_S, REQUEST, TraceDone, TraceRequest, done_name, new_trace_id, trace_name, write_atomic,
)
from meshscope.agent.contract.storelayout import StoreLayout
from meshscope.agent.transport.frame import FRAME_HEADER_SIZE, FrameError, decode_payload, parse_frame_header
from meshscope.agent.transport.reader import SpoolReader

PROG = "meshscope trace"
DEFAULT_TIMEOUT_S = 120.0
# How far ahead of the spools' last step the trace starts: a rank sees a request within POLL_S, and the
# spools lag the ranks by a flush of the telemetry and one of the spool writer (0.25 + 0.5 s); the rest is
# margin for a loaded machine.
LEAD_S = POLL_S + 2.0
TAIL_BYTES = 4 << 20  # how much of a spool's end holds its recent steps
RECORD_KINDS = ("step", "span", "collective", "event")


@dataclass
class RankSpool:
    rank: int
    path: Path
    attempt: int
    host: str = ""
    pid: int = 0
    t_start: float = math.nan
    world_size: int = 0
    backend: str = ""
    started: bool = False
    ended: str = ""  # the event that ended it ("end", "crash"), "" while live


@dataclass
class LiveRun:
    store: Path
    run: str
    world_size: int
    ranks: dict[int, RankSpool] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- spools
def rank_spools(store: Path, run: str) -> dict[int, Path]:
    """Each rank's newest attempt's spool file of ``run`` in ``store``."""
    newest: dict[int, tuple[int, Path]] = {}
    directory = Path(StoreLayout.of(store).spool) / run
    for entry in os.scandir(directory) if directory.is_dir() else ():
        m = SPOOL_NAME.match(entry.name)
        if m:
            rank, attempt = int(m.group(1)), int(m.group(2))
            if rank not in newest or attempt > newest[rank][0]:
                newest[rank] = (attempt, Path(entry.path))
    return {rank: path for rank, (_, path) in sorted(newest.items())}


def scan_kinds(path: Path, kinds: tuple[str, ...]) -> dict[str, list[pa.Table]]:
    """The tables of ``kinds`` in a spool file, decoding only their frames: the others are skipped by their
    headers' lengths, so a long run's spool costs a read of 24 bytes per frame. Damage (never expected
    from a live writer) hands the rest to the transport's reader, which resynchronises."""
    out: dict[str, list[pa.Table]] = {k: [] for k in kinds}
    with open(path, "rb") as fh:
        fd, pos = fh.fileno(), 0
        size = os.fstat(fd).st_size
        while pos + FRAME_HEADER_SIZE <= size:
            head = os.pread(fd, FRAME_HEADER_SIZE, pos)
            try:
                kind, version, length, crc = parse_frame_header(head, 0)
            except FrameError:
                break
            end = pos + FRAME_HEADER_SIZE + length
            if end > size:  # the writer is writing it
                return out
            if kind in out:
                try:
                    out[kind].append(decode_payload(kind, version, memoryview(os.pread(fd, length, pos + FRAME_HEADER_SIZE)), crc))
                except FrameError:
                    pass
            pos = end
        else:
            return out
    for kind, tables in read_records(path, pos, kinds).items():
        out[kind].extend(tables)
    return out


def read_records(path: Path, offset: int, kinds: tuple[str, ...]) -> dict[str, list[pa.Table]]:
    """Every table of ``kinds`` in a spool from ``offset`` (any byte: the reader finds the next frame)."""
    out: dict[str, list[pa.Table]] = {k: [] for k in kinds}
    reader = SpoolReader(path)
    while True:
        res = reader.read(offset)
        for frame in res.frames:
            if frame.kind in out and frame.table is not None:
                out[frame.kind].append(frame.table)
        if res.offset <= offset:
            return out
        offset = res.offset


def _frame(tables: list[pa.Table], rank: int) -> pd.DataFrame:
    df = pa.concat_tables(tables).to_pandas() if tables else pd.DataFrame()
    if len(df):
        df["rank"] = rank
    return df


# ----------------------------------------------------------------------------------------- liveness
def live_run(store: str | Path, run: str) -> LiveRun:
    """The run as its spools in ``store`` show it; a UsageError saying why it is not live here."""
    store = Path(store)
    try:
        check_run_name(run)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not store.is_dir():
        raise UsageError(f"store directory {str(store)!r} does not exist")
    spools = rank_spools(store, run)
    if not spools:
        raise UsageError(f"run {run!r} has no spool in store {str(store)!r}: no rank of it to reach here "
                         f"(not started, or its ranks write another store)")
    ranks: dict[int, RankSpool] = {}
    for rank, path in spools.items():
        spool = ranks[rank] = RankSpool(rank=rank, path=path, attempt=int(SPOOL_NAME.match(path.name).group(2)))
        found = scan_kinds(path, ("run", "event"))
        for info in (t.to_pylist() for t in found["run"]):
            for row in info:
                spool.host, spool.pid, spool.t_start = row["host"], int(row["pid"]), float(row["t_start"])
                spool.world_size, spool.backend, spool.started = int(row["world_size"]), row["backend"], True
        kinds = [k for t in found["event"] for k in t.column("kind").to_pylist()]
        spool.started = spool.started or "start" in kinds
        spool.ended = next((k for k in ("end", "crash") if k in kinds), "")
    started = [s for s in ranks.values() if s.started]
    if not started:
        raise UsageError(f"run {run!r} has not started: no rank wrote its start to {str(spools[min(spools)].parent)!r}")
    for s in ranks.values():
        if s.ended:
            raise UsageError(f"run {run!r} is not live: rank {s.rank} recorded its {s.ended} "
                             f"(attempt {s.attempt})")
        if s.pid and s.host == socket.gethostname() and not _alive(s.pid, s.t_start):
            raise UsageError(f"run {run!r} is not live: rank {s.rank}'s process {s.pid} on {s.host} has exited")
    return LiveRun(store=store, run=run, world_size=max(s.world_size for s in started), ranks=ranks)


def _alive(pid: int, t_start: float) -> bool:
    import psutil

    try:
        return psutil.Process(pid).create_time() <= t_start + 1.0  # not another process with the number
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def parse_ranks(text: str | None, world_size: int) -> tuple[int, ...]:
    if text is None:
        return tuple(range(world_size))
    try:
        ranks = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise UsageError(f"--ranks {text!r} is not a comma-separated list of ranks") from None
    if not ranks:
        raise UsageError(f"--ranks {text!r} names no rank")
    for r in ranks:
        if not 0 <= r < world_size:
            raise UsageError(f"--ranks: rank {r} is outside the world of {world_size} ranks (0..{world_size - 1})")
    return ranks


def armed(store: str | Path, run: str, *, now: float | None = None) -> TraceRequest | None:
    """The trace armed for ``run`` and not answered by all its ranks yet (None: none, or expired)."""
    directory = Path(StoreLayout.of(store).deeptrace(run))
    try:
        request = TraceRequest.loads((directory / REQUEST).read_text())
    except (OSError, ValueError):
        return None
    if request.expired(time.time() if now is None else now):
        return None
    ranks = request.ranks if request.ranks is not None else ()
    if ranks and all((directory / request.id / done_name(r)).exists() for r in ranks):
        return None
    return request


def start_step(live: LiveRun, ranks: tuple[int, ...], *, timeout_s: float) -> int | None:
    """The step every rank starts at: ``LEAD_S`` of steps past the last step the spools hold (None when
    they hold none yet: each rank's next step)."""
    last, periods = -1, []
    for r in ranks:
        path = live.ranks[r].path
        size = path.stat().st_size
        steps = _frame(read_records(path, max(0, size - TAIL_BYTES), ("step",))["step"], r)
        if len(steps):
            last = max(last, int(steps["step"].max()))
            recent = steps.sort_values("step").tail(21)
            # start to start: a step's wall leaves out the loop's time between steps
            periods.extend((recent["t_start"].diff() / recent["step"].diff()).dropna().tolist())
    if last < 0:
        return None
    step_s = max(float(pd.Series(periods).median()) if periods else 1.0, 1e-4)
    ahead = 1 + math.ceil(LEAD_S / step_s)
    return last + min(ahead, max(2, int(timeout_s / 2 / step_s)))


# ----------------------------------------------------------------------------------------- the trace
@dataclass
class Result:
    run: str
    id: str
    store_dir: Path
    out: Path | None
    start_step: int | None
    answers: dict[int, TraceDone]
    missing: tuple[int, ...]
    steps: int

    @property
    def ok(self) -> bool:
        return not self.missing and all(a.steps == self.steps and a.trace and not a.error
                                        for a in self.answers.values())

    def as_dict(self) -> dict:
        where = self.out or self.store_dir
        return {
            "run": self.run, "id": self.id, "ok": self.ok, "steps": self.steps, "start_step": self.start_step,
            "store_dir": str(self.store_dir), "out": str(self.out) if self.out else None,
            "merged": str(where / MERGED) if (where / MERGED).exists() else None,
            "missing": list(self.missing),
            "ranks": {str(r): {"first_step": a.first_step, "last_step": a.last_step, "steps": a.steps,
                               "trace": str(where / trace_name(r)) if a.trace else None, "error": a.error,
                               "host": a.host, "profiler_start_s": a.start_s, "profiler_stop_s": a.stop_s,
                               "export_s": a.export_s}
                      for r, a in sorted(self.answers.items())},
        }


def trace(store: str | Path, *, run: str, steps: int, ranks: str | None = None, out: str | Path | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S, echo=None) -> Result:
    """Arm, wait, collect and merge (the command without its printing; ``echo`` gets progress lines).
    UsageError for a mistake; a Result whose ``ok`` is False when a rank fell short."""
    if steps < 1:
        raise UsageError(f"--steps {steps}: trace at least 1 step")
    if not timeout_s > 0:
        raise UsageError(f"--timeout {timeout_s}: must be more than 0 seconds")
    live = live_run(store, run)
    chosen = parse_ranks(ranks, live.world_size)
    absent = [r for r in chosen if r not in live.ranks]
    if absent:
        here = ",".join(map(str, sorted(live.ranks)))
        raise UsageError(f"rank {absent[0]} has no spool in store {str(live.store)!r} (ranks here: {here}; "
                         "the others write their own node's store: trace them there)")
    layout = StoreLayout.of(live.store)
    control = Path(layout.deeptrace(run))
    busy = armed(live.store, run)
    if busy is not None:
        raise UsageError(f"a trace is already armed for run {run!r}: request {busy.id} (expires in "
                         f"{busy.expires - time.time():.0f} s; {str(control / REQUEST)!r})")
    if out is not None:
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {str(out)!r} is not a directory")
        if not out.parent.is_dir():
            raise UsageError(f"--out {str(out)!r}: directory {str(out.parent)!r} does not exist")

    offsets = {r: live.ranks[r].path.stat().st_size for r in chosen}  # the traced steps' records come after
    first = start_step(live, chosen, timeout_s=timeout_s)
    now = time.time()
    request = TraceRequest(id=new_trace_id(now), run=run, steps=steps, ranks=chosen, start_step=first, created=now,
                           expires=now + timeout_s)
    control.mkdir(parents=True, exist_ok=True)
    write_atomic(control / REQUEST, request.dumps())
    if echo:
        echo(f"{PROG}: armed rank{'s' if len(chosen) > 1 else ''} {','.join(map(str, chosen))} of run {run!r} for "
             f"{steps} step{'s' if steps > 1 else ''} from step {first if first is not None else 'next'}; "
             f"waiting up to {timeout_s:g} s")
    deadline = time.monotonic() + timeout_s
    try:
        answers = _wait(control / request.id, chosen, deadline=deadline)
    finally:  # answered, given up on or interrupted: no rank starts it any more
        _withdraw(control, request.id)
    missing = tuple(r for r in chosen if r not in answers)
    store_dir = Path(layout.trace(run, request.id))
    store_dir.mkdir(parents=True, exist_ok=True)
    traces: dict[int, dict] = {}
    for r, a in sorted(answers.items()):
        if a.trace:
            src = control / request.id / a.trace
            os.replace(src, store_dir / trace_name(r))
            traces[r] = json.loads((store_dir / trace_name(r)).read_text())
    for r, a in answers.items():
        write_atomic(store_dir / done_name(r), a.dumps())
    if traces:
        frames = _records(live, answers, offsets, deadline=deadline)
        from meshscope.agent.tracemerge import merged_trace

        merged = merged_trace(traces, **frames, run=run, trace_id=request.id,
                              hosts={r: s.host for r, s in live.ranks.items()},
                              traced={r: (a.first_step, a.last_step) for r, a in answers.items() if a.trace})
        write_atomic(store_dir / MERGED, json.dumps(merged, separators=(",", ":")))
    shutil.rmtree(control / request.id, ignore_errors=True)
    if out is not None:
        out.mkdir(exist_ok=True)
        for name in [trace_name(r) for r in traces] + ([MERGED] if traces else []):
            shutil.copyfile(store_dir / name, out / name)
    return Result(run=run, id=request.id, store_dir=store_dir, out=out, start_step=first, answers=answers,
                  missing=missing, steps=steps)


def _withdraw(control: Path, trace_id: str) -> None:
    try:
        if TraceRequest.loads((control / REQUEST).read_text()).id == trace_id:
            (control / REQUEST).unlink()
    except (OSError, ValueError):
        pass


def _wait(directory: Path, ranks: tuple[int, ...], *, deadline: float) -> dict[int, TraceDone]:
    answers: dict[int, TraceDone] = {}
    while True:
        for r in ranks:
            if r not in answers:
                try:
                    answers[r] = TraceDone.loads((directory / done_name(r)).read_text())
                except (OSError, ValueError):
                    pass
        if len(answers) == len(ranks) or time.monotonic() > deadline:
            return answers
        time.sleep(0.2)


def _records(live: LiveRun, answers: dict[int, TraceDone], offsets: dict[int, int], *,
             deadline: float) -> dict[str, pd.DataFrame]:
    """meshscope's records of each rank's traced steps, from its spool past where it was at arming; waits
    (until ``deadline``, and a few seconds past it at most) for the last traced step's record, which the
    rank's flusher and spool writer write within a second of the step."""
    frames: dict[str, list[pd.DataFrame]] = {k: [] for k in RECORD_KINDS}
    wait_until = max(deadline, time.monotonic() + 5.0)
    for r, a in sorted(answers.items()):
        if not a.trace or a.steps < 1:
            continue
        while True:
            found = read_records(live.ranks[r].path, offsets[r], RECORD_KINDS)
            got = {k: _frame(v, r) for k, v in found.items()}
            step = got["step"]
            if (len(step) and a.last_step in set(step["step"])) or time.monotonic() > wait_until:
                break
            time.sleep(0.2)
        for k, df in got.items():
            if len(df):
                frames[k].append(df[(df["step"] >= a.first_step) & (df["step"] <= a.last_step)])
    out = {}
    for k, dfs in frames.items():
        out[k] = pd.concat(dfs, ignore_index=True) if dfs else pd.DataFrame(columns=["rank", "step", "t_start"])
    return {"steps": out["step"], "spans": out["span"], "collectives": out["collective"], "events": out["event"]}


def collected(store: str | Path, run: str) -> list[dict]:
    """The deep traces collected for ``run`` in ``store``, newest first: id, folder, merged.json (or None)
    and each rank's answer."""
    base = Path(StoreLayout.of(store).traces) / run
    out = []
    for d in sorted((p for p in base.iterdir() if p.is_dir()), reverse=True) if base.is_dir() else ():
        answers = {}
        for f in sorted(d.glob("rank*.done.json")):
            try:
                a = TraceDone.loads(f.read_text())
                answers[a.rank] = a
            except (OSError, ValueError):
                continue
        out.append({"id": d.name, "dir": d, "merged": d / MERGED if (d / MERGED).exists() else None,
                    "answers": answers})
    return out


# ----------------------------------------------------------------------------------------- CLI
def _report(result: Result) -> list[str]:
    where = result.out or result.store_dir
    lines = []
    for r in sorted(set(result.answers) | set(result.missing)):
        a = result.answers.get(r)
        if a is None:
            lines.append(f"  rank {r}: no answer")
        elif a.trace:
            lines.append(f"  rank {r}: steps {a.first_step}..{a.last_step} ({a.steps} step{'s' if a.steps != 1 else ''})"
                         f" -> {where / trace_name(r)}" + (f"  [{a.error}]" if a.error else ""))
        else:
            lines.append(f"  rank {r}: no trace: {a.error}")
    if (where / MERGED).exists():
        lines.append(f"  merged: {where / MERGED} (open in https://ui.perfetto.dev)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = ArgParser(prog=PROG, description="Trace N steps of a running job with torch.profiler on every chosen "
                                              "rank, with nothing restarted: one Kineto trace per rank and one "
                                              "merged Perfetto timeline with meshscope's own records.")
    parser.add_argument("--store", required=True, help="the store directory the job writes (--store of its ranks)")
    parser.add_argument("--run", required=True, help="the run's name")
    parser.add_argument("--steps", required=True, type=int, help="how many steps to trace (from the next step boundary)")
    parser.add_argument("--ranks", default=None, help="comma-separated ranks (default: every rank)")
    parser.add_argument("--out", default=None, help="also copy rank<k>.json and merged.json into this directory")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds to wait for every rank's trace (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")

    def body(args) -> int:
        echo = None if args.json else print
        # Reading and merging the traces takes a core for a second or two, on a node whose cores the job's
        # ranks may hold all of: the ranks come first (bench/deeptrace_cost.py, "collecting").
        os.nice(19)
        try:
            result = trace(args.store, run=args.run, steps=args.steps, ranks=args.ranks, out=args.out,
                           timeout_s=args.timeout, echo=echo)
        except OSError as exc:
            print(f"{PROG}: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(result.as_dict(), indent=2))
        else:
            head = "traced" if result.ok else "incomplete"
            print(f"{PROG}: {head}: run {result.run!r} trace {result.id}")
            print("\n".join(_report(result)))
        if not result.ok:
            short = [str(r) for r in result.missing] + [str(r) for r, a in result.answers.items()
                                                       if a.error or a.steps != result.steps]
            print(f"{PROG}: error: rank(s) {', '.join(short)} did not trace {result.steps} steps within "
                  f"{args.timeout:g} s", file=sys.stderr)
            return 1
        return 0

    return run_command(prog=PROG, parser=parser, argv=argv, body=body)


if __name__ == "__main__":
    sys.exit(main())
