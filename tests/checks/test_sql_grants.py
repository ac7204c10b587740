"""``capgate policy grants``: the printed PostgreSQL grants, applied to a throwaway role on the
real server, refuse what the rule denies and allow what it allows; the SQLite equivalent,
run with sqlite3, makes a database without the denied columns."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.commands.grants import PG_RISKY_FUNCTIONS, print_grants
from gateway.testing import policy_from_text

POLICY = """
version: 1
agents: {"*": [analyst]}
upstreams:
  db: {url: "http://127.0.0.1:9"}
  lite: {url: "http://127.0.0.1:9"}
roles:
  analyst:
    rules:
      - id: pg-orders
        upstream: db
        allow: POST /query
        sql:
          field: sql
          dialect: postgres
          server_version: 15
          tables: [orders, customers, '"Select"']
          schema:
            customers: [id, name, email, ssn, country]
            '"Select"': [id, "from"]
          deny_columns: [customers.ssn, '"Select".from']
          functions: [pg_sleep]
      - id: lite-orders
        upstream: lite
        allow: POST /query
        sql:
          field: sql
          dialect: sqlite
          tables: [orders, customers]
          schema:
            customers: [id, name, email, ssn, country]
            orders: [id, customer_id, total_cents]
          deny_columns: [customers.ssn]
"""


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grants") / "policy.yaml"
    path.write_text(POLICY)
    return path


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["policy", "grants", *argv], {})
    out, err = capsys.readouterr()
    return code, out, err


def test_postgres_grants_name_allowed_columns_only(
    capsys: pytest.CaptureFixture[str], policy_file: Path
) -> None:
    code, out, err = cli(capsys, "--dialect", "postgres", "--role", "agent", str(policy_file))
    assert code == 0, err
    assert "GRANT SELECT (country, email, id, name) ON customers TO agent;" in out
    assert 'GRANT SELECT (id) ON "Select" TO agent;' in out  # quoted where it must be
    assert "GRANT SELECT ON orders TO agent;" in out  # no columns listed, none denied
    assert "GRANT USAGE ON SCHEMA public TO agent;" in out
    assert "ssn" not in out.replace("-- ", "")  # never granted
    assert "pg_sleep(double precision)" not in out  # the rule allows pg_sleep
    assert "REVOKE EXECUTE ON FUNCTION pg_catalog.set_config(text, text, boolean)" in out
    assert "ALTER ROLE agent SET statement_timeout = '5s';" in out
    assert "ALTER ROLE agent SET default_transaction_read_only = on;" in out


def test_a_denied_column_of_an_unlisted_table_is_not_granted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        POLICY.replace("            customers: [id, name, email, ssn, country]\n", "", 1)
    )
    code, out, _ = cli(capsys, "--dialect", "postgres", "--role", "agent", str(path))
    assert code == 1
    assert "ON customers" not in out
    assert "-- customers: the rule denies some of its columns" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dialect", "postgres", "--role", "a", "--rule", "nope"], "no rule 'nope'"),
        (["--dialect", "postgres", "--role", "a\n;DROP"], "--role"),
        (["--dialect", "postgres", "--role", "a", "--statement-timeout", "0; x"], "timeout"),
        (["--dialect", "mysql", "--role", "a"], "invalid choice"),
    ],
)
def test_usage_errors(
    capsys: pytest.CaptureFixture[str], policy_file: Path, argv: list[str], message: str
) -> None:
    code, out, err = cli(capsys, *argv, str(policy_file))
    assert code == 2 and out == "" and message in err


def test_several_rules_need_a_rule_name(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    second = POLICY.split("      - id: lite-orders")[0].split("      - id: pg-orders")[1]
    path.write_text(POLICY + "      - id: pg-two" + second.replace("POST /query", "POST /q2"))
    code, _, err = cli(capsys, "--dialect", "postgres", "--role", "a", str(path))
    assert code == 2 and "pg-orders, pg-two" in err


def test_sqlite_equivalent_copies_allowed_columns_only(tmp_path: Path) -> None:
    full = tmp_path / "full.db"
    with sqlite3.connect(full) as db:
        db.execute("CREATE TABLE customers (id, name, email, ssn, country)")
        db.execute("CREATE TABLE orders (id, customer_id, total_cents)")
        db.execute("INSERT INTO customers VALUES (1, 'n', 'e', 'SENTINEL', 'DE')")
        db.execute("INSERT INTO orders VALUES (1, 1, 100)")
    db.close()
    grants = print_grants(
        policy_from_text(POLICY), dialect="sqlite", role="upstream", source=str(full)
    )
    assert grants.complete
    text = grants.text()
    assert "SQLite has no users and no GRANT" in text
    agent = sqlite3.connect(tmp_path / "agent.db")
    agent.executescript(text)
    agent.close()
    ro = sqlite3.connect(f"file:{tmp_path / 'agent.db'}?mode=ro", uri=True)
    assert ro.execute("SELECT name, country FROM customers").fetchall() == [("n", "DE")]
    with pytest.raises(sqlite3.OperationalError, match="no such column"):
        ro.execute("SELECT ssn FROM customers")
    assert b"SENTINEL" not in (tmp_path / "agent.db").read_bytes()
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        ro.execute("DELETE FROM orders")
    ro.close()


# --- on the real PostgreSQL server ---------------------------------------------------------

psycopg = pytest.importorskip("psycopg")
DSN = os.environ.get("CAPGATE_ORACLE_PG", "host=127.0.0.1 port=5432 user=postgres")
DATABASE = "capgate_grants"
ROLE = "capgate_grants_agent"


def _connect(**kwargs: Any) -> Any:
    return psycopg.connect(DSN, autocommit=True, connect_timeout=3, **kwargs)


@pytest.fixture
def pg_agent() -> Iterator[Any]:
    """A throwaway database and role; the role gets exactly what ``policy grants`` prints."""
    try:
        admin = _connect()
    except psycopg.OperationalError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs PostgreSQL on 127.0.0.1:5432: {exc}")
        pytest.skip(f"no PostgreSQL server: {exc}")
    with admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        admin.execute(f"DROP ROLE IF EXISTS {ROLE}")
        admin.execute(f"CREATE ROLE {ROLE} LOGIN")
        admin.execute(f"CREATE DATABASE {DATABASE}")
    grants = print_grants(policy_from_text(POLICY), dialect="postgres", role=ROLE).text()
    try:
        with _connect(dbname=DATABASE) as db:
            db.execute(
                "CREATE TABLE customers (id int, name text, email text, ssn text, country text);"
                "CREATE TABLE orders (id int, customer_id int, total_cents int);"
                'CREATE TABLE "Select" (id int, "from" text);'
                "CREATE TABLE secrets (id int, secret text);"
                "INSERT INTO customers VALUES (1, 'n', 'e', 'SENTINEL', 'DE');"
                "INSERT INTO orders VALUES (1, 1, 100);"
                "CREATE FUNCTION public.leak() RETURNS text LANGUAGE sql AS $$ SELECT 'x' $$;"
            )
            db.execute(grants)  # the printed script, as printed
        agent = _connect(dbname=DATABASE, user=ROLE)
        yield agent
        agent.close()
    finally:
        with _connect() as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
            admin.execute(f"DROP ROLE IF EXISTS {ROLE}")


def _refused(agent: Any, sql: str) -> str:
    with pytest.raises(psycopg.Error) as info:
        agent.execute(sql)
    return str(info.value.sqlstate)


def test_printed_grants_refuse_what_the_rule_denies_on_postgres(pg_agent: Any) -> None:
    agent = pg_agent
    assert agent.execute("SELECT id, name, email, country FROM customers").fetchall() == [
        (1, "n", "e", "DE")
    ]
    assert agent.execute("SELECT total_cents FROM orders").fetchall() == [(100,)]
    assert agent.execute('SELECT id FROM "Select"').fetchall() == []
    assert _refused(agent, "SELECT ssn FROM customers") == "42501"  # the denied column
    assert _refused(agent, "SELECT * FROM customers") == "42501"  # * includes it
    assert _refused(agent, 'SELECT "from" FROM "Select"') == "42501"
    assert _refused(agent, "SELECT * FROM secrets") == "42501"  # a table not in the rule
    assert _refused(agent, "SELECT public.leak()") == "42501"  # a function in public
    assert _refused(agent, "SELECT set_config('statement_timeout', '0', false)") == "42501"
    assert _refused(agent, "SELECT pg_notify('c', 'x')") == "42501"
    agent.execute("SELECT pg_sleep(0)")  # the rule allows it
    assert agent.execute("SHOW statement_timeout").fetchone() == ("5s",)
    assert _refused(agent, "UPDATE orders SET total_cents = 0") == "25006"  # read-only


def test_every_named_builtin_exists_with_that_signature(pg_agent: Any) -> None:
    # The REVOKE lines applied without error (the fixture ran them); each names a real one.
    for name, args in PG_RISKY_FUNCTIONS:
        row = pg_agent.execute("SELECT %s::regprocedure::text", [f"{name}({args})"]).fetchone()
        assert row[0].startswith(name)
