"""Faults injected on purpose, so that the observability path can be proven against a known cause.

- straggler: the chosen ranks spend ``straggler_seconds`` extra inside their model's forward each step
  (a forward pre-hook, so the delay lands in compute — inside the pipeline span under PP — exactly where
  a slow GPU or a thermally throttled device would put it);
- hang: a rank stops making progress at a step (its peers then block in their next collective);
- crash: a rank exits abruptly at a step (after flushing what telemetry it has, as an exception would);
- non-finite loss: the loss becomes NaN at a step; the trainer then skips that optimizer step;
- desync: at a step every rank issues one more collective on the world group, one rank an all-gather where
  the others issue an all-reduce (ranks in different ops on one group: the classic mismatch);
- slow first step: every rank's first forward takes longer (a ``torch.compile``'s first step, which a hang
  watchdog must not take for a hang).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from meshscope.trainer.config import FaultConfig


class Faults:
    def __init__(self, cfg: FaultConfig, *, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self._step = -1
        self._straggled_step = -1
        self._first_step: int | None = None

    def install(self, module: nn.Module) -> None:
        if self.rank in self.cfg.straggler_ranks and self.cfg.straggler_seconds > 0:
            module.register_forward_pre_hook(self._straggle)
        if self.cfg.first_step_seconds > 0:
            module.register_forward_pre_hook(self._slow_first)

    def _slow_first(self, module: nn.Module, args) -> None:
        if self._first_step is None:  # the first forward of the first step (a resumed run's too)
            self._first_step = self._step
            time.sleep(self.cfg.first_step_seconds)

    def _straggle(self, module: nn.Module, args) -> None:
        # Once per step, however many microbatches or stages run through this module.
        if self._step >= self.cfg.straggler_from_step and self._straggled_step != self._step:
            self._straggled_step = self._step
            time.sleep(self.cfg.straggler_seconds)

    def before_step(self, step: int, tel) -> None:
        self._step = step
        c = self.cfg
        if c.crash_rank == self.rank and c.crash_step == step:
            tel.event("crash", f"injected crash of rank {self.rank} at step {step}", step=step)
            tel.close(timeout_s=2.0)
            os._exit(13)
        if c.hang_rank == self.rank and c.hang_step == step:
            tel.flush()
            while True:  # an injected hang: only a signal ends it
                time.sleep(1.0)
        if c.desync_step == step and c.desync_rank >= 0:
            self._desync()

    def _desync(self) -> None:
        import torch.distributed as dist

        x = torch.ones(4)
        if self.rank == self.cfg.desync_rank:
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the older name
            gather(torch.empty(4 * dist.get_world_size()), x)
        else:
            dist.all_reduce(x)

    def poison(self, loss: torch.Tensor, *, step: int) -> torch.Tensor:
        # The step comes from the caller, never from ``before_step``'s state: a loop that calls
        # ``Trainer.train_step`` directly (the benchmarks) never runs ``before_step``, and a remembered -1
        # would then equal the "off" value of ``nan_step`` and poison every step.
        return loss * float("nan") if step >= 0 and self.cfg.nan_step == step else loss
