"""Rank 0's console output: one line per step (``step=<n> loss=<float> ...``) and, on a terminal, a
progress bar with an ETA underneath that is redrawn in place."""

from __future__ import annotations

import math
import sys
import time


class StepPrinter:
    def __init__(self, *, total: int, start: int, enabled: bool, every: int, out=None, bar=None) -> None:
        self.total, self.start, self.enabled, self.every = total, start, enabled, every
        self.out = out or sys.stdout
        self.bar = sys.stderr.isatty() if bar is None else bar
        self.t0 = time.perf_counter()

    def step(self, step: int, *, loss: float, lr: float, tokens_per_s: float, step_s: float, mfu: float,
             grad_norm: float, skipped: bool) -> None:
        if not self.enabled:
            return
        done = step + 1
        if step % self.every == 0 or done == self.total:
            mfu_txt = f" mfu={mfu:.2%}" if math.isfinite(mfu) else ""
            skip = " skipped" if skipped else ""
            line = (f"step={step} loss={loss:.8f} lr={lr:.3e} grad_norm={grad_norm:.4f} "
                    f"tokens/s={tokens_per_s:,.0f} step_time={step_s * 1e3:.1f}ms{mfu_txt}{skip}")
            if self.bar:
                sys.stderr.write("\r\033[K")
            print(line, file=self.out, flush=True)
        if self.bar:
            frac = (done - self.start) / max(1, self.total - self.start)
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / frac - elapsed if frac > 0 else 0.0
            filled = int(30 * frac)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} eta {eta:5.1f}s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.bar:
            sys.stderr.write("\n")
