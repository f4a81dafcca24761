"""A live synthetic job: ranks appending realistic records to their spools in real time, through the
transport's own writer (``agent.transport.writer.SpoolWriter``). For benchmarks of the live path
(``bench/scale_bucket.py``): ``make_template`` once, then ``LiveJob(...).tick(now)`` in a loop.

Records. ``tests.support.store``'s model (what ``bench/dashboard_pages.py`` uses): a Llama-8B-shaped
job, pp=4 x fsdp=world/4, 1F1B with 4 microbatches, FSDP units merged to 4 per step and direction, so per
rank and step 1 step record, 20 collectives (FSDP all-gathers and reduce-scatters, PP send/recv), 8 pipeline
spans and 1 memory record, with arrival skew, a slower straggler rank and per-step noise. It is written for
``template_steps`` steps into a scratch store; the job replays them cyclically: step k replays template
step k mod K with its step number and collective sequence numbers advanced and every time moved to where
step k falls on the wall clock. Time is scaled so that a step takes ``step_s`` (times and durations x s,
bandwidths and MFU / s): the same job on s-times slower hardware, still self-consistent.

Emission follows the rank side of a real job: a collective is submitted when its ``t_end`` has passed, a
step's spans, step and memory records when the step has ended (``Telemetry`` builds them then), and every
``flush_s`` each rank's writer encodes and appends what was submitted (``SpoolWriter.flush``: the same
frames as its own thread would write, called from this loop instead of one thread per rank, so that a
thousand ranks do not need a thousand threads). Every rank of a node writes under that node's store.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshscope.agent.store.reader import Store, read_table
from meshscope.agent.contract import SCHEMAS, TAGS, event_record, spool_path
from meshscope.agent.transport.writer import SpoolWriter
from tests.support.store import Straggler, SyntheticConfig, write_store

TIMES = ("t_start", "t_end", "t")
RATES = ("algbw", "busbw", "mfu")
STEP_KINDS = ("step", "collective", "span", "memory")  # replayed per step; "run" and "start" once


def template_config(*, run: str, world_size: int, steps: int, seed: int = 0) -> SyntheticConfig:
    if world_size % 4 or world_size < 8:
        raise ValueError(f"world size ({world_size}) must be a multiple of 4 and >= 8 (pp=4 x fsdp=world/4)")
    return SyntheticConfig(run=run, mesh={"pp": 4, "fsdp": world_size // 4}, steps=steps, model="llama-8b",
                           schedule="1F1B", microbatches=4, max_ops_per_group=4, seed=seed,
                           straggler=Straggler(rank=world_size // 3, factor=1.25, cause="compute"))


def make_template(root: str | Path, *, run: str, world_size: int, steps: int = 10, seed: int = 0) -> None:
    """The records of ``steps`` steps of every rank, as a store under ``root`` (read by ``LiveJob``)."""
    write_store(root, config=template_config(run=run, world_size=world_size, steps=steps, seed=seed))


@dataclass(slots=True)
class _Rows:
    """One kind's rows of one rank and template step: value lists in schema order, times relative to the
    step's start (already scaled)."""

    values: list[list] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)  # collectives: relative t_end, sorted (emission order)
    seq_step: list[int] = field(default_factory=list)  # collectives: seq advance per step of its group


@dataclass(slots=True)
class _Rank:
    writer: SpoolWriter
    steps: list[dict[str, _Rows]]  # per template step: kind -> rows
    run_row: list
    started: bool = False


class Schedule:
    """When each step of the replayed job starts and ends: the template's step times scaled to ``step_s``
    (every rank's step k takes the slowest rank's time, as in synchronous training), repeated."""

    def __init__(self, steps, *, step_s: float) -> None:
        if step_s <= 0:
            raise ValueError(f"step_s ({step_s}) must be > 0")
        walls = steps.groupby("step")["wall_s"].max().sort_index()
        self.t_step = steps.groupby("step")["t_start"].min().sort_index().to_dict()  # template time
        self.scale = step_s / float(walls.median())
        self.walls = (walls * self.scale).tolist()
        self.offsets = [0.0]
        for w in self.walls:
            self.offsets.append(self.offsets[-1] + w)
        self.cycle_s = self.offsets.pop()
        self.k = len(self.walls)
        self.t0 = 0.0

    @classmethod
    def of_template(cls, template: str | Path, *, run: str, step_s: float) -> Schedule:
        return cls(read_table(template, "step", run=run, columns=["step", "t_start", "wall_s"]), step_s=step_s)

    def step_start(self, k: int) -> float:
        return self.t0 + (k // self.k) * self.cycle_s + self.offsets[k % self.k]

    def step_end(self, k: int) -> float:
        return self.step_start(k) + self.walls[k % self.k]

    def step_at(self, t: float) -> int:
        """The step running at wall time ``t`` (0 before ``t0``)."""
        if t <= self.t0:
            return 0
        cycles, rest = divmod(t - self.t0, self.cycle_s)
        return int(cycles) * self.k + max(0, bisect.bisect_right(self.offsets, rest) - 1)


class LiveJob:
    """The ranks ``ranks`` of the template's run; ``store_of(rank)``: the store whose spool directory the
    rank writes to (its node's). ``begin(t0)`` puts step 0's start at ``t0`` (Unix seconds); then call
    ``tick(time.time())`` every ``flush_s``."""

    def __init__(self, template: str | Path, *, run: str, ranks: list[int], store_of: Callable[[int], Path],
                 step_s: float = 2.0, flush_s: float = 0.5, ranks_per_node: int = 8) -> None:
        if flush_s <= 0:
            raise ValueError(f"flush_s ({flush_s}) must be > 0")
        self.run, self.flush_s = run, flush_s
        store = Store.open(template)
        tables = {kind: read_table(store, kind, run=run, ranks=ranks) for kind in (*STEP_KINDS, "run")}
        self.schedule = sched = Schedule(tables["step"], step_s=step_s)
        self.ranks: dict[int, _Rank] = {}
        by_rank = {kind: dict(tuple(df.groupby("rank"))) for kind, df in tables.items()}
        for rank in ranks:
            steps: list[dict[str, _Rows]] = [{kind: _Rows() for kind in STEP_KINDS} for _ in range(sched.k)]
            for kind in STEP_KINDS:
                df = by_rank[kind].get(rank)
                if df is not None:
                    self._load(kind, df, steps, t_step=sched.t_step, scale=sched.scale)
            run_df = by_rank["run"][rank]
            run_row = [run_df.iloc[0][c] for c in SCHEMAS["run"].names]
            writer = SpoolWriter(path=spool_path(store_of(rank), run=run, rank=rank, attempt=0), run=run, rank=rank,
                                 attempt=0, host=f"node{rank // ranks_per_node:04d}", start=False)
            self.ranks[rank] = _Rank(writer, steps, run_row)
        self._last: float | None = None
        self.rows_written = 0
        self.max_tick_s = 0.0  # the longest tick: past flush_s, the ranks' records reach the spools late

    def begin(self, t0: float) -> None:
        self.schedule.t0 = self._last = t0

    def _load(self, kind: str, df, steps: list[dict[str, _Rows]], *, t_step: dict, scale: float) -> None:
        names = SCHEMAS[kind].names
        base = df["step"].map(t_step)
        df = df.copy()
        for c in names:
            if c in TIMES:
                df[c] = (df[c] - base) * scale
            elif c.endswith("_s"):
                df[c] = df[c] * scale
            elif c in RATES:
                df[c] = df[c] / scale
        if kind == "collective":
            df["_per_step"] = df.groupby(["step", "group"])["seq"].transform("size")
            df = df.sort_values(["step", "t_end"], kind="stable")
        for j, part in df.groupby("step"):
            rows = steps[int(j)][kind]
            rows.values = [list(v) for v in zip(*(part[c].tolist() for c in names))]
            if kind == "collective":
                rows.ends = part["t_end"].tolist()
                rows.seq_step = part["_per_step"].tolist()

    def tick(self, now: float) -> int:
        """Submit every record due in (last tick, now] and flush each rank's writer. Returns rows written."""
        if self._last is None:
            raise RuntimeError("LiveJob.tick before begin(t0)")
        sched, (last, self._last) = self.schedule, (self._last, now)
        if now <= sched.t0:
            return 0
        k_lo, k_hi = sched.step_at(last), sched.step_at(now)
        n = 0
        for rank, state in self.ranks.items():
            w = state.writer
            if not state.started:
                state.started = True
                run_row = list(state.run_row)
                run_row[SCHEMAS["run"].names.index("t_start")] = sched.t0
                w.submit("run", [(TAGS["run"], *run_row)])
                w.submit("event", [event_record(t=sched.t0, step=0, kind="start", message="synthetic run started")])
                n += 2
            for k in range(k_lo, k_hi + 1):
                n += self._submit_step(w, state, k, last=last, now=now)
            w.flush()
        self.rows_written += n
        self.max_tick_s = max(self.max_tick_s, time.time() - now)
        return n

    def _submit_step(self, w: SpoolWriter, state: _Rank, k: int, *, last: float, now: float) -> int:
        sched = self.schedule
        j, start, end = k % sched.k, sched.step_start(k), sched.step_end(k)
        if end <= last or start > now:
            return 0
        rows = state.steps[j]
        coll = rows["collective"]
        ended = end <= now
        lo = bisect.bisect_right(coll.ends, last - start)
        hi = len(coll.ends) if ended else bisect.bisect_right(coll.ends, now - start)
        n = 0
        if hi > lo:
            w.submit("collective", _shift("collective", coll, k=k, j=j, start=start, idx=range(lo, hi)))
            n += hi - lo
        if ended:
            for kind in ("span", "step", "memory"):
                r = rows[kind]
                if r.values:
                    w.submit(kind, _shift(kind, r, k=k, j=j, start=start, idx=range(len(r.values))))
                    n += len(r.values)
        return n

    def close(self, *, now: float | None = None) -> None:
        """An ``end`` event on every rank, then the writers' last flush."""
        now = time.time() if now is None else now
        step = max(0, self.schedule.step_at(now) - 1)
        for state in self.ranks.values():
            state.writer.submit("event", [event_record(t=now, step=step, kind="end",
                                                       message="synthetic run finished")])
            state.writer.close(timeout_s=2.0)


_IDX: dict[str, tuple[int, tuple[int, ...], int | None]] = {
    kind: (SCHEMAS[kind].names.index("step"), tuple(i for i, c in enumerate(SCHEMAS[kind].names) if c in TIMES),
           SCHEMAS[kind].names.index("seq") if "seq" in SCHEMAS[kind].names else None)
    for kind in STEP_KINDS}


def _shift(kind: str, rows: _Rows, *, k: int, j: int, start: float, idx: range) -> list[tuple]:
    """Tagged rows (``agent.contract`` layout) of template step ``j`` as step ``k`` starting at ``start``."""
    si, ti, qi = _IDX[kind]
    tag, out, cycles = TAGS[kind], [], k - j
    for i in idx:
        v = rows.values[i].copy()
        v[si] = k
        for t in ti:
            v[t] += start
        if qi is not None:
            v[qi] += cycles * rows.seq_step[i]
        out.append((tag, *v))
    return out
