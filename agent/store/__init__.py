"""The run store: Parquet parts and packs under ``agent.contract.storelayout``'s paths, locally or in an
S3-compatible bucket, and the one reader of them.

Writer side (the node agent, ``agent.collector``, writes through these): ``schema`` (the stored schema of
each kind), ``parts`` (a spool byte range as one idempotent part file), ``packs`` (a node's parts of a run
merged into one sorted file), ``objectstore`` (bucket URLs, client, key listing). Reader side:
``reader`` (``Store``, ``read_table``: confined, fault-tolerant DuckDB over every root), ``tableview``
(the SQL that exposes a kind's files), ``compact`` (segments the reader builds in its cache),
``remote`` (a bucket's parts mirrored into the reader's cache), ``duckconn`` (DuckDB connections).
"""
