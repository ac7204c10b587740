"""What a tainted run read, and whether a sensitive call's arguments could have come from it.

A rule with ``taint_arguments: [recipient, ...]`` (``sensitive: true``) narrows the taint:
once its run has read untrusted content, its call is held (or refused) only when the value of
one of those arguments appears in the untrusted content the run received, instead of every
time. capgate cannot see inside the agent, but it sees every untrusted answer and every
argument: this is *literal provenance*. An agent that transforms a value it read (spells an
address out, translates it, computes it) defeats it; the trivial re-encodings an agent may do
on its own (case, whitespace, punctuation, percent- and HTML-encoding, URL schemes,
``mailto:``, ``www.``, a trailing slash, IDNA) do not.

* ``normalise`` maps both sides to one form: Unicode NFKC and case folding, HTML entities
  and percent-encoding undone (up to three layers), IDNA labels decoded, URL schemes,
  ``mailto:`` and ``www.`` dropped, then every character that is not a letter or a digit
  dropped. ``US13 3000-0001`` and ``us1330000001`` are one value; so are
  ``MAILTO:Mark%2EBlack@Gmail.com`` and ``mark.black@gmail.com``.
* ``response_text`` is what an agent reads of an answer: the strings of a JSON body (or of
  each event of an event stream), keys included, and of JSON text inside them; other bodies
  as text. It is normalised and kept per run (``Taints.record``), up to ``RUN_CAP``.
* ``find`` says whether an argument's value appears in what was kept: the whole normalised
  value, and each identifier inside it (addresses, URLs, host names, IBAN-like and other
  words with digits), are looked for in the text; and each identifier of the text is looked
  for in the whole normalised value, so an address read and then written, spaced out, into a
  message body is found too. A value too short to tell apart (under ``MIN_VALUE`` letters
  and digits) is held (fail closed).
* A token may carry the user's own request (claim ``vouched``, written by the orchestrator
  that mints the run's token, never by the agent): a value whose whole normalised form
  appears in it is the user's, and is not held for appearing in what the run read too.
"""

from __future__ import annotations

import html
import json
import re
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

RESPONSE_CAP = 256 * 1024
"""Bytes of one untrusted answer read (and kept from the agent) before it is recorded; a
longer answer is not recorded and its run falls back to holding every sensitive call."""
RUN_CAP = 512 * 1024
"""Normalised characters kept per run; past it, the run holds every sensitive call again."""
READS_TTL_S = 24 * 3600.0
"""How long a run's record lives; after it, the run holds every sensitive call again."""
MIN_VALUE = 6
"""Letters and digits a value needs to be looked for; a shorter one is held."""
MAX_VALUES = 256
"""Argument values looked at per call; a call with more is held."""
VOUCHED_CLAIM = "vouched"
"""The token claim with the user's own request (a string, or a list of strings)."""
MAX_VOUCHED = 16 * 1024
"""Characters of a ``vouched`` claim; a longer one vouches for nothing."""

_SCHEME = re.compile(r"mailto:|[a-z][a-z0-9+.-]{1,15}://|www\.")
_ALNUM = re.compile(r"[^\W_]+")
_IDNA = re.compile(r"xn--[a-z0-9-]+")
# Candidates inside a longer value: whitespace-separated words with a digit or an address's
# punctuation, and digit groups written apart (an IBAN in blocks of four).
_WORD = re.compile(r"[^\s<>\"'`()\[\]{},;|]+")
_DIGIT_GROUPS = re.compile(r"[a-z]{0,2}\d[\d \t.-]{8,}\d")
_IDENTIFIER = re.compile(r"\d|@|://|\w\.\w")
_ESCAPE = re.compile(r"\\u([0-9a-f]{4})|\\x([0-9a-f]{2})")


def _decode_idna(match: re.Match[str]) -> str:
    label = match.group(0)
    try:
        return label.encode("ascii").decode("idna")
    except UnicodeError:
        return label


def _decoded(text: str) -> str:
    """NFKC, case-folded, with HTML entities and percent-encoding undone (three layers)."""
    text = unicodedata.normalize("NFKC", text).casefold()
    for _ in range(3):
        undone = unquote(html.unescape(text), errors="replace")
        if undone == text:
            break
        text = unicodedata.normalize("NFKC", undone).casefold()
    if "\\" in text:  # \u0040 and \x40 escapes, as an agent reading raw JSON may undo them
        text = _ESCAPE.sub(lambda m: chr(int(m.group(1) or m.group(2), 16)), text).casefold()
    if "xn--" in text:
        text = _IDNA.sub(_decode_idna, text)
    return text


def _compact(decoded: str) -> str:
    return "".join(_ALNUM.findall(_SCHEME.sub("", decoded)))


def normalise(text: str) -> str:
    """The form both sides are compared in: letters and digits only, see the module."""
    return _compact(_decoded(text))


def identifiers(text: str) -> set[str]:
    """The identifiers in a text, normalised, those long enough: words with a digit, an
    ``@``, a scheme or a dot between letters (addresses, URLs, host names, IBANs, codes),
    and digit groups written apart."""
    return _identifiers(_decoded(text))


def _identifiers(decoded: str) -> set[str]:
    found = {_compact(word) for word in _WORD.findall(decoded) if _IDENTIFIER.search(word)}
    found.update(_compact(group) for group in _DIGIT_GROUPS.findall(decoded))
    return {c for c in found if len(c) >= MIN_VALUE}


def candidates(value: str) -> set[str]:
    """The whole value and the identifiers inside it, normalised (only those long enough)."""
    whole = normalise(value)
    found = identifiers(value)
    if len(whole) >= MIN_VALUE:
        found.add(whole)
    return found


# --- what an answer says -------------------------------------------------------------------


def _strings(value: Any, out: list[str], depth: int = 0) -> None:
    if depth > 64:
        return
    if isinstance(value, str):
        out.append(value)
        stripped = value.lstrip()
        if depth < 8 and stripped[:1] in ("{", "["):
            try:
                _strings(json.loads(value), out, depth + 1)
            except ValueError:
                pass
    elif isinstance(value, Mapping):
        for k, v in value.items():
            out.append(str(k))
            _strings(v, out, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out, depth + 1)
    elif value is not None and not isinstance(value, bool):
        out.append(str(value))


class Unreadable(ValueError):
    """An answer whose text capgate cannot read as the agent would (compressed, binary, an
    image, an unknown charset): it is not recorded, and its run holds every sensitive call."""


# What an MCP answer may carry that is not text an agent reads as it is.
_OPAQUE_KEYS = frozenset({"blob"})
_OPAQUE_TYPES = frozenset({"image", "audio"})


def _opaque(value: Any, depth: int = 0) -> bool:
    if depth > 64:
        return True
    if isinstance(value, Mapping):
        if value.get("type") in _OPAQUE_TYPES or any(
            k in _OPAQUE_KEYS and isinstance(v, str) for k, v in value.items()
        ):
            return True
        return any(_opaque(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return any(_opaque(v, depth + 1) for v in value)
    return False


def _json_text(text: str) -> str:
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    if _opaque(parsed):
        raise Unreadable("the answer carries an image, audio or binary data")
    out: list[str] = []
    _strings(parsed, out)
    return "\n".join(out)


def _events_text(text: str) -> str:
    out: list[str] = []
    for event in re.split(r"\r?\n\r?\n", text):
        data = [
            line[5:].removeprefix(" ") for line in event.splitlines() if line.startswith("data:")
        ]
        if data:
            out.append(_json_text("\n".join(data)))
    return "\n".join(out)


_TEXT_MEDIA = ("application/xml", "application/javascript", "application/x-www-form-urlencoded")
_COMPRESSED = (b"\x1f\x8b", b"PK\x03\x04", b"BZh", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")


def _charset(params: str) -> str:
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip():
            return value.strip().strip('"').lower()
    return "utf-8"


def response_text(body: bytes, content_type: str, content_encoding: str = "") -> str:
    """What an agent reads of an answer: its strings (JSON, event stream), or its text.
    Raises ``Unreadable`` for an answer it cannot read as the agent would."""
    if content_encoding.strip().lower() not in ("", "identity"):
        raise Unreadable(f"the answer is {content_encoding}-coded")
    if body.startswith(_COMPRESSED):
        raise Unreadable("the answer is compressed")
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    textual = (
        not media
        or media.startswith("text/")
        or media in _TEXT_MEDIA
        or media.endswith(("+json", "+xml", "/json", "/yaml"))
    )
    if not textual:
        raise Unreadable(f"the answer is {media}, not text")
    charset = _charset(params)
    try:
        text = body.decode(charset, errors="strict")
    except (LookupError, UnicodeDecodeError):
        raise Unreadable(f"the answer is not text in {charset}") from None
    if "\x00" in text:
        raise Unreadable("the answer holds NUL characters")
    if media == "application/json" or media.endswith("+json"):
        return _json_text(text)
    if media == "text/event-stream":
        return _events_text(text)
    return text


# --- a call's arguments --------------------------------------------------------------------


def argument_values(arguments: Mapping[str, Any], name: str) -> Iterator[tuple[str, str]]:
    """``(path, text)`` of every string or number under the argument ``name``."""
    if name not in arguments:
        return
    stack: list[tuple[str, Any]] = [(name, arguments[name])]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            yield path, value
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int | float):
            yield path, str(value)
        elif isinstance(value, Mapping):
            stack.extend((f"{path}.{k}", v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))


@dataclass(frozen=True, slots=True)
class Read:
    """One untrusted answer a run received: what it was (for people), its normalised text,
    and the identifiers in it (normalised), looked for inside an argument's value."""

    source: str
    text: str
    marks: tuple[str, ...] = ()

    @classmethod
    def of_text(cls, source: str, text: str) -> Read:
        decoded = _decoded(text)
        return cls(source, _compact(decoded), tuple(sorted(_identifiers(decoded))))

    def entry(self) -> str:
        source = " ".join(self.source.split())  # one line: the entry's fields are lines
        return f"{source}\n{self.text}\n{' '.join(self.marks)}"

    @classmethod
    def of_entry(cls, entry: str) -> Read:
        source, _, rest = entry.partition("\n")
        text, _, marks = rest.partition("\n")
        return cls(source, text, tuple(marks.split()))

    def holds(self, probes: set[str], whole: str) -> bool:
        """Whether a value (its probes, its whole normalised form) could come from here."""
        return any(p in self.text for p in probes) or any(m in whole for m in self.marks)


def vouched_text(claims: Mapping[str, Any]) -> str:
    """The normalised text of a token's ``vouched`` claim: the user's request, as the
    orchestrator that minted the token for the run wrote it; "" when there is none, or it
    is not a string or a list of strings within ``MAX_VOUCHED`` characters (fail closed:
    nothing is vouched for)."""
    value = claims.get(VOUCHED_CLAIM)
    if isinstance(value, str):
        parts = [value]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        parts = value
    else:
        return ""
    if sum(len(p) for p in parts) > MAX_VOUCHED:
        return ""
    return "\n".join(normalise(p) for p in parts)


def find(
    arguments: Mapping[str, Any],
    names: Sequence[str],
    reads: Sequence[Read],
    vouched: str = "",
) -> str | None:
    """Why the call must be held: which argument appears in which read (or is too short to
    tell, or there are too many values to look at); None when none could have come from
    what the run read. A value whose whole normalised form is in ``vouched`` (the user's own
    request, ``vouched_text``) is the user's, wherever else it appears."""
    seen = 0
    for name in names:
        for path, value in argument_values(arguments, name):
            seen += 1
            if seen > MAX_VALUES:
                return f"the call has more than {MAX_VALUES} values to look for"
            whole = normalise(value)
            if not whole:
                continue
            if len(whole) < MIN_VALUE:
                return (
                    f"argument {path} is too short ({len(whole)} letters and digits) to tell "
                    "whether it came from there"
                )
            if whole in vouched:
                continue
            probes = candidates(value)
            for read in reads:
                if read.holds(probes, whole):
                    return f"argument {path} appears in what {read.source} returned"
    return None
