"""The node agent: spools → metrics (/metrics) and the Parquet run store.

The store's layout and write-side paths are :mod:`agent.store.schema`; every reader of the store goes
through :mod:`agent.store.reader` (``Store``, ``read_table``, ``list_runs``). Nothing is imported
here: the reader loads DuckDB and pandas, which the agent's ingest path must not pay for.
"""
