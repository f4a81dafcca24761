"""Reading spool files: follow a file from a byte offset, return complete valid frames, skip damage.

The reader is the agent's only contact with bytes written by ranks, so it never raises on bad input: a
damaged frame is counted under a reason (``REJECT_REASONS``) and the reader resynchronises to the next
frame magic, so valid frames after the damage still flow. An incomplete frame at the end of the file is
the writer still writing: the reader stops before it and returns the offset to resume from.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from meshscope.agent.transport.frame import (
    FRAME_HEADER_SIZE, HEADER_KIND, MAGIC, FrameError, decode_payload, parse_frame_header,
)


@dataclass(slots=True)
class Frame:
    """One valid frame: ``table`` for data frames, ``header`` (dict) for the file header frame."""

    kind: str
    schema_version: int
    offset: int  # where the frame starts in the file
    end: int  # offset just after it
    table: pa.Table | None = None
    header: dict | None = None


@dataclass(slots=True)
class ReadResult:
    frames: list[Frame]
    offset: int  # where to resume: after the last frame or damage consumed; an incomplete tail stays
    rejected: list[tuple[int, str, str]] = field(default_factory=list)  # (offset, reason, detail)
    more: bool = False  # True when the read stopped at max_bytes with more data after it


class SpoolReader:
    """Reads the frames of one spool file.

    ``rejections`` counts rejections per reason over the reader's life; ``recent_rejections`` keeps the
    last few (offset, reason, detail) for diagnostics. ``read`` never raises: an unreadable or vanished
    file reads as "nothing new" and is retried by the caller.
    """

    def __init__(self, path: str | Path, *, max_read_bytes: int = 8 * 1024 * 1024) -> None:
        self.path = Path(path)
        self.max_read_bytes = max_read_bytes
        self.rejections: collections.Counter[str] = collections.Counter()
        self.recent_rejections: collections.deque[tuple[int, str, str]] = collections.deque(maxlen=32)

    def size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except OSError:
            return 0

    def read(self, offset: int, *, stop: int | None = None, max_bytes: int | None = None) -> ReadResult:
        """Frames starting at ``offset``, reading about ``max_bytes`` of file (a larger single frame is
        still read whole) and never past ``stop`` (used to replay an exact byte range)."""
        want = self.max_read_bytes if max_bytes is None else max_bytes
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                end = size if stop is None else min(stop, size)
                avail = max(0, end - offset)
                length = min(want, avail)
                while True:
                    buf = os.pread(fh.fileno(), length, offset)
                    if len(buf) < length:  # the file shrank under us (replaced): take what is there
                        avail = len(buf)
                    parsed = _parse(buf, offset, complete=len(buf) >= avail)
                    if parsed.frames or parsed.rejected or len(buf) >= avail or parsed.need <= len(buf):
                        break
                    length = min(max(parsed.need, 2 * length), avail)  # one frame larger than max_bytes
        except OSError:
            return ReadResult(frames=[], offset=offset)
        for item in parsed.rejected:
            self.rejections[item[1]] += 1
            self.recent_rejections.append(item)
        return ReadResult(
            frames=parsed.frames, offset=parsed.offset, rejected=parsed.rejected, more=len(buf) < avail
        )


@dataclass(slots=True)
class _Parsed:
    frames: list[Frame]
    offset: int
    rejected: list[tuple[int, str, str]]
    need: int  # buffer length needed to make progress past ``offset``


def _parse(buf: bytes, base: int, *, complete: bool) -> _Parsed:
    """Parse frames in ``buf`` (file bytes from offset ``base``). ``complete``: buf reaches the end of
    what can be read now, so a frame running past it is either still being written or truncated."""
    view = memoryview(buf)
    frames: list[Frame] = []
    rejected: list[tuple[int, str, str]] = []
    pos, n, need = 0, len(buf), 0
    while pos < n:
        if n - pos < FRAME_HEADER_SIZE:
            head = buf[pos:pos + len(MAGIC)]
            if MAGIC.startswith(head):
                need = pos + FRAME_HEADER_SIZE  # a frame header still being written
                break
            skip = _find_magic(buf, pos + 1)
            rejected.append((base + pos, "bad_magic", f"{skip - pos} bytes that are not a frame"))
            pos = skip
            continue
        try:
            kind, version, length, crc = parse_frame_header(view, pos)
        except FrameError as err:
            skip = _find_magic(buf, pos + 1)
            detail = f"{skip - pos} bytes that are not a frame" if err.reason == "bad_magic" else err.detail
            rejected.append((base + pos, err.reason, detail))
            pos = skip
            continue
        frame_end = pos + FRAME_HEADER_SIZE + length
        if frame_end > n:
            if complete:
                # Still being written, unless another valid frame header starts inside the declared
                # payload: then this frame was cut short (its writer died) and will never complete.
                nxt = _next_valid_header(buf, view, pos + FRAME_HEADER_SIZE)
                if nxt is not None:
                    rejected.append((base + pos, "truncated", f"cut short; next frame at {base + nxt}"))
                    pos = nxt
                    continue
            need = frame_end
            break
        payload = view[pos + FRAME_HEADER_SIZE:frame_end]
        if (pos + FRAME_HEADER_SIZE) % 8:
            # Frames after damage of odd length sit off the 8-byte grid: give Arrow an aligned copy (it
            # warns on stderr for every unaligned buffer, and some kernels are slow or unsafe on them).
            payload = memoryview(bytes(payload))
        try:
            decoded = decode_payload(kind, version, payload, crc)
        except FrameError as err:
            if err.reason == "bad_payload_crc":
                # A frame cut short (its writer died) followed by good frames: the first of them starts
                # inside its declared length, possibly in its last bytes, so that frame's header (or
                # magic) may run past the declared end and past this buffer. Resume at the first of
                # them; otherwise skip the damaged frame whole.
                nxt = _next_valid_header(buf, view, pos + FRAME_HEADER_SIZE, limit=frame_end)
                if nxt is None:
                    unsure = _unverifiable_header(buf, pos + FRAME_HEADER_SIZE, limit=frame_end)
                    if unsure is not None and not complete:
                        need = unsure + FRAME_HEADER_SIZE  # read that header before deciding
                        break
                    nxt = unsure  # at the end of the file: a frame header still being written
                if nxt is not None:
                    rejected.append((base + pos, "truncated", f"cut short; next frame at {base + nxt}"))
                    pos = nxt
                    continue
            rejected.append((base + pos, err.reason, err.detail))
            pos = frame_end
            continue
        if kind == HEADER_KIND:
            frames.append(Frame(kind, version, base + pos, base + frame_end, header=decoded))
        else:
            frames.append(Frame(kind, version, base + pos, base + frame_end, table=decoded))
        pos = frame_end
    return _Parsed(frames, base + pos, rejected, need)


def _find_magic(buf: bytes, start: int) -> int:
    """Position of the next MAGIC at or after ``start``; if none, the end of ``buf`` less a tail that
    could be the beginning of a magic still being written."""
    found = buf.find(MAGIC, start)
    if found >= 0:
        return found
    n = len(buf)
    for keep in range(len(MAGIC) - 1, 0, -1):
        if n - keep >= start and buf.endswith(MAGIC[:keep]):
            return n - keep
    return max(n, start)


def _next_valid_header(buf: bytes, view: memoryview, start: int, *, limit: int | None = None) -> int | None:
    """The first position in [start, limit) where a frame header with a valid CRC starts (the header
    itself may extend past ``limit``)."""
    end = len(buf) if limit is None else min(len(buf), limit + len(MAGIC) - 1)
    pos = buf.find(MAGIC, start, end)
    while 0 <= pos <= len(buf) - FRAME_HEADER_SIZE:
        try:
            parse_frame_header(view, pos)
            return pos
        except FrameError:
            pos = buf.find(MAGIC, pos + 1, end)
    return None


def _unverifiable_header(buf: bytes, start: int, *, limit: int) -> int | None:
    """The first position in [start, limit) where a frame could start whose header runs past the end of
    ``buf``: a full magic with fewer than FRAME_HEADER_SIZE bytes after it, or a partial magic at the
    very end. Such a header can only be checked once more bytes are read."""
    first = max(start, len(buf) - FRAME_HEADER_SIZE + 1)
    for pos in range(first, min(limit, len(buf))):
        tail = buf[pos:pos + len(MAGIC)]
        if tail == MAGIC or (len(tail) < len(MAGIC) and MAGIC.startswith(tail)):
            return pos
    return None
