"""Reference trainer entry point: ``torchrun --nproc_per_node=N -m meshscope.trainer.train [flags]``.

Also runs as a single process (``python -m meshscope.trainer.train``): it then makes a world of one. The trainer
is meshscope's first *user*: it instruments itself through the public ``agent`` API exactly as any
training loop would, and owns none of the instrumentation.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from meshscope.agent.contract import mfu as model_flops_utilisation
from meshscope.agent.instrument.flops import device_peak
from meshscope.agent.instrument.nulltelemetry import NullTelemetry
from meshscope.agent.instrument.telemetry import Telemetry
from meshscope.trainer import checkpoint, config, data, model as model_lib, optim
from meshscope.trainer.config import ConfigError, TrainConfig
from meshscope.trainer.faults import Faults
from meshscope.trainer.parallel import (
    Placement, build_mesh, build_schedule, parallelize, schedule_stages, unwrap, world_loss,
)
from meshscope.trainer.profiling import Profiler
from meshscope.trainer.progress import StepPrinter


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _sigterm_deferred():
    """Hold SIGTERM back while telemetry closes: torchrun signals every surviving rank when one fails,
    often just as the survivor's own collective error is already closing the telemetry, and a SystemExit
    raised inside ``close`` would cut it short: the rank's queued records, possibly all of them when the
    failure comes early, would never reach the spool (seen: a restarted job's attempt-0 spool of rank 0
    missing). ``close`` is bounded by its own timeouts; a SIGTERM that came meanwhile is raised after it."""
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if got:
            raise SystemExit(128 + got[0])


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _single_process_env() -> None:
    """Without torchrun, make a world of one on loopback."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _device(cfg: TrainConfig) -> torch.device:
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if want_cuda:
        if not torch.cuda.is_available():
            raise ConfigError("device='cuda' but no CUDA device is available")
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


class Trainer:
    def __init__(self, cfg: TrainConfig, *, device: torch.device, layout: Placement, peak_flops: float) -> None:
        self.cfg, self.device, self.layout = cfg, device, layout
        self.peak_flops = peak_flops
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        p = cfg.parallel
        self.flavor = model_lib.FLAVORS[cfg.model.flavor]
        self.seq_len = cfg.model.seq_len
        torch.manual_seed(cfg.seed)  # the same full model on every rank, before any sharding
        full = model_lib.GPT(self.flavor, seq_len=self.seq_len)
        self.parts = parallelize(full, layout=layout, device=device,
                                 activation_checkpoint=cfg.model.activation_checkpoint, compile=cfg.model.compile)
        self.optimizers = optim.build_optimizers(self.parts, cfg.optim)
        self.faults = Faults(cfg.faults, rank=self.rank)
        for part in self.parts:
            self.faults.install(unwrap(part))
        self.scale = 1.0 / (p.microbatches * cfg.optim.grad_accum) if p.pp > 1 else 1.0 / cfg.optim.grad_accum
        self.schedule = (
            build_schedule(self.parts, layout=layout, device=device, loss_fn=self._pp_loss) if p.pp > 1 else None
        )
        self.autocast = device.type == "cuda"
        self.tokens_per_step = cfg.data.batch_size * self.seq_len
        self.flops_per_token = model_lib.flops_per_token(self.flavor, seq_len=self.seq_len)
        self.pp_group = layout.mesh["pp"].get_group() if p.pp > 1 else None
        self._step = -1  # the step train_step is in (set there)

    # The pipeline schedule calls this per microbatch on the last stage.
    def _pp_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.faults.poison(model_lib.loss_fn(logits, targets) * self.scale, step=self._step)

    def _micro_step(self, step: int, micro: int, tel) -> torch.Tensor | None:
        cfg, p = self.cfg, self.layout.parallel
        with tel.phase("data"):
            x, y = data.batch(
                step, micro_step=micro, grad_accum=cfg.optim.grad_accum, global_batch=cfg.data.batch_size,
                dp_rank=self.layout.dp_rank, dp=p.dp, source=cfg.data.source, seed=cfg.seed,
                seq_len=self.seq_len, vocab=self.flavor.vocab_size, device=self.device,
            )
        if self.schedule is not None:
            stage_ids = self.layout.stage_ids()
            first, last = 0 in stage_ids, p.n_stages - 1 in stage_ids
            losses: list[torch.Tensor] = []
            with tel.phase("pipeline"), torch.autocast("cuda", torch.bfloat16, enabled=self.autocast):
                args = (x,) if first else ()
                kwargs = {"target": y, "losses": losses} if last else {}
                self.schedule.step(*args, **kwargs)
            return torch.stack(losses).sum() if last else None
        with tel.phase("forward"), torch.autocast("cuda", torch.bfloat16, enabled=self.autocast):
            loss = self.faults.poison(model_lib.loss_fn(self.parts[0](x), y) * self.scale, step=step)
        with tel.phase("backward"):
            loss.backward()
        return loss.detach()

    def train_step(self, step: int, tel) -> dict:
        """One optimizer step (all gradient-accumulation micro-steps), instrumented through ``tel``."""
        cfg, p = self.cfg, self.layout.parallel
        self._step = step  # the pipeline schedule's loss callback (``_pp_loss``) has no step argument
        with tel.step(step) as s:
            lr = optim.lr_at(step, cfg=cfg.optim, total_steps=cfg.steps)
            for opt in self.optimizers:
                for group in opt.param_groups:
                    group["lr"] = lr
            total = None
            for micro in range(cfg.optim.grad_accum):
                loss = self._micro_step(step, micro, tel)
                if loss is not None:
                    total = loss if total is None else total + loss
            with tel.phase("optimizer"):
                norm = optim.global_grad_norm(self.parts, pp_group=self.pp_group)
                skipped = not bool(torch.isfinite(norm))
                if not skipped:
                    if cfg.optim.grad_clip > 0:
                        optim.clip_(self.parts, max_norm=cfg.optim.grad_clip, total_norm=norm)
                    for opt in self.optimizers:
                        opt.step()
                for opt in self.optimizers:
                    opt.zero_grad(set_to_none=True)
            loss_value = world_loss(total, layout=self.layout)
            flops = self.flops_per_token * self.tokens_per_step / self.world
            result = dict(loss=loss_value, tokens=self.tokens_per_step // p.dp, flops=flops,
                          grad_norm=float(norm), lr=lr, skipped=skipped)
            s.update(**result)
        if skipped:
            tel.event("skipped_step", f"non-finite gradient norm at step {step}", step=step)
        return result

    def run(self, tel) -> int:
        cfg = self.cfg
        start = 0
        stage_ids = self.layout.stage_ids()
        if cfg.checkpoint.resume:
            path = checkpoint.latest(cfg.checkpoint.dir)
            if path is not None:
                start = checkpoint.load(path, parts=self.parts, optimizers=self.optimizers, stage_ids=stage_ids)
                tel.event("restart", f"resumed from {path.name}", step=start)
        printer = StepPrinter(total=cfg.steps, start=start, enabled=self.rank == 0, every=cfg.log_every)
        with Profiler(cfg.profile, rank=self.rank, start=start) as prof:
            for step in range(start, cfg.steps):
                self.faults.before_step(step, tel)
                t0 = time.perf_counter()
                with prof.region(step):
                    r = self.train_step(step, tel)
                prof.step(step)
                dt = time.perf_counter() - t0
                mfu = model_flops_utilisation(flops=r["flops"], seconds=dt, peak_flops=self.peak_flops)
                printer.step(step, loss=r["loss"], lr=r["lr"], tokens_per_s=self.tokens_per_step / dt, step_s=dt,
                             mfu=mfu, grad_norm=r["grad_norm"], skipped=r["skipped"])
                done = step + 1
                if cfg.checkpoint.dir and (
                    (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.steps
                ):
                    checkpoint.save(cfg.checkpoint.dir, step=done, parts=self.parts, optimizers=self.optimizers,
                                    stage_ids=stage_ids)
        printer.close()
        return 0


def run_info(cfg: TrainConfig, *, layout: Placement, device: torch.device, peak: float, peak_source: str) -> dict:
    flavor = model_lib.FLAVORS[cfg.model.flavor]
    n, n_ne = model_lib.count_params(flavor)
    p = layout.parallel
    return {
        "strategy": p.strategy, "mesh": layout.sizes(), "coords": layout.coords(),
        "schedule": p.schedule if p.pp > 1 else "", "microbatches": p.microbatches if p.pp > 1 else 0,
        "virtual_stages": p.virtual_stages, "model": cfg.model.flavor, "n_params": n, "n_params_nonembedding": n_ne,
        "n_layers": flavor.n_layers, "d_model": flavor.d_model, "seq_len": cfg.model.seq_len,
        "global_batch": cfg.data.batch_size,
        "flops_per_token": model_lib.flops_per_token(flavor, seq_len=cfg.model.seq_len),
        "flops_method": f"model shape: 6*N + 12*L*D*S (N={n_ne}, L={flavor.n_layers}, D={flavor.d_model}, "
                        f"S={cfg.model.seq_len})",
        "peak_flops": peak, "peak_source": peak_source,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": dist.get_backend(), "dtype": "bf16-autocast" if device.type == "cuda" else "fp32",
        "config": config.dumps(cfg),
    }


def default_run_name(cfg: TrainConfig) -> str:
    return f"{cfg.parallel.strategy.replace('+', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config.from_args(config.parser("meshscope.trainer.train").parse_args(argv))
        _single_process_env()
        cfg = cfg.resolve(int(os.environ["WORLD_SIZE"]))
        device = _device(cfg)
    except ConfigError as e:
        if _is_rank0():
            print(f"meshscope train: error: {e}", file=sys.stderr)
        return 2
    # torchrun stops the surviving ranks with SIGTERM when one fails: turn it into SystemExit so the
    # `finally` below closes the telemetry and the last steps' buffered records reach the spool.
    signal.signal(signal.SIGTERM, _terminate)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=10),
                            device_id=device if device.type == "cuda" else None)
    try:
        layout = build_mesh(cfg.parallel, device_type=device.type)
        rank = dist.get_rank()
        tcfg = cfg.telemetry
        peak, peak_source = device_peak(device, override=tcfg.peak_flops)
        if tcfg.store:
            # One name for all ranks: rank 0's, so per-rank clocks cannot disagree on a timestamp.
            names = [tcfg.run or default_run_name(cfg)]
            dist.broadcast_object_list(names, src=0)
            run = names[0]
            tel = Telemetry(
                config=tcfg.instrumentation(run=run), rank=rank,
                world_size=dist.get_world_size(),
                local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), device=device,
            )
        else:
            tel = NullTelemetry()
        trainer = Trainer(cfg, device=device, layout=layout, peak_flops=peak)
        tel.start(run_info(cfg, layout=layout, device=device, peak=peak, peak_source=peak_source))
        tel.attach(model_parts=trainer.parts, mesh=layout.mesh, schedule=trainer.schedule,
                   stages=schedule_stages(trainer.schedule))
        try:
            code = trainer.run(tel)
            tel.event("end", f"finished {cfg.steps} steps")
        finally:
            with _sigterm_deferred():
                tel.close()
        return code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_without_finalization(code: int) -> None:
    """Leave the rank process after a clean shutdown without running interpreter finalization.

    torch's gloo teardown race (pytorch/pytorch#179291): a gloo worker thread can still hold the last
    reference to a finished op's Python-owned tensors when the interpreter starts finalizing; dropping
    it then takes the GIL, Python answers with ``pthread_exit`` and the C++ unwinding ends in
    ``std::terminate`` ("terminate called without an active exception", exit -6), after the run has
    finished and every record is written. Seen here on a 2-rank PP-1F1B job after its last step, so
    torchrun reported a finished job as failed. Everything that needs an orderly close is closed by then
    (telemetry, the process group, the profiler); flush the streams and logging and leave."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


if __name__ == "__main__":
    exit_without_finalization(main())
