"""count_attempts: attempts at a rule are counted before its payload is checked, allowed or
not, apart from the rule's rate and quota (which count allowed calls only); on both state
backends."""

# ruff: noqa: F811 (the state fixtures are imported, then named as test parameters)
from __future__ import annotations

import json

import pytest

from gateway.errors import AttemptsLimited, Reason, SqlDenied, StateUnavailable
from gateway.limits import attempts_key, rate_key
from gateway.policy.model import Policy
from gateway.policy.spec import DEFAULT_SQL_ATTEMPTS
from gateway.rates import parse_rate
from gateway.stages.count_attempts import CountAttempts
from gateway.stages.throttle import Throttle
from gateway.stages.validate import Validate
from gateway.state import StateStore
from gateway.testing import make_call, matching, policy_from_text, run_stages
from tests.state.conftest import (  # noqa: F401 (fixtures: both backends)
    backend,
    make_store,
    store,
    store_url,
)

POLICY = """
version: 1
agents: {"*": [analyst]}
upstreams:
  db: {url: "http://127.0.0.1:9"}
roles:
  analyst:
    rules:
      - id: query
        upstream: db
        allow: POST /query
        attempts: 3/hour
        quota: 100
        rate: 2/hour
        sql: {field: sql, dialect: sqlite, tables: [orders], schema: {orders: [id, status]}}
      - id: defaulted
        upstream: db
        allow: POST /defaulted
        sql: {field: sql, dialect: sqlite, tables: [orders], schema: {orders: [id, status]}}
      - id: unlimited
        upstream: db
        allow: POST /unlimited
        attempts: none
        sql: {field: sql, dialect: sqlite, tables: [orders], schema: {orders: [id, status]}}
      - id: plain
        upstream: db
        allow: GET /plain
      - id: lenient
        upstream: db
        allow: POST /lenient
        attempts: 1/hour
        on_state_error: allow
        sql: {field: sql, dialect: sqlite, tables: [orders], schema: {orders: [id, status]}}
"""


@pytest.fixture(scope="module")
def policy() -> Policy:
    return policy_from_text(POLICY)


def sql_call(path: str, sql: str, agent: str = "a1") -> object:
    body = json.dumps({"sql": sql}).encode()
    return make_call("POST", path, body=body, roles=["analyst"], agent=agent, run="r1")


async def attempt(policy: Policy, store: StateStore, path: str, sql: str, agent: str = "a1"):
    call = sql_call("/db" + path, sql, agent)
    stages = (*matching(policy), CountAttempts(store), Validate(), Throttle(store))
    return await run_stages(call, *stages)  # type: ignore[arg-type]


def test_the_rules_read_their_attempts(policy: Policy) -> None:
    rules = {r.id: r for r in policy.roles["analyst"].rules}
    assert rules["query"].attempts == parse_rate("3/hour")
    assert rules["defaulted"].attempts == parse_rate(DEFAULT_SQL_ATTEMPTS)
    assert rules["unlimited"].attempts is None
    assert rules["plain"].attempts is None  # no payload check: no default


async def test_refused_attempts_count_and_are_limited(policy: Policy, store: StateStore) -> None:
    # Denied SQL still spends attempts: the check ran.
    for _ in range(3):
        with pytest.raises(SqlDenied):
            await attempt(policy, store, "/query", "DELETE FROM orders")
    with pytest.raises(AttemptsLimited) as info:
        await attempt(policy, store, "/query", "SELECT id FROM orders")  # would be allowed
    err = info.value
    assert err.status == 429 and err.reason is Reason.ATTEMPTS_LIMITED
    assert err.rule == "query" and int(err.headers["Retry-After"]) >= 1
    # Another agent has its own count.
    await attempt(policy, store, "/query", "SELECT id FROM orders", agent="a2")


async def test_attempts_are_apart_from_the_rate(policy: Policy, store: StateStore) -> None:
    # Two allowed calls spend the rate (2/hour) and two attempts; the rule's rate refuses
    # the third (rate_limited), which was still an attempt; the fourth is past attempts.
    for _ in range(2):
        await attempt(policy, store, "/query", "SELECT id FROM orders")
    with pytest.raises(Exception) as third:
        await attempt(policy, store, "/query", "SELECT id FROM orders")
    assert getattr(third.value, "reason", None) == Reason.RATE_LIMITED
    with pytest.raises(AttemptsLimited):
        await attempt(policy, store, "/query", "SELECT id FROM orders")
    # The keys are distinct in the store.
    assert attempts_key("a1", "query") != rate_key("a1", "query")


async def test_no_attempts_stated_none(policy: Policy, store: StateStore) -> None:
    for _ in range(70):  # past the SQL default's burst of 60
        with pytest.raises(SqlDenied):
            await attempt(policy, store, "/unlimited", "DELETE FROM orders")


async def test_the_default_bounds_sql_rules(policy: Policy, store: StateStore) -> None:
    burst = parse_rate(DEFAULT_SQL_ATTEMPTS).burst
    for _ in range(burst):
        with pytest.raises(SqlDenied):
            await attempt(policy, store, "/defaulted", "DELETE FROM orders")
    with pytest.raises(AttemptsLimited):
        await attempt(policy, store, "/defaulted", "DELETE FROM orders")


class _Down:
    def take_now(self, *args: object, **kw: object) -> object:
        return None  # nothing held here: ask the store

    async def take(self, *args: object, **kw: object) -> object:
        raise StateUnavailable("the state store is down")


async def test_state_down_fails_closed_unless_the_rule_allows(policy: Policy) -> None:
    stage = CountAttempts(_Down())  # type: ignore[arg-type]
    call = sql_call("/db/query", "SELECT id FROM orders")
    with pytest.raises(StateUnavailable):
        await run_stages(call, *matching(policy), stage)  # type: ignore[arg-type]
    lenient = sql_call("/db/lenient", "SELECT id FROM orders")
    await run_stages(lenient, *matching(policy), stage)  # type: ignore[arg-type]
    assert lenient.state_error_allowed  # type: ignore[attr-defined]
