"""gateway/checks/sql/: table-driven fixtures per dialect, each sqlglot pitfall, the body
check, and the policy file keys (with FILE:LINE:COL errors)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import sqlglot.tokens

import gateway.checks.sql as sql_module
import gateway.checks.sql.cache as sql_cache
import gateway.checks.sql.postgres as sql_postgres
import gateway.checks.sql.rules.tables as sql_tables
from gateway.checks.sql import (
    DEFAULT_FUNCTIONS,
    MAX_NESTING,
    MAX_SUBSCRIPTS,
    MAX_TOKENS,
    SQLGLOT_COMPILED,
    Denial,
    SqlBodyCheck,
    SqlPolicy,
    SqlVerdict,
    TableName,
    cache_info,
    clear_parse_cache,
    parse_column_name,
    parse_table_name,
)
from gateway.errors import BodyInvalid, GatewayError, Reason, SqlDenied, ToolDenied
from gateway.payload import BodyPayload, Findings, ToolCallPayload
from gateway.policy.load import load_policy
from gateway.policy_file import PolicyError

FIXTURES = Path(__file__).parent / "fixtures" / "sql"
DIALECTS = ("postgres", "sqlite", "mysql")
NEWLINE = "⏎"  # fixtures are one statement per line; this marks a newline inside one
DENIED_LINE = re.compile(r"^(?P<sql>.*)\s--\s(?P<kind>[a-z]+)\s*$")

SCHEMA = {
    "customers": ["id", "name", "email", "ssn", "country"],
    "orders": ["id", "customer_id", "total_cents", "status", "created_at"],
}

POLICY_TEMPLATE = """\
version: 1
agents:
  "*": [analyst]
upstreams:
  db:
    url: "http://127.0.0.1:9104"
  tools:
    url: "http://127.0.0.1:9105/mcp"
    kind: mcp
roles:
  analyst:
    rules:
      - id: query-orders
        upstream: db
        allow: POST /query
        sql:
{sql}
"""
SQL_FIRST_LINE = POLICY_TEMPLATE.splitlines().index("{sql}") + 1  # 1-based line of the block

ANALYST_SQL = """\
dialect: {dialect}
field: sql
statements: [select]
tables: [orders, customers]
schema:
  customers: [id, name, email, ssn, country]
  orders: [id, customer_id, total_cents, status, created_at]
deny_columns: [customers.ssn]
max_limit: 1000
"""


def indent(block: str, spaces: int = 10) -> str:
    return "\n".join(" " * spaces + line if line else line for line in block.splitlines())


def load_sql_check(sql_block: str, path: Path | str = "policy.yaml") -> SqlBodyCheck:
    policy = load_policy(path, text=POLICY_TEMPLATE.format(sql=indent(sql_block)))
    (check,) = policy.rules_by_id["query-orders"].checks
    assert isinstance(check, SqlBodyCheck)
    return check


def analyst(dialect: str) -> SqlPolicy:
    """The product's analyst role, compiled from policy YAML as in production."""
    return load_sql_check(analyst_sql(dialect)).policy


def analyst_sql(dialect: str) -> str:
    block = ANALYST_SQL.format(dialect=dialect)
    if dialect == "postgres":
        block = block.replace("dialect: postgres\n", "dialect: postgres\nserver_version: 15\n")
    return block


def make(dialect: str = "postgres", **kwargs: Any) -> SqlPolicy:
    kwargs.setdefault("tables", ["orders", "customers"])
    if dialect == "sqlite":  # SQLite's compiler checks against the rule's schema: required
        kwargs.setdefault("schema", SCHEMA)
    if dialect == "postgres":  # the server's major version: the parser's
        kwargs.setdefault("server_version", 15)
    return SqlPolicy.create(dialect, rule_id="r", **kwargs)


def errors(err: GatewayError) -> list[dict[str, Any]]:
    assert err.errors is not None
    return err.errors


def denial(policy: SqlPolicy, text: str) -> SqlDenied:
    with pytest.raises(SqlDenied) as info:
        policy.check(text)
    return info.value


def kind_of(policy: SqlPolicy, text: str) -> str:
    return str(errors(denial(policy, text))[0]["kind"])


def read_fixture(dialect: str, name: str) -> list[tuple[int, str]]:
    lines = (FIXTURES / dialect / name).read_text("utf-8").splitlines()
    return [
        (number, line)
        for number, line in enumerate(lines, start=1)
        if line.strip() and not line.startswith("##")
    ]


def allowed_cases() -> list[Any]:
    return [
        pytest.param(dialect, line.replace(NEWLINE, "\n"), id=f"{dialect}:{number}")
        for dialect in DIALECTS
        for number, line in read_fixture(dialect, "allowed.sql")
    ]


def denied_cases() -> list[Any]:
    cases = []
    for dialect in DIALECTS:
        for number, line in read_fixture(dialect, "denied.sql"):
            m = DENIED_LINE.match(line)
            assert m, f"{dialect}/denied.sql:{number} does not end with '-- <category>'"
            sql = m["sql"].replace(NEWLINE, "\n")
            cases.append(pytest.param(dialect, sql, m["kind"], id=f"{dialect}:{number}"))
    return cases


_POLICIES: dict[str, SqlPolicy] = {}


@pytest.fixture
def policy_for() -> Any:
    def get(dialect: str) -> SqlPolicy:
        if dialect not in _POLICIES:
            _POLICIES[dialect] = analyst(dialect)
        return _POLICIES[dialect]

    return get


# --- the fixtures ---------------------------------------------------------------------------


@pytest.mark.parametrize(("dialect", "text"), allowed_cases())
def test_allowed_fixture(policy_for: Any, dialect: str, text: str) -> None:
    verdict = policy_for(dialect).check(text)
    assert isinstance(verdict, SqlVerdict)
    assert verdict.sql == text  # the original text is forwarded, never a regenerated one
    assert not verdict.rewritten
    assert verdict.kinds == ("select",)
    assert set(verdict.tables) <= {"orders", "customers"}


@pytest.mark.parametrize(("dialect", "text", "expected"), denied_cases())
def test_denied_fixture(policy_for: Any, dialect: str, text: str, expected: str) -> None:
    err = denial(policy_for(dialect), text)
    too_complex = expected in ("size", "depth", "complex")
    assert err.reason is (Reason.SQL_TOO_COMPLEX if too_complex else Reason.SQL_DENIED)
    assert err.status == 403
    assert err.rule == "query-orders"
    assert err.detail
    assert err.errors, "a denial carries structured errors"
    first = errors(err)[0]
    assert first["kind"] == expected, err.detail
    assert {"kind", "found", "detail"} <= set(first)


def test_fixture_categories_are_known_and_covered() -> None:
    used: dict[str, set[str]] = {d: set() for d in DIALECTS}
    for param in denied_cases():
        dialect, _, kind = param.values
        assert kind in {d.value for d in Denial}, f"unknown category {kind!r}"
        used[dialect].add(kind)
    # Every category but the internal one appears in the PostgreSQL fixtures.
    # (comment and size are sqlglot's: PostgreSQL's parser reads comments and has no markers)
    assert {d.value for d in Denial} - used["postgres"] == {
        "unchecked",
        "variable",
        "comment",
        "size",
    }
    assert {"variable", "comment"} <= used["mysql"]
    for dialect in DIALECTS:
        assert len(read_fixture(dialect, "allowed.sql")) >= 30
        assert len(read_fixture(dialect, "denied.sql")) >= 60


# --- PITFALLS.md, sqlglot section: one test each ----------------------------------------------


@pytest.mark.parametrize("text", ["", "   ", "\n\t", ";", ";;", " ; ", "-- note", "/* x */", "# x"])
def test_pitfall_empty_and_lone_semicolon_are_denied(text: str) -> None:
    policy = make("mysql" if text.startswith("#") else "postgres")
    assert kind_of(policy, text) == "empty"


def test_pitfall_statements_are_counted() -> None:
    two = "SELECT id FROM orders; SELECT id FROM customers"
    assert kind_of(make(), two) == "multiple"
    assert make(max_statements=2).check(two).tables == ("customers", "orders")
    assert kind_of(make(max_statements=2), two + "; SELECT 1") == "multiple"
    # Empty statements between semicolons run nothing and are not counted.
    assert make().check("SELECT id FROM orders;;").sql == "SELECT id FROM orders;;"


@pytest.mark.parametrize("text", ["SELEC * FRM t", "LISTEN x", "DISCARD ALL", "orders", "1 + 1"])
def test_pitfall_root_must_be_a_statement(text: str) -> None:
    # sqlglot (MySQL) parses these as expressions; PostgreSQL's parser refuses or names them.
    assert kind_of(make("mysql"), text) == "statement"
    assert kind_of(make(), text) in ("parse", "command")


@pytest.mark.parametrize(
    "text",
    [
        "SET ROLE admin",
        "DO $$ BEGIN NULL; END $$",
        "CALL p()",
        "EXPLAIN ANALYZE DELETE FROM orders",
        "VACUUM",
        "LOCK TABLE orders",
        "CREATE EXTENSION dblink",
        "COPY orders TO '/tmp/x'",
        "SHOW ALL",
        "BEGIN",
    ],
)
def test_pitfall_commands_are_denied(text: str) -> None:
    assert kind_of(make(statements=[k.value for k in sql_module.SqlKind]), text) == "command"


def test_pitfall_parse_errors_deny_with_positions() -> None:
    err = denial(make(), "SELECT *\nFROM WHERE")
    first = errors(err)[0]
    assert first["kind"] == "parse"
    assert first["line"] == 2 and first["col"] >= 1
    # A partial tree (error_level WARN/IGNORE) is never used: nothing of it is allowed.
    assert kind_of(make(), "SELECT * FROM orders WHERE") == "parse"


def test_pitfall_find_all_tables_vs_scopes() -> None:
    policy = make()
    err = denial(policy, "WITH orders AS (SELECT * FROM secrets) SELECT * FROM orders")
    assert (errors(err)[0]["kind"], errors(err)[0]["found"]) == ("table", "secrets")
    assert policy.check("WITH secrets AS (SELECT id FROM orders) SELECT * FROM secrets").tables == (
        "orders",
    )
    err = denial(policy, "SELECT * FROM dblink('host=x', 'select 1') AS t(a int)")
    assert (errors(err)[0]["kind"], errors(err)[0]["found"]) == ("function", "dblink")
    err = denial(make("sqlite"), "SELECT * FROM pragma_table_info('orders')")
    assert (errors(err)[0]["kind"], errors(err)[0]["found"]) == ("function", "pragma_table_info")


def test_pitfall_functions_are_an_allow_list() -> None:
    assert kind_of(make(), "SELECT brand_new_function(id) FROM orders") == "function"
    assert make(functions=["brand_new_function"]).check("SELECT brand_new_function(id) FROM orders")
    assert {"count", "lower", "coalesce", "now"} <= DEFAULT_FUNCTIONS
    assert not {"pg_sleep", "dblink", "load_extension", "sleep", "benchmark"} & DEFAULT_FUNCTIONS


@pytest.mark.parametrize("marker", ["/*!", "/*M!", "/*m!", "/*!50000"])
def test_pitfall_executable_comments_are_denied_where_sqlglot_reads(marker: str) -> None:
    err = denial(make("mysql"), f"SELECT id FROM orders {marker} ; DROP TABLE orders */")
    assert errors(err)[0]["kind"] == "comment"
    assert errors(err)[0]["line"] == 1 and errors(err)[0]["col"] == 23


@pytest.mark.parametrize("dialect", ["postgres", "sqlite"])
@pytest.mark.parametrize("marker", ["/*!", "/*M!"])
def test_executable_comments_are_comments_to_the_database(dialect: str, marker: str) -> None:
    # The database's own reader reads the text: a comment is a comment, whatever it holds.
    text = f"SELECT id FROM orders {marker} ; DROP TABLE orders */ LIMIT 1"
    assert make(dialect).check(text).sql == text


def test_pitfall_original_text_is_forwarded() -> None:
    text = "select  ID  from ORDERS /* keep me */ where STATUS = 'x' -- and me"
    assert make().check(text).sql == text


def test_pitfall_regeneration_examples_are_denied_not_rewritten() -> None:
    # The three examples where sqlglot's output would differ from what the agent sent.
    assert kind_of(make("sqlite"), "PRAGMA table_info(orders)") == "command"
    assert kind_of(make(), 'SELECT "LOWER"(name) FROM customers') == "function"
    assert kind_of(make("mysql"), "SELECT id INTO @v FROM orders") == "into"


def test_pitfall_add_limit_appends_and_rechecks() -> None:
    policy = make(max_limit=100, add_limit=True)
    cases = {
        "SELECT id FROM orders": "SELECT id FROM orders LIMIT 100",
        "SELECT id FROM orders;": "SELECT id FROM orders LIMIT 100",
        "SELECT id FROM orders; -- note": "SELECT id FROM orders LIMIT 100",
        "SELECT id FROM orders -- note": "SELECT id FROM orders LIMIT 100",
        "SELECT id FROM orders WHERE status = 'a;b'": (
            "SELECT id FROM orders WHERE status = 'a;b' LIMIT 100"
        ),
        "SELECT id FROM orders UNION SELECT id FROM customers": (
            "SELECT id FROM orders UNION SELECT id FROM customers LIMIT 100"
        ),
        "(SELECT id FROM orders)": "(SELECT id FROM orders) LIMIT 100",
    }
    for text, expected in cases.items():
        verdict = policy.check(text)
        assert (verdict.sql, verdict.rewritten) == (expected, True), text
        again = policy.check(expected)  # the rewritten text passes on its own, unchanged
        assert (again.sql, again.rewritten) == (expected, False)
    # A LIMIT that is present is never rewritten: too big or not a literal is denied.
    assert kind_of(policy, "SELECT id FROM orders LIMIT 500") == "limit"
    assert kind_of(policy, "SELECT id FROM orders LIMIT $1") == "limit"
    # Several statements are not rewritten.
    assert kind_of(make(max_limit=5, add_limit=True, max_statements=2), "SELECT 1; SELECT 2") == (
        "limit"
    )


def test_pitfall_add_limit_rewrite_is_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real_read = sql_postgres.read

    def spy(rules: Any, text: str, *shapes: Any) -> Any:
        seen.append(text)
        return real_read(rules, text, *shapes)

    monkeypatch.setattr(sql_postgres, "read", spy)
    make(max_limit=7, add_limit=True).check("SELECT id FROM orders")
    assert seen == ["SELECT id FROM orders", "SELECT id FROM orders LIMIT 7"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("SELECT " + "(" * 5000 + "1" + ")" * 5000, "size"),  # the pitfall's example
        ("SELECT " + "(" * 4000 + "1" + ")" * 4000, "depth"),
        ("SELECT " + "(" * (MAX_NESTING + 1) + "1" + ")" * (MAX_NESTING + 1), "depth"),
        ("SELECT " + "ARRAY[" * 40 + "1" + "]" * 40, "depth"),
        ("SELECT " + "NOT " * 4000 + "true", "depth"),
        ("SELECT " + "CASE WHEN true THEN " * 1000 + "1" + " END" * 1000, "depth"),
        ("SELECT " + "- " * 5000 + "1", "depth"),
        ("SELECT " + " + ".join(["1"] * 4000) + " FROM orders", "depth"),
        ("SELECT " + "(" * 6000 + "1" + ")" * 6000, "size"),
        ("SELECT a" + "[1]" * (MAX_SUBSCRIPTS + 1) + " FROM orders", "size"),
        ("SELECT " + ", ".join(["id"] * (MAX_TOKENS // 2 + 1)) + " FROM orders", "size"),
        ("SELECT '" + "x" * 100_001 + "'", "size"),
    ],
    ids=[
        "parens-5000",
        "parens-4000",
        "parens-33",
        "brackets",
        "not",
        "case",
        "minus",
        "plus",
        "parens-6000",
        "subscripts",
        "tokens",
        "length",
    ],
)
def test_pitfall_deep_nesting_is_denied_quickly(text: str, expected: str) -> None:
    policy = make("mysql")  # sqlglot's reading (PostgreSQL's: tests/checks/test_sql_cost.py)
    started = time.perf_counter()
    assert kind_of(policy, text) == expected
    assert time.perf_counter() - started < 5  # generous: ~0.1 s on a laptop


def test_pitfall_parse_and_verdict_are_cached() -> None:
    clear_parse_cache()
    text = "SELECT o.id FROM orders o WHERE o.status = 'cached-test' LIMIT 3"
    one, two = make("mysql", max_limit=10), make("mysql", max_limit=10)
    first = one.check(text)
    assert one.check(text) is first  # the verdict cache answers the repeat
    assert one.cache_info() == {"hits": 1, "misses": 1, "size": 1}
    assert two.check(text) == first  # another policy: its own verdict, the same parse
    parse = cache_info()["parse"]
    assert (parse["misses"], parse["hits"]) == (1, 1)
    # Denials are cached too, and each call gets a fresh exception.
    a, b = denial(one, "SELECT sleep(1)"), denial(one, "SELECT sleep(1)")
    assert a is not b and a.errors == b.errors
    assert one.cache_info()["hits"] == 2


def test_caches_are_bounded_in_entries_and_text() -> None:
    lru: sql_cache.Lru[str, int] = sql_cache.Lru(size=3, max_weight=10)
    for key, weight in [("a", 4), ("b", 4), ("c", 1), ("d", 1)]:
        lru.put(key, weight, weight)
    assert lru.get("a") is None  # evicted: four entries weigh 10 but only 3 fit
    lru.put("e", 5, 5)  # b (4) + c + d + e = 11 > 10: b goes
    assert [lru.get(k) for k in "bcde"] == [None, 1, 1, 5]
    lru.put("huge", 1, 11)  # heavier than the whole cache: not kept
    assert lru.get("huge") is None
    assert lru.info()["size"] == 3


def test_cached_check_is_fast() -> None:
    policy = make(max_limit=10)
    text = "SELECT o.id, c.name FROM orders o JOIN customers c ON c.id = o.customer_id LIMIT 5"
    policy.check(text)
    rounds = 2000
    started = time.perf_counter()
    for _ in range(rounds):
        policy.check(text)
    per_call = (time.perf_counter() - started) / rounds
    assert per_call < 200e-6  # typically ~1 µs; the bench reports the figure


def test_sqlglotc_flag_is_reported() -> None:
    assert SQLGLOT_COMPILED is bool(sqlglot.tokens.SQLGLOTC_INSTALLED)
    info = cache_info()
    assert info["compiled"] is SQLGLOT_COMPILED and info["sqlglot"].startswith("30.")


# --- lexing differences between sqlglot and the database ------------------------------------


def test_sqlglot_meta_directive_cannot_switch_normalisation_off() -> None:
    # Without the marker check, sqlglot sees the CTE and PostgreSQL reads table customers.
    text = (
        'WITH "Customers" AS (SELECT 1) SELECT * FROM Customers /* sqlglot.meta case_sensitive */'
    )
    assert kind_of(make("mysql", tables=["orders"]), text) == "comment"


def test_postgres_unicode_identifiers_are_decoded_as_postgres_does() -> None:
    # sqlglot read U & "...": PostgreSQL's parser decodes the identifier.
    policy = make(deny_columns=["customers.ssn"])
    err = denial(policy, 'SELECT U&"\\0073sn" FROM customers')
    assert (errors(err)[0]["kind"], errors(err)[0]["found"]) == ("column", "customers.ssn")
    assert policy.check('SELECT u&"x" FROM orders')


def test_postgres_long_identifiers_are_truncated_as_postgres_does() -> None:
    # PostgreSQL truncates identifiers to 63 bytes; so does its parser, so the check sees the
    # name the server resolves.
    policy = make(tables=["orders", "o" * 63])
    assert policy.check(f"SELECT id FROM {'o' * 70}").tables == ("o" * 63,)


@pytest.mark.parametrize(
    "text",
    ["SELECT id FROM orders WHERE status = 'a\\' OR 1=1 -- '", 'SELECT "ssn" FROM customers'],
)
def test_mysql_sql_mode_dependent_lexing_is_denied(text: str) -> None:
    assert kind_of(make("mysql"), text) == "parse"


def test_mysql_unknown_sql_mode_refuses_pipes() -> None:
    assert kind_of(make("mysql"), "SELECT id FROM orders WHERE id = 1 || id = 2") == "parse"


def test_mysql_stated_sql_mode_is_how_the_text_is_lexed() -> None:
    plain = make("mysql", sql_mode="STRICT_TRANS_TABLES,NO_ENGINE_SUBSTITUTION")
    # Backslash escapes (the default): 'a\' OR 1=1 -- ' is one string, ... and the text
    # goes on; a double-quoted text is a string.
    assert plain.check("SELECT id FROM orders WHERE status = 'a\\'' LIMIT 1")
    assert plain.check('SELECT id FROM orders WHERE status = "paid"')
    assert plain.check("SELECT id FROM orders WHERE id = 1 || id = 2")
    ansi = make("mysql", sql_mode="ANSI", deny_columns=["customers.ssn"])
    # ANSI_QUOTES: "ssn" is the column, refused as the column it is.
    assert kind_of(ansi, 'SELECT "ssn" FROM customers') == "column"
    assert ansi.check('SELECT "name" FROM customers')
    nbe = make("mysql", sql_mode="NO_BACKSLASH_ESCAPES", deny_columns=["customers.ssn"])
    # A backslash is a character: the string ends at the second quote, and ssn is read.
    text = "SELECT id FROM customers WHERE name = 'a\\' OR ssn = 'x' -- '"
    assert kind_of(nbe, text) == "column"
    # The same text with backslash escapes: one string to the comment, then unterminated.
    assert kind_of(plain, text) == "parse"


@pytest.mark.parametrize(
    "text", ["SELECT \\N FROM orders", "SELECT id FROM orders WHERE id = 1 \\g"]
)
def test_mysql_backslash_outside_strings_is_refused_in_every_mode(text: str) -> None:
    for mode in (None, "", "NO_BACKSLASH_ESCAPES"):
        assert kind_of(make("mysql", sql_mode=mode), text) == "parse"


@pytest.mark.parametrize(
    "text",
    [
        "SELECT `naïve` FROM orders",
        "SELECT id FROM orders -- café",
        "SELECT id /* ü */ FROM orders",
        'SELECT "id\u00e9" FROM orders',
    ],
)
def test_mysql_only_ascii_outside_strings(text: str) -> None:
    assert kind_of(make("mysql", sql_mode="ANSI_QUOTES"), text) == "parse"


def test_mysql_parameters_only_in_the_forms_listed() -> None:
    assert kind_of(make("mysql"), "SELECT id FROM orders WHERE status = ?") == "parse"
    listed = make("mysql", parameters=["?"], max_limit=10)
    assert listed.check("SELECT id FROM orders WHERE status = ? LIMIT 5")
    assert kind_of(listed, "SELECT id FROM orders LIMIT ?") == "limit"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sql_mode": "ORACLE"}, "changes MySQL's grammar"),
        ({"sql_mode": "ANSI_QOUTES"}, "is not a MySQL or MariaDB sql_mode"),
        ({"parameters": [":name"]}, "MySQL's parameter form is '?'"),
    ],
)
def test_mysql_settings_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make("mysql", **kwargs)
    with pytest.raises(ValueError, match="is a MySQL setting"):
        make("postgres", sql_mode="ANSI")


@pytest.mark.parametrize("char", ["\xa0", "\u3000", "\u2028", "\x0b", "\x85", "\ufeff", "\u200b"])
def test_unusual_spaces_outside_strings_are_denied(char: str) -> None:
    # sqlglot splits words on any Unicode space; databases may read U+00A0 as part of a name.
    policy = make("mysql")
    assert kind_of(policy, f"SELECT id{char}FROM orders") == "parse"
    assert kind_of(policy, f"SELECT id FROM orders -- {char}") == "parse"
    assert policy.check(f"SELECT id FROM orders WHERE status = 'a{char}b'")
    # PostgreSQL's parser reads them as PostgreSQL does: part of a name, or in a comment.
    pg = make(deny_columns=["customers.ssn"])
    assert pg.check(f"SELECT id FROM orders -- {char}")
    if char == "\xa0":  # a name character to PostgreSQL: 'ssn\xa0' is not ssn
        assert pg.check(f"SELECT ssn{char} FROM customers")


def test_nul_and_non_strings_are_denied() -> None:
    assert kind_of(make(), "SELECT id FROM orders WHERE status = '\x00'") == "parse"
    with pytest.raises(SqlDenied):
        make().check(b"SELECT 1")  # type: ignore[arg-type]


def test_unexpected_errors_fail_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(sql_tables, "check_tables", broken)
    monkeypatch.setattr(sql_postgres._Reader, "root", broken)
    err = denial(make(), "SELECT id FROM orders")
    assert errors(err)[0]["kind"] == "unchecked"
    err = denial(make("mysql"), "SELECT id FROM orders")
    assert errors(err)[0]["kind"] == "unchecked"
    assert err.detail == "the SQL could not be checked"

    def deep(*args: Any) -> None:
        raise RecursionError

    monkeypatch.setattr(sql_tables, "check_tables", deep)
    assert kind_of(make("mysql"), "SELECT id FROM orders") == "depth"


# --- tables, schemas, columns ------------------------------------------------------------------


def test_schema_qualified_tables_match_only_as_configured() -> None:
    # Without default_schema, 'orders' and 'public.orders' are different names.
    assert kind_of(make(), "SELECT id FROM public.orders") == "table"
    only_qualified = make(tables=["public.orders"])
    assert only_qualified.check("SELECT id FROM public.orders").tables == ("public.orders",)
    assert kind_of(only_qualified, "SELECT id FROM orders") == "table"
    # With default_schema, the unqualified and the qualified name are one table.
    both = make(default_schema="public")
    assert both.check("SELECT id FROM orders").tables == ("public.orders",)
    assert both.check("SELECT id FROM PUBLIC.orders").tables == ("public.orders",)
    assert kind_of(both, "SELECT id FROM other.orders") == "table"
    assert kind_of(both, "SELECT id FROM db.public.orders") == "table"


def test_identifier_normalisation_follows_the_dialect() -> None:
    assert parse_table_name('public."Orders"', "postgres") == ("", "public", "Orders")
    assert parse_table_name("PUBLIC.Orders", "postgres") == ("", "public", "orders")
    assert parse_table_name('"Orders"', "sqlite") == ("", "", "orders")
    assert parse_table_name("Orders", "mysql") == ("", "", "Orders")  # case-sensitive
    assert parse_column_name("Customers.SSN", "postgres") == (("", "", "customers"), "ssn")
    quoted = make(tables=['"Orders"'])
    assert quoted.check('SELECT id FROM "Orders"')
    assert kind_of(quoted, "SELECT id FROM Orders") == "table"
    for bad in ["orders x", "orders;", "a.b.c.d", "dblink(1)", "", "1abc"]:
        with pytest.raises(ValueError):
            parse_table_name(bad, "postgres")


def test_deny_columns_without_a_schema_fail_closed() -> None:
    policy = make(deny_columns=["customers.ssn"])
    assert policy.check("SELECT name FROM customers")
    assert policy.check("SELECT ssn FROM orders")  # orders has no denied ssn, whatever it has
    for text in [
        "SELECT * FROM customers",
        "SELECT ssn FROM customers",
        "SELECT ssn FROM orders o JOIN customers c ON c.id = o.customer_id",
        "SELECT (SELECT ssn FROM orders LIMIT 1) FROM customers",
        "SELECT c FROM customers c",
        "SELECT z.ssn FROM customers c",
    ]:
        assert kind_of(policy, text) == "column", text


def test_schema_resolves_unqualified_columns() -> None:
    policy = make(deny_columns=["customers.ssn"], schema=SCHEMA)
    # With the schema, ssn in the inner query can only be the outer customers.ssn.
    assert kind_of(policy, "SELECT (SELECT ssn FROM orders LIMIT 1) FROM customers") == "column"
    # A column that shares its name with the alias is the column, not the whole row.
    assert policy.check("SELECT name FROM customers name")
    # Columns are reported for the facts, resolved through aliases and single sources.
    verdict = policy.check("SELECT c.name, email FROM customers c")
    assert verdict.columns == ("customers.email", "customers.name")


def test_writes_respect_denied_columns() -> None:
    policy = make(
        statements=["select", "insert", "update", "delete"], deny_columns=["customers.ssn"]
    )
    assert policy.check("INSERT INTO customers (id, name) VALUES (1, 'a')").kinds == ("insert",)
    for text in [
        "INSERT INTO customers (id, ssn) VALUES (1, 'x')",
        "INSERT INTO customers VALUES (1, 'a', 'b', 'c', 'd')",
        "UPDATE customers SET ssn = 'x' WHERE id = 1",
        "UPDATE customers SET name = 'x' WHERE ssn = '1'",
        "DELETE FROM customers RETURNING *",
    ]:
        assert kind_of(policy, text) == "column", text


def test_statement_kinds_are_checked_everywhere() -> None:
    policy = make(statements=["select", "delete"])
    assert policy.check("DELETE FROM orders WHERE id = 1").kinds == ("delete",)
    cte = "WITH x AS (DELETE FROM orders RETURNING id) SELECT id FROM x"
    assert policy.check(cte).kinds == ("delete", "select")
    assert kind_of(policy, "UPDATE orders SET status = 'x'") == "statement"
    assert kind_of(policy, "WITH x AS (UPDATE orders SET status = 'x' RETURNING id) SELECT 1") == (
        "statement"
    )
    assert kind_of(policy, "DELETE FROM secrets") == "table"
    # A DML target is always a table, even when a CTE has its name.
    assert kind_of(policy, "WITH secrets AS (SELECT 1) DELETE FROM secrets") == "table"
    assert kind_of(make(statements=["delete"]), "SELECT id FROM orders") == "statement"


def test_opt_in_families() -> None:
    assert make(allow=["locking"]).check("SELECT id FROM orders FOR UPDATE")
    assert make(allow=["into"], tables=["orders", "backup"]).check(
        "SELECT * INTO backup FROM orders"
    )
    assert make("mysql", allow=["into"]).check("SELECT id INTO @v FROM orders")
    assert make("mysql", allow=["variables"]).check("SELECT @@version")
    catalogs = make(allow=["system_catalogs"])
    assert catalogs.check("SELECT relname FROM pg_catalog.pg_class").tables == (
        "pg_catalog.pg_class",
    )
    with pytest.raises(ValueError, match="system catalog"):
        make(tables=["pg_user"])


def test_errors_carry_positions_and_every_problem() -> None:
    err = denial(make(), "SELECT id,\n       pg_sleep(1), version()\nFROM orders")
    kinds = [(e["kind"], e["found"], e["line"], e["col"]) for e in errors(err)]
    assert kinds == [("function", "pg_sleep", 2, 8), ("function", "version", 2, 21)]
    assert "(and 1 more problem(s), listed in errors)" in err.detail


def test_verdict_reports_kinds_tables() -> None:
    verdict = analyst("postgres").check(
        "SELECT o.id, c.name FROM orders o JOIN customers c ON c.id = o.customer_id LIMIT 5"
    )
    assert verdict.kinds == ("select",)
    assert verdict.tables == ("customers", "orders")
    assert verdict.rewritten is False


def test_create_rejects_bad_values() -> None:
    bad: list[dict[str, Any]] = [
        {"tables": []},
        {"statements": []},
        {"statements": ["destroy"]},
        {"max_statements": 0},
        {"deny_columns": ["secrets.ssn"]},
        {"deny_columns": ["customers.snn"], "schema": SCHEMA},
        {"add_limit": True},
        {"max_limit": 0},
        {"functions": ["pg sleep"]},
        {"allow": ["dml"]},
        {"max_length": 0},
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            make(**kwargs)
    with pytest.raises(ValueError):
        SqlPolicy.create("oracle", tables=["orders"])


# --- the body check -----------------------------------------------------------------------------


def body(raw: bytes, content_type: str = "application/json") -> BodyPayload:
    return BodyPayload(raw, content_type, Findings())


def body_check(**kwargs: Any) -> SqlBodyCheck:
    policy = kwargs.pop("policy", None) or make(max_limit=100, add_limit=True)
    kwargs.setdefault("field", ("sql",))
    return SqlBodyCheck(policy=policy, rule_id="r", **kwargs)


def test_body_field_allowed_records_findings() -> None:
    payload = body(json.dumps({"sql": "SELECT id FROM orders LIMIT 5", "n": 1}).encode())
    before = payload.raw
    body_check().check(payload)
    assert payload.raw == before and not payload.rewritten
    assert (payload.findings.sql_kinds, payload.findings.sql_tables) == ({"select"}, {"orders"})
    assert payload.findings.rewritten is False


def test_body_field_rewrite_forwards_exactly_the_checked_sql() -> None:
    payload = body(json.dumps({"query": {"text": "SELECT id FROM orders", "who": "Zoë"}}).encode())
    body_check(field=("query", "text")).check(payload)
    sent = json.loads(payload.raw)
    assert sent == {"query": {"text": "SELECT id FROM orders LIMIT 100", "who": "Zoë"}}
    assert payload.json() == sent
    assert payload.rewritten and payload.findings.rewritten


@pytest.mark.parametrize(
    "value",
    [{"sql": 5}, {"query": "x"}, {}, [1], {"sql": None}],
)
def test_body_field_missing_or_not_a_string(value: Any) -> None:
    with pytest.raises(BodyInvalid) as info:
        body_check().check(body(json.dumps(value).encode()))
    assert info.value.rule == "r"


def test_body_field_needs_json() -> None:
    with pytest.raises(BodyInvalid):
        body_check().check(body(b"SELECT 1", "text/plain"))
    with pytest.raises(BodyInvalid):
        body_check().check(body(b'{"sql": "a", "sql": "b"}'))


def test_body_field_denied() -> None:
    payload = body(json.dumps({"sql": "DELETE FROM orders"}).encode())
    with pytest.raises(SqlDenied) as info:
        body_check().check(payload)
    assert info.value.rule == "r" and errors(info.value)[0]["kind"] == "statement"
    assert not payload.findings.sql_kinds and not payload.rewritten


def test_raw_body() -> None:
    check = body_check(field=None, raw=True)
    payload = body(b"SELECT id FROM orders", "")
    check.check(payload)
    assert payload.raw == b"SELECT id FROM orders LIMIT 100"
    with pytest.raises(BodyInvalid):
        check.check(body(b"SELECT '\xff'", ""))
    with pytest.raises(SqlDenied):
        check.check(body(b"", ""))


def tool_call(sql: Any, tool: str = "run_sql") -> ToolCallPayload:
    return ToolCallPayload(tool, {"sql": sql, "explain": False}, Findings())


def test_mcp_argument_checked_and_rewritten() -> None:
    check = body_check(field=None, argument="sql")
    payload = tool_call("SELECT id FROM orders")
    check.check(payload)
    assert payload.arguments == {"sql": "SELECT id FROM orders LIMIT 100", "explain": False}
    assert payload.rewritten


def test_mcp_argument_denials() -> None:
    check = body_check(field=None, argument="sql")
    with pytest.raises(SqlDenied):
        check.check(tool_call("SELECT pg_sleep(5)"))
    with pytest.raises(ToolDenied):
        check.check(tool_call(42))
    with pytest.raises(SqlDenied):
        check.check(body(b"{}"))  # a body where the rule reads a tool argument: denied
    with pytest.raises(SqlDenied):
        body_check().check(tool_call("SELECT 1"))  # a tool call where the rule reads a body


# --- the policy file ----------------------------------------------------------------------------


def test_policy_file_compiles_the_analyst_rule() -> None:
    check = load_sql_check(analyst_sql("postgres"))
    assert check.kind == "sql" and check.field == ("sql",) and check.rule_id == "query-orders"
    policy = check.policy
    assert policy.dialect == "postgres" and policy.max_limit == 1000
    assert {str(t) for t in policy.tables} == {"orders", "customers"}
    assert dict(policy.deny_columns) == {TableName("", "", "customers"): frozenset({"ssn"})}


def test_policy_file_example_from_design_loads_without_schema() -> None:
    check = load_sql_check(
        "{field: sql, dialect: postgres, server_version: 15, tables: [orders, customers],\n"
        " deny_columns: [customers.ssn], max_limit: 1000}"
    )
    assert kind_of(check.policy, "SELECT * FROM customers LIMIT 1") == "column"


def test_policy_file_schema_file(tmp_path: Path) -> None:
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    block = analyst_sql("sqlite").replace(
        "schema:\n  customers: [id, name, email, ssn, country]\n"
        "  orders: [id, customer_id, total_cents, status, created_at]\n",
        "schema_file: schema.json\n",
    )
    check = load_sql_check(block, tmp_path / "policy.yaml")
    assert check.policy.schema[TableName("", "", "customers")] == frozenset(SCHEMA["customers"])


def test_policy_file_mcp_tool_rule() -> None:
    text = POLICY_TEMPLATE.format(
        sql=indent("{dialect: sqlite, argument: sql, tables: [orders], schema: {orders: [id]}}")
    )
    text = text.replace("upstream: db", "upstream: tools\n        tool: run_sql")
    policy = load_policy("policy.yaml", text=text)
    (check,) = policy.rules_by_id["query-orders"].checks
    assert isinstance(check, SqlBodyCheck)
    assert (check.argument, check.field, check.raw) == ("sql", None, False)
    with pytest.raises(PolicyError, match="names the tool argument"):
        load_policy("policy.yaml", text=text.replace("argument: sql", "field: sql"))


BASE = "dialect: postgres\nfield: sql\ntables: [orders, customers]\n"

# (the sql: block, its line (0-based) where the error is expected, a part of the message)
BAD_BLOCKS = [
    ("dialect: oracle\nfield: sql\ntables: [orders]", 0, "expected one of ['postgres'"),
    ("field: sql\ntables: [orders]", 0, "missing required key 'dialect'"),
    ("dialect: postgres\nfield: sql", 0, "missing required key 'tables'"),
    (BASE + "tabels: [x]", 3, "unknown key 'tabels'"),
    (BASE + "statements: [select, destroy]", 3, "got 'destroy'"),
    (BASE + "statements: []", 3, "at least one"),
    (BASE + "max_statements: 0", 3, "must be at least 1"),
    (BASE + "allow: [dml]", 3, "listing statement kinds"),
    (BASE + "allow: [everything]", 3, "got 'everything'"),
    (BASE + "deny_columns: [ssn]", 3, "is not a column name"),
    (BASE + "deny_columns: [secrets.ssn]", 3, "not in 'tables'"),
    (BASE + "schema: {customers: [id]}\ndeny_columns: [customers.ssn]", 4, "has no column"),
    (BASE + "add_limit: true", 3, "add_limit needs max_limit"),
    (BASE + "max_limit: 0", 3, "must be at least 1"),
    (BASE + "max_limit: lots", 3, "expected an integer"),
    (BASE + "functions: ['pg sleep']", 3, "not a function name"),
    (BASE + "schema_file: missing.yaml", 3, "cannot read"),
    (BASE + "schema: {orders: [id]}\nschema_file: s.yaml", 4, "not both"),
    (BASE + "schema: [orders]", 3, "expected a mapping"),
    (BASE + "default_schema: 'a b'", 3, "not an identifier"),
    (BASE + "max_length: 1000000", 3, "must be at most"),
    ("dialect: postgres\nfield: sql\nbody: raw\ntables: [orders]", 0, "exactly one of"),
    ("dialect: postgres\ntables: [orders]", 0, "exactly one of"),
    ("dialect: postgres\nargument: sql\ntables: [orders]", 0, "exactly one of"),
    ("dialect: postgres\nbody: json\ntables: [orders]", 1, "expected one of ['raw']"),
    ("dialect: postgres\nfield: 'a..b'\ntables: [orders]", 1, "dotted JSON field path"),
    ("dialect: postgres\nfield: sql\ntables: [pg_user]", 2, "system catalog"),
    ("dialect: postgres\nfield: sql\ntables: ['orders x']", 2, "is not a table name"),
    ("dialect: postgres\nfield: sql\ntables: []", 2, "at least one"),
    ("just a string", 0, "expected a mapping"),
]


@pytest.mark.parametrize(("block", "line", "message"), BAD_BLOCKS)
def test_policy_file_errors_name_file_line_and_column(block: str, line: int, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_sql_check(block)
    issues = [str(i) for i in info.value.issues]
    expected_line = SQL_FIRST_LINE + line
    matching = [i for i in issues if message in i]
    assert matching, issues
    assert any(i.startswith(f"policy.yaml:{expected_line}:") for i in matching), issues


# --- through the gateway's own stages (policy explain) ------------------------------------------


async def test_explain_runs_the_sql_check_in_the_pipeline() -> None:
    from gateway.commands.explain import explain

    block = analyst_sql("postgres").replace("max_limit: 1000", "max_limit: 1000\nadd_limit: true")
    text = POLICY_TEMPLATE.format(sql=indent(block))
    policy = load_policy("policy.yaml", text=text)

    async def decide(sql: str) -> dict[str, Any]:
        return await explain(
            policy,
            roles=["analyst"],
            agent="a1",
            method="POST",
            url="http://127.0.0.1:8787/db/query",
            body=json.dumps({"sql": sql}).encode(),
        )

    allowed = await decide("SELECT id, name FROM customers")
    assert allowed["decision"] == "allow", allowed
    assert allowed["facts"]["sql"] == {
        "kinds": ["select"],
        "tables": ["customers"],
        "rewritten": True,
    }
    assert json.loads(allowed["forwarded_body"]) == {
        "sql": "SELECT id, name FROM customers LIMIT 1000"
    }
    denied = await decide("SELECT ssn FROM customers")
    assert (denied["decision"], denied["reason"], denied["status"]) == ("deny", "sql_denied", 403)
    assert denied["rule"] == "query-orders"
    assert denied["errors"][0]["kind"] == "column"


def test_row_packing_functions_are_out_of_the_default_list() -> None:
    from gateway.checks.sql.options import DEFAULT_FUNCTIONS, ROW_PACKING

    assert DEFAULT_FUNCTIONS.isdisjoint(ROW_PACKING)
    for name in sorted(ROW_PACKING):  # and each one, called, is refused (PostgreSQL)
        assert kind_of(make(), f"SELECT {name}(id) FROM orders") == "function"


def test_sqlite_judges_each_action_by_its_own_rules_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SQLite action is judged once per policy and remembered (``SqliteScratch.judged``):
    uncached checks of a text read the same every time, a database shared by other rules
    judges by those rules, and the memory forgotten when full changes nothing."""
    import gateway.checks.sql.sqlite as sql_sqlite
    from gateway.checks.sql.violations import Refusal

    plain = make("sqlite")
    strict = make("sqlite", deny_columns=["customers.ssn"])
    scratch = plain._scratch
    assert scratch is not None
    text = "SELECT id, ssn, upper(name) FROM customers LIMIT 5"
    first = sql_sqlite.read(plain, scratch, text)
    assert "customers.ssn" in first.columns
    assert sql_sqlite.read(plain, scratch, text) == first
    with pytest.raises(Refusal) as info:  # the same database, other rules
        sql_sqlite.read(strict, scratch, text)
    assert info.value.violations[0].found == "customers.ssn"
    assert sql_sqlite.read(plain, scratch, text) == first
    monkeypatch.setattr(sql_sqlite, "_JUDGED_MAX", 2)
    for _ in range(3):
        assert sql_sqlite.read(plain, scratch, text) == first
        assert scratch.judged(plain) == {}  # full (more than 2): forgotten
