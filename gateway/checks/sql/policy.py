"""``SqlPolicy``: one rule's compiled ``sql:`` settings, and the check of a text against them.

``check`` measures the text, parses it (``parsing``), runs the checks of each statement
(``statement``) and remembers the verdict per text in a bounded cache. Any unexpected error
while checking denies the call (``Denial.UNCHECKED``).

Regenerating SQL can change its meaning, so the checked text itself is forwarded; an appended
LIMIT is added to the text and the new text is parsed and checked again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from sqlglot import exp

from gateway.checks.sql import parsing
from gateway.checks.sql.cache import _Lru
from gateway.checks.sql.lexing import _raw_text_problems
from gateway.checks.sql.limits import (
    CACHE_MAX_TEXT,
    MAX_SQL_LENGTH,
    MAX_STATEMENTS,
    VERDICT_CACHE_CHARS,
    VERDICT_CACHE_SIZE,
)
from gateway.checks.sql.names import (
    TableName,
    _is_catalog,
    column_key,
    parse_column_name,
    parse_function_name,
    parse_identifier,
    parse_table_name,
)
from gateway.checks.sql.options import DEFAULT_FUNCTIONS, DIALECTS, SqlFamily, SqlKind
from gateway.checks.sql.statement import _StatementCheck
from gateway.checks.sql.violations import Denial, _Refusal
from gateway.errors import SqlDenied

logger = logging.getLogger("capgate.checks.sql")


@dataclass(frozen=True, slots=True)
class SqlVerdict:
    """What an allowed SQL text does, and the exact text to forward."""

    sql: str  # the text that was checked: the original, or the original plus ' LIMIT n'
    kinds: tuple[str, ...]  # statement kinds found, root and nested (sorted)
    tables: tuple[str, ...]  # real tables read or written (sorted, normalised)
    columns: tuple[str, ...]  # table.column references that could be resolved (best effort)
    rewritten: bool = False  # True when a LIMIT was appended (add_limit)


@dataclass(frozen=True, eq=False)
class SqlPolicy:
    """A compiled ``sql:`` policy. Build it with ``SqlPolicy.create``; ``check`` is thread-safe.

    Security parameters come from the policy file only, never from the call.
    """

    dialect: str
    tables: frozenset[TableName]  # canonical (default_schema filled in)
    statements: frozenset[SqlKind] = frozenset({SqlKind.SELECT})
    max_statements: int = 1
    default_schema: str | None = None
    schema: Mapping[TableName, frozenset[str]] = field(default_factory=dict)
    deny_columns: Mapping[TableName, frozenset[str]] = field(default_factory=dict)
    denied_names: frozenset[str] = frozenset()  # every denied column name, for a quick test
    functions: frozenset[str] = DEFAULT_FUNCTIONS
    max_limit: int | None = None
    add_limit: bool = False
    allow: frozenset[SqlFamily] = frozenset()
    max_length: int = MAX_SQL_LENGTH
    rule_id: str | None = None
    _verdicts: _Lru[str, SqlVerdict | _Refusal] = field(
        default_factory=lambda: _Lru(VERDICT_CACHE_SIZE, VERDICT_CACHE_CHARS), repr=False
    )

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        dialect: str,
        *,
        tables: Iterable[str],
        statements: Iterable[str] = ("select",),
        max_statements: int = 1,
        default_schema: str | None = None,
        schema: Mapping[str, Iterable[str]] | None = None,
        deny_columns: Iterable[str] = (),
        functions: Iterable[str] = (),
        max_limit: int | None = None,
        add_limit: bool = False,
        allow: Iterable[str] = (),
        max_length: int = MAX_SQL_LENGTH,
        rule_id: str | None = None,
    ) -> SqlPolicy:
        """Build a policy from plain values; raise ValueError naming the first bad one."""
        if dialect not in DIALECTS:
            raise ValueError(f"dialect: expected one of {list(DIALECTS)}, got {dialect!r}")
        kinds = frozenset(SqlKind(s) for s in statements)
        if not kinds:
            raise ValueError("statements: at least one statement kind is required")
        if not 1 <= max_statements <= MAX_STATEMENTS:
            raise ValueError(f"max_statements: must be between 1 and {MAX_STATEMENTS}")
        families = frozenset(SqlFamily(a) for a in allow)
        default = parse_identifier(default_schema, dialect) if default_schema else None

        def canon(t: TableName) -> TableName:
            return TableName(t.catalog, t.db or default or "", t.name)

        allowed = frozenset(canon(parse_table_name(t, dialect)) for t in tables)
        if not allowed:
            raise ValueError("tables: at least one table is required")
        if SqlFamily.SYSTEM_CATALOGS not in families:
            for t in allowed:
                if _is_catalog(t, dialect):
                    raise ValueError(
                        f"tables: {str(t)!r} is a system catalog; add system_catalogs to allow"
                    )
        columns: dict[TableName, frozenset[str]] = {}
        for name, cols in (schema or {}).items():
            columns[canon(parse_table_name(name, dialect))] = frozenset(
                column_key(parse_identifier(c, dialect), dialect) for c in cols
            )
        denied: dict[TableName, set[str]] = {}
        for text in deny_columns:
            table, column = parse_column_name(text, dialect)
            table, column = canon(table), column_key(column, dialect)
            if table not in allowed:
                raise ValueError(f"deny_columns: {text!r} names a table that is not in tables")
            if table in columns and column not in columns[table]:
                raise ValueError(
                    f"deny_columns: {text!r}: the schema of {str(table)!r} has no such column"
                )
            denied.setdefault(table, set()).add(column)
        if max_limit is not None and max_limit < 1:
            raise ValueError("max_limit: must be at least 1")
        if add_limit and max_limit is None:
            raise ValueError("add_limit: needs max_limit")
        if not 1 <= max_length <= MAX_SQL_LENGTH:
            raise ValueError(f"max_length: must be between 1 and {MAX_SQL_LENGTH}")
        return cls(
            dialect=dialect,
            tables=allowed,
            statements=kinds,
            max_statements=max_statements,
            default_schema=default,
            schema=MappingProxyType(columns),
            deny_columns=MappingProxyType({t: frozenset(c) for t, c in denied.items()}),
            denied_names=frozenset(c for cols in denied.values() for c in cols),
            functions=DEFAULT_FUNCTIONS | {parse_function_name(f) for f in functions},
            max_limit=max_limit,
            add_limit=add_limit,
            allow=families,
            max_length=max_length,
            rule_id=rule_id,
        )

    # -- the check -------------------------------------------------------------------------------

    def check(self, text: str) -> SqlVerdict:
        """The verdict for ``text``, or raise ``SqlDenied`` saying what was found and where."""
        if not isinstance(text, str):
            raise SqlDenied("the SQL must be a string", rule=self.rule_id)
        cacheable = len(text) <= CACHE_MAX_TEXT
        if cacheable:
            hit = self._verdicts.get(text)
            if hit is not None:
                if isinstance(hit, _Refusal):
                    raise hit.error(self.rule_id)
                return hit
        result: SqlVerdict | _Refusal
        try:
            result = self._evaluate(text, rewrite=self.add_limit)
        except _Refusal as refusal:
            result = refusal
        except RecursionError:
            result = _Refusal.of(Denial.DEPTH, "the SQL is nested too deeply to be checked")
        except Exception:  # fail closed: a bug or an unexpected input never allows the SQL
            logger.warning("the SQL check failed unexpectedly; the SQL is denied", exc_info=True)
            result = _Refusal.of(Denial.UNCHECKED, "the SQL could not be checked")
        if cacheable:
            self._verdicts.put(text, result, len(text))
        if isinstance(result, _Refusal):
            raise result.error(self.rule_id)
        return result

    def cache_info(self) -> dict[str, int]:
        """Hits and misses of this policy's verdict cache."""
        return self._verdicts.info()

    def _evaluate(self, text: str, *, rewrite: bool) -> SqlVerdict:
        if len(text) > self.max_length:
            raise _Refusal.of(
                Denial.SIZE, f"the SQL is longer than {self.max_length} characters", "length"
            )
        _raw_text_problems(text)
        parsed = parsing._parse(self.dialect, text)
        # Empty statements (';;', or '; -- note', which sqlglot returns as exp.Semicolon holding
        # the comment) run nothing; only real statements count.
        statements = [
            s for s in parsed.statements if s is not None and not isinstance(s, exp.Semicolon)
        ]
        if not statements:
            raise _Refusal.of(Denial.EMPTY, "the SQL has no statement (only comments or ';')")
        if len(statements) > self.max_statements:
            raise _Refusal.of(
                Denial.MULTIPLE,
                f"the SQL has {len(statements)} statements; the rule allows {self.max_statements}",
                str(len(statements)),
            )
        kinds: set[str] = set()
        tables: set[str] = set()
        columns: set[str] = set()
        missing_limit = False
        for statement in statements:
            result = _StatementCheck(self, parsed, text, statement).run()
            kinds |= result.kinds
            tables |= result.tables
            columns |= result.columns
            missing_limit = missing_limit or result.missing_limit
        if missing_limit:
            if not rewrite or len(statements) != 1:
                detail = f"the query has no LIMIT; the rule requires LIMIT <= {self.max_limit}"
                raise _Refusal.of(Denial.LIMIT, detail, "no limit")
            # Append to the checked text (never regenerate it), then check the new text whole.
            new_text = f"{text[: parsed.last_end + 1]} LIMIT {self.max_limit}"
            checked = self._evaluate(new_text, rewrite=False)
            return SqlVerdict(
                sql=new_text,
                kinds=checked.kinds,
                tables=checked.tables,
                columns=checked.columns,
                rewritten=True,
            )
        return SqlVerdict(
            sql=text,
            kinds=tuple(sorted(kinds)),
            tables=tuple(sorted(tables)),
            columns=tuple(sorted(columns)),
        )

    # -- helpers used by the rules ---------------------------------------------------------------

    def canonical(self, table: TableName) -> TableName:
        return TableName(table.catalog, table.db or self.default_schema or "", table.name)
