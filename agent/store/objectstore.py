"""The run store on S3-compatible object storage: URLs, the client, and the key layout.

The bucket mirrors the local store's tables under a prefix, with the same keys (``agent.contract.storelayout``)::

    s3://<bucket>/<prefix>/tables/<kind>/run=<run>/rank=<rank>/part-<stream>-<start>-<end>.parquet
    s3://<bucket>/<prefix>/tables/<kind>/run=<run>/packs/pack-<id>.parquet        (agent.store.packs)

Part names are idempotent (a part is one byte range of one spool stream, ``agent.store.parts``), so an
upload repeated after a crash writes the same object again, and "exactly once" in the bucket is the same
rule as on disk: one object per (stream, range), and what a compaction or a pack replaced (a part inside
another part of its stream or inside a pack's ranges, a pack inside another pack) is ignored by readers
and deleted by the agent once its replacement is up.

The client is pyarrow's S3 filesystem (the AWS SDK's credential chain: environment, ``~/.aws``
config and credentials files, instance roles). The endpoint comes from ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` (the AWS SDKs' convention), which pyarrow's constructor does not read itself.
pyarrow is imported lazily: the agent without ``--upload`` and the readers of local stores never load
the S3 client.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshscope.agent.store.packs import PartRef
from meshscope.agent.store.packs import superseded as packs_superseded
from meshscope.agent.contract import KINDS, PACK_RE, PART_RE, is_run_name
from meshscope.agent.contract.storelayout import TABLE_KEY, StoreLayout

if TYPE_CHECKING:
    from pyarrow.fs import S3FileSystem

SCHEME = "s3://"
# S3's bucket naming rules (virtual-host style): 3-63 of [a-z0-9.-], starting and ending alphanumeric.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_PART = re.compile(r"^[A-Za-z0-9._=+-]+$")
# A stored part's key below the prefix: the local layout, nothing else (anything else in the bucket is
# ignored, so no key can name a path outside a reader's cache).
_KEYS = StoreLayout.keys()


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
    """A part (``tables/<kind>/run=<run>/rank=<rank>/part-*``) or a pack (``.../run=<run>/packs/pack-*``,
    ``rank`` None: its ranges are in its manifest, ``agent.store.packs``)."""

    rel: str  # key below the prefix
    run_dir: str  # tables/<kind>/run=<run>
    rank: int | None
    stream: str
    start: int
    end: int
    size: int

    @property
    def pack(self) -> bool:
        return self.rank is None


def table_part(rel: str, size: int) -> RemotePart | None:
    """The part or pack a key below the prefix names, or None when it is not one of the store's layout."""
    m = TABLE_KEY.match(rel)
    if not m or m["kind"] not in KINDS or not is_run_name(m["run"]):
        return None
    run_dir = str(_KEYS.run_dir(m["kind"], m["run"]))
    if m["packs"]:
        return RemotePart(rel, run_dir, None, "", 0, 0, size) if PACK_RE.match(m["name"]) else None
    name = PART_RE.match(m["name"])
    if not name:
        return None
    return RemotePart(rel=rel, run_dir=run_dir, rank=int(m["rank"]), stream=name["stream"], start=int(name["start"]),
                      end=int(name["end"]), size=size)


def list_parts(s3: S3FileSystem, url: S3Url) -> dict[str, RemotePart]:
    """Every part under ``url`` (one flat listing), by key below the prefix. Raises OSError."""
    from pyarrow import fs

    base = url.path(str(_KEYS.tables))
    cut = len(url.path()) + 1
    out: dict[str, RemotePart] = {}
    for info in s3.get_file_info(fs.FileSelector(base, recursive=True, allow_not_found=True)):
        if info.type == fs.FileType.File:
            part = table_part(info.path[cut:], int(info.size or 0))
            if part is not None:
                out[part.rel] = part
    if not out:
        _bucket_exists(s3, url)
    return out


def _bucket_exists(s3: S3FileSystem, url: S3Url) -> None:
    """Raises OSError when the bucket is missing: an empty listing with ``allow_not_found`` does not tell
    a missing bucket from an empty prefix (pyarrow 26 against moto 5 lists nothing and raises nothing)."""
    from pyarrow import fs

    try:
        info = s3.get_file_info(url.bucket)
    except OSError:
        return  # e.g. credentials scoped to the prefix may not HEAD the bucket: not evidence it is missing
    if info.type == fs.FileType.NotFound:
        raise FileNotFoundError(f"NO_SUCH_BUCKET: bucket {url.bucket!r} not found")


def superseded(parts: Iterable[RemotePart], manifests: Mapping[str, tuple | None]) -> set[str]:
    """Keys of what a compaction or a packing replaced (``agent.store.packs.superseded``, per run
    directory): readers ignore them, the uploader deletes them. ``manifests``: pack key -> its manifest."""
    by_run: dict[str, list[RemotePart]] = {}
    for p in parts:
        by_run.setdefault(p.run_dir, []).append(p)
    out: set[str] = set()
    for group in by_run.values():
        refs = [PartRef(p.rel, p.rank, p.stream, p.start, p.end) for p in group if not p.pack]
        out |= packs_superseded(refs, [(p.rel, manifests.get(p.rel)) for p in group if p.pack])
    return out


def check_bucket(s3: S3FileSystem, url: S3Url) -> None:
    """A listing of the prefix: raises OSError when the bucket is missing, access is denied or the
    endpoint cannot be reached."""
    from pyarrow import fs

    s3.get_file_info(fs.FileSelector(url.path(), recursive=False, allow_not_found=True))
    _bucket_exists(s3, url)


def gone(exc: BaseException) -> bool:
    """Whether an S3 error says the object is not there (deleted since a listing: a pack merged away).
    pyarrow raises FileNotFoundError for some calls and a plain OSError naming the AWS error for GETs."""
    text = str(exc)
    return isinstance(exc, FileNotFoundError) or "RESOURCE_NOT_FOUND" in text or "NoSuchKey" in text


_AWS_ERROR = re.compile(r"(?:AWS Error |^)([A-Z][A-Z_]+)\b", re.M)  # pyarrow's, or ours (_bucket_exists)
_HTTP_403 = re.compile(r"\b(?:HTTP (?:status|response code)[: ]*403|403 Forbidden)\b")
_DENIED = {"ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH"}


def describe_error(exc: BaseException, *, url: S3Url) -> str:
    """One line for the user from a pyarrow S3 error. Classified by the AWS error code and HTTP status it
    names, never by a bare substring of the text: the text also holds the object's key, whose byte
    offsets can read "...403..." (a lost connection was once reported as "access denied" that way)."""
    text = str(exc)
    codes = set(_AWS_ERROR.findall(text))
    if "NETWORK_CONNECTION" in codes or "curlCode" in text:
        where = endpoint_from_env() or "the default AWS endpoint"
        return f"cannot reach {where} for {url}"
    if "NO_SUCH_BUCKET" in codes:
        return f"bucket {url.bucket!r} does not exist ({url})"
    if codes & _DENIED or _HTTP_403.search(text):
        return f"access to {url} denied: check the AWS credentials (environment or ~/.aws)"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"{url}: {first}"
