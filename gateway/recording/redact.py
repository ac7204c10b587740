"""Redaction: what never reaches a recording, decided in one place.

Every record passes through ``RecordingWriter.append`` (``writer.py``), which calls the one
``Redactor`` below on every header, body and target before a byte is written. Four layers,
applied in a single pass over each value:

1. **Provenance.** The credential the gateway injected into this call is known exactly (the
   ``Injection`` of the ``UpstreamRequest``), so it is removed wherever it appears, whatever
   it looks like: the header that carries it becomes ``{"secret": "<name>"}``, and its value
   anywhere else (another header, a request or response body, the target, JSON-escaped or
   percent-encoded) becomes ``[secret:<name>]``. The name is ``Injection.name``
   (``"<upstream>:<type>"``), so a reader knows which credential was there, never its value.
2. **Names.** Headers in ``SENSITIVE_HEADERS`` become ``{"redacted": "header"}``; in JSON
   bodies, every string or number under a key in ``SENSITIVE_KEYS`` (at any depth,
   case-insensitive, ``-`` and ``_`` alike, plus the suffixes in ``SENSITIVE_KEY_SUFFIXES``)
   becomes ``"[redacted:key]"``; in query strings and form bodies, ``name=value`` pairs with
   such a name become ``name=[redacted:key]``.
3. **Shapes.** ``SCANNERS`` find token-like values anywhere (JWTs, PEM private keys, cloud
   and SaaS keys, high-entropy ``Bearer``/``Basic`` credentials) and replace them with
   ``[redacted:<kind>]``.
4. **URLs.** In a URL (``scheme://``, also JSON-escaped or percent-encoded) the userinfo
   becomes ``[redacted:userinfo]`` and the value of a parameter in ``URL_CREDENTIAL_PARAMS``
   (or any sensitive key) ``[redacted:key]``.

A JSON string whose escapes hide ASCII from these byte scans (``"\\u0068unter2"``) is decoded,
redacted as text and written back as one JSON string. A header whose name holds the injected
credential (in any case) or a token shape is not written. Coded bodies are decoded before any
of this (``codings.py``, ``RecordingWriter._coded_body``).

Markers are plain text, so a redacted JSON body stays JSON, and redaction is a pure function
of its input: the replay side redacts an incoming call the same way before computing its
key, so a call whose body held a password still matches its recording.

``lint.py`` checks a whole recording with this same redactor: whatever it would still change
is a finding.

Known limits, on purpose: a secret the gateway did not inject and that has no telling name
or shape (a random string under an innocent key) cannot be recognised; values under
sensitive keys are redacted in JSON bodies only up to ``STRUCTURED_LIMIT`` bytes (larger
bodies get provenance and shape redaction, streamed).
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import unquote

from gateway.credentials import labelled_forms

if TYPE_CHECKING:
    from gateway.credentials import Injection

HeaderValue = str | dict[str, str]
"""A recorded header value: the text, or a marker ``{"secret": name}`` / ``{"redacted": kind}``."""

SENSITIVE_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "authentication",
        "cookie",
        "set-cookie",
        "set-cookie2",
        "x-api-key",
        "api-key",
        "apikey",
        "x-auth-token",
        "x-access-token",
        "x-refresh-token",
        "x-session-token",
        "x-csrf-token",
        "x-xsrf-token",
        "x-amz-security-token",
        "x-goog-api-key",
        "x-vault-token",
        "private-token",
        "x-upstream-token",
    }
)
"""Header names (lower-case) whose whole value is never written."""

VOLATILE_HEADERS = frozenset({"traceparent", "tracestate"})
"""Request headers never written to a recording: W3C trace context is new on every call
(the gateway's own span ids), so recording it would make every run's recording differ and
would replay a stale trace into the next test run. Replay never matches on headers."""

SENSITIVE_KEYS = frozenset(
    {
        "password",
        "passwd",
        "passphrase",
        "secret",
        "token",
        "api_key",
        "apikey",
        "access_token",
        "refresh_token",
        "id_token",
        "auth_token",
        "session_token",
        "client_secret",
        "private_key",
        "secret_key",
        "aws_secret_access_key",
        "authorization",
        "cookie",
        "credential",
        "credentials",
    }
)
"""Body and query keys (normalised: lower-case, ``-`` as ``_``) whose values are never written."""

SENSITIVE_KEY_SUFFIXES = ("_password", "_secret", "_token", "_api_key", "_apikey", "_private_key")
"""A key ending in one of these is sensitive too (``db_password``, ``github_token``)."""

NOT_SENSITIVE_KEYS = frozenset(
    {
        "page_token",
        "next_page_token",
        "prev_page_token",
        "continuation_token",
        "sync_token",
        "max_token",
        "csrf_token_name",
    }
)
"""Keys that end like secrets but name pagination cursors or limits; left as they are."""

URL_CREDENTIAL_PARAMS = frozenset(
    {
        "key",
        "apikey",
        "api_key",
        "access_key",
        "accesskey",
        "access_token",
        "token",
        "auth",
        "auth_token",
        "authorization",
        "password",
        "passwd",
        "pwd",
        "pass",
        "secret",
        "client_secret",
        "sig",
        "signature",
        "x_amz_signature",
        "x_amz_credential",
        "x_amz_security_token",
        "x_goog_signature",
        "x_goog_credential",
        "session",
        "sessionid",
        "session_id",
        "jsessionid",
        "phpsessid",
    }
)
"""Query parameters (normalised like keys) whose values are never written when they appear in
a URL (``scheme://...``) anywhere in a body, header or reason: API keys (``key=`` is Google's),
signed-URL signatures and credentials (S3, GCS, Azure SAS ``sig=``), session ids; and every name
``is_sensitive_key`` accepts. The URL's userinfo (``https://user:pass@host``) goes too."""

STRUCTURED_LIMIT = 16 * 1024 * 1024
"""Bodies up to this size are redacted whole, in memory, with JSON key redaction; larger
ones are streamed through provenance and shape redaction in windows."""

WINDOW = 1024 * 1024
OVERLAP = 64 * 1024  # longer than any pattern below can match (PEM bodies are capped at 16 KiB)

BEARER_MIN_ENTROPY = 3.0  # bits per character; random tokens are ~4.5-6, words ~2.5-3.5

# Token shapes, most specific first (on a tie at one position, the earlier kind wins). Each
# starts with a literal where it can, so the regex engine skips ahead fast; an ``*_inner``
# group marks the part replaced when the match holds a prefix that stays (``Bearer ``).
# Every quantifier is bounded, so a match never outgrows OVERLAP when streaming.
SCANNERS: tuple[tuple[str, bytes], ...] = (
    ("jwt", rb"eyJ[A-Za-z0-9_-]{2,8192}\.eyJ[A-Za-z0-9_-]{2,16384}\.[A-Za-z0-9_-]{0,8192}"),
    (
        "pem",
        rb"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----"
        rb"(?:[\s\S]{0,16384}?-----END[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----"
        rb"|[A-Za-z0-9+/=\s\\:,-]{0,16384})",
    ),
    ("aws_access_key", rb"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA)[0-9A-Z]{16}\b"),
    ("github_token", rb"\bgh[pousr]_[A-Za-z0-9]{36,255}\b|\bgithub_pat_[A-Za-z0-9_]{22,255}\b"),
    ("slack_token", rb"\bxox[abposr]-[A-Za-z0-9-]{10,250}"),
    ("stripe_key", rb"\b[sr]k_(?:live|test)_[A-Za-z0-9]{16,247}\b"),
    ("openai_key", rb"\bsk-(?:proj-|ant-[a-z0-9]{2,8}-)?[A-Za-z0-9_-]{20,200}"),
    ("google_api_key", rb"\bAIza[0-9A-Za-z_-]{35}\b"),
    ("bearer", rb"(?i:\bbearer)[ \t]+(?P<bearer_inner>[A-Za-z0-9._~+/-]{16,4096}=*)"),
    ("basic", rb"(?i:\bbasic)[ \t]+(?P<basic_inner>[A-Za-z0-9+/]{6,4096}={0,2})"),
)

JSON_VALUE = "\x00json"  # the literal's name for values found under sensitive JSON keys
_USERINFO = b"[redacted:userinfo]"

_KIND_NAMES = {name: name.replace("_", "-") for name, _ in SCANNERS}


def normalise_key(key: str) -> str:
    return key.lower().replace("-", "_")


def is_sensitive_key(key: str) -> bool:
    k = normalise_key(key)
    if k in NOT_SENSITIVE_KEYS:
        return False
    return k in SENSITIVE_KEYS or k.endswith(SENSITIVE_KEY_SUFFIXES)


# (A backslash is taken with the character after it, never before a quote: a value inside a
# JSON string ends before its escaped closing quote, so the JSON stays valid.)
_FORM_VALUE = re.compile(rb"=((?:[^&\s\"';,<>\\]|\\[^\"\s]){1,4096})")
# A URL: a scheme, then "://" plain, JSON-escaped ("\/") or percent-encoded ("%3A%2F%2F").
_URL = re.compile(
    rb"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{1,30}(?::|%3[Aa])(?:/|\\/|%2[Ff]){2}"
    rb"(?P<rest>[^\s\"'<>`]{1,8192})"
)
_AUTHORITY_END = re.compile(rb"[/\\?#]|%2[Ff]|%3[Ff]|%23")
_USERINFO_END = re.compile(rb"@|%40")
# One query parameter of a URL, its separators plain, percent-encoded or JSON-escaped.
_URL_PARAM = re.compile(
    rb"(?:[?&;]|%3[Ff]|%26|\\u0026)(?P<name>[A-Za-z0-9_.~%-]{1,80}?)(?:=|%3[Dd]|\\u003[dD])"
    rb"(?P<value>(?:(?!%26|%23|\\u0026)(?:[^&#;\\]|\\[^\"])){1,4096})"
)
# An escape that can hide ASCII text from the byte scans: "\u0068" for "h", "\/" for "/".
# (Escapes of other characters cannot hide a token shape; a known secret's own JSON form,
# non-ASCII escaped, is one of its literals already.)
_HIDING_ESCAPE = re.compile(rb"\\(?:u00[0-7][0-9A-Fa-f]|/)")
# A JSON string literal; only those holding such an escape are decoded and checked.
_JSON_STRING = re.compile(rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')
_KEY_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_KEY_BEFORE = frozenset(b"?&; \t\r\n,")
_COMPILED = tuple((name, re.compile(rx)) for name, rx in SCANNERS)


def entropy(text: bytes) -> float:
    """Shannon entropy in bits per character."""
    if not text:
        return 0.0
    counts = Counter(text)
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def _looks_like_basic(token: bytes) -> bool:
    try:
        decoded = base64.b64decode(token + b"=" * (-len(token) % 4), validate=True)
    except ValueError:
        return False
    return b":" in decoded and all(32 <= b < 127 for b in decoded)


def _looks_like_bearer(token: bytes) -> bool:
    if token.startswith(b"[") or len(token) < 16:
        return False
    has_digit = any(48 <= b <= 57 for b in token)
    has_alpha = any(65 <= b <= 90 or 97 <= b <= 122 for b in token)
    return has_digit and has_alpha and entropy(token) >= BEARER_MIN_ENTROPY


def marker_name(name: str, label: str) -> str:
    """The marker of one form of a known secret: ``[secret:<name>]`` stands for the value as
    sent, ``[secret:<name>#b64.1]`` for its base64 form at alignment 1, and so on, so that
    replay can put back exactly the form the upstream sent (and mask it the same way)."""
    return f"{name}#{label}" if label else name


@dataclass(frozen=True, slots=True)
class KnownSecret:
    """A credential value known by provenance: the gateway put it into the call."""

    name: str  # "<upstream>:<type>", as in Injection.name
    value: str  # the bare secret
    header: str | None = None  # the header the gateway put it in
    header_value: str | None = None  # that header's whole value (prefix included)

    @classmethod
    def from_injection(cls, injection: Injection) -> KnownSecret:
        return cls(
            name=injection.name,
            value=injection.secret.reveal(),
            header=injection.header,
            header_value=injection.value.reveal(),
        )

    def __repr__(self) -> str:  # never show the value, even in a test failure
        return f"KnownSecret(name={self.name!r}, value='****')"

    def literals(self) -> tuple[tuple[str, bytes], ...]:
        """The byte forms the value may take in a body or URL (``labelled_forms``: raw,
        JSON-escaped, %-encoded, base64), and the whole header value, each with the marker
        name that stands for it (``<name>`` for the value itself, ``<name>#<form>`` else),
        longest first, so a header value with its prefix wins over the bare secret."""
        forms = {form: marker_name(self.name, label) for label, form in labelled_forms(self.value)}
        if self.header_value:
            forms.setdefault(self.header_value.encode(), marker_name(self.name, "header"))
        return tuple(
            sorted(((n, f) for f, n in forms.items() if len(f) >= 4), key=lambda i: -len(i[1]))
        )


Span = tuple[int, int, int]
"""(start, end) in the input and the length of what replaced it, for remapping offsets."""


@dataclass(frozen=True, slots=True)
class Redacted:
    data: bytes
    spans: tuple[Span, ...] | None  # None when the body had to be re-serialised (offsets lost)

    @property
    def changed(self) -> bool:
        return self.spans is None or bool(self.spans)


def remap_offsets(offsets: Sequence[int], spans: Sequence[Span]) -> list[int]:
    """Move byte offsets of the input (chunk boundaries) to the redacted output."""
    out: list[int] = []
    for offset in offsets:
        shift = 0
        moved = offset
        for start, end, new_len in spans:
            if end <= offset:
                shift += new_len - (end - start)
            elif start < offset:  # inside a replaced span: move to its end
                moved = start + (end - start)
                shift += new_len - (end - start)
            else:
                break
        out.append(moved + shift)
    return out


@dataclass(frozen=True, slots=True)
class _Hit:
    """One candidate replacement: where the match is, what part is replaced, and by what."""

    rep_start: int
    priority: int  # lower wins when two hits start at the same place
    rep_end: int
    match_start: int
    match_end: int
    text: bytes
    kind: str


def _literal_hits(data: bytes, literals: Sequence[tuple[str, bytes]]) -> Iterator[_Hit]:
    for name, lit in literals:
        pos = data.find(lit)
        while pos != -1:
            end = pos + len(lit)
            if name == JSON_VALUE:
                # A value found under a sensitive JSON key is replaced in value position only
                # (never where the same text is a key), quotes included.
                after = end
                while after < len(data) and data[after] in b" \t\r\n":
                    after += 1
                if after >= len(data) or data[after] != 58:  # ':'
                    yield _Hit(pos, 1, end, pos, end, b'"[redacted:key]"', "sensitive-key")
            else:
                yield _Hit(
                    pos, 0, end, pos, end, b"[secret:" + name.encode() + b"]", "known-secret"
                )
            pos = data.find(lit, pos + 1)


def _shape_hits(data: bytes) -> Iterator[_Hit]:
    for priority, (name, pattern) in enumerate(_COMPILED, start=2):
        kind = _KIND_NAMES[name]
        for m in pattern.finditer(data):
            if name == "bearer":
                inner = m.group("bearer_inner")
                if not _looks_like_bearer(inner):
                    continue
                start, end = m.span("bearer_inner")
            elif name == "basic":
                inner = m.group("basic_inner")
                if not _looks_like_basic(inner):
                    continue
                start, end = m.span("basic_inner")
            else:
                start, end = m.span()
            yield _Hit(
                start, priority, end, m.start(), m.end(), b"[redacted:" + kind.encode() + b"]", kind
            )


def _form_hits(data: bytes) -> Iterator[_Hit]:
    """``name=value`` pairs (query strings, form bodies) whose name is a secret's."""
    for m in _FORM_VALUE.finditer(data):
        eq = m.start()
        k = eq
        while k > 0 and eq - k < 80 and data[k - 1] in _KEY_CHARS:
            k -= 1
        if k == eq or (k > 0 and data[k - 1] not in _KEY_BEFORE):
            continue
        value = m.group(1)
        if value.startswith(b"[") or not is_sensitive_key(data[k:eq].decode("ascii")):
            continue
        yield _Hit(eq + 1, 50, m.end(), k, m.end(), b"[redacted:key]", "sensitive-key")


def is_url_credential(name: bytes) -> bool:
    """Whether a URL query parameter (raw, maybe percent-encoded) names a credential."""
    key = normalise_key(unquote(name.decode("ascii", "replace")))
    return key in URL_CREDENTIAL_PARAMS or is_sensitive_key(key)


def _url_hits(data: bytes) -> Iterator[_Hit]:
    """Userinfo and credential parameters of URLs (``scheme://user:pass@host/?key=...``)."""
    for m in _URL.finditer(data):
        rest, base = m.group("rest"), m.start("rest")
        end = _AUTHORITY_END.search(rest)
        authority_end = end.start() if end else len(rest)
        at = [u.start() for u in _USERINFO_END.finditer(rest, 0, authority_end)]
        if at and at[-1] > 0 and not rest.startswith(b"[redacted:"):
            yield _Hit(base, 40, base + at[-1], base, base + at[-1], _USERINFO, "url-userinfo")
        for p in _URL_PARAM.finditer(rest, authority_end):
            value = p.group("value")
            if value.startswith(b"[") or not is_url_credential(p.group("name")):
                continue
            start, stop = base + p.start("value"), base + p.end("value")
            yield _Hit(start, 40, stop, base + p.start(), stop, b"[redacted:key]", "url-credential")


def _escaped_hits(data: bytes, literals: Sequence[tuple[str, bytes]]) -> Iterator[_Hit]:
    """JSON strings whose escapes (``\\u0068unter2``, ``https:\\/\\/``) hide a secret from
    the byte scans: each is decoded, redacted as text, and written back as one JSON string."""
    if not _HIDING_ESCAPE.search(data):
        return
    for m in _JSON_STRING.finditer(data):
        token = m.group()
        if not _HIDING_ESCAPE.search(token):
            continue
        try:
            text = json.loads(token)
        except ValueError:
            continue
        inner = text.encode("utf-8", "surrogatepass")
        out, spans, _, applied = Redactor._apply(inner, literals, escapes=False)
        if not spans:
            continue
        fixed = json.dumps(out.decode("utf-8", "surrogatepass")).encode()
        yield _Hit(m.start(), 60, m.end(), m.start(), m.end(), fixed, applied[0].kind)


def _hits(data: bytes, literals: Sequence[tuple[str, bytes]], escapes: bool = True) -> list[_Hit]:
    hits = [
        *_literal_hits(data, literals),
        *_shape_hits(data),
        *_form_hits(data),
        *_url_hits(data),
        *(_escaped_hits(data, literals) if escapes else ()),
    ]
    hits.sort(key=lambda h: (h.rep_start, h.priority, -(h.rep_end - h.rep_start)))
    return hits


class Redactor:
    """The four layers of redaction over headers, bodies and targets (see module docstring)."""

    def __init__(
        self,
        *,
        sensitive_headers: frozenset[str] = SENSITIVE_HEADERS,
        omit_headers: frozenset[str] = frozenset(),
    ) -> None:
        self.sensitive_headers = frozenset(h.lower() for h in sensitive_headers)
        # Headers not written at all (e.g. ``date`` for a recording checked into a repository).
        self.omit_headers = VOLATILE_HEADERS | {h.lower() for h in omit_headers}

    # -- the matching pass --------------------------------------------------------------------

    @staticmethod
    def _literals(
        secrets: Sequence[KnownSecret], extra: Sequence[tuple[str, bytes]] = ()
    ) -> list[tuple[str, bytes]]:
        lits: list[tuple[str, bytes]] = [pair for s in secrets for pair in s.literals()]
        lits.extend(extra)
        # Longest first, so the longest form of a value is the one replaced.
        lits.sort(key=lambda item: len(item[1]), reverse=True)
        return lits

    @staticmethod
    def _apply(
        data: bytes,
        literals: Sequence[tuple[str, bytes]],
        final: bool = True,
        escapes: bool = True,
    ) -> tuple[bytes, list[Span], int, list[_Hit]]:
        """Replace every hit, earliest first (ties: provenance, JSON keys, shapes, form keys).

        With ``final`` False, nothing is replaced from the start of a match that reaches into
        the last ``OVERLAP`` bytes: more input could still extend it. Returns the output, the
        spans replaced, how much input was consumed, and the hits applied.
        """
        hits = _hits(data, literals, escapes)
        cut = len(data)
        if not final:
            cut = max(len(data) - OVERLAP, 0)
            for h in hits:
                if h.match_end > len(data) - OVERLAP:
                    cut = min(cut, h.match_start)
        out: list[bytes] = []
        spans: list[Span] = []
        applied: list[_Hit] = []
        pos = 0
        for h in hits:
            if h.rep_start < pos or h.rep_end > cut:
                continue
            out.append(data[pos : h.rep_start])
            out.append(h.text)
            spans.append((h.rep_start, h.rep_end, len(h.text)))
            applied.append(h)
            pos = h.rep_end
        out.append(data[pos:cut])
        return b"".join(out), spans, cut, applied

    # -- values ------------------------------------------------------------------------------

    def text(self, value: str, secrets: Sequence[KnownSecret] = ()) -> str:
        """A header value, target or any short string, with secrets replaced by markers."""
        data, spans, _, _ = self._apply(
            value.encode("utf-8", "surrogateescape"), self._literals(secrets)
        )
        return data.decode("utf-8", "replace") if spans else value

    def target(self, target: str, secrets: Sequence[KnownSecret] = ()) -> str:
        return self.text(target, secrets)

    def headers(
        self, pairs: Iterable[tuple[str, str]], secrets: Sequence[KnownSecret] = ()
    ) -> list[tuple[str, HeaderValue]]:
        out: list[tuple[str, HeaderValue]] = []
        for name, value in pairs:
            low = name.lower()
            if low in self.omit_headers:
                continue
            if self._name_leaks(name, secrets):
                # SECURITY: a header named after a credential (an upstream reflecting it), in
                # any case, or whose name holds a token, is not written; the gateway never
                # passes the first kind to the agent either.
                continue
            carried = next(
                (
                    s
                    for s in secrets
                    if s.header is not None
                    and s.header.lower() == low
                    and value in (s.header_value, s.value)
                ),
                None,
            )
            if carried is not None:
                out.append((name, {"secret": carried.name}))
            elif low in self.sensitive_headers:
                out.append((name, {"redacted": "header"}))
            else:
                out.append((name, self.text(value, secrets)))
        return out

    def _name_leaks(self, name: str, secrets: Sequence[KnownSecret]) -> bool:
        if self.text(name, secrets) != name:
            return True
        low = name.lower().encode("utf-8", "surrogateescape")
        return any(form.lower() in low for s in secrets for _, form in s.literals())

    def body(self, data: bytes, secrets: Sequence[KnownSecret] = ()) -> Redacted:
        """A whole body (up to ``STRUCTURED_LIMIT``): provenance, JSON keys, form keys, shapes."""
        if not data:
            return Redacted(data, ())
        doc: Any = None
        is_json = False
        if len(data) <= STRUCTURED_LIMIT and data.lstrip()[:1] in (b"{", b"["):
            try:
                doc = json.loads(data)
                is_json = True
            except (ValueError, RecursionError):
                doc = None
        extra: list[tuple[str, bytes]] = []
        non_string = False
        if is_json:
            values, non_string = sensitive_values(doc)
            for v in values:
                if any(s.value and s.value in v for s in secrets):
                    continue  # provenance names it better: [secret:<name>]
                # (A lone surrogate, which JSON's \ud800 escape reads as, cannot be UTF-8:
                # its unescaped form is kept as bytes no UTF-8 body holds, never a crash.)
                unescaped = json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass")
                for form in {json.dumps(v).encode(), unescaped}:
                    extra.append((JSON_VALUE, form))
        literals = self._literals(secrets, extra)
        out, spans, _, _ = self._apply(data, literals)
        if is_json and (non_string or extra):
            # Check the result: anything under a sensitive key not yet a marker (a number, or a
            # string escaped another way) means re-serialising the document with it replaced.
            try:
                check = json.loads(out)
            except (ValueError, RecursionError):
                check = None
            if check is None or _has_unredacted(check):
                fixed = _redact_doc(doc)
                text = json.dumps(fixed, ensure_ascii=False, separators=(",", ":")).encode()
                again, _, _, _ = self._apply(text, literals)
                return Redacted(again, None)
        return Redacted(out, tuple(spans))

    def stream(
        self, src: IO[bytes], dst: IO[bytes], secrets: Sequence[KnownSecret] = ()
    ) -> list[Span]:
        """Redact a body too large for memory, window by window (provenance and shapes).

        A match is only replaced once everything after it that could extend it has been read,
        so a token split across two windows is still found whole.
        """
        literals = self._literals(secrets)
        spans: list[Span] = []
        carry = b""
        base = 0  # input offset of carry[0]
        while True:
            block = src.read(WINDOW)
            final = not block
            data = carry + block
            out, local, consumed, _ = self._apply(data, literals, final=final)
            dst.write(out)
            spans.extend((base + s, base + e, n) for s, e, n in local)
            carry = data[consumed:]
            base += consumed
            if final:
                return spans

    def scan(
        self, data: bytes, known: Sequence[KnownSecret] = ()
    ) -> Iterator[tuple[int, str, bytes]]:
        """(offset, kind, matched bytes) of everything secret-looking in ``data``."""
        _, _, _, applied = self._apply(data, self._literals(known))
        for h in applied:
            yield h.rep_start, h.kind, data[h.rep_start : h.rep_end]


DEFAULT_REDACTOR = Redactor()


def _is_marker(value: Any) -> bool:
    return (
        isinstance(value, str)
        and value.startswith(("[redacted:", "[secret:"))
        and value.endswith("]")
    )


def sensitive_values(doc: Any) -> tuple[set[str], bool]:
    """String values under sensitive keys (at any depth below one), and whether any
    non-string scalar sits there too."""
    found: set[str] = set()
    non_string = False
    stack: list[tuple[Any, bool]] = [(doc, False)]
    while stack:
        item, under = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                stack.append((v, under or is_sensitive_key(str(k))))
        elif isinstance(item, list):
            stack.extend((v, under) for v in item)
        elif under:
            if isinstance(item, str):
                if item and not _is_marker(item):
                    found.add(item)
            elif isinstance(item, int | float) and not isinstance(item, bool):
                non_string = True
    return found, non_string


def _has_unredacted(doc: Any) -> bool:
    values, non_string = sensitive_values(doc)
    return bool(values) or non_string


def _redact_doc(doc: Any, under: bool = False) -> Any:
    if isinstance(doc, dict):
        return {k: _redact_doc(v, under or is_sensitive_key(str(k))) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_redact_doc(v, under) for v in doc]
    if (
        under
        and (isinstance(doc, str) and doc or isinstance(doc, int | float))
        and not isinstance(doc, bool)
    ):
        return doc if _is_marker(doc) else "[redacted:key]"
    return doc
