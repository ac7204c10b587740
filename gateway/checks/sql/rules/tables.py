"""The tables a statement names: each one on the rule's list, CTEs told apart by SQL's scoping.

``find_all(exp.Table)`` also yields CTE names and table functions. A name is a CTE only where
SQL's scoping makes that CTE visible (a CTE body sees the CTEs before it; an INSERT/UPDATE/
DELETE target is always a table), compared after normalising identifiers the way the database
does (otherwise ``WITH "Customers" AS (...) SELECT * FROM Customers`` reads the real
``customers`` table in PostgreSQL while looking like the CTE). Table functions are functions.

Table names match ``tables`` exactly after normalisation: ``public.orders`` is not ``orders``
(the search_path decides what an unqualified name means) unless ``default_schema: public``
says they are the same table. System catalogs need ``allow: [system_catalogs]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlglot import exp

from gateway.checks.sql.names import TableName, is_catalog
from gateway.checks.sql.options import SqlFamily
from gateway.checks.sql.violations import Denial, Violation, at, refuse_if_any

if TYPE_CHECKING:
    from gateway.checks.sql.statement import Statement


def check_tables(statement: Statement, tree: exp.Expr) -> list[exp.Table]:
    """Every table named is allowed; returns the real tables (not CTE references)."""
    rules = statement.rules
    real: list[exp.Table] = []
    violations: list[Violation] = []
    for table in tree.find_all(exp.Table):
        if _is_cte_reference(table):
            continue  # a reference to a CTE, whose own body is checked where it is defined
        this = table.this
        if isinstance(this, exp.Func):
            continue  # a table function: checked as a function
        if isinstance(this, exp.Parameter | exp.Placeholder) and isinstance(table.parent, exp.Into):
            continue  # INTO @variable: refused (or allowed) as INTO
        where = statement.where(table)
        alias = table.args.get("alias")
        if isinstance(alias, exp.TableAlias) and not isinstance(alias.this, exp.Identifier | None):
            violations.append(
                Violation(
                    Denial.PARSE,
                    f"the alias of {table.name}{at(where)} is not a name (MySQL refuses it)",
                    alias.sql(dialect=statement.dialect)[:80],
                    **where,
                )
            )
            continue
        if not isinstance(this, exp.Identifier):
            violations.append(
                Violation(
                    Denial.TABLE,
                    f"the source {table.sql(dialect=statement.dialect)[:80]}{at(where)} is not "
                    "a plain table name",
                    table.sql(dialect=statement.dialect)[:80],
                    **where,
                )
            )
            continue
        name = TableName(table.catalog, table.db, table.name)
        canon = rules.canonical(name)
        if is_catalog(name, statement.dialect):
            if SqlFamily.SYSTEM_CATALOGS in rules.allow:
                real.append(table)
                statement.tables.add(str(name))
                continue
            violations.append(
                Violation(
                    Denial.CATALOG,
                    f"the system catalog {name}{at(where)} is not allowed",
                    str(name),
                    **where,
                )
            )
            continue
        if canon not in rules.tables:
            violations.append(
                Violation(
                    Denial.TABLE,
                    f"the table {name}{at(where)} is not in the rule's tables "
                    f"({', '.join(sorted(str(t) for t in rules.tables))})",
                    str(name),
                    **where,
                )
            )
            continue
        real.append(table)
        statement.tables.add(str(canon))
    refuse_if_any(violations)
    return real


def _is_cte_reference(table: exp.Table) -> bool:
    """True when ``table`` names a CTE visible where it stands (SQL's lexical scoping).

    Only a FROM/JOIN/USING source can be a CTE: an INSERT/UPDATE/DELETE/DDL target always
    names a real table. A CTE body sees the CTEs before it, and itself WITH RECURSIVE.
    Identifiers are already normalised, so names compare as the database compares them.
    """
    if table.args.get("db") or table.args.get("catalog"):
        return False
    if not (isinstance(table.parent, exp.From | exp.Join) or table.arg_key == "using"):
        return False
    name = table.name
    child: exp.Expr = table
    node = table.parent
    while node is not None:
        if isinstance(node, exp.With):
            if isinstance(child, exp.CTE):
                # The strictest reading across databases: the CTEs before this one, and this
                # one itself under WITH RECURSIVE. (PostgreSQL also sees later CTEs under
                # RECURSIVE, MySQL resolves them as tables: treated as tables here, which can
                # only deny more.)
                ctes = node.expressions
                index = next(i for i, c in enumerate(ctes) if c is child)
                visible = ctes[: index + 1] if node.args.get("recursive") else ctes[:index]
                if any(c.alias == name for c in visible):
                    return True
        else:
            with_ = node.args.get("with_")
            if isinstance(with_, exp.With) and with_ is not child:
                if any(c.alias == name for c in with_.expressions):
                    return True
        child, node = node, node.parent
    return False
