"""Rank → agent transport: framed Arrow batches in append-only per-rank spool files.

Rank side: :class:`SpoolWriter` (``submit(kind, rows)`` from the training thread, never blocks or
raises). Agent side: :class:`SpoolReader` (follow a file from an offset, reject damage with a reason).
The on-disk format is documented in :mod:`agent.transport.frame`; the names and schemas it carries are the
contract's (:mod:`agent.contract`).
"""

from meshscope.agent.transport.frame import (
    FORMAT_VERSION, KIND_CODES, MAGIC, REJECT_REASONS, FrameError, encode_data_frame, encode_file_header,
    rows_to_batch,
)
from meshscope.agent.transport.reader import Frame, ReadResult, SpoolReader
from meshscope.agent.transport.writer import SpoolWriter

__all__ = [
    "FORMAT_VERSION", "KIND_CODES", "MAGIC", "REJECT_REASONS", "Frame", "FrameError", "ReadResult",
    "SpoolReader", "SpoolWriter", "encode_data_frame", "encode_file_header", "rows_to_batch",
]
