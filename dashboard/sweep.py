"""``meshscope sweep``: one model over a grid of world sizes, strategies and microbatch counts, every run
recorded in the store so that the dashboard's Scaling page can show strong- and weak-scaling efficiency.

Strong scaling keeps the global batch fixed (``--batch-size``); weak scaling keeps the work per device
fixed (global batch = ``--batch-size`` × world size). Each grid point is a real ``torchrun`` job of the
reference trainer; the defaults finish in a few minutes on a 2-core CPU machine. The table printed at the end
is the Scaling page's (``report``: the same loads and ``dashboard.scaling``'s families, baselines and fits).

    meshscope sweep --store runs [--model tiny] [--world-sizes 1,2,4] [--strategies ddp,fsdp,tp,pp]
                    [--microbatches 4] [--scaling strong,weak] [--steps 8] [--batch-size 8] [--name NAME]
                    [--include-unclean]

The families take clean runs only (``dashboard.runs_clean``: no injected fault, no crash, hang or restart,
finished); the others are listed with why, and ``--include-unclean`` puts them back in.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from meshscope.agent.cliargs import ArgParser
from meshscope.agent.contract import check_run_name
from meshscope.agent.contract.layout import FLAVORS
from meshscope.dashboard.config import ConfigError

STRATEGY_ARGS = {
    "ddp": lambda n: [],
    "fsdp": lambda n: ["--fsdp"],
    "tp": lambda n: ["--tp", str(n)],
    "pp": lambda n: ["--pp", str(n)],
    "fsdp-tp": lambda n: ["--fsdp", "--tp", "2"],
}


@dataclass(frozen=True, kw_only=True)
class Point:
    scaling: str
    strategy: str
    world: int
    microbatches: int
    batch: int

    def run_name(self, prefix: str) -> str:
        mb = f"-m{self.microbatches}" if self.strategy == "pp" else ""
        return f"{prefix}-{self.scaling}-{self.strategy}-w{self.world}{mb}"

    def args(self) -> list[str]:
        extra = STRATEGY_ARGS[self.strategy](self.world) if self.world > 1 else []
        if self.strategy == "pp" and self.world > 1:
            extra += ["--microbatches", str(self.microbatches)]
        return ["--batch-size", str(self.batch), *extra]


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{what} {text!r} must be comma-separated integers") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{what} {text!r} must be positive integers")
    return values


def grid(*, world_sizes: list[int], strategies: list[str], microbatches: list[int], scalings: list[str],
         batch: int, model: str) -> list[Point]:
    """The valid grid points (a strategy that cannot run at a world size is skipped, e.g. tp=4 when the
    model has 2 heads); world size 1 is the shared baseline of every strategy."""
    flavor = FLAVORS[model]
    # One world-size-1 run is the baseline of both studies (at n = 1 strong and weak coincide).
    points: list[Point] = [Point(scaling="base", strategy="single", world=1, microbatches=1, batch=batch)]
    for scaling in scalings:
        for strategy in strategies:
            for world in world_sizes:
                if world == 1:
                    continue
                if strategy == "tp" and flavor.n_heads % world:
                    continue
                if strategy == "pp" and flavor.n_layers % world:
                    continue
                if strategy == "fsdp-tp" and (world % 2 or world < 4):
                    continue
                dp = {"tp": 1, "pp": 1, "fsdp-tp": world // 2}.get(strategy, world)
                b = batch * world if scaling == "weak" else batch  # weak: fixed work per device
                for m in (microbatches if strategy == "pp" else [1]):
                    if strategy == "pp" and (b % m or m < world):
                        continue
                    if b % dp:
                        continue
                    points.append(Point(scaling=scaling, strategy=strategy, world=world, microbatches=m, batch=b))
    return points


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="meshscope sweep", description=(
        "Run one model over a grid of world sizes, strategies and microbatch counts, every run recorded in the "
        "store for the dashboard's Scaling page (strong- and weak-scaling efficiency)."))
    p.add_argument("--store", required=True, help="run store directory (created if missing)")
    p.add_argument("--model", default="tiny", help=f"model flavor: {', '.join(FLAVORS)}")
    p.add_argument("--world-sizes", default="1,2,4")
    p.add_argument("--strategies", default="ddp,fsdp,tp,pp")
    p.add_argument("--microbatches", default="4")
    p.add_argument("--scaling", default="strong,weak")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (strong) / batch per device (weak)")
    p.add_argument("--name", default="", help="run-name prefix (default sweep-<time>)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--include-unclean", action="store_true",
                   help="build the families from every run, not only the clean ones (the others are marked)")
    return p


def _validate(ns) -> tuple[list[int], list[str], list[int], list[str]]:
    if ns.model not in FLAVORS:
        raise ConfigError(f"unknown model flavor {ns.model!r} (choose from {', '.join(FLAVORS)})")
    worlds = _ints(ns.world_sizes, "--world-sizes")
    mbs = _ints(ns.microbatches, "--microbatches")
    strategies = [s for s in ns.strategies.split(",") if s]
    bad = [s for s in strategies if s not in STRATEGY_ARGS]
    if bad or not strategies:
        raise ConfigError(f"unknown strategy {','.join(bad) or ns.strategies!r} (choose from {', '.join(STRATEGY_ARGS)})")
    scalings = [s for s in ns.scaling.split(",") if s]
    if not scalings or any(s not in ("strong", "weak") for s in scalings):
        raise ConfigError(f"--scaling {ns.scaling!r} must be strong, weak or strong,weak")
    if ns.steps < 3:
        raise ConfigError(f"--steps={ns.steps} must be >= 3 (the first step is warm-up)")
    if ns.batch_size < 1:
        raise ConfigError(f"--batch-size={ns.batch_size} must be >= 1")
    if ns.name:  # the names the sweep derives from it must pass the contract's one run-name rule
        try:
            check_run_name(f"{ns.name}-strong-ddp-w1")
        except ValueError:
            raise ConfigError(f"--name {ns.name!r} cannot start a run name: use letters, digits, '.', '_' or '-', "
                              "starting with a letter or digit") from None
    if ns.store.startswith("s3://"):
        raise ConfigError(f"--store {ns.store!r}: the sweep's jobs write a local store directory; to put it in a "
                          "bucket, run `meshscope agent --store DIR --upload s3://...` beside the sweep")
    store = Path(ns.store)
    if store.exists() and not store.is_dir():
        raise ConfigError(f"store {ns.store!r} is not a directory")
    return worlds, strategies, mbs, scalings


def _ingest(store: Path, env: dict) -> None:
    """Bring the spools into the store; when an agent already follows the store (it holds the lock), it
    ingests them itself and this is a no-op."""
    proc = subprocess.run([sys.executable, "-m", "meshscope.cli", "ingest", "--store", str(store)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "lock" not in (proc.stderr + proc.stdout).lower():
        print(f"meshscope sweep: warning: ingest failed: {proc.stderr.strip()}", file=sys.stderr)


def report(store: Path, runs: list[str], *, include_unclean: bool = False) -> dict:
    """The Scaling page's numbers for ``runs``: read through the page's own loads and computed by the same
    functions (``dashboard.scaling``), so this table and the page cannot disagree. Returns ``per_run``
    (throughput over steady steps, the runs the families are built from), ``left_out`` (the runs that are
    not clean, with their ``reason``; empty with ``include_unclean``), ``table`` (per family and run:
    speedup, efficiency), ``fits`` (per family: the Amdahl verdict or why there is none) and ``note`` (why
    there is no family, if none)."""
    # The store reader (DuckDB) and the dashboard's analysis, imported late: only this last step of the
    # sweep needs them.
    from meshscope.agent.store.reader import Store
    from meshscope.dashboard import scaling, views

    every, _ = views.scaling_runs(views.direct_loader(Store.open(store)), runs=runs)
    per_run, left_out = scaling.family_runs(every, include_unclean=include_unclean)
    table = scaling.scaling_table(per_run)
    note = "" if len(table) else scaling.no_family_reason(per_run)
    if per_run.empty and len(left_out):
        note = (f"No scaling verdict: none of the {len(left_out)} runs is clean (--include-unclean compares them "
                "anyway).")
    return {"per_run": per_run, "left_out": left_out, "table": table,
            "fits": scaling.amdahl_fits(table, clean=not include_unclean and "clean" in every), "note": note}


def _marks(r) -> str:
    """A row's trailing marks: not clean (included on request), CPU contention."""
    out = []
    if not getattr(r, "clean", True):
        out.append(f"x not clean: {r.reason}")
    if getattr(r, "cpu_contention", False):
        out.append(f"CPU contention {r.cpu_wait_share:.0%}")
    return ("  " + ", ".join(out)) if out else ""


def format_report(rep: dict) -> str:
    """The terminal table: per family, its baseline, each run's throughput, speedup and efficiency against
    it (marked where the run is not clean or its ranks waited for a core), and the fit verdict; then the
    runs that belong to no family, and the runs left out as not clean with why."""
    head = f"{'run':<44} {'ranks':>5} {'batch':>5} {'tokens/s':>10} {'speedup':>8} {'eff.':>6} {'exp.comm':>8}"
    lines = []
    table, fits = rep["table"], rep["fits"].set_index("family")
    for family, g in table.groupby("family", sort=True):
        lines += ["", f"{family}: baseline {g['baseline'].iloc[0]} (n0 = {int(g['n0'].iloc[0])})", head]
        lines += [f"{r.run:<44} {r.world_size:>5} {r.global_batch:>5.0f} {r.tokens_per_s:>10,.0f} {r.speedup:>8.3f} "
                  f"{r.efficiency:>6.1%} {r.comm_fraction:>8.0%}{_marks(r)}" for r in g.itertuples()]
        lines.append(fits.loc[family, "note"])
    per_run = rep["per_run"]
    alone = per_run[~per_run["run"].isin(table["run"])] if len(table) else per_run
    if rep["note"]:
        lines += ["", rep["note"]]
    if len(alone):
        lines += ["", "Runs in no family (throughput only):", head]
        lines += [f"{r.run:<44} {r.world_size:>5} {r.global_batch:>5.0f} {r.tokens_per_s:>10,.0f} {'':>8} {'':>6} "
                  f"{r.comm_fraction:>8.0%}{_marks(r)}" for r in alone.itertuples()]
    left = rep.get("left_out")
    if left is not None and len(left):
        lines += ["", f"Left out, not clean ({len(left)}; --include-unclean to include them):"]
        lines += [f"{r.run:<44} {r.world_size:>5} {r.global_batch:>5.0f} {r.tokens_per_s:>10,.0f}  {r.reason}"
                  for r in left.itertuples()]
    if "cpu_contention" in per_run and per_run["cpu_contention"].fillna(False).astype(bool).any():
        lines += ["", "CPU contention: the marked runs' ranks waited for a core (that share of the time they were "
                      "ready to run); their throughput is the machine's load as much as the job's."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        ns = _parser().parse_args(argv)
        worlds, strategies, mbs, scalings = _validate(ns)
    except ConfigError as e:
        print(f"meshscope sweep: error: {e}", file=sys.stderr)
        return 2
    store = Path(ns.store)
    store.mkdir(parents=True, exist_ok=True)
    prefix = ns.name or f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    points = grid(world_sizes=worlds, strategies=strategies, microbatches=mbs, scalings=scalings,
                  batch=ns.batch_size, model=ns.model)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    names: dict[str, Point] = {}
    t_start = time.monotonic()
    for i, point in enumerate(points, 1):
        name = point.run_name(prefix)
        print(f"[{i}/{len(points)}] {name}: {point.world} rank(s), batch {point.batch}", flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={point.world}",
               "-m", "meshscope.trainer.train", "--model", ns.model, "--steps", str(ns.steps), "--log-every", str(ns.steps),
               "--store", str(store), "--run-name", name, *point.args()]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=ns.timeout)
        if proc.returncode != 0:
            print(f"meshscope sweep: error: {name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}",
                  file=sys.stderr)
            return 1
        names[name] = point
    _ingest(store, env)
    print(f"\n{len(points)} runs in {time.monotonic() - t_start:.0f}s; store: {store}")
    print(format_report(report(store, list(names), include_unclean=ns.include_unclean)))
    print("\nOpen the dashboard's Scaling page on this store to see the efficiency curves and the Amdahl fit.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
