"""``Policy.match``: default deny, roles, caps, path/query/header constraints, reasons.

Every decision is checked for its outcome and its reason: a ``Match`` names the rule, a
refusal is ``NoRule`` (403, ``no_rule``) or ``QueryInvalid`` (400, ``query_invalid``, with
the rule id of the nearest rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from multidict import CIMultiDict

from gateway.errors import NoRule, QueryInvalid, Reason, ToolDenied
from gateway.policy.model import Constraint, Match, Policy
from gateway.target import parse_target
from tests.helpers_core import policy_from_text

POLICY = """
version: 1
agents: {"*": [sre, api-reader, writer, mcp-user]}
upstreams:
  metrics: {url: "http://127.0.0.1:9101"}
  logs: {url: "http://127.0.0.1:9102"}
  api: {url: "http://127.0.0.1:9200"}
  mcp: {url: "http://127.0.0.1:9300", kind: mcp}
roles:
  sre:
    rules:
      - id: read-cpu
        upstream: metrics
        allow: GET /metrics/cpu
        query:
          window: {enum: ["1m", "5m", "15m"], required: true}
      - id: read-logs
        upstream: logs
        allow: GET /logs/application
        query:
          level: [debug, info, warn, error]
          limit: {min: 1, max: 500}
          since: {integer: true}
          tag: {regex: "[a-z]{1,8}", repeat: true}
      - id: read-host-metric
        upstream: metrics
        allow: GET /metrics/host/{host}/{metric}
        params:
          host: {regex: "web-[0-9]+"}
          metric: [cpu, mem]
  api-reader:
    rules:
      - id: get-item
        upstream: api
        allow: GET /items/{id}
        params:
          id: {integer: true, min: 1, max: 1000}
        headers:
          X-Env: {enum: [prod, staging], required: true}
          X-Trace: {regex: "[0-9a-f]{8}"}
      - id: search
        upstream: api
        allow: GET /search
        allow_extra_query: true
        query:
          q: {required: true, max_length: 10}
      - id: list-slash
        upstream: api
        allow: GET /items/
      - id: get-item-any
        upstream: api
        allow: GET /items/{id}
        headers:
          X-Env: {enum: [dev]}
  writer:
    rules:
      - id: put-item
        upstream: api
        allow: PUT /items/{id}
        headers:
          X-Tags: {enum: [a, b], repeat: true}
          X-Once: [x]
  mcp-user:
    rules:
      - id: mcp-search
        upstream: mcp
        allow: POST /mcp
        tool: search
      - id: mcp-any
        upstream: mcp
        allow: POST /mcp
"""


@pytest.fixture(scope="module")
def policy() -> Policy:
    return policy_from_text(POLICY)


def match(
    policy: Policy,
    raw: str,
    *,
    roles: tuple[str, ...] = ("sre",),
    caps: frozenset[str] | None = None,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    tool: str | None = None,
) -> Match:
    return policy.match(
        roles,
        caps,
        parse_target(raw),
        method,
        headers if headers is not None else {},
        ("tool", tool) if tool is not None else None,
    )


def no_rule(policy: Policy, raw: str, *, contains: str = "", **kw: Any) -> NoRule:
    with pytest.raises(NoRule) as info:
        match(policy, raw, **kw)
    err = info.value
    assert err.reason is Reason.NO_RULE and err.status == 403
    assert contains in err.detail, err.detail
    return err


def query_invalid(policy: Policy, raw: str, *, rule: str, contains: str, **kw: Any) -> QueryInvalid:
    with pytest.raises(QueryInvalid) as info:
        match(policy, raw, **kw)
    err = info.value
    assert err.reason is Reason.QUERY_INVALID and err.status == 400
    assert err.rule == rule
    assert contains in err.detail, err.detail
    return err


# --- allowed ----------------------------------------------------------------------------------


def test_allowed_call_names_its_rule(policy: Policy) -> None:
    m = match(policy, "/metrics/metrics/cpu?window=5m")
    assert m.rule.id == "read-cpu" and m.rule.role == "sre"
    assert m.params == {}


def test_path_params_are_returned_decoded(policy: Policy) -> None:
    m = match(policy, "/metrics/metrics/host/web-12/mem")
    assert m.rule.id == "read-host-metric"
    assert m.params == {"host": "web-12", "metric": "mem"}


# --- default deny -----------------------------------------------------------------------------


def test_unknown_upstream_is_denied(policy: Policy) -> None:
    no_rule(policy, "/nosuch/metrics/cpu?window=5m", contains="no upstream named 'nosuch'")


def test_path_not_in_any_rule_is_denied(policy: Policy) -> None:
    err = no_rule(policy, "/metrics/metrics/mem?window=5m", contains="GET /metrics/metrics/mem")
    assert err.rule is None


@pytest.mark.parametrize(
    "raw",
    [
        "/metrics/metrics/cpu/?window=5m",  # trailing slash is another path
        "/metrics/metrics/cpu/x?window=5m",
        "/metrics/metrics?window=5m",
        "/metrics?window=5m",
        "/metrics/cpu?window=5m",  # the upstream name is not part of the upstream's path
        "/metrics/Metrics/cpu?window=5m",
        "/metrics/metrics/cpu%20?window=5m",
        "/logs/metrics/cpu?window=5m",  # right path, other upstream
    ],
)
def test_near_misses_of_the_path_are_denied(policy: Policy, raw: str) -> None:
    no_rule(policy, raw, contains="no rule of the token's roles allows GET")


@pytest.mark.parametrize(
    "method", ["POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "get", "TRACE"]
)
def test_method_mismatch_is_denied(policy: Policy, method: str) -> None:
    no_rule(policy, "/metrics/metrics/cpu?window=5m", method=method, contains=f"allows {method} ")


def test_role_not_granted_is_denied(policy: Policy) -> None:
    no_rule(policy, "/metrics/metrics/cpu?window=5m", roles=("api-reader",))
    no_rule(policy, "/metrics/metrics/cpu?window=5m", roles=())
    no_rule(policy, "/metrics/metrics/cpu?window=5m", roles=("no-such-role",))
    no_rule(policy, "/metrics/metrics/cpu?window=5m", roles=("SRE",))


def test_any_granted_role_is_enough(policy: Policy) -> None:
    m = match(policy, "/metrics/metrics/cpu?window=5m", roles=("api-reader", "sre"))
    assert m.rule.id == "read-cpu"


# --- caps -------------------------------------------------------------------------------------


def test_caps_naming_the_rule_allow(policy: Policy) -> None:
    m = match(policy, "/metrics/metrics/cpu?window=5m", caps=frozenset({"read-cpu"}))
    assert m.rule.id == "read-cpu"


def test_caps_not_naming_the_rule_deny(policy: Policy) -> None:
    no_rule(policy, "/metrics/metrics/cpu?window=5m", caps=frozenset({"read-logs"}))


def test_empty_caps_deny_everything(policy: Policy) -> None:
    no_rule(policy, "/metrics/metrics/cpu?window=5m", caps=frozenset())
    no_rule(policy, "/logs/logs/application", caps=frozenset())


def test_cap_naming_a_rule_of_another_role_grants_nothing(policy: Policy) -> None:
    # The token's role is sre; naming api-reader's rule in caps must not borrow it.
    no_rule(policy, "/api/items/5", caps=frozenset({"get-item"}), headers={"X-Env": "prod"})
    no_rule(policy, "/api/search?q=x", caps=frozenset({"search", "read-cpu"}))


def test_caps_narrow_which_of_two_rules_can_match(policy: Policy) -> None:
    # get-item needs X-Env prod/staging; get-item-any accepts dev. Caps pick one.
    h = {"X-Env": "dev"}
    m = match(policy, "/api/items/5", roles=("api-reader",), headers=h)
    assert m.rule.id == "get-item-any"
    query_invalid(
        policy,
        "/api/items/5",
        roles=("api-reader",),
        headers=h,
        caps=frozenset({"get-item"}),
        rule="get-item",
        contains="'x-env'",
    )


# --- path parameters --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        "/metrics/metrics/host/db-1/cpu",  # regex
        "/metrics/metrics/host/web-1x/cpu",  # regex is a full match
        "/metrics/metrics/host/xweb-1/cpu",
        "/metrics/metrics/host/web-1/disk",  # enum
        "/metrics/metrics/host/web-1/CPU",
        "/metrics/metrics/host/web-1%20/cpu",
    ],
)
def test_path_param_constraints(policy: Policy, raw: str) -> None:
    err = no_rule(policy, raw, contains="path parameter")
    assert "rule 'read-host-metric'" in err.detail


@pytest.mark.parametrize(
    "value", ["0", "1001", "-1", "+1", " 1", "1_0", "0x10", "01", "1.0", "1e3", "", "١"]
)
def test_integer_path_param_refuses_non_canonical_integers(policy: Policy, value: str) -> None:
    from urllib.parse import quote

    target = parse_target("/api/items/" + quote(value, safe="+"))
    assert target.segments == ("items", value)
    with pytest.raises(NoRule) as info:
        policy.match(("api-reader",), frozenset({"get-item"}), target, "GET", {"X-Env": "prod"})
    if value:
        assert "path parameter 'id' must be" in info.value.detail


def test_integer_path_param_bounds(policy: Policy) -> None:
    for good in ("1", "1000", "42"):
        m = match(policy, f"/api/items/{good}", roles=("api-reader",), headers={"X-Env": "prod"})
        assert m.rule.id == "get-item" and m.params == {"id": good}


def test_trailing_slash_pattern_matches_only_with_the_slash(policy: Policy) -> None:
    assert match(policy, "/api/items/", roles=("api-reader",)).rule.id == "list-slash"
    no_rule(policy, "/api/items", roles=("api-reader",))


def test_empty_segment_never_fills_a_param(policy: Policy) -> None:
    # "/api/items/" has one empty segment; {id} must not take it, or a rule allowing one
    # item (GET /items/{id}, id unconstrained) would also allow the listing GET /items/.
    m = match(policy, "/api/items/", roles=("api-reader",), headers={"X-Env": "dev"})
    assert m.rule.id == "list-slash"
    err = no_rule(
        policy,
        "/api/items/",
        roles=("api-reader",),
        headers={"X-Env": "dev"},
        caps=frozenset({"get-item-any"}),
    )
    assert "path parameter" not in err.detail  # not a near miss: the shape differs


# --- query ------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", ["1m", "5m", "15m"])
def test_query_enum_allows(policy: Policy, window: str) -> None:
    assert match(policy, f"/metrics/metrics/cpu?window={window}").rule.id == "read-cpu"


@pytest.mark.parametrize("window", ["2h", "5M", "5m%20", "", "1m,5m"])
def test_query_enum_refuses(policy: Policy, window: str) -> None:
    query_invalid(
        policy,
        f"/metrics/metrics/cpu?window={window}",
        rule="read-cpu",
        contains="query parameter 'window' must be one of ['15m', '1m', '5m']",
    )


def test_query_required(policy: Policy) -> None:
    query_invalid(policy, "/metrics/metrics/cpu", rule="read-cpu", contains="'window' is required")


def test_query_repeated_is_refused_unless_allowed(policy: Policy) -> None:
    query_invalid(
        policy,
        "/metrics/metrics/cpu?window=5m&window=1m",
        rule="read-cpu",
        contains="'window' is repeated",
    )
    m = match(policy, "/logs/logs/application?tag=a&tag=b&tag=c")
    assert m.rule.id == "read-logs"


def test_query_repeat_checks_every_value(policy: Policy) -> None:
    query_invalid(
        policy,
        "/logs/logs/application?tag=a&tag=B",
        rule="read-logs",
        contains="'tag' must match",
    )


def test_unknown_query_parameter_is_refused(policy: Policy) -> None:
    query_invalid(
        policy,
        "/metrics/metrics/cpu?window=5m&debug=1",
        rule="read-cpu",
        contains="'debug' is not allowed by rule 'read-cpu'",
    )


def test_unknown_query_parameter_with_allow_extra_query(policy: Policy) -> None:
    m = match(policy, "/api/search?q=x&anything=1&more=2", roles=("api-reader",))
    assert m.rule.id == "search"
    query_invalid(
        policy, "/api/search?x=1", roles=("api-reader",), rule="search", contains="'q' is required"
    )
    query_invalid(
        policy,
        "/api/search?q=01234567890",
        roles=("api-reader",),
        rule="search",
        contains="longer than 10",
    )


def test_encoded_parameter_name_is_matched_decoded(policy: Policy) -> None:
    # "win%64ow" would be ambiguous (%64 is 'd'), refused before matching; an encoded '='
    # in a name makes another name, which is unknown here.
    query_invalid(
        policy,
        "/metrics/metrics/cpu?window%3D5m=1&window=5m",
        rule="read-cpu",
        contains="'window=5m' is not allowed",
    )


@pytest.mark.parametrize("limit", ["1", "500", "250"])
def test_query_int_range_allows(policy: Policy, limit: str) -> None:
    assert match(policy, f"/logs/logs/application?limit={limit}").rule.id == "read-logs"


@pytest.mark.parametrize(
    "limit,why",
    [
        ("0", "at least 1"),
        ("501", "at most 500"),
        ("-1", "at least 1"),
        ("%2B1", "integer"),  # '+1'
        ("+1", "integer"),  # '+' is a space in a query: ' 1'
        ("%201", "integer"),
        ("1%20", "integer"),
        ("1_0", "integer"),
        ("0x10", "integer"),
        ("01", "integer"),
        ("00", "integer"),
        ("1.0", "integer"),
        ("1e2", "integer"),
        ("", "integer"),
        ("%D9%A1", "integer"),  # Arabic-Indic digit one: int() would accept it
        ("9" * 40, "integer"),
        ("-0" + "9" * 5, "integer"),
    ],
)
def test_query_int_refuses(policy: Policy, limit: str, why: str) -> None:
    query_invalid(
        policy,
        f"/logs/logs/application?limit={limit}",
        rule="read-logs",
        contains="'limit' must be an integer" if why == "integer" else why,
    )


def test_integer_flag_without_bounds(policy: Policy) -> None:
    assert match(policy, "/logs/logs/application?since=-5").rule.id == "read-logs"
    assert match(policy, "/logs/logs/application?since=0").rule.id == "read-logs"
    query_invalid(policy, "/logs/logs/application?since=-0x1", rule="read-logs", contains="integer")


@pytest.mark.parametrize("level", ["debug", "error"])
def test_query_shorthand_list_is_an_enum(policy: Policy, level: str) -> None:
    assert match(policy, f"/logs/logs/application?level={level}").rule.id == "read-logs"


def test_query_regex_is_a_full_match(policy: Policy) -> None:
    query_invalid(
        policy, "/logs/logs/application?tag=abc1", rule="read-logs", contains="must match"
    )
    query_invalid(
        policy, "/logs/logs/application?tag=abcdefghi", rule="read-logs", contains="must match"
    )
    query_invalid(
        policy, "/logs/logs/application?tag=a%20", rule="read-logs", contains="must match"
    )


def test_regex_does_not_let_a_trailing_newline_through() -> None:
    # re.match(r"[a-z]+$") accepts "abc\n"; the constraint uses fullmatch.
    import re

    c = Constraint(name="t", regex=re.compile(r"[a-z]+$"))
    assert c.violation("abc") is None
    assert c.violation("abc\n") == "must match '[a-z]+$'"


# --- headers ----------------------------------------------------------------------------------


def test_header_constraints(policy: Policy) -> None:
    kw: dict[str, Any] = {"roles": ("api-reader",), "caps": frozenset({"get-item"})}
    assert match(policy, "/api/items/7", headers={"X-Env": "prod"}, **kw).rule.id == "get-item"
    m = match(policy, "/api/items/7", headers={"X-Env": "staging", "X-Trace": "0123abcd"}, **kw)
    assert m.rule.id == "get-item"
    query_invalid(
        policy, "/api/items/7", headers={}, rule="get-item", contains="'x-env' is required", **kw
    )
    query_invalid(
        policy,
        "/api/items/7",
        headers={"X-Env": "dev"},
        rule="get-item",
        contains="header 'x-env' must be one of",
        **kw,
    )
    query_invalid(
        policy,
        "/api/items/7",
        headers={"X-Env": "prod", "X-Trace": "xyz"},
        rule="get-item",
        contains="header 'x-trace' must match",
        **kw,
    )


def test_header_names_are_case_insensitive_in_a_plain_mapping(policy: Policy) -> None:
    # A plain dict keyed "X-ENV" must still be checked against the x-env constraint.
    kw: dict[str, Any] = {"roles": ("api-reader",), "caps": frozenset({"get-item"})}
    assert match(policy, "/api/items/7", headers={"x-env": "prod"}, **kw).rule.id == "get-item"
    assert match(policy, "/api/items/7", headers={"X-ENV": "prod"}, **kw).rule.id == "get-item"
    query_invalid(
        policy,
        "/api/items/7",
        headers={"X-ENV": "prod", "x-trace": "nothex!!"},
        rule="get-item",
        contains="'x-trace' must match",
        **kw,
    )


def test_repeated_header_is_refused_unless_allowed(policy: Policy) -> None:
    kw: dict[str, Any] = {"roles": ("writer",), "method": "PUT"}
    h = CIMultiDict([("X-Env", "prod"), ("x-env", "prod")])
    query_invalid(
        policy,
        "/api/items/7",
        roles=("api-reader",),
        caps=frozenset({"get-item"}),
        headers=h,
        rule="get-item",
        contains="'x-env' is repeated",
    )
    ok = CIMultiDict([("X-Tags", "a"), ("x-tags", "b")])
    assert match(policy, "/api/items/7", headers=ok, **kw).rule.id == "put-item"
    bad = CIMultiDict([("X-Tags", "a"), ("X-Tags", "c")])
    query_invalid(
        policy,
        "/api/items/7",
        headers=bad,
        rule="put-item",
        contains="'x-tags' must be one of",
        **kw,
    )
    once = CIMultiDict([("X-Once", "x"), ("X-ONCE", "x")])
    query_invalid(
        policy, "/api/items/7", headers=once, rule="put-item", contains="'x-once' is repeated", **kw
    )


def test_headers_not_named_by_the_rule_are_not_checked(policy: Policy) -> None:
    kw: dict[str, Any] = {"roles": ("api-reader",), "caps": frozenset({"get-item"})}
    h = {"X-Env": "prod", "X-Other": "anything"}
    assert match(policy, "/api/items/7", headers=h, **kw).rule.id == "get-item"


# --- rule order and the reported reason -------------------------------------------------------


def test_query_invalid_names_the_nearest_rule_and_a_later_rule_still_wins(policy: Policy) -> None:
    # get-item fails on its header; get-item-any (later) allows: the call is allowed.
    m = match(policy, "/api/items/7", roles=("api-reader",), headers={"X-Env": "dev"})
    assert m.rule.id == "get-item-any"
    # Neither allows: the first near miss is reported, with its rule id.
    query_invalid(
        policy,
        "/api/items/7",
        roles=("api-reader",),
        headers={"X-Env": "test"},
        rule="get-item",
        contains="'x-env' must be one of ['prod', 'staging']",
    )


def test_path_param_failure_is_no_rule_with_the_reason(policy: Policy) -> None:
    err = no_rule(policy, "/metrics/metrics/host/db-1/cpu")
    assert "rule 'read-host-metric': path parameter 'host' must match" in err.detail
    assert err.rule is None


# --- MCP tools --------------------------------------------------------------------------------


def test_tool_rules(policy: Policy) -> None:
    kw: dict[str, Any] = {"roles": ("mcp-user",), "method": "POST"}
    assert match(policy, "/mcp/mcp", tool="search", **kw).rule.id == "mcp-search"
    # A tool call needs a rule naming that tool: the tool-less rule does not allow it.
    with pytest.raises(ToolDenied) as info:
        match(policy, "/mcp/mcp", tool="delete", **kw)
    assert info.value.reason is Reason.TOOL_DENIED and info.value.status == 403
    assert "the tool 'delete'" in info.value.detail
    # A protocol message (no tool) is allowed by any rule on the endpoint.
    assert match(policy, "/mcp/mcp", tool=None, **kw).rule.id == "mcp-search"
    caps = frozenset({"mcp-any"})
    assert match(policy, "/mcp/mcp", tool=None, caps=caps, **kw).rule.id == "mcp-any"
    with pytest.raises(ToolDenied):
        match(policy, "/mcp/mcp", tool="search", caps=caps, **kw)


# --- Constraint.violation directly ------------------------------------------------------------


@pytest.mark.parametrize(
    "value,ok",
    [
        ("0", True),
        ("-0", True),
        ("7", True),
        ("-7", True),
        ("999999999999999999", True),
        ("9999999999999999999", False),
        ("+7", False),
        (" 7", False),
        ("7 ", False),
        ("7\n", False),
        ("07", False),
        ("0x7", False),
        ("7_0", False),
        ("٧", False),
        ("", False),
        ("-", False),
    ],
)
def test_constraint_integer_syntax(value: str, ok: bool) -> None:
    c = Constraint(name="n", integer=True)
    assert (c.violation(value) is None) is ok


def test_constraint_max_length_is_checked_first() -> None:
    c = Constraint(name="n", enum=frozenset({"a" * 5}), max_length=4)
    assert c.violation("a" * 5) == "is longer than 4 characters"
