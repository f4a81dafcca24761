"""Optional torch.profiler capture of a step range: one Chrome trace per rank, ``<dir>/rank-<r>.json``.

The profiler is the independent truth the telemetry is tested against; it is never always-on (it costs
+1…+14 % per step on CPU in this project's runs; ``bench/profiler_agreement.py`` runs both)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function

from meshscope.trainer.config import ProfileConfig


class Profiler:
    def __init__(self, cfg: ProfileConfig, *, rank: int, start: int) -> None:
        self.cfg, self.rank, self.start = cfg, rank, start
        self._prof = None

    def __enter__(self) -> "Profiler":
        self._maybe_start(self.start)
        return self

    def step(self, step: int) -> None:
        """Call after each optimizer step: starts before the first profiled step, stops after the last."""
        if not self.cfg.dir:
            return
        if self._prof is not None and step + 1 == self.cfg.range[1]:
            self._finish()
        self._maybe_start(step + 1)

    def region(self, step: int):
        """Marks one optimizer step in the trace (``train_step_<n>``) so per-step totals can be cut."""
        return record_function(f"train_step_{step}") if self._prof is not None else nullcontext()

    def _maybe_start(self, next_step: int) -> None:
        if self.cfg.dir and self._prof is None and next_step == self.cfg.range[0]:
            self._prof = profile(activities=[ProfilerActivity.CPU])
            self._prof.__enter__()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        out = Path(self.cfg.dir)
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank-{self.rank}.json"))

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._finish()
