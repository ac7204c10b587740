"""The canonical request target: checked in its raw form, refused when ambiguous.

Agents call ``/<upstream>/<path>?<query>``. Servers and proxies disagree about encoded
slashes, dot segments, ``;`` parameters, double encoding, ``+``, lower-case escapes and more;
every such disagreement is a way to make the policy check one path while the upstream serves
another. So the raw target (``request.raw_path``, never the decoded ``request.path``) must
already be in its one canonical form, and anything else is refused with ``target_ambiguous``.
Nothing is normalised: what the policy checked is byte for byte what is forwarded.

Canonical means:
- origin form (starts with ``/``); no absolute form, no ``*``, no fragment;
- only RFC 3986 ``pchar`` characters in the path, except ``;`` (path parameters);
- percent escapes in upper-case hex, never encoding an unreserved character, ``/``, ``\\``,
  ``.``, ``;``, ``%`` or a control character, and decoding to valid UTF-8; in the path, no
  escape of a character that may stand as it is (``!$&'()*+,=:@``);
- no empty segment (``//``) except a trailing slash, no ``.`` or ``..`` segment;
- a query of ``name=value`` pairs joined by ``&``, each with an ``=``, none empty, no ``;``
  separator, and no escape that decodes to another escape (double encoding).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from gateway.errors import TargetAmbiguous

MAX_TARGET_LENGTH = 8192

UPSTREAM_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")

# pchar = unreserved / pct-encoded / sub-delims / ":" / "@", minus ";" (path parameters).
_PATH_CHARS = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,=:@/%]*")
# The query also allows "/" and "?", but no ";" (some servers split pairs on it).
_QUERY_CHARS = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,=:@/?%]*")
_ESCAPE = re.compile(r"%(.{0,2})", re.DOTALL)
_HEX2 = re.compile(r"[0-9A-F]{2}")
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
# Bytes that must never appear encoded in a path: each changes how the path splits or decodes.
_PATH_FORBIDDEN_ENCODED = frozenset(b"/\\.;%") | frozenset(range(0x20)) | {0x7F}
# Characters that are legal as they are in a path segment must be written as they are:
# "%2B" and "+" decode alike, and two spellings of one path is what this module refuses.
_PATH_LITERAL_ONLY = frozenset(b"!$&'()*+,=:@")
_QUERY_FORBIDDEN_ENCODED = frozenset(range(0x20)) | {0x7F}


@dataclass(frozen=True, slots=True)
class Target:
    """One call's target, split and decoded for matching, with the raw form for forwarding."""

    raw: str  # the whole raw target as received
    upstream: str  # the first segment
    rest: str  # raw path after the upstream name: "" or "/..." (forwarded as is)
    segments: tuple[str, ...]  # decoded segments of ``rest``
    raw_query: str  # raw query without "?", "" when there is none
    query_pairs: tuple[tuple[str, str], ...]  # decoded (name, value) pairs, in order

    @property
    def forward_target(self) -> str:
        """The path and query to send upstream, relative to the upstream's base path."""
        return self.rest + ("?" + self.raw_query if self.raw_query else "")


def _refuse(detail: str) -> TargetAmbiguous:
    return TargetAmbiguous(f"request target refused: {detail}")


def _check_escapes(text: str, forbidden: frozenset[int], where: str) -> None:
    if "%" not in text:
        return
    for m in _ESCAPE.finditer(text):
        hexpart = m.group(1)
        if not _HEX2.fullmatch(hexpart):
            if re.fullmatch(r"[0-9A-Fa-f]{2}", hexpart):
                raise _refuse(f"lower-case percent escape %{hexpart} in the {where}")
            raise _refuse(f"malformed percent escape in the {where}")
        byte = int(hexpart, 16)
        if byte in _UNRESERVED:
            raise _refuse(f"%{hexpart} encodes {chr(byte)!r}, which must not be encoded")
        if byte in forbidden:
            raise _refuse(f"encoded byte %{hexpart} is not allowed in the {where}")
        if byte == 0x25:
            after = text[m.end() : m.end() + 2]
            if re.fullmatch(r"[0-9A-Fa-f]{2}", after):
                raise _refuse(f"double percent-encoding (%25{after}) in the {where}")


def _decode(text: str, where: str, *, plus_is_space: bool = False) -> str:
    if plus_is_space:
        text = text.replace("+", " ")
    if "%" not in text:
        return text  # the character checks already admitted only ASCII
    try:
        return unquote_to_bytes(text).decode("utf-8")
    except UnicodeDecodeError:
        raise _refuse(f"percent escapes in the {where} do not decode to UTF-8") from None


_ACCEPTED: dict[str, Target] = {}  # agents repeat their targets: accepted ones are kept
_ACCEPTED_MAX = 4096


def parse_target(raw: str) -> Target:
    """Split and check a raw request target; raise ``TargetAmbiguous`` unless canonical.

    A pure function of ``raw``: accepted targets are memoised (bounded); refusals are not."""
    target = _ACCEPTED.get(raw)
    if target is None:
        target = _parse_target(raw)
        if len(_ACCEPTED) >= _ACCEPTED_MAX:
            _ACCEPTED.clear()
        _ACCEPTED[raw] = target
    return target


def _parse_target(raw: str) -> Target:
    if len(raw) > MAX_TARGET_LENGTH:
        raise _refuse(f"longer than {MAX_TARGET_LENGTH} characters")
    if not raw.startswith("/"):
        raise _refuse("only origin-form targets (/upstream/path) are accepted")
    if raw.startswith("//"):
        raise _refuse("empty path segment")
    if "#" in raw:
        raise _refuse("a fragment (#) is not allowed")
    path, sep, query = raw.partition("?")
    if not _PATH_CHARS.fullmatch(path):
        bad = next(c for c in path if not _PATH_CHARS.fullmatch(c))
        raise _refuse(f"character {bad!r} is not allowed in the path")
    _check_escapes(path, _PATH_FORBIDDEN_ENCODED | _PATH_LITERAL_ONLY, "path")

    parts = path.split("/")[1:]  # path starts with "/"
    upstream = parts[0]
    if not UPSTREAM_NAME.fullmatch(upstream):
        raise _refuse("the first segment must be an upstream name")
    for i, part in enumerate(parts):
        if part == "" and i != len(parts) - 1:
            raise _refuse("empty path segment (//)")
        if part in (".", ".."):
            raise _refuse("dot segment in the path")
    rest = path[len(upstream) + 1 :]
    segments = tuple(_decode(p, "path") for p in parts[1:])

    pairs: list[tuple[str, str]] = []
    if sep:
        if query == "":
            raise _refuse("empty query after '?'")
        if not _QUERY_CHARS.fullmatch(query):
            bad = next(c for c in query if not _QUERY_CHARS.fullmatch(c))
            raise _refuse(f"character {bad!r} is not allowed in the query")
        _check_escapes(query, _QUERY_FORBIDDEN_ENCODED, "query")
        for pair in query.split("&"):
            name, eq, value = pair.partition("=")
            if not eq or not name:
                raise _refuse(f"query part {pair!r} is not name=value")
            pairs.append(
                (
                    _decode(name, "query", plus_is_space=True),
                    _decode(value, "query", plus_is_space=True),
                )
            )
    return Target(raw, upstream, rest, segments, query, tuple(pairs))
