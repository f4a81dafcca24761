"""GPU samples from NVML (``pynvml`` from nvidia-ml-py), when a driver is present.

The true boundary is "NVML absent": ``load_nvml()`` returns None on a machine without the library or a
driver, and the agent then simply samples nothing. The sampler only talks to the module object it is
given, so tests inject a fake module; on a GPU machine check the real path with::

    python -m meshscope.agent.collector.gpu        # prints one sample per GPU, or why NVML is unavailable

A field a GPU does not support (NVML NotSupported, e.g. ECC on consumer cards) is stored as NaN / -1 and
not exported; any other NVML failure is counted in ``errors`` (exported as
meshscope_agent_gpu_sample_errors_total) and never raised.
"""

from __future__ import annotations

import sys
from types import ModuleType

from meshscope.agent.contract import AnchoredClock, Clock, GpuRecord


def load_nvml(module: ModuleType | None = None) -> tuple[ModuleType | None, str]:
    """(initialised NVML module, "") or (None, reason). ``module`` replaces ``import pynvml``."""
    if module is None:
        try:
            import pynvml as module  # noqa: PLC0415 - optional at runtime
        except ImportError as exc:
            return None, f"pynvml not installed ({exc})"
    try:
        module.nvmlInit()
        if module.nvmlDeviceGetCount() < 1:
            module.nvmlShutdown()
            return None, "no GPU visible to NVML"
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"NVML unavailable: {type(exc).__name__}: {exc}"
    return module, ""


class GpuSampler:
    """Samples every GPU NVML sees into ``GpuRecord`` rows (``agent.contract``)."""

    def __init__(self, nvml: ModuleType, *, host: str, clock: Clock) -> None:
        self._nvml = nvml
        self._host = host
        self._clock = clock
        self.errors = 0
        self._error_type = getattr(nvml, "NVMLError", Exception)
        self._not_supported = getattr(nvml, "NVMLError_NotSupported", ())
        self._timeout = getattr(nvml, "NVMLError_Timeout", ())
        count = self._q(nvml.nvmlDeviceGetCount, default=0)
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._static = [
            {
                "uuid": _text(self._q(nvml.nvmlDeviceGetUUID, h, default="")),
                "name": _text(self._q(nvml.nvmlDeviceGetName, h, default="")),
                "sm_max_hz": _mhz(self._q(nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_SM, default=None)),
            }
            for h in self._handles
        ]
        self._xid = [0] * count
        self._events = self._register_xid_events()
        # NVML's v1 memory struct counts the driver's reserved memory as used (615 MiB on an H200, measured
        # by bench/gpu_check.py); v2 does not, which is what nvidia-smi shows. v1 where v2 is unknown.
        self._mem_v2 = getattr(nvml, "nvmlMemory_v2", None)

    def _q(self, fn, *args, default):
        """One NVML query: NotSupported gives ``default`` quietly, other NVML errors are counted."""
        try:
            return fn(*args)
        except self._not_supported:
            return default
        except self._error_type:
            self.errors += 1
            return default

    def _register_xid_events(self):
        nvml = self._nvml
        if not hasattr(nvml, "nvmlEventSetCreate"):
            return None
        event_set = self._q(nvml.nvmlEventSetCreate, default=None)
        if event_set is None:
            return None
        registered = False
        for h in self._handles:
            try:
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, event_set)
                registered = True
            except self._error_type:  # not supported on this GPU / without privileges: no XID counts
                pass
        return event_set if registered else None

    def _drain_xid(self) -> None:
        if self._events is None:
            return
        nvml = self._nvml
        for _ in range(1000):  # bounded: an XID storm must not stall the agent loop
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except self._timeout:
                return
            except self._error_type:
                self.errors += 1
                return
            index = self._q(nvml.nvmlDeviceGetIndex, data.device, default=None)
            if index is not None and 0 <= index < len(self._xid):
                self._xid[index] += 1

    def sample(self) -> list[GpuRecord]:
        """One record per GPU; what a GPU does not report is NaN (ratios, watts, degrees, hertz) or -1
        (counts and sizes)."""
        nvml = self._nvml
        t = self._clock.now()
        self._drain_xid()
        throttle_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons")
        rows = []
        for i, h in enumerate(self._handles):
            util = self._q(nvml.nvmlDeviceGetUtilizationRates, h, default=None)
            mem = self._memory(h)
            power_mw = self._q(nvml.nvmlDeviceGetPowerUsage, h, default=None)
            temp = self._q(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU, default=None)
            sm = self._q(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM, default=None)
            throttle = self._q(throttle_fn, h, default=-1)
            ecc = self._q(nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                          nvml.NVML_VOLATILE_ECC, default=-1)
            static = self._static[i]
            rows.append(GpuRecord(  # the agent's thread, not training: the named tuple, read by name below
                t=t, host=self._host, gpu=i, uuid=static["uuid"], name=static["name"],
                util_ratio=_nan(util.gpu / 100.0 if util is not None else None),
                mem_util_ratio=_nan(util.memory / 100.0 if util is not None else None),
                mem_used_bytes=int(mem.used) if mem is not None else -1,
                mem_total_bytes=int(mem.total) if mem is not None else -1,
                power_watts=_nan(power_mw / 1000.0 if power_mw is not None else None),
                temperature_celsius=_nan(temp), sm_clock_hz=_mhz(sm), sm_clock_max_hz=static["sm_max_hz"],
                throttle_reasons=int(throttle), xid_errors_total=self._xid[i] if self._events is not None else -1,
                ecc_errors_total=int(ecc),
            ))
        return rows

    def _memory(self, h):
        if self._mem_v2 is not None:
            try:
                return self._nvml.nvmlDeviceGetMemoryInfo(h, version=self._mem_v2)
            except Exception:  # noqa: BLE001 - an older driver or binding: v1 from now on
                self._mem_v2 = None
        return self._q(self._nvml.nvmlDeviceGetMemoryInfo, h, default=None)

    def close(self) -> None:
        nvml = self._nvml
        if self._events is not None:
            self._q(nvml.nvmlEventSetFree, self._events, default=None)
        self._q(nvml.nvmlShutdown, default=None)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nan(value) -> float:
    return float("nan") if value is None else float(value)


def _mhz(value) -> float:
    return float("nan") if value is None else float(value) * 1e6


def main() -> int:
    nvml, reason = load_nvml()
    if nvml is None:
        print(f"meshscope gpu: {reason}")
        return 1
    sampler = GpuSampler(nvml, host="localhost", clock=AnchoredClock())
    for row in sampler.sample():
        print(row._asdict())
    print(f"errors: {sampler.errors}")
    sampler.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
