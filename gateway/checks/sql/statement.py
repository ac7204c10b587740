"""One statement under check: what the rule families read, and what they found.

A ``Statement`` holds the rules it is held to (``SqlRules``), the text and its parse, the
statement's tree, and the statement kinds, tables and columns the rules record as they go;
``where`` places a node in the text for a denial. The rule families (``rules/``) take a
``Statement`` and know nothing above it; ``driver`` runs them in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlglot import exp

from gateway.checks.sql.violations import position

if TYPE_CHECKING:
    from gateway.checks.sql.parsing import Parsed
    from gateway.checks.sql.settings import SqlRules


class Statement:
    """One statement being checked: what the rules read, and what they found (the verdict)."""

    __slots__ = ("rules", "parsed", "text", "root", "dialect", "kinds", "tables", "columns")

    def __init__(self, rules: SqlRules, parsed: Parsed, text: str, root: exp.Expr) -> None:
        self.rules = rules
        self.parsed = parsed  # the whole text's parse (quoted identifiers by offset)
        self.text = text
        self.root = root  # this statement's tree
        self.dialect = rules.dialect
        self.kinds: set[str] = set()  # statement kinds found, root and nested
        self.tables: set[str] = set()  # real tables read or written (normalised)
        self.columns: set[str] = set()  # table.column references that could be resolved

    def where(self, node: exp.Expr | None) -> dict[str, Any]:
        """line/col/order of ``node`` in the text, for a violation (empty when unknown)."""
        return locate(self.text, node)


def locate(text: str, node: exp.Expr | None) -> dict[str, Any]:
    """line/col/order of a node, from its own source offset or that of its first identifier."""
    for candidate in (node, getattr(node, "this", None)):
        if isinstance(candidate, exp.Expr):
            start = candidate.meta.get("start")
            if isinstance(start, int) and 0 <= start < len(text):
                return position(text, start)
    return {}
