"""Property tests of gateway/checks/sql/.

- Any text, in any dialect, ends in a verdict or ``SqlDenied``, never another exception.
- SELECTs generated from a small grammar (joins, derived tables, subqueries, CTEs that shadow
  table names, set operations, identifier case and quoting) are allowed exactly when every base
  table they read is on the list: the check is neither bypassed nor over-strict.
- Queries over a table with a denied column are allowed exactly when nothing reaches it.

Profiles: ``CAPGATE_FUZZ=deep`` runs many more examples (default: fast).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.checks.sql import SqlPolicy, SqlVerdict
from gateway.errors import SqlDenied

DEEP = os.environ.get("CAPGATE_FUZZ") == "deep"
FUZZ = settings(
    max_examples=4000 if DEEP else 150,
    deadline=None,
    derandomize=not DEEP and os.environ.get("CI", "").lower() in ("true", "1"),
    suppress_health_check=[HealthCheck.too_slow],
)

DIALECTS = ("postgres", "sqlite", "mysql")
ALLOWED = ("orders", "customers")
FORBIDDEN = ("secrets", "refunds", "users")
NAMES = ALLOWED + FORBIDDEN + ("c1", "c2")

# SQLite rules name the columns of every table: SQLite's compiler checks against them.
PLAIN_SCHEMA = {"customers": ["id", "name", "ssn"], "orders": ["id", "status", "name", "ssn"]}
POLICIES = {
    d: SqlPolicy.create(
        d,
        tables=list(ALLOWED),
        max_statements=1 if d == "sqlite" else 3,
        max_joins=32,
        server_version=15 if d == "postgres" else None,
        schema=PLAIN_SCHEMA if d == "sqlite" else None,
    )
    for d in DIALECTS
}
GUARDED = {
    (d, schema): SqlPolicy.create(
        d,
        tables=list(ALLOWED),
        deny_columns=["customers.ssn"],
        server_version=15 if d == "postgres" else None,
        schema=PLAIN_SCHEMA if schema or d == "sqlite" else None,
    )
    for d in DIALECTS
    for schema in (False, True)
}

SQL_WORDS = [
    "SELECT", "FROM", "WHERE", "WITH", "AS", "UNION", "ALL", "JOIN", "ON", "USING", "LIMIT",
    "INSERT", "INTO", "DELETE", "UPDATE", "SET", "VALUES", "CREATE", "DROP", "TABLE", "CASE",
    "WHEN", "THEN", "END", "NOT", "NULL", "AND", "OR", "IN", "EXISTS", "LATERAL", "FOR",
    "RECURSIVE", "PRAGMA", "ATTACH", "COPY", "DO", "CALL", "orders", "customers", "secrets",
    "ssn", "id", "pg_sleep", "t", "x", "*", ",", "(", ")", "[", "]", ";", "'", '"', "`", "$$",
    "--", "/*", "*/", "/*!", "U&", ".", "=", "1", "1.5e3", "?", "$1", ":n", "@v", "@@v", "\\",
    "\n", "::", "->", "||", "\x00", "é", "😀",
]  # fmt: skip


def check_never_crashes(policy: SqlPolicy, text: str) -> None:
    try:
        verdict = policy.check(text)
    except SqlDenied as err:
        assert err.errors and err.errors[0]["kind"]
    else:
        assert isinstance(verdict, SqlVerdict)
        assert verdict.sql == text or verdict.rewritten


@FUZZ
@given(st.sampled_from(DIALECTS), st.text(max_size=300))
def test_random_text_only_ever_denies(dialect: str, text: str) -> None:
    check_never_crashes(POLICIES[dialect], text)
    check_never_crashes(GUARDED[(dialect, True)], text)


@FUZZ
@given(
    st.sampled_from(DIALECTS),
    st.lists(st.sampled_from(SQL_WORDS), max_size=40),
    st.lists(st.sampled_from([" ", "", "\n", "\t"]), min_size=40, max_size=40),
)
def test_sql_shaped_noise_only_ever_denies(dialect: str, words: list[str], gaps: list[str]) -> None:
    text = "".join(w + g for w, g in zip(words, gaps, strict=False))
    check_never_crashes(POLICIES[dialect], text)
    check_never_crashes(GUARDED[(dialect, False)], text)


# --- a grammar of SELECTs with a table oracle ---------------------------------------------------


@dataclass(frozen=True)
class Query:
    sql: str
    reads: frozenset[str]  # canonical names of the base tables read


def spell(draw: st.DrawFn, name: str, dialect: str) -> tuple[str, str]:
    """(how the name is written, the name the database resolves it to)."""
    if dialect == "postgres":
        style = draw(st.sampled_from(["plain", "upper", "quoted", "quoted_upper"]))
        return {
            "plain": (name, name),
            "upper": (name.upper(), name),
            "quoted": (f'"{name}"', name),
            "quoted_upper": (f'"{name.upper()}"', name.upper()),
        }[style]
    if dialect == "sqlite":
        style = draw(st.sampled_from(["plain", "upper", "quoted", "bracket"]))
        return {
            "plain": (name, name),
            "upper": (name.upper(), name),
            "quoted": (f'"{name.upper()}"', name),
            "bracket": (f"[{name}]", name),
        }[style]
    style = draw(st.sampled_from(["plain", "backtick", "upper"]))
    return {
        "plain": (name, name),
        "backtick": (f"`{name}`", name),
        "upper": (name.upper(), name.upper()),
    }[style]


@st.composite
def source(draw: st.DrawFn, dialect: str, depth: int, ctes: frozenset[str]) -> Query:
    if depth > 0 and draw(st.integers(0, 3)) == 0:
        inner = draw(query(dialect, depth - 1, ctes))
        return Query(f"({inner.sql})", inner.reads)
    # Mostly allowed names and visible CTEs, so that allowed queries are common too.
    pool = st.sampled_from(NAMES)
    if ctes and draw(st.integers(0, 2)) == 0:
        pool = st.sampled_from(sorted(c.lower() for c in ctes))
    elif draw(st.integers(0, 2)) > 0:
        pool = st.sampled_from(ALLOWED)
    written, name = spell(draw, draw(pool), dialect)
    reads = frozenset() if name in ctes else frozenset({name})
    return Query(written, reads)


@st.composite
def select(draw: st.DrawFn, dialect: str, depth: int, ctes: frozenset[str]) -> Query:
    sources = draw(st.lists(source(dialect, depth, ctes), min_size=1, max_size=2))
    parts = [f"{sources[0].sql} AS t0"]
    for i, src in enumerate(sources[1:], start=1):
        parts.append(f"JOIN {src.sql} AS t{i} ON t{i}.id = t0.id")
    reads = frozenset().union(*(s.reads for s in sources))
    sql = f"SELECT t0.id FROM {' '.join(parts)}"
    if depth > 0 and draw(st.booleans()):
        sub = draw(query(dialect, depth - 1, ctes))
        op = draw(st.sampled_from(["IN", "EXISTS"]))
        sql += f" WHERE t0.id IN ({sub.sql})" if op == "IN" else f" WHERE EXISTS ({sub.sql})"
        reads |= sub.reads
    return Query(sql, reads)


@st.composite
def query(draw: st.DrawFn, dialect: str, depth: int, ctes: frozenset[str] = frozenset()) -> Query:
    shape = draw(st.sampled_from(["select", "union", "with"] if depth > 0 else ["select"]))
    if shape == "select":
        return draw(select(dialect, depth, ctes))
    if shape == "union":
        left = draw(select(dialect, depth - 1, ctes))
        right = draw(select(dialect, depth - 1, ctes))
        return Query(f"{left.sql} UNION {right.sql}", left.reads | right.reads)
    # WITH: each CTE sees the ones before it; its name may shadow a table name.
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=2, unique=True))
    defs, reads, visible = [], frozenset[str](), ctes
    for name in names:
        written, canon = spell(draw, name, dialect)
        body = draw(query(dialect, depth - 1, visible))
        defs.append(f"{written} AS ({body.sql})")
        reads |= body.reads
        visible = visible | {canon}
    main = draw(select(dialect, depth - 1, visible))
    return Query(f"WITH {', '.join(defs)} {main.sql}", reads | main.reads)


@FUZZ
@given(st.data())
def test_generated_selects_never_read_a_table_off_the_list(data: st.DataObject) -> None:
    dialect = data.draw(st.sampled_from(DIALECTS))
    q = data.draw(query(dialect, depth=3))
    try:
        verdict = POLICIES[dialect].check(q.sql)
    except SqlDenied as err:
        first = (err.errors or [{}])[0]
        if dialect == "sqlite" and (
            "circular reference" in first["detail"]
            or "multiple references to recursive table" in first["detail"]
            or first["kind"] == "recursive"
        ):
            # SQLite: a CTE that names itself (in any letter case) is recursive, or an error
            # SQLite raises itself, RECURSIVE or not; denied either way
            return
        # Denied only because a table off the list is read (nothing else is wrong in them).
        assert not q.reads <= set(ALLOWED), (q, err.errors)
        assert first["kind"] == "table", (q, err.errors)
    else:
        if dialect == "sqlite":
            # SQLite never compiles a CTE that is not used, so it reads (and checks) only the
            # tables a statement really reaches: never one off the list.
            assert set(verdict.tables) <= set(ALLOWED), (q, verdict)
            return
        assert q.reads <= set(ALLOWED), (q, verdict)
        assert set(verdict.tables) == set(q.reads)


# --- denied columns ------------------------------------------------------------------------------

# (select item over alias t, whether it reaches customers.ssn when t is customers)
ITEMS = [
    ("t.id", False),
    ("t.name", False),
    ("id", False),
    ("count(*)", False),
    ("t.ssn", True),
    ("ssn", True),
    ("lower(t.ssn)", True),
    ("t.*", True),
    ("*", True),
    ("t", True),
]


@FUZZ
@given(
    st.sampled_from(DIALECTS),
    st.booleans(),
    st.sampled_from(["customers", "orders"]),
    st.lists(st.sampled_from(ITEMS), min_size=1, max_size=3),
    st.sampled_from(["select", "where", "derived", "cte", "exists"]),
    st.booleans(),
)
def test_denied_column_is_never_reached(
    dialect: str, schema: bool, table: str, items: list[tuple[str, bool]], shape: str, shout: bool
) -> None:
    if dialect != "postgres":
        items = [i for i in items if i[0] != "t"] or [("t.id", False)]  # whole rows: PostgreSQL
    if shout:  # unquoted names are case-insensitive (MySQL: column names on every platform)
        items = [(i.upper(), reach) for i, reach in items]
        if dialect == "mysql":  # ... but not MySQL table aliases (T is not t: denied, unknown)
            items = [(i.replace("T.", "t."), reach) for i, reach in items]
    listed = ", ".join(i for i, _ in items)
    leaks = table == "customers" and any(reach for _, reach in items)
    if shape == "where":
        reaching = [i for i, reach in items if reach and not i.endswith("*")]
        listed = "t.id"
        cond = reaching[0] if reaching else "t.id"
        sql = f"SELECT {listed} FROM {table} t WHERE {cond} IS NOT NULL"
        leaks = table == "customers" and bool(reaching)
    elif shape == "derived":
        sql = f"SELECT * FROM (SELECT {listed} FROM {table} t) AS w"
    elif shape == "cte":
        sql = f"WITH w AS (SELECT {listed} FROM {table} t) SELECT * FROM w"
    elif shape == "exists":
        sql = f"SELECT 1 AS one WHERE EXISTS (SELECT {listed} FROM {table} t)"
        # EXISTS (SELECT * ...) outputs nothing; anything else named is still read.
        leaks = table == "customers" and any(reach and i != "*" for i, reach in items)
        if dialect != "mysql":  # the database checks every column * expands to, even here
            leaks = table == "customers" and any(reach for _, reach in items)
    else:
        sql = f"SELECT {listed} FROM {table} t"
    policy = GUARDED[(dialect, schema)]
    try:
        policy.check(sql)
    except SqlDenied as err:
        assert leaks, (sql, err.errors)
        assert (err.errors or [{}])[0]["kind"] == "column"
    else:
        assert not leaks, sql
