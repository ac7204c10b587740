"""gateway/checks/sql/settings.py: one validator of a ``sql:`` policy's settings, used both by
``SqlPolicy.create`` and by the policy file reader (which points at the key or item named)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.checks.sql import SqlPolicy, SqlSettings, SqlSettingsError
from gateway.checks.sql.settings import SettingProblem
from gateway.policy.load import load_policy
from gateway.policy_file import PolicyError

POLICY = """\
version: 1
agents:
  "*": [analyst]
upstreams:
  db:
    url: "http://127.0.0.1:9104"
roles:
  analyst:
    rules:
      - id: q
        upstream: db
        allow: POST /query
        sql:
          dialect: postgres
          server_version: 15
          field: sql
{rest}
"""
FIRST = POLICY.splitlines().index("{rest}") + 1  # 1-based line of the first extra key
WHERE = "roles.analyst.rules[0].sql"


def file_issues(rest: str, path: Path | str = "policy.yaml") -> list[str]:
    text = POLICY.format(rest="\n".join("          " + line for line in rest.splitlines()))
    with pytest.raises(PolicyError) as info:
        load_policy(path, text=text)
    return [str(i) for i in info.value.issues]


def test_create_names_the_first_problem_and_lists_them_all() -> None:
    with pytest.raises(SqlSettingsError) as info:
        SqlPolicy.create(
            "postgres",
            server_version=15,
            tables=["orders", "pg_user"],
            statements=["select", "destroy"],
            deny_columns=["secrets.ssn"],
            max_limit=0,
        )
    err = info.value
    assert isinstance(err, ValueError)
    assert (
        str(err)
        == str(err.problems[0])
        == (
            "statements[1]: expected one of ['select', 'insert', 'update', 'delete', 'merge', "
            "'create', 'drop', 'alter', 'truncate'], got 'destroy'"
        )
    )
    assert [(p.key, p.item) for p in err.problems] == [
        ("statements", 1),
        ("tables", 1),
        ("deny_columns", 0),
        ("max_limit", None),
    ]


def test_problem_names_its_key_and_item() -> None:
    assert str(SettingProblem("max_limit", None, "must be at least 1, got 0")) == (
        "max_limit: must be at least 1, got 0"
    )
    assert str(SettingProblem("tables", 2, "x")) == "tables[2]: x"
    assert str(SettingProblem("schema", "customers", "x")) == "schema.customers: x"


def test_the_file_reports_every_problem_at_its_item() -> None:
    issues = file_issues(
        "tables: [orders, pg_user, 'a b']\n"
        "deny_columns: [customers.ssn]\n"
        "functions: [md5, 'pg sleep']\n"
        "max_limit: 0"
    )
    assert issues == [
        f"policy.yaml:{FIRST}:28: {WHERE}.tables[1]: 'pg_user' is a system catalog; add "
        "system_catalogs to 'allow' to let the rule read catalogs",
        f"policy.yaml:{FIRST}:37: {WHERE}.tables[2]: 'a b' is not a table name; expected "
        "[catalog.][schema.]table, each part an identifier or a quoted identifier",
        f"policy.yaml:{FIRST + 1}:26: {WHERE}.deny_columns[0]: 'customers.ssn' names a table "
        "that is not in 'tables'",
        f"policy.yaml:{FIRST + 2}:28: {WHERE}.functions[1]: 'pg sleep' is not a function name "
        "(letters, digits, '_' or '$')",
        f"policy.yaml:{FIRST + 3}:22: {WHERE}.max_limit: must be at least 1, got 0",
    ]


@pytest.mark.parametrize(
    ("rest", "kwargs"),
    [
        ("tables: [orders]\nstatements: [select, destroy]", {"statements": ["select", "destroy"]}),
        ("tables: []", {"tables": []}),
        ("tables: [orders]\nstatements: []", {"statements": []}),
        ("tables: [orders]\nmax_statements: 51", {"max_statements": 51}),
        ("tables: [orders]\nallow: [ddl]", {"allow": ["ddl"]}),
        ("tables: [pg_class, orders]", {"tables": ["pg_class", "orders"]}),
        ("tables: [orders]\ndefault_schema: 'a b'", {"default_schema": "a b"}),
        ("tables: [orders]\nschema: {orders: [id, 'a b']}", {"schema": {"orders": ["id", "a b"]}}),
        ("tables: [orders]\ndeny_columns: [orders.x]\nschema: {orders: [id]}", {}),
        ("tables: [orders]\nadd_limit: true", {"add_limit": True}),
        ("tables: [orders]\nmax_limit: 1000000001", {"max_limit": 1_000_000_001}),
        ("tables: [orders]\nmax_length: 0", {"max_length": 0}),
    ],
)
def test_create_and_the_file_say_the_same(rest: str, kwargs: dict[str, Any]) -> None:
    if not kwargs:
        kwargs = {"deny_columns": ["orders.x"], "schema": {"orders": ["id"]}}
    kwargs.setdefault("tables", ["orders"])
    with pytest.raises(SqlSettingsError) as info:
        SqlPolicy.create("postgres", server_version=15, **kwargs)
    (problem,) = info.value.problems
    (issue,) = file_issues(rest)
    assert issue.endswith(f"{WHERE}.{problem}"), issue


def test_a_schema_file_problem_points_at_the_schema_file_key(tmp_path: Path) -> None:
    (tmp_path / "schema.json").write_text(json.dumps({"orders": ["id", "a b"]}))
    issues = file_issues("tables: [orders]\nschema_file: schema.json", tmp_path / "policy.yaml")
    path = str(tmp_path / "schema.json")
    assert issues == [
        f"{tmp_path / 'policy.yaml'}:{FIRST + 1}:24: {WHERE}.schema_file: in {path!r}: "
        f"{WHERE}.schema_file.orders: 'a b' is not an identifier"
    ]


def test_the_reader_checks_types_and_leaves_values_to_the_settings() -> None:
    # A value of the wrong type is reported once, where it is read, and not judged again.
    issues = file_issues("tables: orders\nmax_limit: lots\nadd_limit: true\nstatements: [5]")
    assert [i.split(": ", 1)[1] for i in issues] == [
        f"{WHERE}.tables: expected a list, got a string",
        f"{WHERE}.max_limit: expected an integer, got a string",
        f"{WHERE}.statements[0]: expected a statement kind, got an integer",
    ]


def test_settings_not_read_in_full_are_never_valid() -> None:
    settings = SqlSettings(
        dialect="postgres", tables=(), server_version=15, unread=frozenset({"tables"})
    )
    with pytest.raises(SqlSettingsError) as info:
        SqlPolicy.from_settings(settings)
    assert info.value.problems == ()
    assert info.value.unread == {"tables"}


def test_from_settings_builds_the_same_policy_as_create() -> None:
    kwargs: dict[str, Any] = {
        "tables": ["orders", "customers"],
        "default_schema": "public",
        "schema": {"customers": ["id", "ssn"]},
        "deny_columns": ["customers.ssn"],
        "functions": ["md5"],
        "max_limit": 10,
        "add_limit": True,
        "allow": ["locking"],
        "server_version": 15,
    }
    one = SqlPolicy.create("postgres", rule_id="r", **kwargs)
    two = SqlPolicy.from_settings(SqlSettings(dialect="postgres", **kwargs), rule_id="r")
    fields = ("tables", "statements", "default_schema", "schema", "deny_columns", "denied_names")
    fields += ("functions", "max_limit", "add_limit", "allow", "max_length", "rule_id")
    for name in fields:
        assert getattr(one, name) == getattr(two, name), name


def test_mysql_settings_are_read_from_the_file() -> None:
    text = POLICY.format(
        rest="          tables: [orders]\n          sql_mode: 'ANSI,NO_BACKSLASH_ESCAPES'\n"
        "          parameters: ['?']"
    ).replace("dialect: postgres\n          server_version: 15\n", "dialect: mysql\n")
    rule = load_policy("policy.yaml", text=text).rules_by_id["q"]
    (check,) = rule.checks
    policy = check.policy  # type: ignore[attr-defined]
    assert policy.sql_mode >= {"ANSI_QUOTES", "PIPES_AS_CONCAT", "NO_BACKSLASH_ESCAPES"}
    assert policy.parameters == frozenset({"?"})
    (issue,) = file_issues("tables: [orders]\nsql_mode: ANSI")
    assert issue.endswith(f"{WHERE}.sql_mode: is a MySQL setting (dialect: mysql)"), issue
