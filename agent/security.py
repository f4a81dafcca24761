"""Security helpers: PromQL literals for user-supplied label values, and the agent's basic-auth file.

PromQL. A label value that comes from configuration or user input (a run name typed into the dashboard,
a job label in a config file) must never be spliced into a query as raw text: a ``"`` ends the string
and the rest becomes PromQL. :func:`promql_label_value` returns a complete double-quoted literal, e.g.
``f"meshscope_rank_last_step{{run={promql_label_value(run)}}}"``; :func:`promql_regex_value` does the
same for ``=~`` / ``!~`` matchers, escaping RE2 metacharacters first so the value matches literally.

Basic auth (``meshscope agent --basic-auth-file FILE``). The file is htpasswd-like, one ``user:hash``
per line; blank lines and lines starting with ``#`` are ignored. Accepted hashes:

- ``$pbkdf2-sha256$<rounds>$<salt>$<checksum>``: PBKDF2-HMAC-SHA256, salt and checksum in passlib's
  "adapted base64" (``+`` written as ``.``, no padding), so ``passlib.hash.pbkdf2_sha256`` reads and
  writes the same strings. Make one with ``python -m meshscope.agent.security hash-password`` (reads the password
  from stdin). No dependency beyond the standard library.
- ``$2a$``, ``$2b$``, ``$2y$``: bcrypt, as written by ``htpasswd -B`` and accepted by Prometheus'
  own web config; needs the ``bcrypt`` package (the agent says so at start if it is missing).

Anything else (plain text, ``{SHA}``, ``$apr1$`` MD5, crypt) is refused at start with the line number.
A verified (user, password) pair is remembered for the life of the process (keyed by an HMAC with a
per-process key, never stored in clear), so Prometheus scraping every few seconds costs one hash a
process, not one a scrape. Hash computations are serialised: a flood of wrong passwords costs at most
one CPU core, never all of them (the node's training ranks need those).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

# ------------------------------------------------------------------------------------------------ PromQL

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
# RE2 metacharacters (Prometheus anchors regex matchers and uses Go's RE2 syntax).
_RE2_META = frozenset(r"\.+*?()|[]{}^$")


def promql_label_value(value: str) -> str:
    """``value`` as a PromQL double-quoted string literal (quotes included).

    Escapes backslash, double quote, newline, carriage return and tab with their usual escapes and every
    other control character as ``\\uXXXX``; everything else (any Unicode) stays as it is. The escapes are
    the ones PromQL (Go) and JSON share, so ``json.loads`` of the result gives ``value`` back. Raises
    ``ValueError`` for strings that are not valid Unicode text (lone surrogates), which no label can hold.
    """
    if not isinstance(value, str):
        raise TypeError(f"label value must be a str, got {type(value).__name__}")
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        elif 0xD800 <= code <= 0xDFFF:
            raise ValueError(f"label value {value!r} is not valid Unicode (lone surrogate U+{code:04X})")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def promql_regex_value(value: str) -> str:
    """A literal for a regex matcher (``=~``) that matches exactly ``value``: RE2 metacharacters are
    backslash-escaped first, then the result is quoted like :func:`promql_label_value`."""
    return promql_label_value("".join("\\" + ch if ch in _RE2_META else ch for ch in value))


# -------------------------------------------------------------------------------------------- passwords

PBKDF2_PREFIX = "$pbkdf2-sha256$"
DEFAULT_ROUNDS = 100_000  # ~0.1 s on one core here; only paid once per process per valid pair
_BCRYPT_PREFIXES = ("$2a$", "$2b$", "$2y$")
_PBKDF2 = re.compile(r"^\$pbkdf2-sha256\$(\d{1,9})\$([A-Za-z0-9./]*)\$([A-Za-z0-9./]{43})$")


def _ab64_encode(raw: bytes) -> str:
    return base64.b64encode(raw).decode().rstrip("=").replace("+", ".")


def _ab64_decode(text: str) -> bytes:
    text = text.replace(".", "+")
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


def hash_password(password: str, *, rounds: int = DEFAULT_ROUNDS, salt: bytes | None = None) -> str:
    """A ``$pbkdf2-sha256$`` hash of ``password`` (a random 16-byte salt unless given)."""
    if rounds < 1000:
        raise ValueError(f"rounds ({rounds}) must be >= 1000")
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, rounds)
    return f"{PBKDF2_PREFIX}{rounds}${_ab64_encode(salt)}${_ab64_encode(digest)}"


def check_hash(hashed: str) -> str | None:
    """Why ``hashed`` cannot be used (one line), or None if it can."""
    if hashed.startswith(PBKDF2_PREFIX):
        m = _PBKDF2.match(hashed)
        if m is None:
            return "malformed $pbkdf2-sha256$ hash (expected $pbkdf2-sha256$<rounds>$<salt>$<checksum>)"
        try:
            _ab64_decode(m.group(2))
            _ab64_decode(m.group(3))
        except (binascii.Error, ValueError):
            return "malformed $pbkdf2-sha256$ hash (salt or checksum is not adapted base64)"
        return None
    if hashed.startswith(_BCRYPT_PREFIXES):
        try:
            import bcrypt  # noqa: F401, PLC0415 - optional: only for bcrypt entries
        except ImportError:
            return ("bcrypt hash, but the 'bcrypt' package is not installed (pip install bcrypt), or use a "
                    "$pbkdf2-sha256$ hash from: python -m meshscope.agent.security hash-password")
        return None
    return ("unsupported hash: use $pbkdf2-sha256$ (python -m meshscope.agent.security hash-password) or bcrypt "
            "(htpasswd -B); plain text, {SHA}, $apr1$ and crypt are refused")


def verify_password(password: str, hashed: str) -> bool:
    """True if ``password`` matches ``hashed`` (a hash :func:`check_hash` accepts); constant-time compare."""
    if hashed.startswith(PBKDF2_PREFIX):
        m = _PBKDF2.match(hashed)
        if m is None:
            return False
        rounds, salt, want = int(m.group(1)), _ab64_decode(m.group(2)), _ab64_decode(m.group(3))
        got = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, rounds)
        return hmac.compare_digest(got, want)
    if hashed.startswith(_BCRYPT_PREFIXES):
        import bcrypt  # noqa: PLC0415

        try:
            return bcrypt.checkpw(password.encode(), hashed.encode())
        except ValueError:
            return False
    return False


class CredentialsError(ValueError):
    """A basic-auth file that cannot be used; the message names the file and line."""


@dataclass(slots=True)
class Credentials:
    """Users and their password hashes, checked with :meth:`check`. Thread-safe."""

    users: dict[str, str]
    _verified: set[bytes] = field(default_factory=set)
    _key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _dummy: str = ""

    MAX_CACHED = 256

    @classmethod
    def load(cls, path: str | Path) -> Credentials:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CredentialsError(f"cannot read basic-auth file {str(path)!r}: "
                                   f"{getattr(exc, 'strerror', None) or exc}") from None
        users: dict[str, str] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            user, sep, hashed = line.partition(":")
            where = f"basic-auth file {str(path)!r} line {number}"
            if not sep or not user or not hashed:
                raise CredentialsError(f"{where}: expected user:hash")
            if user in users:
                raise CredentialsError(f"{where}: user {user!r} listed twice")
            problem = check_hash(hashed)
            if problem:
                raise CredentialsError(f"{where}: {problem}")
            users[user] = hashed
        if not users:
            raise CredentialsError(f"basic-auth file {str(path)!r} lists no user")
        creds = cls(users=users)
        # Unknown users cost one hash too, so response time does not tell which user names exist.
        creds._dummy = next(iter(users.values()))
        return creds

    def check(self, user: str, password: str) -> bool:
        token = hmac.new(self._key, f"{user}\0{password}".encode("utf-8", "surrogatepass"), "sha256").digest()
        if token in self._verified:
            return True
        with self._lock:  # one hash at a time: bounded CPU under a flood of bad passwords
            hashed = self.users.get(user)
            ok = verify_password(password, hashed if hashed is not None else self._dummy) and hashed is not None
            if ok:
                if len(self._verified) >= self.MAX_CACHED:
                    self._verified.clear()
                self._verified.add(token)
        return ok


def parse_basic_authorization(header: str | None) -> tuple[str, str] | None:
    """(user, password) from an ``Authorization: Basic ...`` header value; None if absent or malformed."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


def main(argv: list[str] | None = None) -> int:
    """``python -m meshscope.agent.security hash-password [--rounds N]``: read a password from stdin (without echo
    on a terminal), print its ``$pbkdf2-sha256$`` hash for a basic-auth file line ``user:<hash>``."""
    import argparse  # noqa: PLC0415
    import getpass  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m meshscope.agent.security", description=main.__doc__.split(":")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    hp = sub.add_parser("hash-password", help="hash a password read from stdin")
    hp.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    args = ap.parse_args(argv)
    password = getpass.getpass("password: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\r\n")
    if not password:
        print("python -m meshscope.agent.security: error: empty password", file=sys.stderr)
        return 2
    print(hash_password(password, rounds=args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
