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

Seen = tuple[int, str | None, str | None]  # an action's code and names, without db and trigger
# An action judged: its violation, and the table, column and statement kind it adds to the
# reading (None: none).
Judged = tuple[Violation | None, str | None, str | None, str | None]
_JUDGED_MAX = 4096  # actions remembered judged per policy (then forgotten all at once)


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
        self._judged: tuple[SqlRules | None, dict[Seen, Judged]] = (None, {})

    def judged(self, rules: SqlRules) -> dict[Seen, Judged]:
        """The actions already judged under ``rules`` (the policy this database is for): a
        judgement depends on the action and the rules alone. Bounded; replaced whole when
        other rules ask (one pair, swapped at once: safe between threads)."""
        owner, memo = self._judged
        if owner is not rules or len(memo) >= _JUDGED_MAX:
            memo = {}
            self._judged = (rules, memo)
        return memo

    def compile(self, text: str) -> tuple[list[Seen], str | None]:
        """Compile ``EXPLAIN <text>``; (every action authorized, without its database and
        trigger names, SQLite's error or None).

        ``"multiple"`` is returned as the error when more than one statement is present.
        """
        actions: list[Seen] = []
        append = actions.append
        compiled = _COMPILED
        ok, deny = sqlite3.SQLITE_OK, sqlite3.SQLITE_DENY

        def authorize(
            code: int, a: str | None, b: str | None, db: str | None, trigger: str | None
        ) -> int:
            append((code, a, b))
            return ok if code in compiled else deny

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
    shape = tok.outline(text)
    if shape.end < 0:
        raise Refusal.of(Denial.EMPTY, "the SQL has no statement (only comments or ';')")
    if shape.joins > rules.max_joins:
        raise Refusal.of(
            Denial.COMPLEX,
            f"the SQL joins more than {rules.max_joins} times (max_joins); each join "
            "multiplies what the database may have to read",
            "joins",
        )
    first = tok.first_keyword(text)
    if first in _LEADING_COMMANDS:
        raise Refusal.of(
            Denial.COMMAND, f"a {first} statement is never allowed", (first or "").lower()
        )
    actions, error = scratch.compile(text)
    seen = list(dict.fromkeys(actions))
    if error is not None:
        raise _compile_error(rules, error, seen)
    violations, reading = _judge_and_read(rules, scratch, seen)
    if (shape.natural or shape.using) and _names_guarded_table(rules, text):
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
        _limit(rules, text, shape, reading)
    return reading


def _judge_one(rules: SqlRules, code: int, a: str | None, b: str | None) -> Judged:
    """One action against the policy: its violation, and the table, the column and the
    statement kind it adds to the reading (None when it adds none)."""
    problem = _action_problem(rules, code, a, b)
    table = (a or "").lower()
    named = column = None
    if code == sqlite3.SQLITE_READ or code in _KIND_OF_ACTION:
        canon = _table_name(rules, table)
        if canon in rules.tables:
            named = str(canon)
            if code == sqlite3.SQLITE_READ and b:
                column = f"{canon}.{b.lower()}"
    kind = _KIND_OF_ACTION.get(code) or _DDL_ACTIONS.get(code)
    value = kind.value if kind is not None and not table.startswith("sqlite_") else None
    return problem, named, column, value


def _judge_and_read(
    rules: SqlRules, scratch: SqliteScratch, actions: list[Seen]
) -> tuple[list[Violation], Reading]:
    """Every action (each once) against the policy: the violations found, and the tables,
    columns and statement kinds of the actions SQLite authorized. Each action is judged once
    per policy (``SqliteScratch.judged``): the same action is judged the same every time."""
    memo = scratch.judged(rules)
    violations: list[Violation] = []
    reading = Reading()
    for action in actions:
        judged = memo.get(action)
        if judged is None:
            judged = memo[action] = _judge_one(rules, *action)
        problem, table, column, kind = judged
        if problem is not None:
            violations.append(problem)
        if table is not None:
            reading.tables.add(table)
        if column is not None:
            reading.columns.add(column)
        if kind is not None:
            reading.kinds.add(kind)
    return violations, reading


def _names_guarded_table(rules: SqlRules, text: str) -> bool:
    """A word naming a table with denied columns (NATURAL and USING over it are refused).

    SQLite does not report the columns such a join compares, nor a joined table none of whose
    columns is otherwise read; any word naming a guarded table counts (conservative)."""
    if not rules.deny_columns:
        return False
    guarded = {t.name.lower() for t in rules.deny_columns}
    for token in tok.iter_code_tokens(text):
        if token.kind is tok.Kind.NAME:
            name = token.text[1:-1] if token.quoted else token.text
            if name.lower() in guarded:
                return True
    return False


_DECIMAL = re.compile(r"[0-9]+")
_HEXADECIMAL = re.compile(r"0[xX][0-9a-fA-F]+")


def _literal(token: tok.Token) -> int | None:
    if token.kind is not tok.Kind.NUMBER:
        return None
    digits = token.text
    if _DECIMAL.fullmatch(digits):
        return int(digits)
    if _HEXADECIMAL.fullmatch(digits):
        return int(digits, 16)
    return None


def _limit(rules: SqlRules, text: str, shape: tok.Outline, reading: Reading) -> None:
    """The outermost query's LIMIT (``shape.limit_start``, -1: none): a literal integer no
    larger than ``max_limit``."""
    maximum = rules.max_limit
    if tok.outside_comments_and_strings(text, shape.end):
        reading.end = shape.end
    if maximum is None:
        return
    if shape.limit_start < 0:
        reading.missing_limit = True
        return
    clause = tok.tokens_to_end(text, shape.limit_end, shape.end)  # the tokens after LIMIT
    count: tok.Token | None = None
    if len(clause) == 1:
        count = clause[0]
    elif (
        len(clause) == 3 and tok.keyword(clause[1]) == "OFFSET" and _literal(clause[2]) is not None
    ):
        count = clause[0]
    elif len(clause) == 3 and clause[1].text == "," and _literal(clause[0]) is not None:
        count = clause[2]
    shown = text[shape.limit_start : shape.end][:40]
    confirmed = tok.outside_comments_and_strings(text, shape.limit_start) and reading.end >= 0
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
