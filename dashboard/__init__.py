"""meshscope dashboard: Streamlit pages over the run store (and Prometheus for the Live page).

The data path, one module per step: the agent's one store reader (``meshscope.agent.store.reader``:
confined, fault-tolerant DuckDB over the Parquet) -> ``data`` (SQL aggregates per page) -> ``analysis`` / ``scaling`` / ``memory_model`` (DataFrame in,
DataFrame out) -> ``figures`` (pure Plotly) -> ``views`` (what a page shows, without Streamlit) ->
``app_pages`` (layout only) under ``app.py``; ``ui`` holds the Streamlit glue and caches,
``cli`` the ``meshscope dashboard`` command. The synthetic stores of the tests and benchmarks are in
``tests/support`` (not installed).
"""
