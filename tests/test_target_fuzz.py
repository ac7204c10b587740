"""Property tests of ``parse_target`` (profiles ``fast``/``deep``, see helpers_core.py).

(a) any string: accepted, or refused with ``TargetAmbiguous`` and nothing else;
(b) any accepted target: forwarded byte for byte, no dot segment, no separator inside a
    decoded segment, decoded parts equal an independent decoder's, and a maximal re-encoding
    of the decoded parts parses back to the same decoded parts (one meaning per target);
(c) a canonical target with one dangerous element inserted is always refused.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.errors import TargetAmbiguous
from gateway.target import Target, parse_target
from tests.helpers_core import FUZZ

UNRESERVED = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"
SUB_DELIMS_PATH = "!$&'()*+,=:@"  # pchar minus ';' and unreserved
# Characters and fragments that make parsers disagree: biased input for (a).
TRICKY = [
    "/",
    "//",
    ".",
    "..",
    "%",
    "%2F",
    "%2f",
    "%2E",
    "%2e",
    "%25",
    "%5C",
    "%3B",
    "%00",
    "%0A",
    "%41",
    "%C3%A9",
    "%FF",
    "?",
    "&",
    "=",
    "#",
    ";",
    "\\",
    "+",
    " ",
    "\x00",
    "\n",
    "é",
    "up",
    "metrics",
    "a",
    "Z",
    "0",
    "%G",
    "%4",
    "%%",
    "*",
    "http://",
    ":",
    "@",
    "~",
]

upstream_names = st.from_regex(re.compile(r"[a-z0-9][a-z0-9_-]{0,10}"), fullmatch=True)
tricky_text = st.lists(st.sampled_from(TRICKY), max_size=12).map("".join)
any_text = st.one_of(st.text(max_size=60), tricky_text, tricky_text.map(lambda s: "/" + s))


def _parse(raw: str) -> Target | None:
    try:
        return parse_target(raw)
    except TargetAmbiguous:
        return None


# --- (a) --------------------------------------------------------------------------------------


@FUZZ
@given(any_text)
@example("/up/%")
@example("/up/x?%")
@example("/up/%E2%82")
@example("/up?&")
def test_anything_is_parsed_or_refused_as_ambiguous(raw: str) -> None:
    try:
        t = parse_target(raw)
    except TargetAmbiguous as exc:
        assert exc.detail.startswith("request target refused: ")
        return
    assert t.raw == raw


# --- canonical target generation --------------------------------------------------------------

# Decoded segment text: any non-control Unicode, minus the characters no segment may decode to.
segment_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\;%."),
    min_size=1,
    max_size=8,
) | st.sampled_from(["a.b", "...", "..a", "a..", "x"])
query_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="%"),
    max_size=8,
)


def encode(text: str, *, keep: str) -> str:
    """Percent-encode (upper-case hex, UTF-8) every character not in UNRESERVED or ``keep``."""
    out = []
    for ch in text:
        if ch in UNRESERVED or ch in keep:
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


@st.composite
def canonical_targets(draw: st.DrawFn) -> tuple[str, str, list[str], list[tuple[str, str]]]:
    """(raw, upstream, decoded segments, decoded query pairs) of a canonical target."""
    upstream = draw(upstream_names)
    segments = draw(st.lists(segment_text, max_size=5))
    trailing = draw(st.booleans())
    # Canonical paths write sub-delims, ':' and '@' as they are (their escapes are refused).
    path = "/" + upstream + "".join("/" + encode(s, keep=SUB_DELIMS_PATH) for s in segments)
    if trailing:
        path += "/"
        segments = [*segments, ""]
    pairs = draw(st.lists(st.tuples(query_text.filter(bool), query_text), max_size=4))
    raw = path
    if pairs:
        raw += "?" + "&".join(f"{encode(n, keep='')}={encode(v, keep='')}" for n, v in pairs)
    return raw, upstream, segments, pairs


# --- (b) --------------------------------------------------------------------------------------


def _independent_decode(raw_part: str, *, plus: bool) -> str:
    if plus:
        raw_part = raw_part.replace("+", " ")
    return unquote(raw_part, encoding="utf-8", errors="strict")


def _check_accepted(t: Target) -> None:
    raw = t.raw
    # forwarded exactly: the raw input minus "/<upstream>"
    assert t.forward_target == raw[len("/" + t.upstream) :]
    assert "/" + t.upstream + t.forward_target == raw
    for seg in t.segments:
        assert seg not in (".", "..")
        assert "/" not in seg and "\\" not in seg and "\x00" not in seg
        assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in seg)
    for name, value in t.query_pairs:
        assert name != ""
        assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in name + value)
    # the decoded parts are what a standard decoder makes of the raw parts
    path, _, query = raw.partition("?")
    raw_segments = path.split("/")[2:]
    assert list(t.segments) == [_independent_decode(s, plus=False) for s in raw_segments]
    if query:
        expected = []
        for pair in query.split("&"):
            n, _, v = pair.partition("=")
            expected.append((_independent_decode(n, plus=True), _independent_decode(v, plus=True)))
        assert list(t.query_pairs) == expected
    # one spelling: re-encoding the decoded path gives back exactly the raw path
    assert (
        "/" + t.upstream + "".join("/" + encode(s, keep=SUB_DELIMS_PATH) for s in t.segments)
        == path
    )
    # one meaning: re-encoding the decoded parts means the same thing
    again = "/" + t.upstream + "".join("/" + encode(s, keep=SUB_DELIMS_PATH) for s in t.segments)
    if t.query_pairs:
        again += "?" + "&".join(
            f"{encode(n, keep='')}={encode(v, keep='')}" for n, v in t.query_pairs
        )
    t2 = parse_target(again)
    assert (t2.upstream, t2.segments, t2.query_pairs) == (t.upstream, t.segments, t.query_pairs)
    # and parsing is a fixed point
    assert parse_target("/" + t.upstream + t.forward_target) == t


@FUZZ
@given(st.one_of(any_text, canonical_targets().map(lambda c: c[0])))
def test_accepted_targets_keep_their_invariants(raw: str) -> None:
    t = _parse(raw)
    # Most random text is refused, which is a fine outcome here (other tests check refusals);
    # returning instead of assume() keeps Hypothesis from failing its filter health check.
    if t is not None:
        _check_accepted(t)


@FUZZ
@given(canonical_targets())
def test_generated_canonical_targets_are_accepted_with_their_decoded_parts(
    case: tuple[str, str, list[str], list[tuple[str, str]]],
) -> None:
    raw, upstream, segments, pairs = case
    t = parse_target(raw)
    assert t.upstream == upstream
    assert list(t.segments) == segments
    assert list(t.query_pairs) == pairs
    _check_accepted(t)


# --- (c) --------------------------------------------------------------------------------------

# Dangerous as a segment of their own, or glued to either end of a segment.
PATH_DANGERS = [
    "%2E%2E",
    "%2e%2e",
    ".%2E",
    "%2E.",
    "%2E",
    "%2F",
    "%2f",
    "%5C",
    "%5c",
    "\\",
    ";",
    ";x=1",
    "%3B",
    "%00",
    "%0A",
    "%0D",
    "%7F",
    "%252F",
    "%252e",
    "%25",
    "%41",
    "%G1",
    "#",
    "#frag",
    "é",
    " ",
    "\x00",
    "\n",
    "%FF",
    "%c3%a9",
    "{x}",
    "|",
    "<",
    "^",
    '"',
    "%u002e",
]
# Dangerous only as a segment of their own ("a.." is a fine name, "%4" + "0" is "%40").
OWN_SEGMENT_DANGERS = ["..", ".", "%", "%4"]
QUERY_DANGERS = [
    "",
    "a",
    "a=1&&b=2",
    "a=1;b=2",
    "a=%00",
    "a=%0A",
    "a=%252F",
    "a=%2f",
    "a=%41",
    "a=%",
    "a=%G1",
    "=1",
    "a=1#x",
    "a=\\",
    "a=é",
    "a= ",
    "a=%FF",
    "a=%7F",
    "a=%4",
]


@FUZZ
@given(
    canonical_targets(),
    st.sampled_from(PATH_DANGERS + OWN_SEGMENT_DANGERS),
    st.sampled_from(["replace", "insert", "prefix", "suffix"]),
    st.data(),
)
def test_dangerous_path_element_is_always_refused(
    case: tuple[str, str, list[str], list[tuple[str, str]]],
    danger: str,
    how: str,
    data: st.DataObject,
) -> None:
    raw = case[0]
    path, sep, query = raw.partition("?")
    parts = path.split("/")[1:]  # parts[0] is the upstream name
    if danger in OWN_SEGMENT_DANGERS:
        how = "replace" if how in ("replace", "prefix") else "insert"
    i = data.draw(st.integers(min_value=1, max_value=len(parts)), label="position")
    if how == "replace":
        new = [*parts[:i], danger, *parts[i + 1 :]]
    elif how == "insert":
        new = [*parts[:i], danger, *parts[i:]]
    elif how == "prefix" and i < len(parts):
        new = [*parts[:i], danger + parts[i], *parts[i + 1 :]]
    else:  # suffix of the part before position i (possibly the upstream name)
        new = [*parts[: i - 1], parts[i - 1] + danger, *parts[i:]]
    mutated = "/" + "/".join(new) + sep + query
    assert _parse(mutated) is None, mutated


@FUZZ
@given(canonical_targets(), st.sampled_from(QUERY_DANGERS), st.booleans())
def test_dangerous_query_element_is_always_refused(
    case: tuple[str, str, list[str], list[tuple[str, str]]], danger: str, first: bool
) -> None:
    path, _, query = case[0].partition("?")
    pairs = [query] if query else []
    pairs.insert(0 if first else len(pairs), danger)
    mutated = path + "?" + "&".join(pairs)
    assert _parse(mutated) is None, mutated


@settings(parent=FUZZ, max_examples=max(20, FUZZ.max_examples // 5))
@given(canonical_targets(), st.sampled_from(["http://evil", "https://evil:443", "/", "*", ""]))
def test_non_origin_forms_are_always_refused(
    case: tuple[str, str, list[str], list[tuple[str, str]]], prefix: str
) -> None:
    raw = case[0]
    mutated = prefix + raw if prefix else raw[1:]
    assert _parse(mutated) is None, mutated
