"""The differential oracle: what the SQL check allows is run on the real database, which must
agree that nothing denied was reached.

- SQLite: every allowed statement runs on a populated database whose denied column
  (``customers.ssn``) and whose tables off the list (``secrets``, ``refunds``) hold sentinel
  values; a sentinel in any row returned, or a change (``total_changes``), fails the test. The
  oracle is the data, never the check itself.
- PostgreSQL (``test_sql_oracle_postgres.py``): every allowed statement runs as a role whose
  column-level grants mirror the policy, in a read-only transaction that is rolled back.

Fed with the fixtures, mutations of the denied corpus (``sql_corpus``) and statements from the
fuzz grammar. Budget: about 2,000 statements in CI; ``CAPGATE_ORACLE=deep`` runs more.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.checks.sql import SqlPolicy
from gateway.errors import SqlDenied
from tests.checks import sql_corpus
from tests.checks.test_sql_fuzz import ITEMS, query

DEEP = os.environ.get("CAPGATE_ORACLE") == "deep"
MUTATIONS = 6000 if DEEP else 700
GENERATED = 3000 if DEEP else 250

SENTINEL = "SENTINEL-7f3a"
SCHEMA = {
    "customers": ["id", "name", "email", "ssn", "country"],
    "orders": ["id", "customer_id", "total_cents", "status", "created_at"],
}
DDL = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT, ssn TEXT, country TEXT);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, total_cents INTEGER,
                     status TEXT, created_at TEXT);
CREATE TABLE secrets (id INTEGER PRIMARY KEY, secret TEXT, ssn TEXT);
CREATE TABLE refunds (id INTEGER PRIMARY KEY, order_id INTEGER, note TEXT);
"""


def sqlite_policy(**kwargs: Any) -> SqlPolicy:
    return SqlPolicy.create(
        "sqlite",
        tables=["orders", "customers"],
        schema=SCHEMA,
        deny_columns=["customers.ssn"],
        max_limit=1000,
        rule_id="oracle",
        **kwargs,
    )


class SqliteOracle:
    """A populated database holding sentinels wherever the policy denies reading."""

    def __init__(self) -> None:
        self.conn = sqlite3.connect(":memory:", isolation_level=None)
        self.conn.executescript(DDL)
        for i in range(1, 6):
            self.conn.execute(
                "INSERT INTO customers VALUES (?, ?, ?, ?, ?)",
                (i, f"name{i}", f"e{i}@x", f"{SENTINEL}-ssn-{i}", "DE"),
            )
            self.conn.execute(
                "INSERT INTO orders VALUES (?, ?, ?, ?, ?)",
                (i, i, 100 * i, "paid", "2026-01-01"),
            )
            self.conn.execute(
                "INSERT INTO secrets VALUES (?, ?, ?)", (i, f"{SENTINEL}-s", f"{SENTINEL}-x")
            )
            self.conn.execute("INSERT INTO refunds VALUES (?, ?, ?)", (i, i, f"{SENTINEL}-r"))
        self.deadline = 0.0
        self.conn.set_progress_handler(lambda: int(time.monotonic() > self.deadline), 1000)
        self.executed = 0

    def run(self, sql: str) -> list[tuple[Any, ...]] | None:
        """Run ``sql`` as an upstream would (one statement, bound parameters all NULL)."""
        before = self.conn.total_changes
        params: list[None] = []
        rows: list[tuple[Any, ...]] | None = None
        for _ in range(2):
            self.deadline = time.monotonic() + 2
            try:
                rows = self.conn.execute(sql, params).fetchall()
                break
            except sqlite3.ProgrammingError as exc:
                m = re.search(r"uses (\d+)", str(exc))
                if not m:
                    raise
                params = [None] * int(m.group(1))
            except sqlite3.OperationalError:
                rows = None  # SQLite refused to run it (or it ran out of time): nothing leaked
                break
        self.executed += 1
        assert self.conn.total_changes == before, f"the database changed: {sql!r}"
        assert not self.conn.in_transaction, f"a transaction was left open: {sql!r}"
        for row in rows or []:
            for value in row:
                assert SENTINEL not in str(value), f"a sentinel came back: {sql!r} -> {row!r}"
        return rows


@pytest.fixture(scope="module")
def oracle() -> Iterator[SqliteOracle]:
    db = SqliteOracle()
    yield db
    db.conn.close()


POLICIES = {"plain": sqlite_policy(), "add_limit": sqlite_policy(add_limit=True)}


def judge(oracle: SqliteOracle, text: str) -> bool:
    """Check ``text`` with each policy; run what is allowed. True when any allowed it."""
    allowed = False
    for policy in POLICIES.values():
        try:
            verdict = policy.check(text)
        except SqlDenied:
            continue
        allowed = True
        oracle.run(verdict.sql)
    return allowed


def test_fixtures_and_mutations_agree_with_sqlite(oracle: SqliteOracle) -> None:
    texts = sql_corpus.read_fixture("sqlite", "allowed.sql")
    texts += sql_corpus.read_fixture("sqlite", "denied.sql")
    texts += sql_corpus.mutations("sqlite", seed=10, budget=MUTATIONS)
    allowed = sum(judge(oracle, text) for text in texts)
    assert allowed >= len(sql_corpus.read_fixture("sqlite", "allowed.sql"))
    # Every allowed fixture returns rows: the oracle database is what the queries expect.
    for text in sql_corpus.read_fixture("sqlite", "allowed.sql"):
        assert oracle.run(POLICIES["plain"].check(text).sql) is not None, text


ORACLE_FUZZ = settings(
    max_examples=GENERATED,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@ORACLE_FUZZ
@given(st.data())
def test_generated_statements_agree_with_sqlite(oracle: SqliteOracle, data: st.DataObject) -> None:
    q = data.draw(query("sqlite", depth=2))
    items = data.draw(st.lists(st.sampled_from([i for i, _ in ITEMS if i != "t"]), min_size=1))
    judge(
        oracle, q.sql.replace("SELECT t0.id", "SELECT " + ", ".join(items).replace("t.", "t0."), 1)
    )
    judge(oracle, q.sql + " LIMIT 5")


def test_the_oracle_sees_a_leak_and_a_write(oracle: SqliteOracle) -> None:
    with pytest.raises(AssertionError, match="sentinel"):
        oracle.run("SELECT ssn FROM customers LIMIT 1")
    with pytest.raises(AssertionError, match="sentinel"):
        oracle.run("SELECT secret FROM secrets LIMIT 1")
    with pytest.raises(AssertionError, match="changed"):
        oracle.run("UPDATE orders SET status = status WHERE id = 1")


def test_the_oracle_ran_its_budget(oracle: SqliteOracle) -> None:
    # Runs after the others in this module (file order): the feed reached the database.
    assert oracle.executed >= (400 if not DEEP else 2000), oracle.executed
