"""Denied columns, however a statement reaches them.

sqlglot's ``qualify`` is quadratic in the length of AND/OR chains (2,000 terms take seconds),
so columns are resolved here, over sqlglot's scopes, in linear time. Refused: a denied column
anywhere (select list, alias, function argument, WHERE, GROUP/ORDER BY, JOIN), ``*`` or ``t.*``
over its table (also inside derived tables and CTEs), a whole-row reference
(``SELECT c FROM customers c``, ``(c).ssn``), column aliases on its table
(``customers AS c(a, b, c, s)``), ``NATURAL JOIN`` and ``USING`` comparing it, an INSERT
writing it, and every column of that name whose table cannot be told for sure (no schema, or
ambiguous).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from sqlglot import exp
from sqlglot.optimizer.scope import Scope, walk_in_scope

from gateway.checks.sql.names import TableName, column_key
from gateway.checks.sql.violations import Denial, Violation, at, refuse_if_any

if TYPE_CHECKING:
    from gateway.checks.sql.statement import Statement

_Sources = Mapping[str, exp.Table | Scope]


def check_columns(
    statement: Statement, tree: exp.Expr, scopes: list[Scope], real: list[exp.Table]
) -> None:
    """No denied column is read or written; records the columns that could be resolved."""
    denied_any = bool(statement.rules.deny_columns)
    owner = _owners(scopes)
    # Sources seen by nodes outside any scope (the body of an INSERT/UPDATE/DELETE).
    top: dict[str, exp.Table | Scope] = {t.alias_or_name: t for t in real}
    violations = _column_aliases(statement, real) if denied_any else []
    for node in tree.walk():
        if isinstance(node, exp.Column):
            if isinstance(node.this, exp.Star):
                if denied_any:
                    violations.extend(_star(statement, node, owner.get(id(node)), top))
                continue
            problem = _column(statement, node, owner.get(id(node)), top, denied_any)
            if problem is not None:
                violations.append(problem)
        elif isinstance(node, exp.Star) and denied_any:
            if isinstance(node.parent, exp.Column | exp.Count):
                continue  # t.* is handled with its column; COUNT(*) reads no column
            if _under_exists(node):
                continue  # EXISTS (SELECT * ...) returns no column
            violations.extend(_star(statement, node, owner.get(id(node)), top))
        elif isinstance(node, exp.Join) and denied_any:
            violations.extend(_join(statement, node, owner.get(id(node)), top))
        elif isinstance(node, exp.Insert) and denied_any:
            violations.extend(_insert(statement, node))
    refuse_if_any(violations)


def _owners(scopes: list[Scope]) -> dict[int, Scope]:
    """The scope of each column, star and join (by id): the first whose own walk reaches it."""
    owner: dict[int, Scope] = {}
    for scope in scopes:
        for node in walk_in_scope(scope.expression):
            if isinstance(node, exp.Column | exp.Star | exp.Join):
                owner.setdefault(id(node), scope)
    return owner


def _column_aliases(statement: Statement, real: list[exp.Table]) -> list[Violation]:
    """FROM customers AS c(a, b, c, s) renames ssn: its new name is not denied."""
    out: list[Violation] = []
    for table in real:
        alias = table.args.get("alias")
        if isinstance(alias, exp.TableAlias) and alias.columns and _denied_for(statement, table):
            out.append(
                Violation(
                    Denial.COLUMN,
                    f"{table.name} has denied column(s) and cannot be given column "
                    f"aliases ({alias.sql(dialect=statement.dialect)[:80]})",
                    alias.name or table.name,
                    **statement.where(alias),
                )
            )
    return out


def _denied_for(statement: Statement, table: exp.Table) -> frozenset[str]:
    name = TableName(table.catalog, table.db, table.name)
    return statement.rules.deny_columns.get(statement.rules.canonical(name), frozenset())


def _schema_for(statement: Statement, table: exp.Table) -> frozenset[str] | None:
    name = TableName(table.catalog, table.db, table.name)
    return statement.rules.schema.get(statement.rules.canonical(name))


def _denied_anywhere(statement: Statement, name: str) -> bool:
    return name in statement.rules.denied_names


def _chain(scope: Scope | None, top: _Sources) -> Iterator[_Sources]:
    while scope is not None:
        yield scope.sources
        scope = scope.parent
    yield top


def _lookup(alias: str, scope: Scope | None, top: _Sources) -> exp.Table | Scope | None:
    for sources in _chain(scope, top):
        if alias in sources:
            return sources[alias]
    return None


def _column(
    statement: Statement,
    column: exp.Column,
    scope: Scope | None,
    top: _Sources,
    denied_any: bool,
) -> Violation | None:
    name = column_key(column.name, statement.dialect)
    if column.table:
        source = _lookup(column.table, scope, top)
        if isinstance(source, exp.Table) and isinstance(source.this, exp.Identifier):
            table = statement.rules.canonical(TableName(source.catalog, source.db, source.name))
            statement.columns.add(f"{table}.{name}")
            if name in _denied_for(statement, source):
                where = statement.where(column)
                return Violation(
                    Denial.COLUMN,
                    f"the column {source.name}.{name}{at(where)} is denied by the rule",
                    f"{source.name}.{name}",
                    **where,
                )
            return None
        if source is None and denied_any and _denied_anywhere(statement, name):
            where = statement.where(column)
            return Violation(
                Denial.COLUMN,
                f"the column {column.table}.{name}{at(where)} cannot be resolved to a "
                "table, and a column of that name is denied",
                f"{column.table}.{name}",
                **where,
            )
        return None
    if scope is not None and len(scope.sources) == 1:
        only = next(iter(scope.sources.values()))
        if isinstance(only, exp.Table) and isinstance(only.this, exp.Identifier):
            table = statement.rules.canonical(TableName(only.catalog, only.db, only.name))
            statement.columns.add(f"{table}.{name}")
    if not denied_any:
        return None
    # A table or alias used as a value is the whole row (PostgreSQL: SELECT c FROM t c),
    # unless the table has a column of that name, which PostgreSQL prefers.
    source = _lookup(name, scope, top)
    if (
        isinstance(source, exp.Table)
        and _denied_for(statement, source)
        and name not in (_schema_for(statement, source) or ())
    ):
        where = statement.where(column)
        return Violation(
            Denial.COLUMN,
            f"{name}{at(where)} refers to whole rows of {source.name}, which include a "
            "denied column",
            name,
            **where,
        )
    if not _denied_anywhere(statement, name):
        return None
    for candidate in _candidates(statement, name, scope, top):
        if name in _denied_for(statement, candidate):
            where = statement.where(column)
            return Violation(
                Denial.COLUMN,
                f"the column {name}{at(where)} may be {candidate.name}.{name}, which is "
                "denied by the rule",
                f"{candidate.name}.{name}",
                **where,
            )
    return None


def _candidates(
    statement: Statement, name: str, scope: Scope | None, top: _Sources
) -> Iterator[exp.Table]:
    """Real tables an unqualified column could come from, innermost scope first.

    A level where some source certainly has the column ends the search (the database stops
    there too); otherwise outer levels are searched as well (correlated references).
    """
    for sources in _chain(scope, top):
        certain = False
        for source in sources.values():
            if isinstance(source, Scope):
                outputs = _outputs(source, statement.dialect)
                if outputs is not None and name in outputs:
                    certain = True
                continue
            if not isinstance(source.this, exp.Identifier):
                continue
            columns = _schema_for(statement, source)
            if columns is None:
                yield source  # unknown columns: it may have this one
            elif name in columns:
                certain = True
                yield source
        if certain:
            return


def _star(
    statement: Statement, star: exp.Expr, scope: Scope | None, top: _Sources
) -> list[Violation]:
    where = statement.where(star)
    if isinstance(star, exp.Column) and star.table:
        found = _lookup(star.table, scope, top)
        covered = [found] if found is not None else list(top.values())
    else:
        sources = scope.sources if scope is not None else top
        covered = list(sources.values())
    out: list[Violation] = []
    for source in covered:
        if isinstance(source, exp.Table) and _denied_for(statement, source):
            denied = ", ".join(sorted(_denied_for(statement, source)))
            out.append(
                Violation(
                    Denial.COLUMN,
                    f"* over {source.name}{at(where)} includes the denied column(s) "
                    f"{denied}; name the columns instead",
                    f"{source.name}.*",
                    **where,
                )
            )
    return out


def _join(
    statement: Statement, join: exp.Join, scope: Scope | None, top: _Sources
) -> list[Violation]:
    sources = scope.sources if scope is not None else top
    guarded = [
        s for s in sources.values() if isinstance(s, exp.Table) and _denied_for(statement, s)
    ]
    if not guarded:
        return []
    out: list[Violation] = []
    if str(join.args.get("method") or "").upper() == "NATURAL":
        out.append(
            Violation(
                Denial.COLUMN,
                f"NATURAL JOIN compares every same-named column, including the denied "
                f"column(s) of {guarded[0].name}; join ON named columns instead",
                "natural join",
                **statement.where(join.this),
            )
        )
    for ident in join.args.get("using") or []:
        name = column_key(ident.name, statement.dialect)
        for table in guarded:
            if name in _denied_for(statement, table):
                out.append(
                    Violation(
                        Denial.COLUMN,
                        f"JOIN ... USING ({name}) compares the denied column {table.name}.{name}",
                        f"{table.name}.{name}",
                        **statement.where(ident),
                    )
                )
    return out


def _insert(statement: Statement, insert: exp.Insert) -> list[Violation]:
    target = insert.this
    names: list[exp.Expr] | None = None
    if isinstance(target, exp.Schema):
        names = list(target.expressions)
        target = target.this
    if not isinstance(target, exp.Table):
        return []
    denied = _denied_for(statement, target)
    if not denied:
        return []
    if names is None:
        return [
            Violation(
                Denial.COLUMN,
                f"an INSERT into {target.name} without a column list writes its denied "
                "column(s); list the columns",
                f"{target.name}.*",
                **statement.where(target),
            )
        ]
    return [
        Violation(
            Denial.COLUMN,
            f"the INSERT writes the denied column {target.name}.{n.name}",
            f"{target.name}.{n.name}",
            **statement.where(n),
        )
        for n in names
        if column_key(n.name, statement.dialect) in denied
    ]


def _under_exists(star: exp.Expr) -> bool:
    """True for the bare * of a query that is the operand of EXISTS."""
    select = star.parent
    if not isinstance(select, exp.Select) or not any(e is star for e in select.expressions):
        return False
    parent = select.parent
    while isinstance(parent, exp.Subquery | exp.Paren):
        parent = parent.parent
    return isinstance(parent, exp.Exists)


def _outputs(scope: Scope, dialect: str) -> frozenset[str] | None:
    """Column names a derived table or CTE exposes, or None when unknown (a star)."""
    if scope.outer_columns:
        return frozenset(column_key(c, dialect) for c in scope.outer_columns)
    expression = scope.expression
    names = getattr(expression, "named_selects", None)
    if not isinstance(names, list) or "*" in names:
        return None
    selects = getattr(expression, "selects", [])
    if any(isinstance(s, exp.Star) or (isinstance(s, exp.Column) and s.is_star) for s in selects):
        return None
    return frozenset(column_key(n, dialect) for n in names)
