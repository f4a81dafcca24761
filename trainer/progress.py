"""Rank 0's console output: one line per step (``step=<n> loss=<float> ...``) on stdout and, on a terminal,
a tqdm progress bar with an ETA on stderr that the step lines print above."""

from __future__ import annotations

import math
import sys

from tqdm import tqdm


class StepPrinter:
    def __init__(self, *, total: int, start: int, enabled: bool, every: int, out=None, bar=None) -> None:
        self.total, self.enabled, self.every = total, enabled, every
        self.out = out or sys.stdout
        show = sys.stderr.isatty() if bar is None else bar
        self.bar = (tqdm(total=total, initial=start, file=sys.stderr, unit="step", dynamic_ncols=True)
                    if enabled and show else None)

    def step(self, step: int, *, loss: float, lr: float, tokens_per_s: float, step_s: float, mfu: float,
             grad_norm: float, skipped: bool) -> None:
        if not self.enabled:
            return
        if step % self.every == 0 or step + 1 == self.total:
            mfu_txt = f" mfu={mfu:.2%}" if math.isfinite(mfu) else ""
            skip = " skipped" if skipped else ""
            line = (f"step={step} loss={loss:.8f} lr={lr:.3e} grad_norm={grad_norm:.4f} "
                    f"tokens/s={tokens_per_s:,.0f} step_time={step_s * 1e3:.1f}ms{mfu_txt}{skip}")
            if self.bar is not None:
                self.bar.write(line, file=self.out)  # clears the bar, prints, redraws it
                self.out.flush()
            else:
                print(line, file=self.out, flush=True)
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
