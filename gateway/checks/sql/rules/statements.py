"""What a statement is, and what it contains: statement kinds, commands, INTO, locks, variables.

Statements sqlglot does not model (``SET ROLE``, ``DO $$..$$``, ``CALL``, ``VACUUM``,
``LOCK TABLE``, ``EXPLAIN ANALYZE ...``) parse to an opaque ``exp.Command``: exactly the
allowed statement classes are accepted at the root, nothing else. Data-modifying statements
hide in CTEs (``WITH x AS (DELETE ...)``), so every node is looked at, not just the root.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlglot import exp

from gateway.checks.sql.options import SqlFamily, SqlKind
from gateway.checks.sql.violations import Denial, Refusal, Violation, at

if TYPE_CHECKING:
    from gateway.checks.sql.statement import Statement

# Statement classes that may be allowed, by kind. exp.Insert is also a DDL subclass in sqlglot.
_KIND_OF: dict[type[exp.Expr], SqlKind] = {
    exp.Insert: SqlKind.INSERT,
    exp.Update: SqlKind.UPDATE,
    exp.Delete: SqlKind.DELETE,
    exp.Merge: SqlKind.MERGE,
    exp.Create: SqlKind.CREATE,
    exp.Drop: SqlKind.DROP,
    exp.Alter: SqlKind.ALTER,
    exp.TruncateTable: SqlKind.TRUNCATE,
}
QUERY_ROOTS = (exp.Select, exp.SetOperation, exp.Subquery)

# Utility statements that are never allowed, wherever they appear. Looked up by name so a
# class missing from another sqlglot version is simply skipped; anything else that is a DDL or
# DML subclass without a kind (exp.Copy is a DML) is caught by the isinstance test below.
_UTILITY_NAMES = (
    "Command", "Set", "Pragma", "Copy", "Grant", "Revoke", "Analyze", "Use", "Transaction",
    "Commit", "Rollback", "Attach", "Detach", "Kill", "Refresh", "Cache", "Uncache", "LoadData",
    "Summarize", "Describe", "Show", "Comment", "Install", "Execute", "Declare", "Export",
    "Semicolon",
)  # fmt: skip
_UTILITY: tuple[type[exp.Expr], ...] = tuple(
    c for c in (getattr(exp, n, None) for n in _UTILITY_NAMES) if isinstance(c, type)
)

# Node classes ``inspect_problem`` has something to say about (the driver asks only for these).
INSPECTED: tuple[type[exp.Expr], ...] = (
    *_UTILITY,
    *_KIND_OF,
    exp.DDL,
    exp.DML,
    exp.Into,
    exp.Lock,
    exp.SessionParameter,
    exp.PropertyEQ,
    exp.Subquery,
    exp.Select,
)


def check_root(statement: Statement) -> None:
    """The statement itself is one of the allowed kinds (a query is a SELECT)."""
    root = statement.root
    if isinstance(root, exp.Command):
        name = str(root.this or "command").upper()
        raise Refusal.of(
            Denial.COMMAND,
            f"{name} is a statement the gateway cannot inspect (sqlglot keeps its body "
            "opaque); it is never allowed",
            name.lower(),
        )
    if isinstance(root, _UTILITY):
        raise Refusal.of(
            Denial.COMMAND,
            f"a {root.key.upper()} statement is never allowed through this rule",
            root.key,
        )
    if isinstance(root, QUERY_ROOTS):
        if isinstance(root, exp.Subquery) and not isinstance(root.unnest(), exp.Query):
            raise Refusal.of(Denial.STATEMENT, "the SQL is not a statement", root.key)
        kind = SqlKind.SELECT
        if isinstance(root, exp.Select) and not root.expressions:
            raise Refusal.of(Denial.PARSE, "a SELECT with nothing to select", "select")
    else:
        found = _KIND_OF.get(type(root))
        if found is None:
            raise Refusal.of(
                Denial.STATEMENT,
                f"the SQL is not a statement the rule can allow (it parses as "
                f"{type(root).__name__}); check the spelling of the keywords",
                root.key,
            )
        kind = found
    statement.kinds.add(kind.value)
    if kind not in statement.rules.statements:
        raise Refusal.of(
            Denial.STATEMENT,
            f"{kind.value.upper()} statements are not allowed by the rule "
            f"(allowed: {', '.join(sorted(statement.rules.statements))})",
            kind.value,
        )


def _empty_select(statement: Statement, node: exp.Select) -> Violation | None:
    """``SELECT FROM t``: sqlglot reads a select of nothing, the database refuses it."""
    if node.expressions:
        return None
    where = statement.where(node)
    return Violation(Denial.PARSE, f"a SELECT with nothing to select{at(where)}", "select", **where)


def _aliased_table(statement: Statement, node: exp.Subquery) -> Violation | None:
    """``FROM (a JOIN b) AS j``: a derived table with no select list, whose alias would
    stand for every column of the tables inside (and which MySQL refuses)."""
    if isinstance(node.this, exp.Query) or not node.args.get("alias"):
        return None
    where = statement.where(node)
    return Violation(
        Denial.PARSE,
        f"an alias on a parenthesized table or join{at(where)}: MySQL does not accept it; "
        "name the tables inside instead",
        "(...) AS",
        **where,
    )


def inspect_problem(statement: Statement, node: exp.Expr) -> Violation | None:
    """A node below the root that is a statement, INTO, a locking clause or a variable."""
    allow = statement.rules.allow
    if isinstance(node, exp.Subquery):
        return _aliased_table(statement, node)
    if isinstance(node, exp.Select):
        return _empty_select(statement, node)
    if isinstance(node, _UTILITY):  # exp.Command is one of them
        where = statement.where(node)
        return Violation(
            Denial.COMMAND,
            f"a {node.key.upper()} statement inside the SQL{at(where)} is never allowed",
            node.key,
            **where,
        )
    kind = _KIND_OF.get(type(node))
    if kind is not None:
        statement.kinds.add(kind.value)
        if kind in statement.rules.statements:
            return None
        where = statement.where(node)
        return Violation(
            Denial.STATEMENT,
            f"a {kind.value.upper()} nested inside the statement (in a CTE or a "
            f"subquery){at(where)} is not allowed by the rule",
            kind.value,
            **where,
        )
    if isinstance(node, exp.DDL | exp.DML):
        where = statement.where(node)
        return Violation(
            Denial.COMMAND,
            f"a {node.key.upper()} inside the SQL{at(where)} is never allowed",
            node.key,
            **where,
        )
    if isinstance(node, exp.Into) and SqlFamily.INTO not in allow:
        where = statement.where(node.this)
        return Violation(
            Denial.INTO,
            f"SELECT ... INTO{at(where)} writes a table or variables; it is not allowed "
            "(allow: [into] opts in)",
            "into",
            **where,
        )
    if isinstance(node, exp.Lock) and SqlFamily.LOCKING not in allow:
        return Violation(
            Denial.LOCK,
            "a locking clause (FOR UPDATE / FOR SHARE / LOCK IN SHARE MODE) is not allowed "
            "(allow: [locking] opts in)",
            "lock",
        )
    if SqlFamily.VARIABLES not in allow and (
        isinstance(node, exp.SessionParameter)
        or (isinstance(node, exp.PropertyEQ) and isinstance(node.this, exp.Parameter))
    ):
        where = statement.where(node.this)
        return Violation(
            Denial.VARIABLE,
            f"a server or session variable{at(where)} is not allowed (allow: [variables] opts in)",
            node.sql(dialect=statement.dialect)[:80],
            **where,
        )
    return None
