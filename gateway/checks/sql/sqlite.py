"""SQLite: SQLite's own compiler decides what a statement reads, calls and does.

Each SQLite policy keeps a private, in-memory, schema-only database made from the rule's
``schema`` (every table, its columns; no rows). A text is compiled there as ``EXPLAIN <text>``
(compiled, never run) with an authorizer (``sqlite3.Connection.set_authorizer``) that receives
every action SQLite's compiler authorizes: each column read (``SQLITE_READ``, table and column,
also the columns ``*`` expands to), each function (``SQLITE_FUNCTION``), each write, and every
other action (PRAGMA, ATTACH, transactions, DDL...). The policy decides on that list; nothing
is read from a tokenizer of ours. The authorizer refuses every action other than reads,
function calls, SELECT and DML, so a PRAGMA whose effect happens while compiling never takes
effect in the private database.

What SQLite's authorizer does not report, and how it is covered:

- ``NATURAL JOIN`` and ``JOIN ... USING``: SQLite builds the join comparison without asking the
  authorizer; refused when the statement reads a table with denied columns.
- ``rowid`` of a table whose denied column might be its ``INTEGER PRIMARY KEY``: refused on
  tables with denied columns.
- statements that touch nothing (``VACUUM``): not a statement the rule can allow.

One statement only: Python's ``sqlite3`` refuses a text whose tail after the first statement is
anything but whitespace and comments (as the database driver behind the upstream does); it is
refused here too. The ``LIMIT`` of the outermost query is read from the trailing tokens, at
positions SQLite itself (``sqlite3_complete``) confirms are outside comments and strings.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.checks.sql import sqlite_tokens as tok
from gateway.checks.sql.names import TableName
from gateway.checks.sql.options import SqlFamily, SqlKind
from gateway.checks.sql.reading import Reading
from gateway.checks.sql.violations import Denial, Refusal, Violation, ranked, refuse_if_any

if TYPE_CHECKING:
    from gateway.checks.sql.settings import SqlRules

_KIND_OF_ACTION: dict[int, SqlKind] = {
    sqlite3.SQLITE_INSERT: SqlKind.INSERT,
    sqlite3.SQLITE_UPDATE: SqlKind.UPDATE,
    sqlite3.SQLITE_DELETE: SqlKind.DELETE,
}
_DDL_ACTIONS: dict[int, SqlKind] = {
    **dict.fromkeys(
        (
            sqlite3.SQLITE_CREATE_INDEX,
            sqlite3.SQLITE_CREATE_TABLE,
            sqlite3.SQLITE_CREATE_TEMP_INDEX,
            sqlite3.SQLITE_CREATE_TEMP_TABLE,
            sqlite3.SQLITE_CREATE_TEMP_TRIGGER,
            sqlite3.SQLITE_CREATE_TEMP_VIEW,
            sqlite3.SQLITE_CREATE_TRIGGER,
            sqlite3.SQLITE_CREATE_VIEW,
        ),
        SqlKind.CREATE,
    ),
    **dict.fromkeys(
        (
            sqlite3.SQLITE_DROP_INDEX,
            sqlite3.SQLITE_DROP_TABLE,
            sqlite3.SQLITE_DROP_TEMP_INDEX,
            sqlite3.SQLITE_DROP_TEMP_TABLE,
            sqlite3.SQLITE_DROP_TEMP_TRIGGER,
            sqlite3.SQLITE_DROP_TEMP_VIEW,
            sqlite3.SQLITE_DROP_TRIGGER,
            sqlite3.SQLITE_DROP_VIEW,
        ),
        SqlKind.DROP,
    ),
    sqlite3.SQLITE_ALTER_TABLE: SqlKind.ALTER,
}
_COMMAND_NAMES: dict[int, str] = {
    sqlite3.SQLITE_PRAGMA: "pragma",
    sqlite3.SQLITE_TRANSACTION: "transaction",
    sqlite3.SQLITE_ATTACH: "attach",
    sqlite3.SQLITE_DETACH: "detach",
    sqlite3.SQLITE_REINDEX: "reindex",
    sqlite3.SQLITE_ANALYZE: "analyze",
    sqlite3.SQLITE_CREATE_VTABLE: "create virtual table",
    sqlite3.SQLITE_DROP_VTABLE: "drop virtual table",
    sqlite3.SQLITE_SAVEPOINT: "savepoint",
}
# Actions with no effect while compiling: allowed to compile, then judged by the policy.
_COMPILED = frozenset(
    {
        sqlite3.SQLITE_SELECT,
        sqlite3.SQLITE_READ,
        sqlite3.SQLITE_FUNCTION,
        sqlite3.SQLITE_RECURSIVE,
        sqlite3.SQLITE_INSERT,
        sqlite3.SQLITE_UPDATE,
        sqlite3.SQLITE_DELETE,
    }
)
# Statements that SQLite would run as something else than what EXPLAIN <text> compiles.
_LEADING_COMMANDS = frozenset(
    {"EXPLAIN", "PRAGMA", "ATTACH", "DETACH", "VACUUM", "BEGIN", "COMMIT", "END", "ROLLBACK"}
    | {"SAVEPOINT", "RELEASE", "ANALYZE", "REINDEX"}
)
_ROWID_NAMES = frozenset({"rowid", "_rowid_", "oid"})
# Operators SQLite reports as functions: x LIKE y is like(y, x), x GLOB y is glob(y, x).
_OPERATORS = frozenset({"like", "glob"})

Action = tuple[int, str | None, str | None, str | None, str | None]
Seen = tuple[int, str | None, str | None]  # an action's code and names, without db and trigger


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class SqliteScratch:
    """The private schema-only database of one policy, and the compile of a text in it."""

    def __init__(self, schema: dict[TableName, frozenset[str]] | None) -> None:
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        for table, columns in sorted((schema or {}).items()):
            cols = ", ".join(_quote(c) for c in sorted(columns)) or '"_"'
            self._conn.execute(f"CREATE TABLE {_quote(table.name)} ({cols})")
        self.tables = frozenset(t.name.lower() for t in (schema or {}))

    def compile(self, text: str) -> tuple[list[Action], str | None]:
        """Compile ``EXPLAIN <text>``; (every action authorized, SQLite's error or None).

        ``"multiple"`` is returned as the error when more than one statement is present.
        """
        actions: list[Action] = []

        def authorize(
            code: int, a: str | None, b: str | None, db: str | None, trigger: str | None
        ) -> int:
            actions.append((code, a, b, db, trigger))
            return sqlite3.SQLITE_OK if code in _COMPILED else sqlite3.SQLITE_DENY

        callback: Callable[[int, str | None, str | None, str | None, str | None], int] = authorize
        with self._lock:
            self._conn.set_authorizer(callback)
            try:
                cursor = self._conn.execute("EXPLAIN " + text)
                cursor.close()
            except sqlite3.ProgrammingError as exc:
                message = str(exc)
                if "one statement at a time" in message:
                    return actions, "multiple"
                if "binding" not in message.lower():  # bindings are checked after compiling
                    return actions, message
            except sqlite3.Error as exc:
                return actions, str(exc)
            finally:
                self._conn.set_authorizer(None)
        return actions, None


_NO_SUCH = re.compile(r"no such (table|column|function): (.+)")


def _compile_error(rules: SqlRules, error: str, actions: list[Seen]) -> Refusal:
    """SQLite refused to compile the text: say why in the policy's words."""
    if error == "multiple":
        return Refusal.of(
            Denial.MULTIPLE,
            "the SQL has more than one statement; the rule allows one",
            "multiple",
        )
    if "not authorized" in error:
        found = _judge(rules, actions)
        if found:
            return ranked(found)
        return Refusal.of(Denial.COMMAND, "the statement is not one the rule can allow", "command")
    match = _NO_SUCH.match(error)
    if match is not None:
        what, name = match.group(1), match.group(2)
        if what == "function":
            return Refusal.of(
                Denial.FUNCTION,
                f"the function {name}() does not exist for the rule (SQLite: {error})",
                name.split("(")[0],
            )
        if what == "table":
            bare = name.rsplit(".", 1)[-1]
            kind = Denial.CATALOG if bare.lower().startswith("sqlite_") else Denial.TABLE
            return Refusal.of(kind, f"the table {name} is not in the rule's tables or schema", name)
        return Refusal.of(
            Denial.COLUMN, f"the column {name} is not in the rule's schema (SQLite: {error})", name
        )
    return Refusal.of(Denial.PARSE, f"the SQL is not valid SQLite: {error}", error[:80])


def _table_name(rules: SqlRules, name: str) -> TableName:
    return rules.canonical(TableName("", "", name.lower()))


def _judge(rules: SqlRules, actions: list[Seen]) -> list[Violation]:
    """Every action (each once: ``(code, a, b)`` as the authorizer gave them, without
    repeats) against the policy; the violations found."""
    out: list[Violation] = []
    for code, a, b in actions:
        problem = _action_problem(rules, code, a, b)
        if problem is not None:
            out.append(problem)
    return out


def _action_problem(rules: SqlRules, code: int, a: str | None, b: str | None) -> Violation | None:
    if code in _COMMAND_NAMES:
        name = _COMMAND_NAMES[code]
        return Violation(Denial.COMMAND, f"a {name.upper()} statement is never allowed", name)
    if code in _DDL_ACTIONS:
        kind = _DDL_ACTIONS[code]
        if kind in rules.statements:
            return None
        return _kind_refused(rules, kind)
    if code in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_RECURSIVE, sqlite3.SQLITE_FUNCTION):
        return _query_problem(rules, code, b)
    table = (a or "").lower()
    if table.startswith("sqlite_"):
        if SqlFamily.SYSTEM_CATALOGS in rules.allow and code == sqlite3.SQLITE_READ:
            return None
        return Violation(Denial.CATALOG, f"the system catalog {table} is not allowed", table)
    if code == sqlite3.SQLITE_READ:
        return _read_problem(rules, table, (b or "").lower())
    write = _KIND_OF_ACTION.get(code)
    if write is None:
        return Violation(Denial.COMMAND, "the statement is not one the rule can allow", str(code))
    if write not in rules.statements:
        return _kind_refused(rules, write)
    canon = _table_name(rules, table)
    if canon not in rules.tables:
        return Violation(Denial.TABLE, f"the table {table} is not in the rule's tables", table)
    if write is SqlKind.UPDATE and (b or "").lower() in rules.deny_columns.get(canon, ()):
        return Violation(
            Denial.COLUMN, f"the UPDATE writes the denied column {table}.{b}", f"{table}.{b}"
        )
    return None


def _query_problem(rules: SqlRules, code: int, name: str | None) -> Violation | None:
    """SELECT, a recursive CTE, a function call."""
    if code == sqlite3.SQLITE_SELECT:
        return None
    if code == sqlite3.SQLITE_RECURSIVE:
        if SqlFamily.RECURSIVE in rules.allow:
            return None
        return Violation(
            Denial.RECURSIVE,
            "a recursive CTE generates rows without a bound; it is not allowed "
            "(allow: [recursive] opts in)",
            "recursive",
        )
    function = (name or "").lower()
    if function in rules.functions or function in _OPERATORS:
        return None
    return Violation(
        Denial.FUNCTION,
        f"the function {function}() is not on the rule's list of allowed functions",
        function,
    )


def _kind_refused(rules: SqlRules, kind: SqlKind) -> Violation:
    allowed = ", ".join(sorted(rules.statements))
    return Violation(
        Denial.STATEMENT,
        f"{kind.value.upper()} statements are not allowed by the rule (allowed: {allowed})",
        kind.value,
    )


def _read_problem(rules: SqlRules, table: str, column: str) -> Violation | None:
    canon = _table_name(rules, table)
    if canon not in rules.tables:
        if canon not in rules.schema:
            return Violation(
                Denial.FUNCTION,
                f"the table function {table}() is not on the rule's list of allowed functions",
                table,
            )
        return Violation(Denial.TABLE, f"the table {table} is not in the rule's tables", table)
    denied = rules.deny_columns.get(canon, frozenset())
    if column in denied:
        return Violation(
            Denial.COLUMN, f"the column {table}.{column} is denied by the rule", f"{table}.{column}"
        )
    if denied and column in _ROWID_NAMES:
        return Violation(
            Denial.COLUMN,
            f"the rowid of {table} may be its denied column(s) ({', '.join(sorted(denied))})",
            f"{table}.rowid",
        )
    return None


def read(rules: SqlRules, scratch: SqliteScratch, text: str) -> Reading:
    """SQLite's reading of ``text`` under ``rules``; raise ``Refusal``."""
    tokens = tok.code_tokens(text)
    while tokens and tokens[-1].text == ";":
        tokens.pop()
    if not tokens:
        raise Refusal.of(Denial.EMPTY, "the SQL has no statement (only comments or ';')")
    shape = _shape(tokens)
    if shape.joins > rules.max_joins:
        raise Refusal.of(
            Denial.COMPLEX,
            f"the SQL joins more than {rules.max_joins} times (max_joins); each join "
            "multiplies what the database may have to read",
            "joins",
        )
    first = tok.keyword(tokens[0])
    if first in _LEADING_COMMANDS:
        raise Refusal.of(
            Denial.COMMAND, f"a {first} statement is never allowed", (first or "").lower()
        )
    actions, error = scratch.compile(text)
    seen = list(dict.fromkeys((code, a, b) for code, a, b, _db, _trigger in actions))
    if error is not None:
        raise _compile_error(rules, error, seen)
    violations = _judge(rules, seen)
    reading = _reading(rules, seen)
    if (shape.natural or shape.using) and _names_guarded_table(rules, tokens):
        violations.append(
            Violation(
                Denial.COLUMN,
                "NATURAL JOIN and JOIN ... USING compare columns SQLite does not report; they "
                "are not allowed over a table with denied columns (join ON named columns)",
                "natural join" if shape.natural else "using",
            )
        )
    if not reading.kinds:
        if not any(code == sqlite3.SQLITE_SELECT for code, *_ in seen):
            violations.append(
                Violation(Denial.COMMAND, "the statement is not one the rule can allow", "command")
            )
        reading.kinds.add(SqlKind.SELECT.value)
        if SqlKind.SELECT not in rules.statements:
            violations.append(_kind_refused(rules, SqlKind.SELECT))
    refuse_if_any(violations)
    if reading.kinds == {SqlKind.SELECT.value}:
        _limit(rules, text, tokens, shape.limit_at, reading)
    return reading


def _reading(rules: SqlRules, actions: list[Seen]) -> Reading:
    """The tables, columns and statement kinds of the actions SQLite authorized."""
    reading = Reading()
    names: dict[str, TableName] = {}
    for code, a, b in actions:
        table = (a or "").lower()
        if code == sqlite3.SQLITE_READ or code in _KIND_OF_ACTION:
            canon = names.get(table)
            if canon is None:
                canon = names[table] = _table_name(rules, table)
            if canon in rules.tables:
                reading.tables.add(str(canon))
                if code == sqlite3.SQLITE_READ and b:
                    reading.columns.add(f"{canon}.{b.lower()}")
        kind = _KIND_OF_ACTION.get(code) or _DDL_ACTIONS.get(code)
        if kind is not None and not table.startswith("sqlite_"):
            reading.kinds.add(kind.value)
    return reading


@dataclass(slots=True)
class _Shape:
    """What the statement's tokens say that SQLite's authorizer does not report."""

    joins: int = 0  # each JOIN, and each ',' between FROM items (at the FROM's depth)
    limit_at: int = -1  # index of the last LIMIT at bracket depth 0 (the outermost query's)
    natural: bool = False  # a NATURAL keyword
    using: bool = False  # a USING keyword


_CLAUSE_ENDS = frozenset(
    {"WHERE", "GROUP", "HAVING", "WINDOW", "ORDER", "LIMIT", "UNION", "EXCEPT", "INTERSECT"}
    | {"ON", "USING", "SELECT", "VALUES", "RETURNING", "SET"}
)


def _shape(tokens: list[tok.Token]) -> _Shape:
    """One pass over the tokens: joins, the outermost LIMIT, NATURAL and USING.

    Joins are counted on the tokens (SQLite's authorizer does not report joins); an
    over-count only refuses more."""
    shape = _Shape()
    from_depths: set[int] = set()
    depth = 0
    punct = tok.Kind.PUNCT
    name = tok.Kind.NAME
    for i, token in enumerate(tokens):
        kind = token.kind
        if kind is punct:
            text = token.text
            if text == "(":
                depth += 1
            elif text == ")":
                from_depths.discard(depth)
                depth -= 1
            elif text == "," and depth in from_depths:
                shape.joins += 1
            continue
        if kind is not name or token.quoted:
            continue
        word = token.text.upper()
        if word == "FROM":
            from_depths.add(depth)
        elif word == "JOIN":
            shape.joins += 1
        elif word == "NATURAL":
            shape.natural = True
        elif word in _CLAUSE_ENDS:
            from_depths.discard(depth)
            if word == "LIMIT" and depth == 0:
                shape.limit_at = i
            elif word == "USING":
                shape.using = True
    return shape


def _names_guarded_table(rules: SqlRules, tokens: list[tok.Token]) -> bool:
    """A word naming a table with denied columns (NATURAL and USING over it are refused).

    SQLite does not report the columns such a join compares, nor a joined table none of whose
    columns is otherwise read; any word naming a guarded table counts (conservative)."""
    if not rules.deny_columns:
        return False
    guarded = {t.name.lower() for t in rules.deny_columns}
    for token in tokens:
        if token.kind is tok.Kind.NAME:
            name = token.text[1:-1] if token.quoted else token.text
            if name.lower() in guarded:
                return True
    return False


def _literal(token: tok.Token) -> int | None:
    if token.kind is not tok.Kind.NUMBER:
        return None
    digits = token.text
    if re.fullmatch(r"[0-9]+", digits):
        return int(digits)
    if re.fullmatch(r"0[xX][0-9a-fA-F]+", digits):
        return int(digits, 16)
    return None


def _limit(rules: SqlRules, text: str, tokens: list[tok.Token], at: int, reading: Reading) -> None:
    """The outermost query's LIMIT (the token at ``at``, -1: none): a literal integer no
    larger than ``max_limit``."""
    maximum = rules.max_limit
    last = tokens[-1]
    if tok.outside_comments_and_strings(text, last.end):
        reading.end = last.end
    if maximum is None:
        return
    if at < 0:
        reading.missing_limit = True
        return
    clause = tokens[at + 1 :]
    count: tok.Token | None = None
    if len(clause) == 1:
        count = clause[0]
    elif (
        len(clause) == 3 and tok.keyword(clause[1]) == "OFFSET" and _literal(clause[2]) is not None
    ):
        count = clause[0]
    elif len(clause) == 3 and clause[1].text == "," and _literal(clause[0]) is not None:
        count = clause[2]
    shown = text[tokens[at].start : last.end][:40]
    confirmed = tok.outside_comments_and_strings(text, tokens[at].start) and reading.end >= 0
    value = _literal(count) if count is not None and confirmed else None
    if value is None:
        raise Refusal.of(
            Denial.LIMIT,
            f"{shown} is not LIMIT followed by a literal integer at the end of the query; the "
            f"rule requires LIMIT <= {maximum}",
            shown,
        )
    if value > maximum:
        raise Refusal.of(
            Denial.LIMIT,
            f"LIMIT {count.text if count else value} is above the rule's maximum of {maximum}",
            str(value),
        )
