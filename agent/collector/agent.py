"""The node agent: follow spools, keep /metrics current, write the run store, sample GPUs."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from prometheus_client.registry import CollectorRegistry

from meshscope.agent import version
from meshscope.agent.collector.exposition import MeshscopeCollector
from meshscope.agent.collector.gpu import GpuSampler
from meshscope.agent.collector.ingest import IngestConfig, Ingestor
from meshscope.agent.collector.otlp import OtlpConfig, OtlpPusher  # the SDK itself loads only with --otlp-endpoint
from meshscope.agent.collector.server import MetricsServer, serve_metrics
from meshscope.agent.collector.state import MetricsState
from meshscope.agent.collector.upload import Uploader, UploadConfig
from meshscope.agent.contract import Clock


RETAIN_INTERVAL_S = 30.0  # how often acknowledged local parts past their retention are deleted


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    store: Path
    host: str = "127.0.0.1"
    port: int = 9477
    poll_interval_s: float = 1.0
    gpu_interval_s: float = 5.0  # 0 disables GPU sampling
    run_ttl_s: float = 600.0  # a run's series are dropped this long after its last record
    ingest: IngestConfig = field(default_factory=IngestConfig)
    otlp: OtlpConfig | None = None  # --otlp-endpoint: also push the metrics over OTLP/HTTP
    upload: UploadConfig | None = None  # --upload s3://bucket/prefix

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port ({self.port}) must be in 0..65535")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll interval ({self.poll_interval_s}) must be > 0")
        if self.gpu_interval_s < 0 or self.run_ttl_s <= 0:
            raise ValueError(f"gpu interval ({self.gpu_interval_s}) must be >= 0 and run ttl "
                             f"({self.run_ttl_s}) > 0")


class Agent:
    """Composes the pieces. ``nvml`` is an initialised NVML module (``gpu.load_nvml``) or None."""

    def __init__(self, config: AgentConfig, *, clock: Clock, registry: CollectorRegistry | None = None,
                 nvml: ModuleType | None = None) -> None:
        self.config = config
        self.clock = clock
        self.host = socket.gethostname()
        self.state = MetricsState(run_ttl_s=config.run_ttl_s)
        self.ingestor = Ingestor(store=config.store, state=self.state, clock=clock, config=config.ingest)
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.registry.register(MeshscopeCollector(self.state, host=self.host, version=version()))
        sample_gpus = nvml is not None and config.gpu_interval_s > 0
        self.gpu = GpuSampler(nvml, host=self.host, clock=clock) if sample_gpus else None
        self.server: MetricsServer | None = None
        self._next_gpu = 0.0
        self.otlp = (OtlpPusher(self.registry, config=config.otlp, host=self.host, version=version(), clock=clock)
                     if config.otlp is not None else None)
        self.uploader = (Uploader(store=config.store, config=config.upload, state=self.state, clock=clock)
                         if config.upload is not None else None)
        self._next_retain = 0.0

    def serve(self) -> int:
        """Start the /metrics endpoint; returns the bound port."""
        self.server = serve_metrics(self.registry, host=self.config.host, port=self.config.port)
        return self.server.port

    def step(self) -> bool:
        """One loop iteration: ingest, sample GPUs when due, expire ended runs. True if data arrived."""
        progress = self.ingestor.poll()
        now = self.clock.now()
        if self.gpu is not None and now >= self._next_gpu:
            self._next_gpu = now + self.config.gpu_interval_s
            self.sample_gpus()
        self.state.expire(now)
        if self.uploader is not None and now >= self._next_retain:  # here: the ingest thread owns the parts
            self._next_retain = now + RETAIN_INTERVAL_S
            self.uploader.retain(durable=self.ingestor.durable)
        return progress

    def sample_gpus(self) -> None:
        rows = self.gpu.sample()
        with self.state.lock:
            self.state.gpu_errors = self.gpu.errors
            for row in rows:
                self.state.gpus[row.gpu] = row._asdict()
        self.ingestor.add_gpu_rows(rows)

    def run(self, stop: threading.Event) -> None:
        """Loop until ``stop`` is set, then write everything buffered to the store."""
        if self.uploader is not None:
            self.uploader.start()
        if self.otlp is not None:
            self.otlp.start()
        while not stop.is_set():
            if not self.step():
                stop.wait(self.config.poll_interval_s)
        self.ingestor.poll(final=True)
        if self.uploader is not None:
            self.uploader.stop()  # one last pass over what the final flush wrote
        if self.otlp is not None:
            self.otlp.stop()  # one last push of what the final poll took in

    def run_once(self) -> None:
        if self.gpu is not None:
            self.sample_gpus()
        self.ingestor.ingest_all()
        if self.uploader is not None:
            self.uploader.start()
            self.uploader.stop()
        if self.otlp is not None:
            self.otlp.push()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.gpu is not None:
            self.gpu.close()
        if self.otlp is not None:
            self.otlp.stop()  # idempotent; here for a run() that did not get to its end

