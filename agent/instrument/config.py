"""The telemetry core's configuration, validated at construction (``Telemetry(config=...)``)."""

from __future__ import annotations

from dataclasses import dataclass

from meshscope.agent.contract import check_run_name

FLOPS_MODES = ("analytic", "off")


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    store: str
    run: str
    max_rows_per_kind: int = 200_000  # bound on buffered rows per kind between flushes
    flush_interval_s: float = 0.25  # how often the flusher drains (hang visibility bound)
    memory_every: int = 1  # memory sample every N steps
    # The hang watchdog (agent.instrument.hangdump): no progress for the threshold → one ``hang`` event and
    # one ``hang`` record per stall. The threshold is hangdump.HANG_STEPS median steps within
    # [hang_min_s, hang_after_s]; before the first step has ended (compilation, loading), hang_first_step_s.
    hang_after_s: float = 60.0  # the most the threshold gets; 0: the watchdog is off
    hang_min_s: float = 10.0  # the least (a loaded machine's scheduling hiccups are not hangs)
    hang_first_step_s: float = 300.0  # until a step has ended
    # where each rank also writes torch's Flight Recorder buffer when its watchdog fires (agent.instrument.
    # flightrec: torch's analyser reads the folder); "": not written
    flight_recorder_dir: str = ""
    spool_hold_bytes: int = 8 * 1024 * 1024  # records held in memory while the spool cannot be written
    # DDP's gradient buckets recorded (per-bucket records, exposed time): by a kernel in torch's dispatcher
    # that leaves DDP's C++ built-in all-reduce in place, in a process without CUDA where it is built
    # (comm_ddp), else through a traced Python comm hook, which costs what any Python comm hook (DDP's own
    # default one included) costs against the built-in: +6-16 % training-thread CPU per step on a 6-bucket
    # 1 MB toy on 2 cores (bench/hooks_overhead.py, ddp_vs_builtin). False: DDP models are left alone, their
    # buckets not recorded at all, and the reducer's wait for them at the end of backward counts as backward
    # compute, not exposed communication.
    ddp_comm_hook: bool = True
    # Model FLOPs and MFU: "analytic" (the caller's figures; zero-code counts them from the modules'
    # parameter shapes, never inside forward or backward) or "off" (no MFU, the run record says so).
    flops: str = "analytic"

    def __post_init__(self) -> None:
        bad = []
        if not self.store:
            bad.append(f"store={self.store!r}")
        elif "://" in str(self.store):  # ranks write spools to a local directory; the agent uploads them
            bad.append(f"store={self.store!r} is a URL: ranks write a local store directory (upload it with "
                       "`meshscope agent --store DIR --upload s3://...`)")
        try:
            check_run_name(self.run)  # the contract's one rule: a run name is a directory name
        except ValueError as e:
            bad.append(str(e))
        if self.max_rows_per_kind < 1:
            bad.append(f"max_rows_per_kind={self.max_rows_per_kind}")
        if self.flush_interval_s <= 0:
            bad.append(f"flush_interval_s={self.flush_interval_s}")
        if self.memory_every < 1:
            bad.append(f"memory_every={self.memory_every}")
        for name in ("hang_after_s", "hang_min_s", "hang_first_step_s"):
            if not getattr(self, name) >= 0:  # NaN too
                bad.append(f"{name}={getattr(self, name)}")
        if self.spool_hold_bytes < 0:
            bad.append(f"spool_hold_bytes={self.spool_hold_bytes}")
        if self.flops not in FLOPS_MODES:
            bad.append(f"flops={self.flops!r} (one of {', '.join(FLOPS_MODES)})")
        if bad:
            raise ValueError(f"invalid telemetry config: {', '.join(bad)}")
