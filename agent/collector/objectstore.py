"""The run store on S3-compatible object storage: URLs, the client, and the key layout.

The bucket mirrors the local store's tables (``agent.collector.store``) under a prefix::

    s3://<bucket>/<prefix>/tables/<kind>/run=<run>/rank=<rank>/part-<stream>-<start>-<end>.parquet

Part names are idempotent (a part is one byte range of one spool stream, ``agent.collector.parts``), so an
upload repeated after a crash writes the same object again, and "exactly once" in the bucket is the same
rule as on disk: one object per (stream, range), and a part contained in another part of its stream (the
sources of a compaction whose merged part is already up) is ignored by readers and deleted by the agent.

The client is pyarrow's S3 filesystem (the AWS SDK's credential chain: environment, ``~/.aws``
config and credentials files, instance roles). The endpoint comes from ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` (the AWS SDKs' convention), which pyarrow's constructor does not read itself.
pyarrow is imported lazily: the agent without ``--upload`` and the readers of local stores never load
the S3 client.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshscope.agent.collector.parts import contained
from meshscope.agent.contract import KINDS, PART_RE, is_run_name

if TYPE_CHECKING:
    from pyarrow.fs import S3FileSystem

SCHEME = "s3://"
# S3's bucket naming rules (virtual-host style): 3-63 of [a-z0-9.-], starting and ending alphanumeric.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_PART = re.compile(r"^[A-Za-z0-9._=+-]+$")
# A stored part's key below the prefix: the local layout, nothing else (anything else in the bucket is
# ignored, so no key can name a path outside a reader's cache).
_TABLE_KEY = re.compile(r"^tables/(?P<kind>[a-z_]+)/run=(?P<run>[^/]+)/rank=(?P<rank>-?\d+)/(?P<name>[^/]+)$")


def is_remote(location: object) -> bool:
    return str(location).startswith(SCHEME)


@dataclass(frozen=True, slots=True)
class S3Url:
    bucket: str
    prefix: str  # no leading or trailing "/"; "" for the bucket's root

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"

    def path(self, rel: str = "") -> str:
        """pyarrow's path of ``rel`` below the prefix (``bucket/prefix/rel``)."""
        return "/".join(p for p in (self.bucket, self.prefix, rel) if p)


def parse_url(text: str) -> S3Url:
    """``s3://bucket[/prefix]``. Raises ValueError with a message naming the bad value."""
    if not is_remote(text):
        raise ValueError(f"{text!r} is not an s3:// URL (expected s3://bucket/prefix)")
    rest = text[len(SCHEME):]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(f"{text!r}: {bucket!r} is not a valid S3 bucket name (3-63 characters of a-z, 0-9, '.', "
                         "'-', starting and ending with a letter or digit)")
    parts = [p for p in prefix.strip("/").split("/") if p] if prefix.strip("/") else []
    for part in parts:
        if part in (".", "..") or not _PREFIX_PART.match(part):
            raise ValueError(f"{text!r}: prefix component {part!r} is not allowed (letters, digits and . _ = + - "
                             "only; no '.' or '..')")
    return S3Url(bucket=bucket, prefix="/".join(parts))


def endpoint_from_env() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def filesystem(*, connect_timeout_s: float = 3.0, request_timeout_s: float = 30.0, attempts: int = 3) -> S3FileSystem:
    """pyarrow's S3 client with bounded timeouts and retries (callers add their own backoff on top).

    ``allow_delayed_open``: a part is written with one PutObject rather than a multipart upload, which
    is one request instead of three and leaves no incomplete uploads behind when the writer is killed."""
    from pyarrow import fs

    return fs.S3FileSystem(endpoint_override=endpoint_from_env(), connect_timeout=connect_timeout_s,
                           request_timeout=request_timeout_s, allow_delayed_open=True,
                           retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=attempts))


@dataclass(frozen=True, slots=True)
class RemotePart:
    rel: str  # key below the prefix: tables/<kind>/run=<run>/rank=<rank>/<name>
    directory: str  # tables/<kind>/run=<run>/rank=<rank>
    stream: str
    start: int
    end: int
    size: int


def table_part(rel: str, size: int) -> RemotePart | None:
    """The part a key below the prefix names, or None when it is not a part of the store's layout."""
    m = _TABLE_KEY.match(rel)
    if not m or m["kind"] not in KINDS or not is_run_name(m["run"]):
        return None
    name = PART_RE.match(m["name"])
    if not name:
        return None
    return RemotePart(rel=rel, directory=rel.rsplit("/", 1)[0], stream=name["stream"], start=int(name["start"]),
                      end=int(name["end"]), size=size)


def list_parts(s3: S3FileSystem, url: S3Url) -> dict[str, RemotePart]:
    """Every part under ``url`` (one flat listing), by key below the prefix. Raises OSError."""
    from pyarrow import fs

    base = url.path("tables")
    cut = len(url.path()) + 1
    out: dict[str, RemotePart] = {}
    for info in s3.get_file_info(fs.FileSelector(base, recursive=True, allow_not_found=True)):
        if info.type == fs.FileType.File:
            part = table_part(info.path[cut:], int(info.size or 0))
            if part is not None:
                out[part.rel] = part
    return out


def superseded(parts: list[RemotePart]) -> set[str]:
    """Keys of parts contained in another part of the same directory and stream (compaction sources
    whose merged part is up): readers ignore them, the uploader deletes them."""
    return contained((p.rel, (p.directory, p.stream), p.start, p.end) for p in parts)


def check_bucket(s3: S3FileSystem, url: S3Url) -> None:
    """A listing of the prefix: raises OSError when the bucket is missing, access is denied or the
    endpoint cannot be reached."""
    from pyarrow import fs

    s3.get_file_info(fs.FileSelector(url.path(), recursive=False, allow_not_found=True))


def describe_error(exc: BaseException, *, url: S3Url) -> str:
    """One line for the user from a pyarrow S3 error (its text names the AWS error code)."""
    text = str(exc)
    if "NO_SUCH_BUCKET" in text:
        return f"bucket {url.bucket!r} does not exist ({url})"
    if any(code in text for code in ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH",
                                     "Forbidden", "403")):
        return f"access to {url} denied: check the AWS credentials (environment or ~/.aws)"
    if "NETWORK_CONNECTION" in text or "curlCode" in text:
        where = endpoint_from_env() or "the default AWS endpoint"
        return f"cannot reach {where} for {url}"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"{url}: {first}"
