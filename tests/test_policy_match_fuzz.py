"""Property tests of ``Policy.match`` against an independent re-implementation (an oracle).

For random paths, query strings and headers against one fixed policy:
- a target that ``parse_target`` refuses is never matched (there is nothing to match);
- when ``match`` allows, every constraint of the matched rule holds when re-checked here,
  the rule's literal segments equal the decoded segments, and it is the first rule (in
  role and file order) that the oracle finds fully satisfied;
- when it refuses, the oracle finds no satisfied rule, and the reason is the one the oracle
  expects (``query_invalid`` with the nearest rule's id, or ``no_rule``).
"""

from __future__ import annotations

import re
from typing import Any

from hypothesis import event, given
from hypothesis import strategies as st
from multidict import CIMultiDict

from gateway.errors import NoRule, QueryInvalid, TargetAmbiguous
from gateway.policy.model import Match, Policy, Rule
from gateway.target import Target, parse_target
from tests.helpers_core import FUZZ, policy_from_text

POLICY_TEXT = """
version: 1
agents: {"*": [reader, writer]}
upstreams:
  api: {url: "http://127.0.0.1:9200"}
  other: {url: "http://127.0.0.1:9201"}
roles:
  reader:
    rules:
      - id: item
        upstream: api
        allow: GET /items/{id}
        params:
          id: {integer: true, min: 1, max: 99}
        query:
          view: {enum: [full, short], required: true}
          n: {min: -5, max: 5}
          tag: {regex: "[a-c]{1,3}", repeat: true}
        headers:
          X-Env: {enum: [prod, dev]}
      - id: item-any
        upstream: api
        allow: GET /items/{id}
        allow_extra_query: true
        query:
          view: [short]
      - id: list
        upstream: api
        allow: GET /items/
      - id: nested
        upstream: api
        allow: GET /a/{x}/b/{y}
        params:
          x: {regex: "[a-z]+", max_length: 3}
          y: [one, two]
  writer:
    rules:
      - id: post
        upstream: api
        allow: POST /items
        query:
          dry: {enum: ["1"], required: true}
"""
POLICY: Policy = policy_from_text(POLICY_TEXT)
INT = re.compile(r"-?(0|[1-9][0-9]*)")

# --- generation -------------------------------------------------------------------------------

words = st.sampled_from(
    [
        "items",
        "a",
        "b",
        "1",
        "5",
        "99",
        "100",
        "0",
        "-1",
        "01",
        "+1",
        "x",
        "abc",
        "abcd",
        "one",
        "two",
        "three",
        "%20",
        "%C3%A9",
        "",
        "A",
        "1_0",
        "0x1",
        "%2B1",
    ]
)
names = st.sampled_from(["view", "n", "tag", "dry", "extra", "VIEW", "v%20iew", "tag%20"])
values = st.sampled_from(
    [
        "full",
        "short",
        "FULL",
        "",
        "1",
        "-5",
        "5",
        "6",
        "-6",
        "0",
        "-0",
        "01",
        "+1",
        "%2B1",
        "%201",
        "a",
        "ab",
        "abc",
        "abcd",
        "d",
        "x+y",
        "%26",
        "1e1",
        "%D9%A1",
    ]
)


# Hypothesis leans towards the first choice and towards 0: say which way to lean.
MOSTLY = st.sampled_from([True, True, True, True, False])
MOSTLY_NOT = st.sampled_from([False, False, False, False, True])


def _good_values(c: Any) -> list[str]:
    """Values likely (not certain) to satisfy the constraint."""
    return sorted(c.enum) if c.enum else ["1", "-5", "5", "99", "a", "abc", "bc"]


ALL_RULES = [rule for role in POLICY.roles.values() for rule in role.rules]


@st.composite
def calls(draw: st.DrawFn) -> tuple[str, str, tuple[str, ...], CIMultiDict[str]]:
    """Mostly calls shaped after one rule (so allows are common), some entirely random."""
    rule = draw(st.sampled_from(ALL_RULES))
    if draw(MOSTLY_NOT):
        upstream = draw(st.sampled_from(["api", "other", "none"]))
        segs = draw(st.lists(words, max_size=4))
    else:
        upstream = rule.upstream
        segs = [
            (s if draw(MOSTLY) else draw(words))
            if isinstance(s, str)
            else draw(st.sampled_from(_good_values(s)) | words)
            for s in rule.path.segments
        ]
    path = "/" + upstream + "".join("/" + s for s in segs)
    pairs: list[tuple[str, str]] = []
    for name, c in rule.query.items():  # a value for each known parameter, often a good one
        if draw(MOSTLY):
            pairs.append((name, draw(st.sampled_from(_good_values(c)) | values)))
    extra = draw(st.lists(st.tuples(names, values), max_size=2))
    pairs = draw(st.permutations(pairs + extra)) if draw(st.booleans()) else pairs
    raw = path + ("?" + "&".join(f"{n}={v}" for n, v in pairs) if pairs else "")
    method = rule.method if draw(MOSTLY) else draw(st.sampled_from(["GET", "POST", "PUT"]))
    roles = tuple(draw(st.lists(st.sampled_from(["reader", "writer", "nobody"]), max_size=2)))
    if draw(MOSTLY):
        roles = (*roles, rule.role)
    env = draw(st.lists(st.sampled_from(["prod", "dev", "test", "PROD"]), max_size=2))
    headers: CIMultiDict[str] = CIMultiDict(
        (draw(st.sampled_from(["X-Env", "x-env"])), v) for v in env
    )
    return raw, method, roles, headers


caps_strategy = st.one_of(
    st.none(),
    st.none(),
    st.frozensets(st.sampled_from(["item", "item-any", "list", "nested", "post", "ghost"])),
)

# --- the oracle -------------------------------------------------------------------------------


def _value_ok(c: Any, value: str) -> bool:
    if len(value) > c.max_length:
        return False
    if c.enum is not None and value not in c.enum:
        return False
    if c.integer:
        if not INT.fullmatch(value) or len(value.lstrip("-")) > 18:
            return False
        number = int(value)
        if c.minimum is not None and number < c.minimum:
            return False
        if c.maximum is not None and number > c.maximum:
            return False
    return not (c.regex is not None and re.fullmatch(c.regex.pattern, value) is None)


def _path_params(rule: Rule, target: Target) -> tuple[bool, bool, dict[str, str]]:
    """(shape matches, params satisfy constraints, params)."""
    pattern = rule.path.segments
    if len(pattern) != len(target.segments):
        return False, False, {}
    params: dict[str, str] = {}
    ok = True
    for want, got in zip(pattern, target.segments, strict=True):
        if isinstance(want, str):
            if want != got:
                return False, False, {}
        elif got == "":
            return False, False, {}  # a parameter never takes an empty segment
        else:
            params[want.name] = got
            ok = ok and _value_ok(want, got)
    return True, ok, params


def _query_ok(rule: Rule, pairs: tuple[tuple[str, str], ...]) -> bool:
    counts: dict[str, int] = {}
    for name, value in pairs:
        c = rule.query.get(name)
        if c is None:
            if not rule.allow_extra_query:
                return False
            continue
        counts[name] = counts.get(name, 0) + 1
        if counts[name] > 1 and not c.repeat:
            return False
        if not _value_ok(c, value):
            return False
    return all(not c.required or name in counts for name, c in rule.query.items())


def _headers_ok(rule: Rule, headers: CIMultiDict[str]) -> bool:
    for name, c in rule.headers.items():
        got = headers.getall(name, [])
        if not got:
            if c.required:
                return False
            continue
        if len(got) > 1 and not c.repeat:
            return False
        if not all(_value_ok(c, v) for v in got):
            return False
    return True


def oracle(
    roles: tuple[str, ...],
    caps: frozenset[str] | None,
    target: Target,
    method: str,
    headers: CIMultiDict[str],
) -> tuple[str, str | None]:
    """("allow", rule id) | ("query_invalid", rule id) | ("no_rule", None)."""
    if target.upstream not in POLICY.upstreams:
        return "no_rule", None
    near: str | None = None
    seen: set[str] = set()
    for role in roles:
        if role not in POLICY.roles:
            continue
        for rule in POLICY.roles[role].rules:
            if rule.id in seen or rule.upstream != target.upstream or rule.method != method:
                continue
            if caps is not None and rule.id not in caps:
                continue
            seen.add(rule.id)
            shape, params_ok, _ = _path_params(rule, target)
            if not shape or not params_ok:
                continue
            if _query_ok(rule, target.query_pairs) and _headers_ok(rule, headers):
                return "allow", rule.id
            near = near or rule.id
    return ("query_invalid", near) if near else ("no_rule", None)


# --- properties -------------------------------------------------------------------------------


@FUZZ
@given(calls(), caps_strategy)
def test_match_agrees_with_the_oracle(
    call: tuple[str, str, tuple[str, ...], CIMultiDict[str]], caps: frozenset[str] | None
) -> None:
    raw, method, roles, headers = call
    try:
        target = parse_target(raw)
    except TargetAmbiguous:
        return  # refused before matching: nothing to match, never allowed
    expected, expected_rule = oracle(roles, caps, target, method, headers)
    event(f"{expected} {expected_rule}")
    try:
        m = POLICY.match(roles, caps, target, method, headers)
    except QueryInvalid as exc:
        assert (expected, expected_rule) == ("query_invalid", exc.rule), exc.detail
        return
    except NoRule as exc:
        assert expected == "no_rule", (expected, expected_rule, exc.detail)
        assert exc.rule is None
        return
    assert isinstance(m, Match)
    assert (expected, expected_rule) == ("allow", m.rule.id)
    # Re-check the allowed call independently, constraint by constraint.
    rule = m.rule
    assert rule.upstream == target.upstream and rule.method == method
    assert rule.role in roles
    assert caps is None or rule.id in caps
    shape, params_ok, params = _path_params(rule, target)
    assert shape and params_ok and dict(m.params) == params
    literal = [s for s in rule.path.segments if isinstance(s, str)]
    assert literal == [
        got
        for want, got in zip(rule.path.segments, target.segments, strict=True)
        if isinstance(want, str)
    ]
    assert _query_ok(rule, target.query_pairs)
    assert _headers_ok(rule, headers)


@FUZZ
@given(st.text(max_size=40), st.sampled_from(["GET", "POST"]))
def test_random_text_is_never_allowed_unless_canonical(raw: str, method: str) -> None:
    try:
        target = parse_target(raw)
    except TargetAmbiguous:
        return
    try:
        m = POLICY.match(("reader", "writer"), None, target, method, CIMultiDict())
    except (NoRule, QueryInvalid):
        return
    # Anything allowed is a canonical target whose decoded path is the rule's pattern.
    assert "/" + target.upstream + target.forward_target == raw
    assert len(m.rule.path.segments) == len(target.segments)
