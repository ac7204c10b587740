"""The audit record: the closed set of facts about one ended call that may leave the gateway.

The audit trail, the trace span and (later) the live event stream are all built from one
``AuditRecord`` and from nothing else, so what they can say is decided here, once, by type.
The record holds ids, names and decisions. It never holds a request or response body, a
query value, a header value, SQL text or tool arguments: a body is represented by its size
and a keyed digest (HMAC-SHA256 under the audit key), so someone holding the key can check
that a given body was the one sent, while someone reading the trail cannot recover a short
secret by guessing and hashing candidates (a plain hash of ``{"pin":"1234"}`` can be
reversed that way).

Strings the agent controls (tool names, query parameter names, the method) are kept only
when they are short and made of a safe alphabet; anything else is written as ``~`` and a
short keyed digest of it, which still lets two lines be correlated without the text.

``AUDIT_RECORD_VERSION`` is written in every line as ``v``; fields are added, never renamed.
The trail writes a record in a ``decision`` line (``audit_trail.py``); ``docs/audit.md``
specifies every line type.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterable
from typing import Any, NotRequired, TypedDict

AUDIT_RECORD_VERSION = 2  # 2: written in typed lines (docs/audit.md); 1: one line per call
MAX_PATH = 512  # characters of the path kept (the path is the policy's subject, never a value)
MAX_NAMES = 32  # query parameter names / tool names kept per call
MAX_LABEL = 128  # characters of one agent-controlled name
# An agent-controlled name is written as it is only when it matches this.
_SAFE_LABEL = re.compile(rf"[A-Za-z0-9_.:/@+-]{{1,{MAX_LABEL}}}")


_BLOCK = 64  # SHA-256's block size, in bytes (RFC 2104's B)


def audit_key_id(key: bytes) -> str:
    """The audit key's public name: 16 hex digits of a SHA-256 of it (domain-separated), never
    the key. Written in ``start`` checkpoints and ``key`` lines: which key made a line's digests."""
    return hashlib.sha256(b"capgate-audit-key-id\x00" + key).hexdigest()[:16]


class BodyMac:
    """Keyed digests of bodies and labels under the audit key (or sizes only, with no key).

    HMAC-SHA256 (RFC 2104), with the two keyed SHA-256 states computed once: each digest
    copies them instead of keying again, in C calls only (``hmac.HMAC`` adds a Python layer
    around the same steps, which costs more than the hashing for a small body).

    ``rekey`` changes the key in place (``key_reload.py``: every stage holding this object
    digests under the new key from then on); a call whose decision line was written under an
    earlier key keeps that key for its response digest (``under``), so every digest in a
    call's lines is under the key of its decision line.
    """

    __slots__ = ("_key", "_inner", "_outer", "kid", "_earlier")

    def __init__(self, key: bytes | None) -> None:
        self._earlier: dict[str, BodyMac] = {}
        self._set(key)

    def _set(self, key: bytes | None) -> None:
        self._key = key
        self._inner: Any = None
        self._outer: Any = None
        self.kid: str | None = None
        if key is not None:
            self.kid = audit_key_id(key)
            block = hashlib.sha256(key).digest() if len(key) > _BLOCK else key
            block = block.ljust(_BLOCK, b"\0")
            self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
            self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def rekey(self, key: bytes) -> None:
        """Digest under ``key`` from now on; the key before stays reachable by ``under``."""
        if self.kid is not None and self._key is not None:
            self._earlier[self.kid] = BodyMac(self._key)
        self._set(key)
        self._earlier.pop(self.kid or "", None)

    def under(self, kid: str | None) -> BodyMac:
        """The digests of the key named ``kid`` (a call's decision key), this one by default."""
        if kid is None or kid == self.kid:
            return self
        return self._earlier.get(kid, self)

    @property
    def keyed(self) -> bool:
        return self._key is not None

    def of(self, data: bytes) -> BodyDigest:
        if self._inner is None:
            return {"size": len(data)}
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return {"size": len(data), "hmac": outer.hexdigest()}

    def stream(self) -> BodyHasher:
        return BodyHasher(self._inner.copy() if self._inner is not None else None, self._outer)

    def label(self, text: str) -> str:
        """``text`` itself when it is a short safe name; otherwise ``~`` and a keyed digest."""
        if _SAFE_LABEL.fullmatch(text):
            return text
        data = text.encode("utf-8", "surrogatepass")
        if self._key is None:
            return "~" + hashlib.sha256(b"capgate-label\x00" + data).hexdigest()[:16]
        return "~" + hmac.digest(self._key, b"label\x00" + data, "sha256").hex()[:16]


class BodyHasher:
    """A body digest computed chunk by chunk, as the body streams through."""

    __slots__ = ("_inner", "_outer", "size")

    def __init__(self, inner: Any, outer: Any) -> None:
        self._inner = inner
        self._outer = outer
        self.size = 0

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._inner is not None:
            self._inner.update(chunk)

    def result(self) -> BodyDigest:
        if self._inner is None:
            return {"size": self.size}
        outer = self._outer.copy()
        outer.update(self._inner.digest())
        return {"size": self.size, "hmac": outer.hexdigest()}


class BodyDigest(TypedDict):
    """A body as the audit knows it: its size, and its HMAC-SHA256 under the audit key (hex;
    absent when the gateway has no key)."""

    size: int
    hmac: NotRequired[str]


class McpSummary(TypedDict):
    method: str  # the JSON-RPC method (for an answer: the server's request it answers)
    name: NotRequired[str]  # the tool or prompt, the resource URI, as labels


class SqlSummary(TypedDict):
    kinds: list[str]  # statement kinds of an allowed query
    tables: list[str]  # its tables, as the policy names them


class AuditRecord(TypedDict):
    """What one call did and what was decided, in fields that can never hold a payload.

    A closed set: the type checker refuses any other key, and ``test_advisories.py`` refuses
    any other key in a written line. It is serialised as it is (the trail adds ``prev``).
    """

    v: int  # AUDIT_RECORD_VERSION
    time: str
    request_id: str
    agent: str | None
    jti: str | None
    run: str | None
    upstream: str | None
    method: str
    path: str
    rule: str | None
    decision: str  # allow | deny
    reason: str  # "allowed" or a stable reason code
    status: int | None
    duration_ms: float
    query: NotRequired[list[str]]  # parameter names, in order; never their values
    request_body: NotRequired[BodyDigest]
    response_body: NotRequired[BodyDigest]
    sql: NotRequired[SqlSummary]
    mcp: NotRequired[McpSummary]  # one line per JSON-RPC message, sharing the request id
    approval: NotRequired[str]  # the approval that let the call go on
    operator: NotRequired[str]  # the operator whose action decided it: approved, declined, stopped
    state_error_allowed: NotRequired[bool]  # only ever True
    fault: NotRequired[str]  # a fault injected by --faults (chaos on demand): latency 10s, ...


_second: list[Any] = [None, ""]  # (whole second, its formatted text): one strftime a second
# ".000Z" to ".999Z", so a time is two strings joined (formatting the milliseconds each time
# cost more than the rest of it); the last entry is for a fraction that rounds up to 1000.
_MILLIS = (*(f".{n:03d}Z" for n in range(1000)), ".999Z")


def timestamp(t: float) -> str:
    """``t`` (seconds since the epoch) in UTC, to the millisecond: ``2026-01-31T12:00:00.123Z``."""
    whole = int(t)
    if _second[0] != whole:
        _second[0] = whole
        _second[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    second: str = _second[1]
    return second + _MILLIS[int((t - whole) * 1000)]


def milliseconds(seconds: float) -> float:
    """A duration in milliseconds, to the microsecond (``round(seconds * 1000, 3)`` for a
    duration, in a fourth of its time: ``round`` to decimal places goes through a string)."""
    return int(seconds * 1_000_000 + 0.5) / 1000


def names(mac: BodyMac, items: Iterable[str]) -> list[str]:
    """Agent-controlled names, deduplicated in order, capped in number and alphabet."""
    out: list[str] = []
    for item in items:
        label = mac.label(item)
        if label not in out:
            out.append(label)
            if len(out) >= MAX_NAMES:
                break
    return out
