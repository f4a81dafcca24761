"""GPU sampling through an injected fake NVML module (the real one needs a driver: see gpu.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from prometheus_client import generate_latest

from meshscope.agent.collector.agent import Agent, AgentConfig
from meshscope.agent.collector.gpu import GpuSampler, load_nvml
from meshscope.agent.store.reader import read_table
from meshscope.agent.contract import GpuRecord


class FakeClock:
    t = 1_700_000_000.0

    def now(self) -> float:
        return self.t


def fake_nvml(*, gpus: int = 2, xids: list[int] | None = None, ecc_supported: bool = True):
    """A module-shaped object with the pynvml calls the sampler uses."""
    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's names
        pass

    class NVMLError_Timeout(NVMLError):  # noqa: N801
        pass

    pending = list(xids or [])
    state = {"shutdown": 0}

    def ecc(h, *_):
        if not ecc_supported:
            raise NVMLError_NotSupported()
        return 3 * h

    def wait(_set, _timeout_ms):
        if not pending:
            raise NVMLError_Timeout()
        return SimpleNamespace(device=pending.pop(0), eventType=8, eventData=79)

    def power(h):
        if h == 1:
            raise NVMLError("GPU is lost")
        return 350_000

    return SimpleNamespace(
        NVMLError=NVMLError, NVMLError_NotSupported=NVMLError_NotSupported, NVMLError_Timeout=NVMLError_Timeout,
        NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        nvmlEventTypeXidCriticalError=8, state=state,
        nvmlInit=lambda: None, nvmlShutdown=lambda: state.__setitem__("shutdown", state["shutdown"] + 1),
        nvmlDeviceGetCount=lambda: gpus, nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetIndex=lambda h: h,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h:04d}", nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMaxClockInfo=lambda h, clk: 1980, nvmlDeviceGetClockInfo=lambda h, clk: 1410,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=87, memory=40),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=60 * 2**30, total=80 * 2**30, free=20 * 2**30),
        nvmlDeviceGetPowerUsage=power, nvmlDeviceGetTemperature=lambda h, s: 71,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0b100, nvmlDeviceGetTotalEccErrors=ecc,
        nvmlEventSetCreate=lambda: "set", nvmlDeviceRegisterEvents=lambda h, kind, s: None,
        nvmlEventSetWait_v2=wait, nvmlEventSetFree=lambda s: None,
    )


def test_sampler_rows_units_and_unsupported_fields():
    nvml = fake_nvml(xids=[1, 1, 0], ecc_supported=False)
    sampler = GpuSampler(nvml, host="node0", clock=FakeClock())
    records = sampler.sample()
    assert all(type(r) is GpuRecord for r in records)
    rows = [r._asdict() for r in records]
    assert [r["gpu"] for r in rows] == [0, 1] and rows[0]["uuid"] == "GPU-0000"
    assert rows[0]["name"] == "NVIDIA H100 80GB HBM3" and rows[0]["util_ratio"] == 0.87
    assert rows[0]["mem_used_bytes"] == 60 * 2**30 and rows[0]["power_watts"] == 350.0
    assert rows[0]["sm_clock_hz"] == 1.41e9 and rows[0]["sm_clock_max_hz"] == 1.98e9
    assert rows[0]["throttle_reasons"] == 4 and rows[0]["temperature_celsius"] == 71.0
    assert [r["xid_errors_total"] for r in rows] == [1, 2]
    assert rows[0]["ecc_errors_total"] == -1  # not supported: quietly absent
    assert math.isnan(rows[1]["power_watts"]) and sampler.errors == 1  # a real failure: counted
    sampler.close()
    assert nvml.state["shutdown"] == 1


def test_nvml_absent_is_a_clean_none():
    class Missing:
        def nvmlInit(self):
            raise OSError("NVML Shared Library Not Found")

    module, reason = load_nvml(Missing())
    assert module is None and "NVML Shared Library Not Found" in reason
    real, why = load_nvml()  # this machine: whatever it has, never an exception
    assert (real is None) == bool(why)


def test_agent_exports_and_stores_gpu_samples(tmp_path):
    from meshscope.agent.contract import EventRecord, spool_path
    from meshscope.agent.transport.writer import SpoolWriter

    clock = FakeClock()
    w = SpoolWriter(path=spool_path(tmp_path, run="g", rank=0, attempt=0), run="g", rank=0, attempt=0, host="h",
                    start=False)
    w.submit("event", [EventRecord(t=clock.t, step=0, kind="start", message="")])
    w.flush()
    agent = Agent(AgentConfig(store=tmp_path, port=0, gpu_interval_s=1.0), clock=clock, nvml=fake_nvml(xids=[0]))
    agent.step()  # ingests the run's first record and samples both GPUs
    text = generate_latest(agent.registry).decode()
    assert 'meshscope_gpu_utilization_ratio{gpu="0"} 0.87' in text
    assert 'meshscope_gpu_xid_errors_total{gpu="0"} 1.0' in text
    assert 'meshscope_gpu_ecc_errors_total{gpu="1"} 3.0' in text
    assert 'meshscope_gpu_info{gpu="1",host=' in text and 'uuid="GPU-0001"' in text
    assert "meshscope_agent_gpu_sample_errors_total 1.0" in text  # GPU 1 lost its power reading
    agent.run_once()
    agent.close()
    df = read_table(tmp_path, "gpu", run="g")
    assert set(df["rank"]) == {-1} and set(df["gpu"]) == {0, 1} and len(df) == 4
