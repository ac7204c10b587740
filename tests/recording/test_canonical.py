"""The canonical call key: JSON order and whitespace, SQL, volatile fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from gateway.checks.sql import normalise_sql
from gateway.policy.model import PathPattern, Rule, volatile_problem
from gateway.recording.canonical import (
    CallKey,
    call_key,
    canonical_body,
    recanonicalise,
    split_target,
)


@dataclass(frozen=True)
class SqlCheck:
    """Stands in for gateway/checks/sql/adapter.py's compiled check (read by attribute)."""

    kind: str = "sql"
    field: str = "sql"
    dialect: str = "postgres"

    def check(self, call: object) -> None:
        return None


def rule(volatile: tuple[str, ...] = (), checks: tuple[Any, ...] = ()) -> Rule:
    return Rule(
        id="r",
        role="x",
        upstream="db",
        method="POST",
        path=PathPattern("/query", ("query",)),
        volatile=volatile,
        checks=checks,
    )


def key(body: bytes | None, target: str = "/query", r: Rule | None = None) -> CallKey:
    form, canonical = canonical_body(body, r)
    return call_key("db", "post", target, form, canonical, r.volatile if r else ())


def test_json_key_order_and_whitespace_do_not_matter() -> None:
    assert key(b'{"b": 1, "a": {"y": [1, 2], "x": "\\u00e9"}}') == key(
        b'{"a":{"x":"\xc3\xa9","y":[1,2]},"b":1}'
    )
    assert key(b'{"a": 1}') != key(b'{"a": 2}')
    assert canonical_body(b'{"b": 1, "a": 2}') == ("json", '{"a":2,"b":1}')


def test_text_and_binary_bodies() -> None:
    assert canonical_body(b"plain text") == ("text", "plain text")
    form, canonical = canonical_body(b"\xff\x00\xfe")
    assert form == "digest" and canonical is not None and canonical.startswith("sha256:")
    assert canonical_body(b"") == (None, None) and canonical_body(None) == (None, None)


def test_sql_keyword_case_and_whitespace_do_not_matter() -> None:
    r = rule(checks=(SqlCheck(),))
    a = key(b'{"sql": "select  id,total_cents\\n from orders where id = 1"}', r=r)
    b = key(b'{"sql": "SELECT id, total_cents FROM orders WHERE id = 1"}', r=r)
    assert a == b
    assert a != key(b'{"sql": "SELECT id FROM orders WHERE id = 2"}', r=r)
    # Without the rule's SQL check the texts differ.
    assert key(b'{"sql": "select  id from orders"}') != key(b'{"sql": "SELECT id FROM orders"}')


def test_unparseable_sql_falls_back_to_collapsed_whitespace() -> None:
    assert normalise_sql("SELECT ((  FROM\n x", "postgres") == "SELECT (( FROM x"


def test_the_checks_own_normaliser_is_used_when_it_has_one() -> None:
    @dataclass(frozen=True)
    class Normalising(SqlCheck):
        def normalize(self, text: str) -> str:
            return "N:" + text.lower()

    assert canonical_body(b'{"sql": "SELECT 1"}', rule(checks=(Normalising(),))) == (
        "json",
        '{"sql":"N:select 1"}',
    )


def test_sql_in_a_nested_field_and_recanonicalised_recordings() -> None:
    r = rule(checks=(SqlCheck(field="/params/q"),))
    form, canonical = canonical_body(b'{"params": {"q": "select 1"}}', r)
    assert canonical == '{"params":{"q":"SELECT 1"}}'
    # A recording made without the check normalises under a rule that has it.
    stored = canonical_body(b'{"params": {"q": "select   1"}}')[1]
    assert recanonicalise("json", stored, r) == canonical


def test_volatile_body_pointers_and_query_parameters() -> None:
    r = rule(volatile=("/request_id", "/items/*/ts", "query:nonce", "/a~1b"))
    a = key(
        b'{"request_id": "1", "items": [{"ts": 1, "v": "x"}], "a/b": 1}', "/query?nonce=1&x=2", r
    )
    b = key(
        b'{"request_id": "2", "items": [{"ts": 2, "v": "x"}], "a/b": 2}', "/query?nonce=9&x=2", r
    )
    assert a == b
    assert a != key(b'{"request_id": "2", "items": [{"ts": 2, "v": "y"}]}', "/query?nonce=9&x=2", r)
    assert a != key(b'{"request_id": "1", "items": [{"ts": 1, "v": "x"}]}', "/query?x=3", r)
    whole = rule(volatile=("body",))
    assert key(b'{"a": 1}', r=whole) == key(b"anything", r=whole)


def test_query_order_is_part_of_the_key() -> None:
    assert split_target("/a/b?x=1&y=%20") == ("/a/b", (("x", "1"), ("y", "%20")))
    assert key(None, "/q?a=1&b=2") != key(None, "/q?b=2&a=1")


@pytest.mark.parametrize(
    ("entry", "ok"),
    [
        ("/id", True),
        ("query:nonce", True),
        ("body", True),
        ("header:x", False),
        ("id", False),
        ("query:", False),
    ],
)
def test_volatile_entry_forms(entry: str, ok: bool) -> None:
    assert (volatile_problem(entry) is None) is ok


def test_the_real_sql_check_of_a_policy_is_understood() -> None:
    import gateway.checks.sql  # noqa: F401  (registers the 'sql' rule key)
    from gateway.policy.load import load_policy

    policy = load_policy(
        "p.yaml",
        """
version: 1
agents: {"*": [analyst]}
upstreams:
  db: {url: "http://127.0.0.1:9"}
roles:
  analyst:
    rules:
      - id: query-orders
        upstream: db
        allow: POST /query
        sql: {field: sql, dialect: postgres, server_version: 15, tables: [orders]}
""",
    )
    r = policy.rules_by_id["query-orders"]
    a = canonical_body(b'{"sql": "select id   from orders"}', r)
    b = canonical_body(b'{"sql": "SELECT id FROM orders"}', r)
    assert a == b == ("json", '{"sql":"SELECT id FROM orders"}')
