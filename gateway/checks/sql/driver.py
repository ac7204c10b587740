"""(MySQL) sqlglot's reading of a text (``read``), and the checks of each parsed statement: a
thin driver running the rule families in order.

1. ``rules.statements``: what the root is;
2. one walk over every node below it: nested statements, commands, INTO, locks, variables
   (``rules.statements``) and functions (``rules.functions``);
3. ``rules.tables``, then ``rules.columns`` over sqlglot's scopes;
4. ``rules.limit``.

Each stage raises its violations together (``Refusal``), so a denial lists every problem of
the first stage that found one. What the rules find is recorded in the ``Statement``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.optimizer.scope import traverse_scope

from gateway.checks.sql import parsing
from gateway.checks.sql.lexing import lexer_key, raw_text_problems
from gateway.checks.sql.limits import MAX_TREE_DEPTH
from gateway.checks.sql.reading import Reading, count_statements
from gateway.checks.sql.rules import columns, functions, limit, statements, tables
from gateway.checks.sql.statement import Statement
from gateway.checks.sql.violations import Denial, Refusal, Violation, refuse_if_any

if TYPE_CHECKING:
    from gateway.checks.sql.settings import SqlRules


def read(rules: SqlRules, text: str) -> Reading:
    """sqlglot's reading of ``text`` for ``rules`` (MySQL): the raw markers refused, the text
    parsed once (``parsing``), and each statement checked (``check_statement``)."""
    raw_text_problems(text, rules.dialect)
    parsed = parsing.parse(lexer_key(rules.dialect, rules.sql_mode), text, rules.parameters)
    # Empty statements (';;', or '; -- note', which sqlglot returns as exp.Semicolon holding
    # the comment) run nothing; only real statements count.
    found = [s for s in parsed.statements if s is not None and not isinstance(s, exp.Semicolon)]
    count_statements(len(found), rules.max_statements)
    reading = Reading(statements=len(found), end=parsed.last_end + 1)
    for root in found:
        statement = Statement(rules, parsed, text, root)
        if check_statement(statement):
            reading.missing_limit = True
        reading.kinds |= statement.kinds
        reading.tables |= statement.tables
        reading.columns |= statement.columns
    return reading


class _Category(StrEnum):
    """Which rule has to look at a node class (computed once per class)."""

    OTHER = "other"
    FUNCTION = "function"
    INSPECT = "inspect"


def _categorize(cls: type[exp.Expr]) -> _Category:
    if issubclass(cls, exp.Func):
        return _Category.FUNCTION
    if issubclass(cls, statements.INSPECTED):
        return _Category.INSPECT
    return _Category.OTHER


_NODE_CATEGORY: dict[type[exp.Expr], _Category] = {}


def check_statement(statement: Statement) -> bool:
    """Run every rule family over ``statement``, recording what they find in it; raise
    ``Refusal``. True when the outermost query has no LIMIT and the rules require one."""
    statements.check_root(statement)
    _check_nodes(statement)
    tree = statement.root  # normalised when parsed; nothing below changes it
    try:
        scopes = traverse_scope(tree)
    except SqlglotError:
        raise Refusal.of(
            Denial.UNCHECKED, "the SQL's sources could not be resolved", "scope"
        ) from None
    real = tables.check_tables(statement, tree)
    columns.check_columns(statement, tree, scopes, real)
    return limit.check_limit(statement)


def _check_nodes(statement: Statement) -> None:
    """One walk over every node: nested statements, INTO, locks, variables, functions."""
    root = statement.root
    violations: list[Violation] = []
    stack: list[tuple[exp.Expr, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise Refusal.of(
                Denial.DEPTH,
                f"the SQL's syntax tree is deeper than {MAX_TREE_DEPTH} levels",
                "depth",
            )
        below = depth + 1
        for value in node.args.values():  # faster than iter_expressions()
            if isinstance(value, exp.Expr):
                stack.append((value, below))
            elif isinstance(value, list):
                stack.extend((v, below) for v in value if isinstance(v, exp.Expr))
        if node is not root:
            problem = _node_problem(statement, node)
            if problem is not None:
                violations.append(problem)
    refuse_if_any(violations)


def _node_problem(statement: Statement, node: exp.Expr) -> Violation | None:
    category = _NODE_CATEGORY.get(type(node))
    if category is None:
        category = _NODE_CATEGORY.setdefault(type(node), _categorize(type(node)))
    if category is _Category.OTHER:
        return None  # most nodes: identifiers, literals, operators, clauses
    if category is _Category.FUNCTION:
        assert isinstance(node, exp.Func)
        return functions.function_problem(statement, node)
    return statements.inspect_problem(statement, node)
