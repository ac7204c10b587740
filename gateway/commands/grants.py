"""``capgate policy grants``: the database privileges that mirror a rule's ``sql:`` policy.

The SQL check is the first wall; the database role behind the upstream is the second. This
prints what that role should be given, from the rule's own settings, so the two say the same:

PostgreSQL
    ``GRANT USAGE`` on each table's schema; per allowed table and allowed statement kind, a
    column-level ``GRANT SELECT (cols)`` (``INSERT``, ``UPDATE`` likewise; ``DELETE`` is
    table-wide) naming the rule's ``schema`` columns minus ``deny_columns``; a whole-table
    grant only where the rule lists no columns and denies none. Functions: PostgreSQL lets
    PUBLIC execute every function; the output revokes, from PUBLIC, the built-in functions
    outside the rule's list that a read-only role could still misuse (sleeping, locking,
    notifying, running a query given as text, changing a setting such as
    ``statement_timeout``), and every function outside the list in the database's own
    schemas (extensions such as dblink install there), now and by default for new ones.
    Finally the role's ``statement_timeout`` and read-only default.
SQLite
    SQLite has no users and no GRANT. The equivalent printed is a separate database file that
    holds only the allowed columns (copied from the full one, re-run to refresh), opened
    read-only by the upstream; or, in the upstream's own code, an authorizer that denies the
    reads capgate denies. Both are said plainly, as comments, beside the script.

A table whose columns the rule does not list, but of which it denies some, cannot be granted
column by column: it is left out with a comment, and the command exits 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.checks.sql import SqlBodyCheck, SqlKind, SqlPolicy, TableName
from gateway.checks.sql.names import quote_identifier
from gateway.policy.model import Policy, Rule

EXIT_INCOMPLETE = 1

_TIMEOUT = re.compile(r"[0-9]{1,9}(ms|s|min|h)")

PG_RISKY_FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("pg_sleep", "double precision"),
    ("pg_sleep_for", "interval"),
    ("pg_sleep_until", "timestamp with time zone"),
    ("set_config", "text, text, boolean"),
    ("pg_notify", "text, text"),
    ("pg_advisory_lock", "bigint"),
    ("pg_advisory_xact_lock", "bigint"),
    ("pg_advisory_lock_shared", "bigint"),
    ("query_to_xml", "text, boolean, boolean, text"),
    ("query_to_xmlschema", "text, boolean, boolean, text"),
    ("query_to_xml_and_xmlschema", "text, boolean, boolean, text"),
    ("cursor_to_xml", "refcursor, integer, boolean, boolean, text"),
)
"""Built-in functions PUBLIC may execute that a read-only role could misuse: hold a
connection (sleep, advisory locks), reach other sessions (notify), run a query given as text,
or change its own session's settings (``set_config('statement_timeout', '0', false)``)."""

PG_SYSTEM_SCHEMAS = ("pg_catalog", "information_schema")


class GrantsError(ValueError):
    """Raised when no single SQL rule of the dialect can be chosen from the policy."""


@dataclass
class Grants:
    """The printed script and whether it covers everything the rule allows."""

    lines: list[str] = field(default_factory=list)
    complete: bool = True

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def sql_rules(policy: Policy, dialect: str) -> list[tuple[Rule, SqlPolicy]]:
    """The rules of ``policy`` with a ``sql:`` check of ``dialect``, in file order."""
    found = []
    for role in policy.roles.values():
        for rule in role.rules:
            for check in rule.checks:
                if isinstance(check, SqlBodyCheck) and check.policy.dialect == dialect:
                    found.append((rule, check.policy))
    return found


def choose_rule(policy: Policy, dialect: str, rule_id: str | None) -> tuple[Rule, SqlPolicy]:
    rules = sql_rules(policy, dialect)
    if rule_id is not None:
        for rule, sql in rules:
            if rule.id == rule_id:
                return rule, sql
        raise GrantsError(f"no rule {rule_id!r} with a {dialect} sql: check in the policy")
    if len(rules) == 1:
        return rules[0]
    if not rules:
        raise GrantsError(f"the policy has no rule with a {dialect} sql: check")
    names = ", ".join(rule.id for rule, _ in rules)
    raise GrantsError(f"several rules check {dialect} SQL ({names}): name one with --rule")


def pg_ident(name: str) -> str:
    return quote_identifier(name, "postgres")


def _pg_table(table: TableName) -> str:
    return ".".join(pg_ident(part) for part in table if part)


def _columns(sql: SqlPolicy, table: TableName) -> list[str] | None:
    """The columns the role may use in ``table`` (sorted), or None for the whole table;
    raise ``LookupError`` when the rule denies some but does not list them all."""
    listed = sql.schema.get(table)
    denied = sql.deny_columns.get(table, frozenset())
    if listed is None:
        if denied:
            raise LookupError(table)
        return None
    return sorted(c for c in listed if c not in denied)


def postgres_grants(rule: Rule, sql: SqlPolicy, role: str, statement_timeout: str = "5s") -> Grants:
    out = Grants()
    grantee = pg_ident(role)
    say = out.lines.append
    say(f"-- capgate policy grants: rule {rule.id!r} ({rule.role}) as PostgreSQL role {role}")
    say("-- Run as the owner of the tables (and, for the functions, a superuser), in the")
    say("-- database the upstream connects to. The role must exist; e.g.:")
    say(f"--   CREATE ROLE {grantee} LOGIN PASSWORD '...';")
    say("-- PostgreSQL grants nothing on a table to a new role: only what follows is added.")
    schemas = sorted({t.db or sql.default_schema or "public" for t in sql.tables})
    for schema in schemas:
        say(f"GRANT USAGE ON SCHEMA {pg_ident(schema)} TO {grantee};")
    kinds = [k for k in (SqlKind.SELECT, SqlKind.INSERT, SqlKind.UPDATE) if k in sql.statements]
    for table in sorted(sql.tables):
        name = _pg_table(table)
        try:
            columns = _columns(sql, table)
        except LookupError:
            out.complete = False
            say(
                f"-- {table}: the rule denies some of its columns but does not list them "
                "under schema:, so no column grant can be made; list them to grant the rest"
            )
            continue
        for kind in kinds:
            privilege = kind.value.upper()
            if columns is None:
                say(f"GRANT {privilege} ON {name} TO {grantee};")
            elif columns:
                listed = ", ".join(pg_ident(c) for c in columns)
                say(f"GRANT {privilege} ({listed}) ON {name} TO {grantee};")
        if SqlKind.DELETE in sql.statements:
            say(f"GRANT DELETE ON {name} TO {grantee};")
    other = sorted(k.value for k in sql.statements if k not in (*kinds, SqlKind.DELETE))
    if other:
        say(f"-- statement kinds allowed but not granted here (grant by hand): {other}")
    _pg_functions(sql, grantee, say)
    say(f"ALTER ROLE {grantee} SET statement_timeout = '{statement_timeout}';")
    if sql.statements == frozenset({SqlKind.SELECT}):
        say(f"ALTER ROLE {grantee} SET default_transaction_read_only = on;")
    return out


def _pg_functions(sql: SqlPolicy, grantee: str, say: Callable[[str], None]) -> None:
    allowed = sorted(sql.functions)
    say("-- Functions: PostgreSQL lets PUBLIC execute every function, and a REVOKE from")
    say("-- PUBLIC holds for every role of this database: drop a line that another user")
    say(f"-- of it needs. {grantee} may call what the rule allows; these built-ins, outside")
    say("-- its list, are revoked:")
    for name, args in PG_RISKY_FUNCTIONS:
        if name not in sql.functions:
            say(f"REVOKE EXECUTE ON FUNCTION pg_catalog.{name}({args}) FROM PUBLIC;")
    say("-- ... and every function outside the list in this database's own schemas (where")
    say("-- extensions such as dblink install theirs), now and for functions made later:")
    names = ", ".join("'" + f.replace("'", "''") + "'" for f in allowed)
    system = ", ".join(f"'{s}'" for s in PG_SYSTEM_SCHEMAS)
    say("DO $capgate$ DECLARE f regprocedure; BEGIN")
    say("  FOR f IN SELECT p.oid::regprocedure FROM pg_proc p")
    say("      JOIN pg_namespace n ON n.oid = p.pronamespace")
    say(f"      WHERE n.nspname NOT IN ({system}) AND n.nspname NOT LIKE 'pg\\_%'")
    say(f"        AND p.proname <> ALL (ARRAY[{names}]::name[])")
    say("  LOOP EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f); END LOOP;")
    say("END $capgate$;")
    say("ALTER DEFAULT PRIVILEGES REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;")


def _sqlite_ident(name: str) -> str:
    return quote_identifier(name, "sqlite")


def sqlite_equivalent(rule: Rule, sql: SqlPolicy, role: str, source: str) -> Grants:
    out = Grants()
    say = out.lines.append
    say(f"-- capgate policy grants: rule {rule.id!r} ({rule.role}), SQLite, for {role}")
    say("-- SQLite has no users and no GRANT: whoever can open a database file can read all")
    say("-- of it. What follows is not a grant but its equivalent: a separate database file")
    say("-- that holds only the columns the rule allows, for the upstream to open read-only")
    say("-- (URI file:NAME.db?mode=ro, or PRAGMA query_only = ON). Run it with sqlite3 on a")
    say(f"-- new file; it copies from {source!r} (re-run it into a fresh file to refresh).")
    say("-- Or keep one file and, in the upstream's own code, install an authorizer")
    say("-- (sqlite3_set_authorizer) that answers SQLITE_DENY to SQLITE_READ of:")
    denied = sorted(f"{t.name}.{c}" for t, cols in sql.deny_columns.items() for c in cols)
    say(f"--   {', '.join(denied) if denied else '(no column is denied)'}")
    say("-- and to SQLITE_ATTACH, SQLITE_PRAGMA and every table not listed below.")
    quoted_source = "'" + source.replace("'", "''") + "'"
    say(f"ATTACH DATABASE {quoted_source} AS capgate_source;")
    for table in sorted(sql.tables):
        try:
            columns = _columns(sql, table)
        except LookupError:  # pragma: no cover (a SQLite rule always lists its schema)
            out.complete = False
            continue
        name = _sqlite_ident(table.name)
        listed = "*" if columns is None else ", ".join(_sqlite_ident(c) for c in columns)
        # S608: a script printed for a person; every name in it is quoted.
        say(f"CREATE TABLE main.{name} AS SELECT {listed} FROM capgate_source.{name};")  # noqa: S608
    say("DETACH DATABASE capgate_source;")
    return out


def print_grants(
    policy: Policy,
    *,
    dialect: str,
    role: str,
    rule_id: str | None = None,
    statement_timeout: str = "5s",
    source: str = "full.db",
) -> Grants:
    """The script for ``dialect``; raise ``GrantsError`` when no single rule is meant or a
    value would not be safe in the script."""
    if not role or any(ord(ch) < 0x20 or ch == "\x7f" for ch in role):
        raise GrantsError("--role: a database role name without control characters")
    if not _TIMEOUT.fullmatch(statement_timeout):
        raise GrantsError(
            f"--statement-timeout {statement_timeout!r}: expected e.g. 5s, 500ms, 2min"
        )
    if any(ord(ch) < 0x20 for ch in source):
        raise GrantsError("--source: a file name without control characters")
    rule, sql = choose_rule(policy, dialect, rule_id)
    if dialect == "postgres":
        return postgres_grants(rule, sql, role, statement_timeout)
    return sqlite_equivalent(rule, sql, role, source)
