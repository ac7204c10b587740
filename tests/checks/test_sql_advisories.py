"""Issue 10: one regression test per finding, each reproduced against the real database's
reading (SQLite's compiler, PostgreSQL's parser)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gateway.checks.sql import SqlPolicy
from gateway.errors import SqlDenied
from gateway.policy.load import load_policy

EXAMPLE = "policies/example.yaml"


def example_policy(rule_id: str) -> SqlPolicy:
    policy = load_policy(EXAMPLE)
    (check,) = [c for c in policy.rules_by_id[rule_id].checks if c.kind == "sql"]
    return check.policy  # type: ignore[attr-defined,no-any-return]


def first_error(policy: SqlPolicy, text: str) -> dict[str, Any]:
    with pytest.raises(SqlDenied) as info:
        policy.check(text)
    assert info.value.errors
    return info.value.errors[0]


def test_sqlite_tcl_parameter_hides_nothing() -> None:
    # SQLite reads $a::b(') as one bound parameter; sqlglot read a cast whose type argument is
    # a string, so ', ssn, name FROM customers --' hid inside it and the LIMIT capgate
    # appended landed in the comment. Example policy, as reported.
    policy = example_policy("query-orders")
    err = first_error(policy, "SELECT $a::b('), ssn, name FROM customers --')")
    assert (err["kind"], err["found"]) == ("column", "customers.ssn")
    # Without the denied column, a LIMIT is appended only where SQLite itself (sqlite3_complete)
    # confirms the text ends in code; here it reads the quote as opening a string, so the
    # statement is refused for its missing LIMIT instead.
    err = first_error(policy, "SELECT $a::b('), name FROM customers --')")
    assert err["kind"] == "limit"
    assert policy.check("SELECT name FROM customers -- ')").sql == (
        "SELECT name FROM customers LIMIT 1000"
    )


def test_sqlite_parenthesized_table_with_alias_is_checked() -> None:
    policy = example_policy("query-orders")
    assert first_error(policy, "SELECT j.ssn, j.name FROM (customers) j LIMIT 5")["kind"] == (
        "column"
    )


def test_mcp_run_sql_rule_has_a_schema() -> None:
    policy = example_policy("mcp-run-sql")
    assert policy.check("SELECT id FROM orders").sql == "SELECT id FROM orders LIMIT 100"
    assert first_error(policy, "SELECT ssn FROM customers")["kind"] == "table"


def test_sqlite_check_never_logs_the_sql(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    policy = example_policy("query-orders")
    for text in [
        "SELECT 'x-secret-1",
        "SELECT ssn FROM customers -- x-secret-1",
        "SELEC x-secret-1",
    ]:
        with pytest.raises(SqlDenied):
            policy.check(text)
    assert "x-secret-1" not in caplog.text
