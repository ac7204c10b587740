"""``Reading``: what a database's own reading of one SQL text says, for the policy to judge.

Each authority (``postgres``: PostgreSQL's parser; ``sqlite``: SQLite's compiler; the sqlglot
path for the other dialects) turns a text into a ``Reading`` or a ``Refusal``. The policy
decides what to forward from it: the text as received, or the text with ``LIMIT n`` appended
at ``end`` when the authority's own tokens show that the text ends there in code (outside a
comment and a string).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.checks.sql.violations import Denial, Refusal


@dataclass(slots=True)
class Reading:
    """The statement kinds, tables and columns a text reaches, and its outermost LIMIT."""

    kinds: set[str] = field(default_factory=set)
    tables: set[str] = field(default_factory=set)
    columns: set[str] = field(default_factory=set)
    statements: int = 1
    missing_limit: bool = False  # the outermost query has no LIMIT and the rule needs one
    end: int = -1  # offset just after the last token in code; -1: no safe place for a LIMIT


def count_statements(found: int, allowed: int) -> None:
    """Refuse a text of no statement, or of more than ``allowed`` (the rule's
    ``max_statements``), as every authority counts them."""
    if not found:
        raise Refusal.of(Denial.EMPTY, "the SQL has no statement (only comments or ';')")
    if found > allowed:
        raise Refusal.of(
            Denial.MULTIPLE,
            f"the SQL has {found} statements; the rule allows {allowed}",
            str(found),
        )


def refuse_blank(text: str) -> None:
    """Refuse a NUL, and a text of nothing but whitespace, before any authority reads it."""
    if "\x00" in text:
        raise Refusal.of(Denial.PARSE, "the SQL contains a NUL character", "\\x00")
    if not text.strip():
        raise Refusal.of(Denial.EMPTY, "the SQL is empty")
