"""The respond stage's masking of an injected credential, as a property: however an upstream
splits its answer into chunks, and whichever of the secret's characters it JSON-escapes, the
agent never gets bytes from which the secret can be read back; and an answer that does not
carry the secret passes unchanged."""

from __future__ import annotations

import base64
import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.credentials import reflections_of
from gateway.stages.respond import Scrubber

SECRET = "Hunter2-Xy7Q9/pLm4Rt"


def scrub(chunks: list[bytes], secret: str = SECRET) -> bytes:
    scrubber = Scrubber(reflections_of(secret))
    return b"".join(scrubber.feed(c) for c in chunks) + scrubber.flush()


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    out, last = [], 0
    for p in points:
        out.append(data[last:p])
        last = p
    out.append(data[last:])
    return out


def json_escaped(secret: str, which: list[bool], upper: bool) -> str:
    out = []
    for char, escape in zip(secret, which + [False] * len(secret), strict=False):
        if escape:
            code = f"{ord(char):04x}"
            out.append("\\u" + (code.upper() if upper else code))
        elif char == "/":
            out.append("\\/")
        else:
            out.append(char)
    return "".join(out)


FILLER = st.text(
    st.characters(min_codepoint=32, max_codepoint=126, exclude_characters='\\"'), max_size=40
)


@settings(max_examples=300)
@given(
    before=FILLER,
    after=FILLER,
    which=st.lists(st.booleans(), max_size=len(SECRET)),
    upper=st.booleans(),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_an_escaped_secret_is_never_readable_whatever_the_chunks(
    before: str, after: str, which: list[bool], upper: bool, cuts: list[int]
) -> None:
    body = json.dumps({"msg": "x"}).replace('"x"', '"' + before + "SECRET" + after + '"')
    body = body.replace("SECRET", json_escaped(SECRET, which, upper))
    raw = body.encode()
    out = scrub(split(raw, cuts))
    assert len(out) == len(raw)  # masking keeps lengths
    assert SECRET not in json.loads(out)["msg"]


@settings(max_examples=300)
@given(text=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=8))
def test_an_answer_without_the_secret_passes_unchanged(text: bytes, cuts: list[int]) -> None:
    if any(f in text for f in reflections_of(SECRET).forms) or re.search(
        reflections_of(SECRET).escaped, text
    ):
        return
    assert scrub(split(text, cuts)) == text


@given(pad=st.integers(0, 2), cuts=st.lists(st.integers(0, 120), max_size=6))
def test_base64_of_the_secret_inside_longer_text_cannot_be_decoded(
    pad: int, cuts: list[int]
) -> None:
    encoded = base64.b64encode(b"\0" * pad + SECRET.encode() + b" and more")
    out = scrub(split(b"data=" + encoded + b";", cuts))
    decoded = base64.b64decode(out[5:-1].replace(b"*", b"A"))
    assert SECRET.encode() not in decoded


SECRETS = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=24)


@settings(max_examples=300)
@given(secret=SECRETS, which=st.lists(st.booleans(), max_size=24), upper=st.booleans())
def test_no_reflection_is_shorter_than_the_header_prefilter_skips(
    secret: str, which: list[bool], upper: bool
) -> None:
    # The respond stage masks a header value only when it is at least ``shortest`` long:
    # every exact form, and every JSON-escaped spelling, must be at least that long.
    seen = reflections_of(secret)
    assert all(len(form) >= seen.shortest for form in seen.forms)
    escaped = json_escaped(secret, which, upper).encode("utf-8", "surrogatepass")
    for match in seen.escaped.finditer(escaped):
        assert len(match.group()) >= seen.shortest
    assert seen.escaped.search(escaped) is not None
    assert len(escaped) >= seen.shortest


# --- the answer's head: one look at the whole head, then per header only on a hit ------------

_head_text = st.lists(
    st.sampled_from([*"abcXYZ019-/ ;=\\é☃", "Hunter2", "hunter2-xy7q9", "Xy7Q9/pLm4Rt"]),
    max_size=12,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    reason=st.one_of(st.none(), _head_text),
    pairs=st.lists(
        st.tuples(st.sampled_from(["X-A", "Set-Cookie", "X-Hunter2-Xy7Q9/pLm4Rt-B"]), _head_text),
        max_size=5,
    ),
    reflect=st.lists(st.sampled_from(["raw", "b64", "json", "lower-name"]), max_size=2),
)
def test_the_heads_one_look_masks_exactly_as_the_per_header_checks(
    reason: str | None, pairs: list[tuple[str, str]], reflect: list[str]
) -> None:
    """``_head`` first looks for a reflection in the whole head at once and skips the
    per-header checks on a miss: its result must equal the per-header checks' on every
    head, with the secret (or a form of it) planted in values, names and the reason."""
    from types import SimpleNamespace

    from multidict import CIMultiDict

    from gateway.stages import respond

    forms = {
        "raw": SECRET,
        "b64": base64.b64encode(SECRET.encode()).decode(),
        "json": json_escaped(SECRET, [True, False, True], upper=False),
        "lower-name": SECRET.lower(),
    }
    for i, how in enumerate(reflect):
        if how == "lower-name":
            pairs.append((f"X-{forms[how]}", "v"))
        elif pairs and i % 2 == 0:
            name, value = pairs[0]
            pairs[0] = (name, value + forms[how])
        else:
            reason = (reason or "") + forms[how]
    upstream = SimpleNamespace(reason=reason, headers=CIMultiDict(pairs))
    call = SimpleNamespace(request_id="r1")
    seen = reflections_of(SECRET)
    fast = respond._head(call, upstream, frozenset(), seen)  # type: ignore[arg-type]
    original = respond._reflected_in_head
    try:
        respond._reflected_in_head = lambda *a: True  # type: ignore[assignment]
        slow = respond._head(call, upstream, frozenset(), seen)  # type: ignore[arg-type]
    finally:
        respond._reflected_in_head = original  # type: ignore[assignment]
    assert fast == slow
    text = repr(fast)
    assert SECRET not in text and SECRET.lower() not in text.lower()
