"""Issue 10: one regression test per finding, each reproduced against the real database's
reading (SQLite's compiler, PostgreSQL's parser)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gateway.checks.sql import SqlPolicy
from gateway.errors import SqlDenied, SqlTooComplex
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


POSTGRES = {
    "dialect": "postgres",
    "server_version": 15,
    "tables": ["orders", "customers"],
    "schema": {
        "customers": ["id", "name", "email", "ssn", "country"],
        "orders": ["id", "customer_id", "total_cents", "status", "created_at"],
    },
    "deny_columns": ["customers.ssn"],
    "max_limit": 1000,
}


def pg(**kwargs: Any) -> SqlPolicy:
    settings = dict(POSTGRES, **kwargs)
    dialect = settings.pop("dialect")
    return SqlPolicy.create(dialect, rule_id="r", **settings)


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        # sqlglot read $² as a parameter; PostgreSQL reads $²$...$²$ as a string.
        ("SELECT $²$ FROM orders LIMIT 5 -- $²$, ssn, name FROM customers LIMIT 5", "column"),
        ("SELECT $²$ FROM orders LIMIT 5 -- $²$ FROM secrets LIMIT 5", "table"),
        ("SELECT $²$ FROM orders -- $²$, pg_read_file('/etc/passwd') LIMIT 5", "function"),
        ("SELECT $²$ x $²$; UPDATE orders SET status = 'x'", "multiple"),
    ],
)
def test_postgres_dollar_quotes_with_unicode_tags(text: str, kind: str) -> None:
    assert first_error(pg(), text)["kind"] == kind


@pytest.mark.parametrize(
    "text",
    [
        "SELECT j FROM (orders o JOIN customers c ON c.id = o.customer_id) AS j LIMIT 5",
        "SELECT j.ssn FROM (orders o JOIN customers c ON c.id = o.customer_id) AS j LIMIT 5",
        "SELECT j.* FROM (orders o JOIN customers c ON c.id = o.customer_id) AS j LIMIT 5",
    ],
)
def test_postgres_aliased_join_is_checked(text: str) -> None:
    assert first_error(pg(), text)["kind"] == "column"


def test_postgres_standard_conforming_strings_is_stated() -> None:
    text = "SELECT id FROM orders WHERE status = 'a\\' LIMIT 1"
    assert first_error(pg(), text)["kind"] == "parse"  # not stated: refused
    assert pg(standard_conforming_strings=True).check(text).sql == text
    assert first_error(pg(standard_conforming_strings=False), text)["kind"] == "parse"
    # No backslash: nothing depends on the setting.
    assert pg().check("SELECT id FROM orders WHERE status = 'a' LIMIT 1")


def test_postgres_parser_major_must_match_the_server() -> None:
    with pytest.raises(ValueError, match="server_version"):
        pg(server_version=18)
    with pytest.raises(ValueError, match="server_version"):
        pg(server_version=None)


def test_postgres_parse_errors_have_positions_and_are_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    err = first_error(pg(), "SELECT 'x-secret-2' FROM\nWHERE")
    assert err["kind"] == "parse" and err["line"] == 2
    assert "x-secret-2" not in caplog.text


def test_row_packing_recursive_and_joins_are_bounded() -> None:
    assert first_error(pg(), "SELECT string_agg(name, ',') FROM customers LIMIT 1")["kind"] == (
        "function"
    )
    assert pg(functions=["string_agg"]).check("SELECT string_agg(name, ',') FROM customers LIMIT 1")
    recursive = (
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT i FROM n LIMIT 5"
    )
    assert first_error(pg(), recursive)["kind"] == "recursive"
    assert pg(allow=["recursive"]).check(recursive)
    joins = "SELECT a.id FROM orders a, orders b, orders c, orders d, orders e LIMIT 1"
    with pytest.raises(SqlTooComplex) as info:
        pg().check(joins)
    assert info.value.reason.value == "sql_too_complex"
    assert pg(max_joins=4).check(joins)


def test_the_wall_clock_backstop_is_never_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.checks.sql.policy as sql_policy

    policy = pg()
    monkeypatch.setattr(sql_policy, "CHECK_BACKSTOP_SECONDS", -1.0)
    with pytest.raises(SqlTooComplex):
        policy.check("SELECT id FROM orders LIMIT 1")
    monkeypatch.setattr(sql_policy, "CHECK_BACKSTOP_SECONDS", 10.0)
    assert policy.check("SELECT id FROM orders LIMIT 1")  # checked again, not remembered


def test_an_unexpected_error_logs_no_sql(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import gateway.checks.sql.postgres as sql_postgres

    def broken(self: Any, node: Any) -> None:
        raise ValueError("SELECT x-secret-3 FROM customers")

    monkeypatch.setattr(sql_postgres._Reader, "root", broken)
    caplog.set_level(logging.DEBUG)
    assert first_error(pg(), "SELECT 'x-secret-3' LIMIT 1")["kind"] == "unchecked"
    assert "x-secret-3" not in caplog.text and "Traceback" not in caplog.text
    assert "ValueError" in caplog.text
