"""What a run ran on beyond its config: the CUDA, NCCL and driver versions, the CPU, and the environment
flags that change how torch, NCCL and the thread pools behave. Written once per rank into the run record's
``environment`` (schema 6), where ``meshscope diff`` lists what changed between two runs.

Read once at start, never on the training path; every probe may fail (no GPU, no NVML, an old torch) and
then leaves its key out rather than raising into the user's job.
"""

from __future__ import annotations

import os
import platform
import re
from typing import Any, Mapping

# Variables whose value changes what a job does or how fast (NCCL's algorithms and transports, torch's
# allocator and distributed knobs, thread pools, inductor), the first prefixes first where the cap cuts.
# Launcher bookkeeping that differs between any two runs (TORCHELASTIC_*, MASTER_PORT, RANK, ...), meshscope's
# own names and places, and places in general (which devices, directories, files) are not among them.
FLAG_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "CUDA_", "CUBLAS_", "CUBLASLT_", "CUDNN_", "NVTE_", "GLOO_",
                 "TORCHINDUCTOR_", "OMP_", "MKL_", "KMP_", "UCX_", "FI_")
FLAG_EXCLUDED_PREFIXES = ("TORCHELASTIC_",)
FLAG_EXCLUDED = ("CUDA_VISIBLE_DEVICES",)
PLACE_SUFFIXES = ("_DIR", "_FILE", "_PATH", "_HOME", "_ROOT")
# name components that may mark a credential: never written to a store (``NCCL_IB_PKEY`` is a partition key)
SECRET_WORDS = frozenset({"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASS", "PWD", "CREDENTIAL", "CREDENTIALS",
                          "KEY", "AUTH", "CERT", "PRIVATE"})
_USERINFO = re.compile(r"(://)[^/@\s]+@")  # user:password@ in a URL value
MAX_FLAGS = 64  # bounded: the record is one row per rank, not a dump of the environment
MAX_VALUE_CHARS = 200


def _kept(name: str) -> bool:
    if not name.startswith(FLAG_PREFIXES) or name.startswith(FLAG_EXCLUDED_PREFIXES) or name in FLAG_EXCLUDED:
        return False
    return not name.endswith(PLACE_SUFFIXES) and not SECRET_WORDS & set(name.upper().split("_"))


def flags(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment's flags of ``FLAG_PREFIXES`` (at most ``MAX_FLAGS``, taken in the prefixes' order,
    values cut to ``MAX_VALUE_CHARS`` with a URL's user and password left out), without launcher
    bookkeeping, places or anything named like a credential; sorted by name."""
    names = sorted((n for n in list(environ) if _kept(n)),
                   key=lambda n: (next(i for i, p in enumerate(FLAG_PREFIXES) if n.startswith(p)), n))
    out = {n: _USERINFO.sub(r"\1", str(environ.get(n, "")))[:MAX_VALUE_CHARS] for n in names[:MAX_FLAGS]}
    return dict(sorted(out.items()))


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
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
