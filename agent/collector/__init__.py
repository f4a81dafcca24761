"""The node agent: spools → metrics (/metrics) and the Parquet run store.

Readers of the store use :func:`agent.collector.store.read_table` and :func:`list_runs`.
"""

from meshscope.agent.collector.store import list_runs, read_table

__all__ = ["list_runs", "read_table"]
