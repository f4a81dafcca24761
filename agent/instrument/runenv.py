"""What a run ran on beyond its config: the CUDA, NCCL and driver versions, the CPU, and the environment
flags that change how torch, NCCL and the thread pools behave. Written once per rank into the run record's
``environment`` (schema 6), where ``meshscope diff`` lists what changed between two runs.

Read once at start, never on the training path; every probe may fail (no GPU, no NVML, an old torch) and
then leaves its key out rather than raising into the user's job.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Mapping

# Variables whose value changes what a job does or how fast (NCCL's algorithms and transports, torch's
# allocator and distributed knobs, thread pools, inductor). Launcher bookkeeping that differs between any
# two runs (TORCHELASTIC_*, MASTER_PORT, RANK, ...) and meshscope's own names and places are not among them.
FLAG_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "CUDA_", "CUBLAS_", "CUBLASLT_", "CUDNN_", "NVTE_", "GLOO_",
                 "TORCHINDUCTOR_", "OMP_", "MKL_", "KMP_", "UCX_", "FI_")
FLAG_EXCLUDED_PREFIXES = ("TORCHELASTIC_",)
# names that may hold a credential: never written to a store
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "KEY")
MAX_FLAGS = 64  # bounded: the record is one row per rank, not a dump of the environment
MAX_VALUE_CHARS = 200


def flags(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment's flags of ``FLAG_PREFIXES`` (sorted, at most ``MAX_FLAGS``, values cut to
    ``MAX_VALUE_CHARS``), without launcher bookkeeping or anything named like a credential."""
    out: dict[str, str] = {}
    for name in sorted(environ):
        if not name.startswith(FLAG_PREFIXES) or name.startswith(FLAG_EXCLUDED_PREFIXES):
            continue
        if any(word in name.upper() for word in SECRET_WORDS):
            continue
        out[name] = str(environ[name])[:MAX_VALUE_CHARS]
        if len(out) == MAX_FLAGS:
            break
    return out


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cuda(cuda: bool) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        import torch

        if torch.version.cuda:
            out["cuda"] = str(torch.version.cuda)
        if getattr(torch.version, "hip", None):
            out["hip"] = str(torch.version.hip)
        if not cuda or not torch.cuda.is_available():
            return out
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # a probe never fails the job  # noqa: BLE001
        return out
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            out["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML (a container without the driver's library): the key is left out  # noqa: BLE001
        pass
    return out


def environment(*, cuda: bool, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{"cuda", "nccl", "driver" (where the job runs on a GPU), "cpu", "flags": {...}}`` of this process
    (the GPU's name is the run record's ``device``)."""
    return {**_cuda(cuda), "cpu": cpu_model(), "flags": flags(os.environ if environ is None else environ)}
