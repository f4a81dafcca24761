"""meshscope's instrumentation (``agent.instrument``), spool transport (``agent.transport``) and node agent
(``agent.collector``)."""

from importlib import metadata

# The agent's public parts: all that the trainer, the dashboard, the CLI (and a user's loop) import from the
# agent; the rest is the agent's own business. tests/test_imports.py holds every module to this list.
PUBLIC = (
    "meshscope.agent",  # version()
    "meshscope.agent.contract",  # schema, records, clock, run and file names, busbw: what every side agrees on
    "meshscope.agent.contract.layout",  # the parallel-layout rules and model flavors the trainer runs and the planner predicts
    "meshscope.agent.cliargs",  # the one shape of a command line
    "meshscope.agent.instrument.telemetry",  # Telemetry, TelemetryConfig: the in-process API
    "meshscope.agent.instrument.nulltelemetry",  # NullTelemetry: the same API when telemetry is off
    "meshscope.agent.instrument.flops",  # device peak FLOP/s, MFU's denominator
    "meshscope.agent.store.reader",  # the one reader of the run store
    "meshscope.agent.collector.catchup",  # readers take in what the spools hold beyond the store
    "meshscope.agent.deeptrace",  # meshscope trace: arm torch.profiler on a running job, collect, merge
    "meshscope.agent.zerocode",  # observe(): zero-code observation of an unmodified loop
    "meshscope.agent.zerocode.frameworks",  # the Hugging Face and Lightning callbacks
    "meshscope.agent.security",  # PromQL quoting of label values built from run names
)


def version() -> str:
    """The installed meshscope distribution's version (``0+unknown`` in a checkout that was not installed):
    recorded in every run record, exported by the agent, printed by ``meshscope --version``."""
    try:
        return metadata.version("meshscope")
    except metadata.PackageNotFoundError:
        return "0+unknown"
