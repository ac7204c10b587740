"""The canonical request target: every accepted form, and every ambiguity refused.

A refusal is always ``TargetAmbiguous`` (400, ``target_ambiguous``); nothing is normalised,
so an accepted target's ``forward_target`` is byte for byte the raw input after the
upstream name.
"""

from __future__ import annotations

import pytest

from gateway.errors import BadRequest, Reason, TargetAmbiguous
from gateway.target import MAX_TARGET_LENGTH, Target, parse_target

# raw target -> (upstream, decoded segments, decoded query pairs)
ACCEPTED: list[tuple[str, str, tuple[str, ...], tuple[tuple[str, str], ...]]] = [
    ("/metrics", "metrics", (), ()),
    ("/metrics/", "metrics", ("",), ()),
    ("/metrics/metrics/cpu", "metrics", ("metrics", "cpu"), ()),
    ("/metrics/metrics/cpu/", "metrics", ("metrics", "cpu", ""), ()),
    ("/metrics/metrics/cpu?window=5m", "metrics", ("metrics", "cpu"), (("window", "5m"),)),
    ("/m?a=b", "m", (), (("a", "b"),)),
    ("/db-1/query", "db-1", ("query",), ()),
    ("/db_2/x", "db_2", ("x",), ()),
    ("/0up/x", "0up", ("x",), ()),
    ("/up/a%20b", "up", ("a b",), ()),
    ("/up/caf%C3%A9", "up", ("café",), ()),
    ("/up/%E2%80%AE", "up", ("\u202e",), ()),
    ("/up/a%3Fb%23c", "up", ("a?b#c",), ()),
    ("/up/a+b", "up", ("a+b",), ()),  # '+' is not a space in a path
    ("/up/a:b@c", "up", ("a:b@c",), ()),
    ("/up/~user", "up", ("~user",), ()),
    ("/up/a.b/...x/..a", "up", ("a.b", "...x", "..a"), ()),
    ("/up/...", "up", ("...",), ()),
    ("/up/!$&'()*+,=", "up", ("!$&'()*+,=",), ()),
    ("/up/v1/items/42", "up", ("v1", "items", "42"), ()),
    ("/up/x?a=1&b=2&a=3", "up", ("x",), (("a", "1"), ("b", "2"), ("a", "3"))),
    ("/up/x?a=", "up", ("x",), (("a", ""),)),
    ("/up/x?a==", "up", ("x",), (("a", "="),)),
    ("/up/x?q=a+b", "up", ("x",), (("q", "a b"),)),  # '+' is a space in a query
    ("/up/x?q=a%2Bb", "up", ("x",), (("q", "a+b"),)),
    ("/up/x?q=%2F%3B%5C", "up", ("x",), (("q", "/;\\"),)),
    ("/up/x?q=%26%3D", "up", ("x",), (("q", "&="),)),
    ("/up/x?%3D=1", "up", ("x",), (("=", "1"),)),
    ("/up/x?q=a/b?c", "up", ("x",), (("q", "a/b?c"),)),
    ("/up/x?q=%25", "up", ("x",), (("q", "%"),)),
    ("/up/x?q=100%25", "up", ("x",), (("q", "100%"),)),
    ("/up/x?q=%C3%A9", "up", ("x",), (("q", "é"),)),
    ("/up/x?q=..", "up", ("x",), (("q", ".."),)),  # dots are data in a query
]


@pytest.mark.parametrize("raw,upstream,segments,pairs", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_canonical_targets_are_accepted(
    raw: str, upstream: str, segments: tuple[str, ...], pairs: tuple[tuple[str, str], ...]
) -> None:
    t = parse_target(raw)
    assert isinstance(t, Target)
    assert t.raw == raw
    assert t.upstream == upstream
    assert t.segments == segments
    assert t.query_pairs == pairs
    # Forwarded byte for byte: the raw input minus "/<upstream>".
    assert t.forward_target == raw[len("/" + upstream) :]
    path, _, query = raw.partition("?")
    assert t.rest == path[len("/" + upstream) :]
    assert t.raw_query == query


def test_forward_target_of_bare_upstream_is_empty() -> None:
    t = parse_target("/metrics")
    assert t.rest == "" and t.raw_query == "" and t.forward_target == ""
    assert parse_target("/metrics?x=1").forward_target == "?x=1"


def test_escapes_are_forwarded_as_received_not_decoded() -> None:
    t = parse_target("/up/a%20b/caf%C3%A9?q=a+b&r=%2F")
    assert t.forward_target == "/a%20b/caf%C3%A9?q=a+b&r=%2F"
    assert t.segments == ("a b", "café")
    assert t.query_pairs == (("q", "a b"), ("r", "/"))


# raw target -> a word the refusal's detail must contain
REFUSED: list[tuple[str, str]] = [
    # encoded separators
    ("/up/a%2Fb", "%2F"),
    ("/up/a%2fb", "lower-case"),
    ("/up/a%5Cb", "%5C"),
    ("/up/a%5cb", "lower-case"),
    ("/up/%2F", "%2F"),
    ("/up%2Fadmin/x", "%2F"),
    # raw backslash
    ("/up/a\\b", "'\\\\'"),
    ("/up\\x", "'\\\\'"),
    ("/up/x?q=a\\b", "'\\\\'"),
    # dot segments, plain and encoded
    ("/up/..", "dot segment"),
    ("/up/.", "dot segment"),
    ("/up/a/../b", "dot segment"),
    ("/up/a/./b", "dot segment"),
    ("/up/a/..", "dot segment"),
    ("/up/../other/x", "dot segment"),
    ("/..", "upstream"),
    ("/./x", "upstream"),
    ("/up/%2E%2E/x", "%2E"),
    ("/up/%2e%2e/x", "lower-case"),
    ("/up/.%2E/x", "%2E"),
    ("/up/%2E./x", "%2E"),
    ("/up/%2E", "%2E"),
    ("/up/a%2Eb", "%2E"),
    # path parameters
    ("/up/a;b", "';'"),
    ("/up/a;jsessionid=1/b", "';'"),
    ("/up/..;/admin", "';'"),
    ("/up/a%3Bb", "%3B"),
    ("/up/a%3bb", "lower-case"),
    # control characters and NUL, raw and encoded
    ("/up/a\x00b", "not allowed in the path"),
    ("/up/a\nb", "not allowed in the path"),
    ("/up/a\rb", "not allowed in the path"),
    ("/up/a\tb", "not allowed in the path"),
    ("/up/a\x7fb", "not allowed in the path"),
    ("/up/a%00b", "%00"),
    ("/up/a%0Ab", "%0A"),
    ("/up/a%0Db", "%0D"),
    ("/up/a%09b", "%09"),
    ("/up/a%1Fb", "%1F"),
    ("/up/a%7Fb", "%7F"),
    ("/up/x?q=%00", "%00"),
    ("/up/x?q=%0A", "%0A"),
    ("/up/x?q=%0D%0AX-Injected:1", "%0D"),
    ("/up/x?q=%7F", "%7F"),
    ("/up/x?q=a\x00", "not allowed in the query"),
    # double encoding
    ("/up/a%252Fb", "%25"),
    ("/up/a%252e", "%25"),
    ("/up/a%25", "%25"),
    ("/up/x?q=%252F", "double percent-encoding"),
    ("/up/x?q=%252e", "double percent-encoding"),
    ("/up/x?q=%25%32%46", "%32"),
    # lower-case hex escapes
    ("/up/caf%c3%a9", "lower-case"),
    ("/up/a%2cb", "lower-case"),
    ("/up/x?q=%c3%a9", "lower-case"),
    ("/up/x?q=%2f", "lower-case"),
    # encoded unreserved characters
    ("/up/%41dmin", "%41"),
    ("/up/a%2Db", "%2D"),
    ("/up/a%5Fb", "%5F"),
    ("/up/a%7Eb", "%7E"),
    ("/up/%30", "%30"),
    ("/up/x?q=%41", "%41"),
    ("/up/x?%61=1", "%61"),
    ("/up/x?q=%2E%2E", "%2E"),
    # malformed escapes
    ("/up/a%", "malformed"),
    ("/up/a%G1", "malformed"),
    ("/up/a%4", "malformed"),
    ("/up/a%4/b", "malformed"),
    ("/up/a%%41", "malformed"),
    ("/up/a% 1", "' '"),
    ("/up/x?q=%", "malformed"),
    ("/up/x?q=%ZZ", "malformed"),
    ("/up/x?q=1%", "malformed"),
    # escapes that do not decode to UTF-8
    ("/up/%FF", "UTF-8"),
    ("/up/%C3", "UTF-8"),
    ("/up/%C0%AF", "UTF-8"),  # overlong "/"
    ("/up/%ED%A0%80", "UTF-8"),  # a surrogate
    ("/up/x?q=%FF", "UTF-8"),
    # absolute-form, asterisk-form, authority-form, no leading slash
    ("http://evil/x", "origin-form"),
    ("https://evil.example/metrics/cpu", "origin-form"),
    ("*", "origin-form"),
    ("evil:443", "origin-form"),
    ("up/x", "origin-form"),
    ("", "origin-form"),
    # empty segments
    ("//up/x", "empty path segment"),
    ("//evil/x", "empty path segment"),
    ("/up//x", "empty path segment"),
    ("/up/x//", "empty path segment"),
    ("/up//", "empty path segment"),
    ("/", "upstream"),
    ("/?a=b", "upstream"),
    # fragments
    ("/up/x#frag", "fragment"),
    ("/up/x?q=1#frag", "fragment"),
    ("/up/x#", "fragment"),
    # non-ASCII raw characters
    ("/up/café", "'é'"),
    ("/up/\u202e", "not allowed in the path"),
    ("/up/\uff0e\uff0e", "not allowed in the path"),  # fullwidth dots
    ("/up/x?q=é", "'é'"),
    ("/up/a b", "' '"),
    ("/up/x?q=a b", "' '"),
    ('/up/"x"', "'\"'"),
    ("/up/<x>", "'<'"),
    ("/up/a|b", "'|'"),
    ("/up/a`b", "'`'"),
    ("/up/{x}", "'{'"),
    ("/up/a^b", "'^'"),
    # queries
    ("/up/x?", "empty query"),
    ("/up?", "empty query"),
    ("/up/x?a", "not name=value"),
    ("/up/x?a=1&b", "not name=value"),
    ("/up/x?=1", "not name=value"),
    ("/up/x?a=1&&b=2", "not name=value"),
    ("/up/x?a=1&", "not name=value"),
    ("/up/x?&a=1", "not name=value"),
    ("/up/x?a=1;b=2", "';'"),
    # upstream names
    ("/UP/x", "upstream"),
    ("/Metrics/cpu", "upstream"),
    ("/_up/x", "upstream"),
    ("/-up/x", "upstream"),
    ("/up.x/y", "upstream"),
    ("/up:80/y", "upstream"),
    ("/up@evil/y", "upstream"),
    ("/" + "a" * 64 + "/x", "upstream"),
    ("/up%41/x", "%41"),
    ("/%75p/x", "%75"),
    # too long
    ("/up/" + "a" * MAX_TARGET_LENGTH, "longer than"),
]


@pytest.mark.parametrize("raw,word", REFUSED, ids=[repr(r)[:60] for r, _ in REFUSED])
def test_ambiguous_targets_are_refused(raw: str, word: str) -> None:
    with pytest.raises(TargetAmbiguous) as info:
        parse_target(raw)
    err = info.value
    assert type(err) is TargetAmbiguous
    assert isinstance(err, BadRequest)
    assert err.reason is Reason.TARGET_AMBIGUOUS
    assert err.status == 400
    assert err.detail.startswith("request target refused: ")
    assert word in err.detail, err.detail


def test_encoded_semicolon_in_a_query_value_is_data() -> None:
    t = parse_target("/up/x?a=1%3Bb")
    assert t.query_pairs == (("a", "1;b"),)
    assert t.forward_target == "/x?a=1%3Bb"


def test_longest_accepted_target() -> None:
    raw = "/up/" + "a" * (MAX_TARGET_LENGTH - 4)
    assert len(raw) == MAX_TARGET_LENGTH
    assert parse_target(raw).segments == ("a" * (MAX_TARGET_LENGTH - 4),)
    with pytest.raises(TargetAmbiguous, match="longer than"):
        parse_target(raw + "a")


def test_upstream_name_of_63_characters_is_accepted() -> None:
    name = "a" + "b" * 62
    assert parse_target(f"/{name}/x").upstream == name


def test_each_segment_is_decoded_on_its_own() -> None:
    # Decoding happens after splitting: an encoded '?' or '#' never starts a query/fragment.
    t = parse_target("/up/a%3Fq=1/b%23c")
    assert t.segments == ("a?q=1", "b#c")
    assert t.query_pairs == ()
    assert t.raw_query == ""


def test_segments_never_contain_separators() -> None:
    for raw in ("/up/a%2Fb", "/up/a%5Cb", "/up/a%00b"):
        with pytest.raises(TargetAmbiguous):
            parse_target(raw)


def test_target_is_immutable() -> None:
    t = parse_target("/up/x")
    with pytest.raises(AttributeError):
        t.rest = "/admin"  # type: ignore[misc]


@pytest.mark.parametrize(
    "escape", ["%21", "%24", "%26", "%27", "%28", "%29", "%2A", "%2B", "%2C", "%3D", "%3A", "%40"]
)
def test_path_escapes_of_characters_that_may_stand_as_they_are_are_refused(escape: str) -> None:
    # "+" and "%2B" would be two spellings of one segment.
    with pytest.raises(TargetAmbiguous) as err:
        parse_target(f"/up/a{escape}b")
    assert err.value.reason.value == "target_ambiguous"
    # In the query they are data (e.g. a literal '&' or '=' in a value) and stay allowed.
    assert parse_target(f"/up/x?q=a{escape}b").query_pairs[0][0] == "q"
