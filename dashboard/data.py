"""Data access for the pages: DuckDB over the store's Parquet, filtered by run and step range, with the
aggregation pushed into SQL so that 1,024 ranks x 1,000 steps arrive as per-rank or per-step tables.

Shape of the cost: the store holds one small file per rank and kind, so at 1,024 ranks a scan is
dominated by opening 1,024 files (~0.2-0.3 s here), and the collective and span tables grow with
ranks x steps x ops. So each function reads a kind once (materialising the filtered rows when several
aggregates need them), and the heavy tables are read over a step window that fits ``ROW_BUDGET``
(``budget_window``; the pages say which steps they used). Decoding dominates once the files are open:
a file's columns are decoded whole whatever the step filter keeps (each file is one row group), about
0.1-0.2 s per column of the collective table at 1,024 ranks, so a function reads only the columns it
needs and a kind it can get elsewhere is not read at all (the Overview maps ranks to GPUs through the
runs table's ``rank_hosts`` rather than every rank's ``run`` file). Aggregating in SQL keeps the rows
that cross into pandas few (``collective_links``: a few hundred collective instances, not 200,000
records).

Every function takes the ``Store`` first and the rest keyword-only, returns DataFrames (or a dict of
them) and has no Streamlit in it; ``dashboard.ui`` caches them. ``steps`` is an inclusive (first, last)
step range or None for all steps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pandas as pd

from meshscope.agent.store.reader import SKIPPED, Store
from meshscope.agent.contract import SCHEMAS
from meshscope.dashboard.analysis import THROTTLE_MASK

_ALL = (-(2**62), 2**62)
# The collective and span tables grow with ranks x steps x ops. A page analyses the latest steps of the
# selected range that fit a budget (and says which), so its cost stays bounded:
ROW_BUDGET = 2_000_000  # records aggregated in SQL (spans)
RAW_BUDGET = 200_000  # raw records brought into pandas (collectives)
_META_COLS = ("world_size", "strategy", "mesh", "schedule", "microbatches", "virtual_stages", "model",
              "n_params", "n_params_nonembedding", "n_layers", "d_model", "seq_len", "global_batch",
              "flops_per_token", "peak_flops", "device", "dtype", "config",
              # how the FLOPs were found or why MFU is absent, where the writer says (newer run records)
              *(c for c in ("flops_method", "mfu_reason") if c in SCHEMAS["run"].names))


def _range(steps: tuple[int, int] | None) -> list[int]:
    lo, hi = steps or _ALL
    return [int(lo), int(hi)]


def budget_window(steps: tuple[int, int], *, rows_per_step: float | None, budget: int) -> tuple[int, int]:
    """The latest steps of ``steps`` whose records fit in ``budget`` (all of them when the rate is
    unknown)."""
    lo, hi = steps
    if not rows_per_step or rows_per_step <= 0:
        return lo, hi
    return max(lo, hi - max(1, int(budget // rows_per_step)) + 1), hi


def parse_mesh(text: str | None) -> dict[str, int]:
    """The ``mesh`` JSON of a run record as {dim: degree}; {} when absent or malformed."""
    try:
        mesh = json.loads(text or "{}")
        return {str(k): int(v) for k, v in mesh.items()} if isinstance(mesh, dict) else {}
    except (json.JSONDecodeError, TypeError, ValueError):
        return {}


def parse_config(text) -> dict:
    """The ``config`` JSON of a run record (the trainer's whole config: ``model``, ``faults``,
    ``telemetry``, ...) as a dict; {} when absent, malformed or not an object. A dict passes through."""
    if isinstance(text, dict):
        return text
    try:
        config = json.loads(text or "{}") if isinstance(text, str) else {}
    except (json.JSONDecodeError, TypeError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _skipped(target: pd.DataFrame, *sources: pd.DataFrame) -> pd.DataFrame:
    target.attrs[SKIPPED] = sorted({p for s in sources for p in s.attrs.get(SKIPPED, [])})
    return target


# ------------------------------------------------------------------------------------------ runs
def runs_table(store: Store) -> pd.DataFrame:
    """One row per run in the store: metadata from the ``run`` records (the latest attempt, lowest
    rank), ranks that reported, step range, collectives recorded per step (all ranks), start and end.
    Runs with no ``run`` records (partial) still appear, with empty metadata.

    ``rank_hosts``: each rank's host and local rank (latest attempt) as JSON, read with ``rank_hosts``:
    the GPU join of the Overview takes it from here (the app caches this table) instead of opening every
    rank's ``run`` file again."""
    names = store.runs()
    cols = ", ".join(f"first({c} ORDER BY attempt DESC, rank) AS {c}" for c in _META_COLS)
    meta, hosts, steps = store.query_all([
        (f"SELECT run, {cols}, count(DISTINCT rank) AS ranks_started, max(attempt) AS attempts, "
         "min(t_start) AS t_start FROM run GROUP BY run", None),
        ("""WITH r AS (SELECT run, rank, first(host ORDER BY attempt DESC) AS host,
                              first(local_rank ORDER BY attempt DESC) AS local_rank,
                              coalesce(first(try_cast(json_extract_string(coords, '$.pp') AS INTEGER)
                                             ORDER BY attempt DESC), 0) AS stage
                       FROM run GROUP BY run, rank)
            SELECT run, CAST(to_json({'rank': list(rank ORDER BY rank), 'host': list(host ORDER BY rank),
                                      'local_rank': list(local_rank ORDER BY rank),
                                      'stage': list(stage ORDER BY rank)}) AS VARCHAR) AS rank_hosts
            FROM r GROUP BY run""", None),
        ("SELECT run, min(step) AS first_step, max(step) AS last_step, count(DISTINCT step) AS steps, "
         "count(DISTINCT rank) AS ranks_stepping, max(t_end) AS t_end, "
         "sum(n_collectives) / count(DISTINCT step) AS collectives_per_step FROM step GROUP BY run", None),
    ], kinds=("run", "step"), runs=names,
        # The run kind is one row per rank and attempt: read it once for both statements.
        materialize={"run": ("true", [], ("run", "rank", "attempt", "t_start", "host", "local_rank", "coords",
                                          *_META_COLS))})
    out = (pd.DataFrame({"run": pd.Series(names, dtype=object)})
           .merge(meta, how="left", on="run").merge(steps, how="left", on="run")
           .merge(hosts, how="left", on="run"))
    out["t_start"] = out["t_start"].fillna(out["t_end"])
    out = out.sort_values("t_start", ascending=False, na_position="last").reset_index(drop=True)
    return _skipped(out, meta, steps)


def _rank_lists(text: str | None, columns: dict[str, str]) -> pd.DataFrame:
    """Columns of the ``rank_hosts`` JSON (``columns``: JSON key -> column name) as a frame; rows with
    an unknown value left out; empty when absent or unreadable."""
    try:
        d = json.loads(text) if isinstance(text, str) else {}
        t = pd.DataFrame({name: d.get(key, []) for key, name in columns.items()})
    except (json.JSONDecodeError, TypeError, ValueError):
        t = pd.DataFrame({name: [] for name in columns.values()})
    return t.dropna().reset_index(drop=True)


def rank_hosts(text: str | None) -> pd.DataFrame:
    """The ``rank_hosts`` JSON of a runs-table row as ``rank``, ``host``, ``local_rank`` (ranks whose
    host or local rank is unknown left out); empty when absent."""
    t = _rank_lists(text, {"rank": "rank", "host": "host", "local_rank": "local_rank"})
    return t.astype({"rank": "int32", "host": object, "local_rank": "int32"})


def rank_stages(text: str | None) -> pd.DataFrame:
    """The ``rank_hosts`` JSON of a runs-table row as ``rank``, ``peer_group`` (the rank's pipeline stage:
    the ranks that do the same work, the straggler rule's peers); empty when absent (all ranks peers)."""
    return _rank_lists(text, {"rank": "rank", "stage": "peer_group"}).astype({"rank": "int64", "peer_group": "int64"})


def events(store: Store, *, run: str, limit: int = 200) -> pd.DataFrame:
    """Timeline events other than start/end, newest first."""
    return store.query("SELECT t, rank, step, kind, message FROM event WHERE kind NOT IN ('start', 'end') "
                       "ORDER BY t DESC LIMIT ?", kinds=("event",), runs=[run], params=[limit])


def run_events(store: Store, *, runs: list[str]) -> pd.DataFrame:
    """The events of ``runs`` in one read, one row per (run, kind, rank): ``n`` (how many), ``step`` and
    ``message`` (its first by time), ``t`` (its first time); every attempt's events. The input of
    ``runs_clean.clean_runs`` (start and end included: a rank without an end did not finish)."""
    return store.query("SELECT run, kind, rank, count(*) AS n, arg_min(step, t) AS step, "
                       "arg_min(message, t) AS message, min(t) AS t FROM event "
                       "GROUP BY run, kind, rank ORDER BY run, kind, rank",
                       kinds=("event",), runs=runs)


def hang_rows(store: Store, *, run: str) -> dict[str, pd.DataFrame]:
    """The input of ``hang.analyse``: the run's hang records (``hangs``, the newest attempt's) and each
    rank's last step end (``last_steps``: rank, step, t_end)."""
    hangs, last = store.query_all(
        [("SELECT rank, t, step, since_s, phase, in_collective, op, \"where\", groups, stacks FROM hang ORDER BY t", None),
         ("SELECT rank, max(step) AS step, max(t_end) AS t_end FROM step GROUP BY rank ORDER BY rank", None)],
        kinds=("hang", "step"), runs=[run])
    return {"hangs": hangs, "last_steps": last}


def cpu_wait_steps(store: Store, *, runs: list[str], budget: int = RAW_BUDGET) -> pd.DataFrame:
    """Per run of ``runs``, rank and step: ``wall_s``, ``compute_s``, ``other_s``, ``cpu_s``, ``cpu_wait_s``
    (``environment.run_queue_share``'s input), for each run's latest steps whose rows fit an equal share of
    ``budget``: ``rank_steps``' rows for many runs in one read."""
    share = max(1, int(budget) // max(len(runs), 1))
    return store.query(
        """WITH w AS (SELECT run, max(step) AS hi, greatest(1, count(DISTINCT rank)) AS n FROM step GROUP BY run)
           SELECT s.run, s.rank, s.step, s.wall_s, s.compute_s, s.other_s, s.cpu_s, s.cpu_wait_s FROM step s
           JOIN w ON s.run = w.run WHERE s.step > w.hi - greatest(1, ? // w.n) ORDER BY s.run, s.step, s.rank""",
        kinds=("step",), runs=runs, params=[share])


# ------------------------------------------------------------------------------------ overview
def overview_data(store: Store, *, run: str, runs: list[str], steps: tuple[int, int] | None,
                  max_ranks: int = 128, max_steps: int = 200, budget: int = RAW_BUDGET) -> dict[str, pd.DataFrame]:
    """Everything the Overview takes from the step records, in one read of them:

    - ``series``: per run (all ``runs``) and step: ``step_time_s`` (max wall over ranks), ``tokens_mean``
      (mean replica tokens), ``mfu`` (mean per-rank MFU), ``loss`` (mean of finite losses), ``ranks``,
      ``loss_nonfinite`` (ranks whose loss was NaN or infinite) and ``loss_nan`` (of them, NaN).
    - ``breakdown``: per rank of ``run``: mean wall / compute / exposed comm / bubble / other seconds.
    - ``heatmap``: compute seconds on a grid of at most max_ranks x max_steps cells (mean over a cell's
      steps, then max over its ranks, so a slow rank is not averaged away); ``rank_bin``/``step_bin``
      are a cell's first rank/step, ``rank_width``/``step_width`` its size.
    - ``rank_steps``: ``rank_steps`` (the same statement): the input of ``stragglers.rank_step_verdicts``,
      ``environment.cpu_wait_share``, the steady breakdown and ``analysis.step_time``.
    - ``window``: the step range's first start and last end time (for the GPU join)."""
    r = _range(steps)
    focus = "run = $run"
    frames = store.query_all([
        ("SELECT run, step, max(wall_s) AS step_time_s, avg(tokens) AS tokens_mean, avg(mfu) AS mfu, "
         "avg(loss) FILTER (WHERE loss IS NOT NULL AND NOT isnan(loss) AND NOT isinf(loss)) AS loss, "
         "count(*) AS ranks, count(*) FILTER (WHERE loss_nonfinite) AS loss_nonfinite, "
         "count(*) FILTER (WHERE loss_nonfinite AND isnan(loss)) AS loss_nan "
         "FROM step GROUP BY run, step ORDER BY run, step", None),
        (f"SELECT rank, avg(wall_s) AS wall_s, avg(compute_s) AS compute_s, avg(exposed_comm_s) AS exposed_comm_s, "
         f"avg(bubble_s) AS bubble_s, avg(other_s) AS other_s, count(*) AS steps FROM step WHERE {focus} "
         f"GROUP BY rank ORDER BY rank", {"run": run}),
        (f"""WITH s AS (SELECT rank, step, compute_s FROM step WHERE {focus}),
           b AS (SELECT greatest(1, ceil((max(rank) + 1) / $mr))::BIGINT AS rw, min(step) AS s0,
                        greatest(1, ceil((max(step) - min(step) + 1) / $ms))::BIGINT AS sw FROM s),
           c AS (SELECT rank // b.rw AS rbin, (step - b.s0) // b.sw AS sbin, avg(compute_s) AS v
                 FROM s, b WHERE b.sw > 1 GROUP BY rbin, rank, sbin
                 -- a one-step cell's mean is its one row (a rank has one row per step): skipping that
                 -- grouping (ranks x steps groups, 3.3 M at 16,384 ranks) saves most of the query
                 UNION ALL SELECT rank // b.rw, step - b.s0, compute_s FROM s, b WHERE b.sw = 1)
        SELECT rbin * b.rw AS rank_bin, sbin * b.sw + b.s0 AS step_bin, max(v) AS compute_s,
               any_value(b.rw) AS rank_width, any_value(b.sw) AS step_width
        FROM c, b GROUP BY ALL ORDER BY rank_bin, step_bin""", {"run": run, "mr": max_ranks, "ms": max_steps}),
        (_RANK_STEPS, {"run": run, "budget": budget}),
        (f"SELECT min(t_start) AS t_start, max(t_end) AS t_end FROM step WHERE {focus}", {"run": run}),
    ], kinds=("step",), runs=runs, materialize={"step": ("step BETWEEN ? AND ?", r, _OVERVIEW_COLS)})
    return dict(zip(("series", "breakdown", "heatmap", "rank_steps", "window"), frames))


_OVERVIEW_COLS = ("run", "rank", "step", "t_start", "t_end", "wall_s", "compute_s", "exposed_comm_s", "bubble_s",
                  "other_s", "tokens", "mfu", "loss", "loss_nonfinite", "cpu_s", "cpu_wait_s")
# Per rank and step of ``$run``, for the latest steps whose rows fit ``$budget``: one statement, read by the
# Overview (``overview_data``) and the Communication page (``rank_steps``), so both state the same figures.
_RANK_STEPS = """WITH w AS (SELECT max(step) AS hi, greatest(1, count(DISTINCT rank)) AS n FROM step WHERE run = $run)
    SELECT rank, step, wall_s, compute_s, exposed_comm_s, bubble_s, other_s, cpu_s, cpu_wait_s FROM step, w
    WHERE run = $run AND step > w.hi - greatest(1, $budget // w.n) ORDER BY step, rank"""


def rank_steps(store: Store, *, run: str, steps: tuple[int, int] | None, budget: int = RAW_BUDGET) -> pd.DataFrame:
    """Per rank and step of ``run``: ``wall_s``, ``compute_s``, ``exposed_comm_s``, ``bubble_s``, ``other_s``,
    ``cpu_s``, ``cpu_wait_s``, for the latest steps of the range whose rows fit ``budget``: the rows
    ``overview_data``'s ``rank_steps`` holds, read alone (the Communication page)."""
    return store.query_all([(_RANK_STEPS, {"run": run, "budget": budget})], kinds=("step",), runs=[run],
                           materialize={"step": ("step BETWEEN ? AND ?", _range(steps), _OVERVIEW_COLS)})[0]


def attempts(store: Store, *, run: str) -> pd.DataFrame:
    """Per attempt of ``run`` (a torchrun restart, or a launch ``meshscope run --new-attempt`` recorded as
    the next attempt): ``attempt`` (as stored, 0 first), ``ranks``, ``rank_steps``, ``first_step`` and
    ``last_step`` of the step rows it wrote, every attempt's rows read (not only the newest attempt's, as
    the other readers do). A step row belongs to the attempt of its rank's latest run record that
    started before the step ended."""
    return store.query(
        """SELECT r.attempt, count(DISTINCT s.rank) AS ranks, count(*) AS rank_steps, min(s.step) AS first_step,
                  max(s.step) AS last_step
           FROM step s ASOF JOIN run r ON s.rank = r.rank AND s.t_end >= r.t_start
           GROUP BY r.attempt ORDER BY r.attempt""", kinds=("step", "run"), runs=[run], all_attempts=True)


def collective_counts(store: Store, *, run: str, steps: tuple[int, int] | None = None) -> pd.DataFrame:
    """Per op and dim (its kind, ``dim``, and the job's own name, ``mesh_dim``: "" in records from before
    it): ``ops_per_rank_step`` (ops over the rank-steps that recorded any op in ``steps``), ``bytes_per_op``
    (mean) and ``exposed_s_per_rank_step``. What a job's structure predicts (FSDP2: an all-gather per
    module per forward, ...) is checked against this."""
    return store.query(
        """WITH c AS (SELECT * FROM collective WHERE step BETWEEN ? AND ?),
                n AS (SELECT count(*) AS rank_steps FROM (SELECT DISTINCT rank, step FROM c))
           SELECT op, dim, coalesce(mesh_dim, '') AS mesh_dim, count(*) / any_value(n.rank_steps) AS ops_per_rank_step,
                  avg(bytes) AS bytes_per_op, sum(wait_s) / any_value(n.rank_steps) AS exposed_s_per_rank_step
           FROM c, n GROUP BY op, dim, coalesce(mesh_dim, '') ORDER BY op, dim, mesh_dim""",
        kinds=("collective",), runs=[run], params=_range(steps))


def gpu_by_device(store: Store, *, run: str, window: tuple[float, float] | None) -> pd.DataFrame:
    """``gpu_by_rank`` before the join: per ``host`` and ``gpu`` (index), from the GPU samples only (a few
    files per host rather than one ``run`` file per rank). Join with ``runs_table``'s ``rank_hosts``
    through ``analysis.gpu_ranks``."""
    a, b = window or (-1e300, 1e300)
    return store.query(
        f"""SELECT host, gpu, avg(sm_clock_hz / nullif(sm_clock_max_hz, 0)) AS clock_ratio,
                   avg(CASE WHEN (throttle_reasons & {THROTTLE_MASK}) != 0 THEN 1.0 ELSE 0.0 END) AS throttle_share,
                   bit_or(throttle_reasons & {THROTTLE_MASK}) AS reasons
            FROM gpu WHERE t BETWEEN ? AND ? GROUP BY host, gpu ORDER BY host, gpu""",
        kinds=("gpu",), runs=[run], params=[float(a), float(b)])


def gpu_by_rank(store: Store, *, run: str, window: tuple[float, float] | None) -> pd.DataFrame:
    """Per rank (joined on host and GPU index = local rank, samples within ``window`` seconds):
    ``clock_ratio`` (mean SM clock / max clock), ``throttle_share`` (samples with a slowdown reason),
    ``reasons`` (OR of slowdown bits)."""
    a, b = window or (-1e300, 1e300)
    return store.query(
        f"""WITH r AS (SELECT rank, first(host ORDER BY attempt DESC) AS host,
                     first(local_rank ORDER BY attempt DESC) AS local_rank FROM run GROUP BY rank),
        g AS (SELECT host, gpu, avg(sm_clock_hz / nullif(sm_clock_max_hz, 0)) AS clock_ratio,
                     avg(CASE WHEN (throttle_reasons & {THROTTLE_MASK}) != 0 THEN 1.0 ELSE 0.0 END) AS throttle_share,
                     bit_or(throttle_reasons & {THROTTLE_MASK}) AS reasons
              FROM gpu WHERE t BETWEEN ? AND ? GROUP BY host, gpu)
        SELECT r.rank, g.clock_ratio, g.throttle_share, g.reasons FROM r JOIN g
          ON r.host = g.host AND r.local_rank = g.gpu ORDER BY r.rank""",
        kinds=("run", "gpu"), runs=[run], params=[float(a), float(b)])


# ------------------------------------------------------------------------------- communication
def collective_rows(store: Store, *, run: str, steps: tuple[int, int] | None) -> pd.DataFrame:
    """Raw collective and P2P rows of a step window, for time per op, arrival skew and network-side
    busbw (``analysis.comm_summary``, ``arrival_skew``, ``collective_instances``). At 1,024 ranks
    reading the columns costs about the same for 10 steps as for all (each rank's file is read whole),
    so one read serves the whole Communication page; pass a window that fits ``RAW_BUDGET`` rows."""
    return store.query(
        "SELECT rank, step, op, dim, \"group\", group_size, bytes, seq, t_start, t_end, duration_s, wait_s, peer, "
        "coalesce(mesh_dim, '') AS mesh_dim FROM collective WHERE step BETWEEN ? AND ?", kinds=("collective",), runs=[run], params=_range(steps))


_INSTANCES = ('SELECT "group", seq, any_value(op) AS op, any_value(dim) AS dim, max(group_size) AS group_size, '
              'max(bytes) AS bytes, count(*) AS members, max(t_start) AS t_last, min(t_end) AS t_end '
              'FROM collective GROUP BY "group", seq ORDER BY "group", seq')
_MEMBERS = 'SELECT rank, dim, "group" FROM collective GROUP BY ALL ORDER BY ALL'


def collective_links(store: Store, *, run: str, steps: tuple[int, int] | None) -> dict[str, pd.DataFrame]:
    """What ``analysis.link_ratios`` needs, aggregated in SQL from one read of the collective records of
    a step window (P2P left out), so a few hundred instances cross into pandas instead of every record:

    - ``instances``: per (group, seq): ``group``, ``seq``, ``op``, ``dim``, ``group_size`` and ``bytes``
      (max over members), ``members``, ``t_last`` (latest start), ``t_end`` (earliest end); add the bus
      bandwidth with ``analysis.instance_busbw``. Same rows as ``analysis.collective_instances`` on
      ``collective_rows`` of the window.
    - ``members``: distinct (``rank``, ``dim``, ``group``), ordered by them. The order matters only
      where two groups of a rank have exactly the same ratio: ``link_ratios`` then names the first (on the
      raw rows, the first in the rank's records). Keeping the records' order would cost ~0.2-0.4 s of
      the ~1.5 s read at 1,024 ranks, for a tie between floating-point medians."""
    instances, members = store.query_all(
        [(_INSTANCES, None), (_MEMBERS, None)], kinds=("collective",), runs=[run],
        materialize={"collective": ("step BETWEEN ? AND ? AND peer < 0", _range(steps),
                                    ("rank", "op", "dim", "group", "group_size", "bytes", "seq", "t_start", "t_end"))})
    return {"instances": instances, "members": _skipped(members, instances)}


# ------------------------------------------------------------------------------------ pipeline
REPLAY_STEPS = 20  # the latest steps of the window whose spans the Pipeline page replays (pipeline_sim.replay)


def pipeline_data(store: Store, *, run: str, steps: tuple[int, int] | None,
                  gantt_step: int | None) -> dict[str, pd.DataFrame]:
    """Spans and step windows, each kind read once, for the Pipeline page:

    - ``bubble``: per step and stage, ``analysis.measured_bubble`` over the pipeline's extent (the first
      span start to the last span end of the step, all ranks: the window the theory describes; the
      optimizer and work before the schedule, like FSDP's first all-gather, are outside it), averaged over
      the stage's ranks: ``bubble``, ``imbalance``, ``schedule_bubble``, ``busy_s``, ``window_s``. Stage is
      the rank's lowest stage (its position in the pipeline, also under interleaving).
    - ``replay_spans``: every span of the latest ``REPLAY_STEPS`` steps of the range, for the replay.
    - ``spans`` / ``windows`` / ``p2p``: the spans of ``gantt_step`` for one representative rank per
      pipeline position (the lowest rank), those ranks' step records (``t_start``, ``t_end``, ``wall_s``)
      and their P2P records (``rank``, ``op``, ``peer``, ``t_start``, ``t_end``, ``wait_s``)."""
    lo, hi = _range(steps)
    g = -1 if gantt_step is None else int(gantt_step)
    keep = ("(step BETWEEN ? AND ? OR step = ?)", [lo, hi, g])
    bubble, replay_spans, spans, windows, p2p = store.query_all([
        ("""WITH s AS (SELECT rank, step, min(stage) AS stage, sum(t_end - t_start) AS busy,
                             min(t_start) AS a, max(t_end) AS b
                      FROM span WHERE step BETWEEN $lo AND $hi GROUP BY rank, step),
           e AS (SELECT step, max(b) - min(a) AS extent, max(busy) AS max_busy FROM s GROUP BY step)
        SELECT s.step, s.stage, avg(1 - s.busy / e.extent) AS bubble,
               avg((e.max_busy - s.busy) / e.extent) AS imbalance, any_value(1 - e.max_busy / e.extent) AS schedule_bubble,
               avg(s.busy) AS busy_s, any_value(e.extent) AS window_s, count(*) AS ranks
        FROM s JOIN e USING (step) WHERE e.extent > 0
        GROUP BY s.step, s.stage ORDER BY s.step, s.stage""", {"lo": lo, "hi": hi}),
        ("""SELECT step, rank, stage, microbatch, kind, t_start, t_end FROM span
            WHERE step BETWEEN greatest($lo, $hi - $n + 1) AND $hi ORDER BY step, rank, t_start""",
         {"lo": lo, "hi": hi, "n": REPLAY_STEPS}),
        ("""WITH pos AS (SELECT rank, min(stage) AS pos FROM span WHERE step = $g GROUP BY rank),
               rep AS (SELECT min(rank) AS rank FROM pos GROUP BY pos)
            SELECT step, rank, stage, microbatch, kind, t_start, t_end FROM span
            WHERE step = $g AND rank IN (SELECT rank FROM rep) ORDER BY rank, t_start""", {"g": g}),
        ("SELECT rank, step, t_start, t_end, wall_s FROM step WHERE step = $g ORDER BY rank", {"g": g}),
        ("SELECT rank, op, peer, t_start, t_end, wait_s FROM collective WHERE step = $g AND op IN ('send', 'recv') "
         "ORDER BY rank, t_start", {"g": g}),
    ], kinds=("span", "step", "collective"), runs=[run],
        materialize={"step": (*keep, ("rank", "step", "t_start", "t_end", "wall_s")),
                     "span": (*keep, ("rank", "step", "stage", "microbatch", "kind", "t_start", "t_end"))})
    shown = spans["rank"].unique()
    windows = windows[windows["rank"].isin(shown)].reset_index(drop=True)
    p2p = p2p[p2p["rank"].isin(shown)].reset_index(drop=True)
    return {"bubble": bubble, "replay_spans": replay_spans, "spans": spans, "windows": _skipped(windows, bubble),
            "p2p": p2p}


# -------------------------------------------------------------------------------------- memory
def memory_data(store: Store, *, run: str, steps: tuple[int, int] | None) -> dict[str, pd.DataFrame]:
    """``per_rank``: current (latest sample) and peak allocated / reserved / RSS bytes, device capacity
    (NULL for CPU), alloc retries and OOMs, the bytes of parameters, gradients and optimizer state measured
    from the tensors (-1 or NULL where not measured); ``per_step``: max and median over ranks of the peaks."""
    per_rank, per_step = store.query_all([
        ("SELECT rank, arg_max(allocated_bytes, t) AS allocated, max(allocated_peak_bytes) AS allocated_peak, "
         "arg_max(reserved_bytes, t) AS reserved, max(reserved_peak_bytes) AS reserved_peak, "
         "arg_max(rss_bytes, t) AS rss, max(rss_peak_bytes) AS rss_peak, "
         "max(CASE WHEN device_total_bytes > 0 THEN device_total_bytes END) AS capacity, "
         "max(alloc_retries) AS alloc_retries, max(ooms) AS ooms, max(param_bytes) AS param_bytes, "
         "max(grad_bytes) AS grad_bytes, max(optimizer_bytes) AS optimizer_bytes "
         "FROM memory GROUP BY rank ORDER BY rank", None),
        ("SELECT step, max(allocated_peak_bytes) AS allocated_peak_max, median(allocated_peak_bytes) AS "
         "allocated_peak_median, max(rss_peak_bytes) AS rss_peak_max, median(rss_peak_bytes) AS rss_peak_median "
         "FROM memory GROUP BY step ORDER BY step", None),
    ], kinds=("memory",), runs=[run], materialize={"memory": ("step BETWEEN ? AND ?", _range(steps), _MEMORY_COLS)})
    return {"per_rank": per_rank, "per_step": per_step}


_MEMORY_COLS = ("rank", "step", "t", "allocated_bytes", "allocated_peak_bytes", "reserved_bytes", "reserved_peak_bytes",
                "rss_bytes", "rss_peak_bytes", "device_total_bytes", "alloc_retries", "ooms", "param_bytes", "grad_bytes",
                "optimizer_bytes")


# ----------------------------------------------------------------------------------------- gpu
def gpu_data(store: Store, *, run: str, bins: int = 120, lowest: int = 64,
             gpus: Sequence[str] = ()) -> dict[str, pd.DataFrame]:
    """``summary`` per GPU: samples, mean utilisation / power, max temperature, mean and min SM clock
    ratio, share of samples throttled, reason bits, memory, XID / ECC error counts. ``series`` per GPU
    and time bin (``bins`` over the run): mean utilisation, power, temperature, clock ratio; ``t`` is
    the bin's first sample (epoch seconds); for the ``lowest`` GPUs by the summary's ``clock_order``
    (mean clock ratio, ties by host and GPU) and the ``gpus`` named "host:gpu". Every GPU's series would be 2 M rows at
    16,384 GPUs, more than a page can draw or a reader can see."""
    # One per-GPU table, numbered by clock ratio, for both results: the series' GPUs are then exactly the
    # summary's lowest by ``clock_order`` (two aggregations could order ties and float sums differently).
    _, summary, series = store.query_all([
        (f"CREATE TEMP TABLE g AS SELECT *, row_number() OVER (ORDER BY clock_ratio NULLS LAST, host, gpu) "
         f"AS clock_order FROM (SELECT host, gpu, any_value(name) AS name, count(*) AS samples, "
         f"avg(util_ratio) AS util, avg(power_watts) AS power_w, max(temperature_celsius) AS temp_max_c, "
         f"avg(sm_clock_hz / nullif(sm_clock_max_hz, 0)) AS clock_ratio, "
         f"min(sm_clock_hz / nullif(sm_clock_max_hz, 0)) AS clock_ratio_min, "
         f"avg(CASE WHEN (throttle_reasons & {THROTTLE_MASK}) != 0 THEN 1.0 ELSE 0.0 END) AS throttle_share, "
         f"bit_or(throttle_reasons & {THROTTLE_MASK}) AS reasons, max(mem_used_bytes) AS mem_used_max, "
         f"max(mem_total_bytes) AS mem_total, max(xid_errors_total) - min(xid_errors_total) AS xid_errors, "
         f"max(ecc_errors_total) - min(ecc_errors_total) AS ecc_errors FROM gpu GROUP BY host, gpu)", None),
        ("SELECT * FROM g ORDER BY host, gpu", None),
        ("WITH w AS (SELECT min(t) AS a, greatest(max(t) - min(t), 1e-9) AS span FROM gpu), "
         "k AS (SELECT host, gpu FROM g WHERE clock_order <= ? "
         "OR list_contains(CAST(? AS VARCHAR[]), host || ':' || gpu)) "
         "SELECT host || ':' || gpu AS gpu, least(floor((t - w.a) / w.span * ?), ? - 1) AS bin, "
         "min(t) AS t, avg(util_ratio) AS util, avg(power_watts) AS power_w, avg(temperature_celsius) AS temp_c, "
         "avg(sm_clock_hz / nullif(sm_clock_max_hz, 0)) AS clock_ratio FROM gpu JOIN k USING (host, gpu), w "
         "GROUP BY ALL ORDER BY gpu, bin", [lowest, list(gpus), bins, bins]),
    ], kinds=("gpu",), runs=[run], materialize={"gpu": ("true", [], _GPU_COLS)})
    return {"summary": summary, "series": series}


_GPU_COLS = tuple(f.name for f in SCHEMAS["gpu"] if f.name not in ("uuid", "mem_util_ratio"))  # the columns used


# ------------------------------------------------------------------------------------- scaling
def run_summaries(store: Store, *, runs: list[str]) -> pd.DataFrame:
    """Per run: median step time (max wall over ranks, median over steps: robust to warm-up), mean
    replica tokens per step, mean MFU, and the exposed-communication fraction sum(exposed) / sum(wall)
    over ranks and steps. Join with ``runs_table`` for the metadata."""
    return store.query(
        "WITH s AS (SELECT run, step, max(wall_s) AS t, avg(tokens) AS tok, avg(mfu) AS mfu, "
        "sum(exposed_comm_s) AS exposed, sum(wall_s) AS wall FROM step GROUP BY run, step) "
        "SELECT run, median(t) AS step_time_s, avg(tok) AS tokens_mean, avg(mfu) AS mfu, count(*) AS steps_used, "
        "sum(exposed) / nullif(sum(wall), 0) AS comm_fraction FROM s GROUP BY run",
        kinds=("step",), runs=runs)


# -------------------------------------------------------------------------------------- planner
PLANNER_STEPS = 50  # the latest steps of a run the planner calibrates from (its steady state)
_PLANNER_STEP_COLS = ("rank", "step", "wall_s", "compute_s", "exposed_comm_s", "bubble_s", "other_s", "forward_s",
                      "backward_s", "optimizer_s", "data_s", "flops", "tokens", "cpu_wait_s")


def planner_data(store: Store, *, run: str, last_steps: int = PLANNER_STEPS) -> dict[str, pd.DataFrame]:
    """What the planner calibrates from (``dashboard.planner.calibration``), over the run's latest ``last_steps``
    steps (the calibration leaves the warm-up out itself):

    - ``steps``: per rank and step, the step record's times, ``flops`` and ``tokens``;
    - ``instances``: per collective instance (group, sequence number): ``step``, ``op``, ``dim``,
      ``group_size``, ``source``, ``bytes``, ``duration_s`` (the least over its ranks: the rank that
      arrived last waited for the transfer only, not for its peers) and ``ranks``;
    - ``comm``: per rank, step, dimension and op: ``n``, ``bytes``, ``duration_s``, ``wait_s`` (sums);
    - ``spans``: the pipeline spans (``step``, ``rank``, ``stage``, ``microbatch``, ``kind``, ``t_start``,
      ``t_end``) of the latest ``REPLAY_STEPS`` steps;
    - ``memory``: per rank, the peaks: ``rss_peak_bytes``, ``allocated_peak_bytes`` (-1 on CPU),
      ``device_total_bytes``."""
    steps, instances, comm, spans, memory = store.query_all([
        (f"""WITH w AS (SELECT max(step) AS hi FROM step)
            SELECT {', '.join(_PLANNER_STEP_COLS)} FROM step, w WHERE step > w.hi - $n ORDER BY step, rank""",
         {"n": last_steps}),
        ("""WITH w AS (SELECT max(step) AS hi FROM collective)
            SELECT any_value(step) AS step, any_value(op) AS op, any_value(dim) AS dim, max(group_size) AS group_size,
                   any_value(source) AS source, max(bytes) AS bytes, min(duration_s) AS duration_s, count(*) AS ranks
            FROM collective, w WHERE step > w.hi - $n AND op NOT IN ('send', 'recv')
            GROUP BY "group", seq, source ORDER BY step""", {"n": last_steps}),
        ("""WITH w AS (SELECT max(step) AS hi FROM collective)
            SELECT rank, step, dim, op, count(*) AS n, sum(bytes) AS bytes, sum(duration_s) AS duration_s,
                   sum(wait_s) AS wait_s
            FROM collective, w WHERE step > w.hi - $n GROUP BY ALL ORDER BY ALL""", {"n": last_steps}),
        (f"""WITH w AS (SELECT max(step) AS hi FROM span)
            SELECT step, rank, stage, microbatch, kind, t_start, t_end FROM span, w
            WHERE step > w.hi - {REPLAY_STEPS} ORDER BY step, rank, t_start""", None),
        ("SELECT rank, max(rss_peak_bytes) AS rss_peak_bytes, max(allocated_peak_bytes) AS allocated_peak_bytes, "
         "max(device_total_bytes) AS device_total_bytes FROM memory GROUP BY rank ORDER BY rank", None),
    ], kinds=("step", "collective", "span", "memory"), runs=[run])
    return {"steps": steps, "instances": instances, "comm": comm, "spans": spans, "memory": memory}


# ------------------------------------------------------------------------------------- compare
def diff_data(store: Store, *, run: str) -> dict[str, pd.DataFrame]:
    """What ``dashboard.diff`` compares of ``run``: its rank-steps (the step parts, ``optimizer_s`` and
    ``tokens`` too), the exposed wait per step, op and dim summed over ranks (``wait_s`` of the collective
    records), its run record (the latest attempt's, lowest rank: versions and config included) and its
    peak memory per rank (the largest of the allocator's peak and the RSS peak)."""
    steps, exposed, record, memory = store.query_all([
        ("SELECT rank, step, wall_s, compute_s, exposed_comm_s, bubble_s, other_s, optimizer_s, tokens, mfu "
         "FROM step ORDER BY step, rank", None),
        ("SELECT step, op, dim, coalesce(mesh_dim, '') AS mesh_dim, sum(wait_s) AS wait_s FROM collective "
         "WHERE wait_s = wait_s GROUP BY ALL ORDER BY ALL", None),
        ("SELECT * EXCLUDE (run) FROM run ORDER BY attempt DESC, rank LIMIT 1", None),
        ("SELECT rank, max(greatest(allocated_peak_bytes, rss_peak_bytes)) AS peak_bytes FROM memory "
         "GROUP BY rank ORDER BY rank", None),
    ], kinds=("step", "collective", "run", "memory"), runs=[run])
    return {"rank_steps": steps, "exposed": exposed, "record": record, "memory": memory}
