"""The logic behind the Overview page's deep-trace panel (``dashboard.tracepanel``): which store a run can be
traced through, the ``meshscope trace`` command the button starts, what that command said, and the traces
collected so far. No Streamlit here.

The button starts the command as a child process rather than tracing in the page: the trace waits for the
job's next steps (seconds, a slow job's minutes), and the command is the one place that arms, collects and
says what went wrong (a run that ended, a trace already armed) in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from meshscope.agent.deeptrace import collected, rank_spools

DEFAULT_STEPS = 5
SHOWN = 5  # the newest traces listed


def local_root(roots: tuple[Path, ...] | list[Path], run: str) -> Path | None:
    """The first store directory that holds ``run``'s rank spools (where its ranks can be reached), or None."""
    for root in roots:
        if rank_spools(Path(root), run):
            return Path(root)
    return None


def command(store: Path, run: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "meshscope.cli", "trace", "--store", str(store), "--run", run, "--steps",
            str(int(steps)), "--json"]


def launch(store: Path, run: str, steps: int) -> subprocess.Popen:
    """``meshscope trace ... --json`` as a child process (its output is a few hundred bytes: pipes suffice)."""
    return subprocess.Popen(command(store, run, steps), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


@dataclass(frozen=True)
class Outcome:
    code: int
    result: dict | None  # the command's JSON (exit 0 or 1)
    error: str  # its last error line ("" when none)

    def summary(self) -> str:
        """One sentence: the steps each rank traced, or why not."""
        if self.result is None:
            return self.error or f"meshscope trace exited with status {self.code}"
        ranks = self.result.get("ranks", {})
        parts = [f"rank {r} steps {a['first_step']}–{a['last_step']}" if a["steps"] else f"rank {r}: {a['error']}"
                 for r, a in sorted(ranks.items(), key=lambda kv: int(kv[0]))]
        parts += [f"rank {r}: no answer" for r in self.result.get("missing", [])]
        head = "Traced" if self.result.get("ok") else "Incomplete"
        return f"{head} ({self.result.get('steps')} steps): " + "; ".join(parts) + "."


def outcome(proc: subprocess.Popen) -> Outcome | None:
    """What the command said, once it has exited (None while it runs)."""
    if proc.poll() is None:
        return None
    out, err = proc.communicate()
    try:
        result = json.loads(out) if out.strip() else None
    except ValueError:
        result = None
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return Outcome(code=proc.returncode, result=result, error=lines[-1] if lines else "")


def traces(store: Path, run: str) -> list[dict]:
    """The newest ``SHOWN`` collected traces of ``run``: id, folder, merged.json and each rank's steps."""
    out = []
    for t in collected(store, run)[:SHOWN]:
        steps = sorted({(a.first_step, a.last_step) for a in t["answers"].values() if a.steps})
        out.append({**t, "ranks": sorted(t["answers"]),
                    "steps": ", ".join(f"{lo}–{hi}" for lo, hi in steps) or "none"})
    return out
