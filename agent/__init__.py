"""meshscope's instrumentation (``agent.instrument``), spool transport (``agent.transport``) and node agent
(``agent.collector``)."""

from importlib import metadata


def version() -> str:
    """The installed meshscope distribution's version (``0+unknown`` in a checkout that was not installed):
    recorded in every run record, exported by the agent, printed by ``meshscope --version``."""
    try:
        return metadata.version("meshscope")
    except metadata.PackageNotFoundError:
        return "0+unknown"
