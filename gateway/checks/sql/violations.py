"""What a denial says: its category, what was found and where, and the ``SqlDenied`` it becomes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gateway.checks.sql.limits import MAX_ERRORS
from gateway.errors import SqlDenied, SqlTooComplex


class Denial(StrEnum):
    """Stable categories of a denial, carried as ``errors[i]["kind"]``."""

    SIZE = "size"  # too long, too many tokens or subscripts
    EMPTY = "empty"  # nothing but whitespace, comments or semicolons; an empty statement
    COMMENT = "comment"  # MySQL executable comment, sqlglot comment directive
    DEPTH = "depth"  # nested too deeply
    PARSE = "parse"  # not valid SQL for the dialect, or lexed differently by the database
    MULTIPLE = "multiple"  # more statements than max_statements
    STATEMENT = "statement"  # a kind not in statements (anywhere), or not a statement at all
    COMMAND = "command"  # SET, COPY, PRAGMA, ATTACH, SHOW, transactions, exp.Command, ...
    INTO = "into"  # SELECT ... INTO
    LOCK = "lock"  # FOR UPDATE / FOR SHARE
    VARIABLE = "variable"  # @@system variables, @user := assignments
    FUNCTION = "function"  # a function not allowed (also table functions, qualified names)
    CATALOG = "catalog"  # a system catalog
    TABLE = "table"  # a table not in tables
    COLUMN = "column"  # a denied column, reached in any way, or a column that cannot be told
    LIMIT = "limit"  # LIMIT missing, not a literal integer, or above max_limit
    UNCHECKED = "unchecked"  # the check itself failed: denied
    COMPLEX = "complex"  # past the bounds on nodes, joins or check time (sql_too_complex)
    RECURSIVE = "recursive"  # a recursive CTE, unless the rule allows them


# Categories reported with reason sql_too_complex (a SqlDenied, status 403).
_TOO_COMPLEX = frozenset({Denial.SIZE, Denial.DEPTH, Denial.COMPLEX})

# Order in which violations of one statement are reported (errors[0] is the first).
_PRIORITY = {
    kind: i
    for i, kind in enumerate(
        (
            Denial.COMMAND,
            Denial.STATEMENT,
            Denial.INTO,
            Denial.LOCK,
            Denial.VARIABLE,
            Denial.RECURSIVE,
            Denial.FUNCTION,
            Denial.CATALOG,
            Denial.TABLE,
            Denial.COLUMN,
            Denial.LIMIT,
        )
    )
}


@dataclass(frozen=True, slots=True)
class Violation:
    kind: Denial
    detail: str
    found: str
    line: int | None = None
    col: int | None = None
    order: int = 1 << 60  # source offset, for a stable report order

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "found": self.found, "detail": self.detail}
        if self.line is not None:
            out["line"] = self.line
            out["col"] = self.col
        return out


class Refusal(Exception):
    """Internal: the SQL is denied; converted to a fresh ``SqlDenied`` per call (cacheable)."""

    def __init__(self, violations: list[Violation]) -> None:
        super().__init__(violations[0].detail)
        self.violations = violations

    @classmethod
    def of(cls, kind: Denial, detail: str, found: str = "", **where: Any) -> Refusal:
        return cls([Violation(kind, detail, found or kind.value, **where)])

    def error(self, rule_id: str | None) -> SqlDenied:
        first = self.violations[0]
        detail = first.detail
        if len(self.violations) > 1:
            detail += f" (and {len(self.violations) - 1} more problem(s), listed in errors)"
        cls = SqlTooComplex if first.kind in _TOO_COMPLEX else SqlDenied
        return cls(
            detail,
            rule=rule_id,
            errors=[v.as_dict() for v in self.violations[:MAX_ERRORS]],
        )


def ranked(violations: list[Violation]) -> Refusal:
    """A refusal listing every violation, the most important first, then in source order."""
    violations.sort(key=lambda v: (_PRIORITY.get(v.kind, 99), v.order))
    return Refusal(violations)


def refuse_if_any(violations: list[Violation]) -> None:
    """Refuse with every violation found, the most important first, then in source order."""
    if violations:
        raise ranked(violations)


# --- where in the text ----------------------------------------------------------------------------


def position(text: str, offset: int) -> dict[str, Any]:
    """line and col (1-based) of a character offset, and the offset itself for ordering."""
    line = text.count("\n", 0, offset) + 1
    col = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return {"line": line, "col": col, "order": offset}


def at(where: dict[str, Any]) -> str:
    return f" at line {where['line']}, column {where['col']}" if where else ""
