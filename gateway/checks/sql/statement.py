"""The checks of one parsed statement: a thin driver running the rule families in order.

1. ``rules.statements``: what the root is;
2. one walk over every node below it: nested statements, commands, INTO, locks, variables
   (``rules.statements``) and functions (``rules.functions``);
3. ``rules.tables``, then ``rules.columns`` over sqlglot's scopes;
4. ``rules.limit``.

Each stage raises its violations together (``Refusal``), so a denial lists every problem of
the first stage that found one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.optimizer.scope import traverse_scope

from gateway.checks.sql.limits import MAX_TREE_DEPTH
from gateway.checks.sql.rules import columns, functions, limit, statements, tables
from gateway.checks.sql.violations import Denial, Refusal, Violation, locate, refuse_if_any

if TYPE_CHECKING:
    from gateway.checks.sql.parsing import Parsed
    from gateway.checks.sql.policy import SqlPolicy


@dataclass(slots=True)
class _StatementResult:
    kinds: set[str]
    tables: set[str]
    columns: set[str]
    missing_limit: bool


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


class _StatementCheck:
    """One statement being checked: what the rules read, and what they found (the verdict)."""

    def __init__(self, policy: SqlPolicy, parsed: Parsed, text: str, root: exp.Expr) -> None:
        self.policy = policy
        self.parsed = parsed
        self.text = text
        self.root = root
        self.dialect = policy.dialect
        self.kinds: set[str] = set()
        self.tables: set[str] = set()
        self.columns: set[str] = set()

    def where(self, node: exp.Expr | None) -> dict[str, Any]:
        return locate(self.text, node)

    def run(self) -> _StatementResult:
        statements.check_root(self)
        self._check_nodes()
        tree = self.root  # normalised when parsed; nothing below changes it
        try:
            scopes = traverse_scope(tree)
        except SqlglotError:
            raise Refusal.of(
                Denial.UNCHECKED, "the SQL's sources could not be resolved", "scope"
            ) from None
        real = tables.check_tables(self, tree)
        columns.check_columns(self, tree, scopes, real)
        missing = limit.check_limit(self)
        return _StatementResult(self.kinds, self.tables, self.columns, missing)

    def _check_nodes(self) -> None:
        """One walk over every node: nested statements, INTO, locks, variables, functions."""
        violations: list[Violation] = []
        stack: list[tuple[exp.Expr, int]] = [(self.root, 0)]
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
            if node is not self.root:
                problem = self._node_problem(node)
                if problem is not None:
                    violations.append(problem)
        refuse_if_any(violations)

    def _node_problem(self, node: exp.Expr) -> Violation | None:
        category = _NODE_CATEGORY.get(type(node))
        if category is None:
            category = _NODE_CATEGORY.setdefault(type(node), _categorize(type(node)))
        if category is _Category.OTHER:
            return None  # most nodes: identifiers, literals, operators, clauses
        if category is _Category.FUNCTION:
            assert isinstance(node, exp.Func)
            return functions.function_problem(self, node)
        return statements.inspect_problem(self, node)
