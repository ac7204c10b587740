"""The statements the differential oracle feeds the SQL check: the fixtures, mutations of the
denied corpus, and (in the oracle tests) hypothesis-generated statements.

Mutations aim at the places where a checker's reading can differ from the database's: every
parameter syntax each database has (SQLite's TCL ``$a::b(...)`` included), dollar-quote tags
made of Unicode digits and letters, comment and quote nesting, parenthesized and nested
aliases, column-alias lists.
"""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path
from typing import Any

from gateway.checks.sql import SqlPolicy

FIXTURES = Path(__file__).parent / "fixtures" / "sql"
SCHEMA = {
    "customers": ["id", "name", "email", "ssn", "country"],
    "orders": ["id", "customer_id", "total_cents", "status", "created_at"],
}


def pg_policy(**kwargs: Any) -> SqlPolicy:
    """The PostgreSQL policy of the oracle's database: ``customers.ssn`` denied, LIMIT 1000."""
    return SqlPolicy.create(
        "postgres",
        server_version=15,
        tables=["orders", "customers"],
        schema=SCHEMA,
        deny_columns=["customers.ssn"],
        max_limit=1000,
        **kwargs,
    )


NEWLINE = "⏎"
_DENIED_LINE = re.compile(r"^(?P<sql>.*)\s--\s(?P<kind>[a-z]+)\s*$")

PARAMETERS = {
    "sqlite": ["?", "?1", "?99", ":a", "@a", "$a", "#a", "$a::b", "$a::b(')", "$a(')", "$a(x)"],
    "postgres": ["$1", "$2", "$99"],
    "mysql": ["?", ":a", "@a", "@@a", "$1", "\\N"],
}
QUOTES = ["'", '"', "`", "[", "$$", "$²$", "$٣$", "$ä$", "$_$", "E'\\'", "U&'", "X'", "B'"]
COMMENTS = ["--", "/*", "*/", "/* /* */", "/*!", "#"]

# Shapes around what a leak would read: {p} is a parameter, quote or comment opener, {q} its
# closer (or the same text again).
SHAPES = [
    "SELECT {p}, ssn, name FROM customers --{q}",
    "SELECT {p} FROM orders LIMIT 5 -- {q}, ssn, name FROM customers LIMIT 5",
    "SELECT {p} FROM orders LIMIT 5 {q}, ssn FROM customers LIMIT 5",
    "SELECT id FROM orders WHERE status = {p} LIMIT 5 {q} UNION SELECT ssn FROM customers",
    "SELECT id, {p} AS x FROM orders {q} LIMIT 5",
    "SELECT {p}{q} FROM orders LIMIT 5",
    "SELECT name FROM customers WHERE name = {p}; SELECT ssn FROM customers {q}",
    "SELECT {p}) , ssn FROM customers --{q}",
]
ALIASES = [
    "SELECT j.ssn, j.name FROM (customers) j LIMIT 5",
    "SELECT j.ssn FROM ((customers)) AS j LIMIT 5",
    "SELECT j FROM (orders o JOIN customers c ON c.id = o.customer_id) AS j LIMIT 5",
    "SELECT j.ssn FROM (orders o JOIN customers c ON c.id = o.customer_id) AS j LIMIT 5",
    "SELECT j.* FROM (orders o JOIN customers c ON c.id = o.customer_id) AS j LIMIT 5",
    "SELECT * FROM (orders o JOIN customers c ON c.id = o.customer_id) AS j LIMIT 5",
    "SELECT x.d FROM customers AS x(a, b, c, d) LIMIT 5",
    "SELECT j.d FROM (customers AS x(a, b, c, d)) AS j LIMIT 5",
    "SELECT t.s FROM (SELECT ssn AS s FROM customers) AS t LIMIT 5",
    "SELECT t.b FROM (SELECT * FROM customers) AS t(a, b, c, d, e) LIMIT 5",
    "WITH t(a, b, c, d) AS (SELECT * FROM customers) SELECT d FROM t LIMIT 5",
    "WITH t AS (SELECT * FROM customers) SELECT t.ssn FROM t LIMIT 5",
    "SELECT (SELECT c2.ssn FROM customers c2 WHERE c2.id = c.id) FROM customers c LIMIT 5",
    "SELECT o.id FROM orders o WHERE EXISTS (SELECT 1 FROM customers c WHERE c.ssn > '') LIMIT 5",
    "SELECT c.id FROM customers c JOIN (SELECT '1' AS ssn) x USING (ssn) LIMIT 5",
    "SELECT o.id FROM orders o NATURAL JOIN customers LIMIT 5",
]


def read_fixture(dialect: str, name: str) -> list[str]:
    out = []
    for line in (FIXTURES / dialect / name).read_text("utf-8").splitlines():
        if not line.strip() or line.startswith("##"):
            continue
        if name == "denied.sql":
            m = _DENIED_LINE.match(line)
            assert m, line
            line = m["sql"]
        out.append(line.replace(NEWLINE, "\n"))
    return out


def mutations(dialect: str, seed: int, budget: int) -> list[str]:
    """Deterministic mutations of the denied corpus, at most ``budget`` of them."""
    rng = random.Random(seed)
    openers = PARAMETERS[dialect] + QUOTES + COMMENTS
    out: list[str] = []
    for shape, (p, q) in itertools.product(SHAPES, itertools.product(openers, repeat=2)):
        if p == q or rng.random() < 0.15:
            out.append(shape.format(p=p, q=q))
    out += ALIASES
    denied = read_fixture(dialect, "denied.sql")
    for text in denied:
        words = text.split(" ")
        for _ in range(3):
            i = rng.randrange(len(words) + 1)
            piece = rng.choice(openers)
            out.append(" ".join(words[:i] + [piece] + words[i:]))
    rng.shuffle(out)
    return out[:budget]
