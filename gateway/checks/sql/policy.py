"""``SqlPolicy``: one rule's compiled ``sql:`` settings, and the check of a text against them.

``SqlPolicy`` is the ``SqlRules`` that ``SqlSettings`` resolve to, with a rule id and a verdict
cache. ``check`` measures the text, has the dialect's authority read it (``sqlite``,
``postgres``, or sqlglot: ``driver.read``, loaded when the first policy of its dialect is
built) and remembers the verdict per text in a bounded cache. Any unexpected error while
checking denies the call (``Denial.UNCHECKED``).

Regenerating SQL can change its meaning, so the checked text itself is forwarded; an appended
LIMIT is added to the text and the new text is parsed and checked again.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

from gateway.checks.sql import sqlite
from gateway.checks.sql.cache import Lru
from gateway.checks.sql.limits import (
    CACHE_MAX_TEXT,
    CHECK_BACKSTOP_SECONDS,
    DEFAULT_MAX_JOINS,
    MAX_SQL_LENGTH,
    OFFLOAD_MIN_CHARS,
    SHAPE_CACHE_CHARS,
    SHAPE_CACHE_SIZE,
    VERDICT_CACHE_CHARS,
    VERDICT_CACHE_SIZE,
)
from gateway.checks.sql.reading import Reading, refuse_blank
from gateway.checks.sql.settings import SqlRules, SqlSettings
from gateway.checks.sql.violations import Denial, Refusal
from gateway.errors import SqlDenied

logger = logging.getLogger("capgate.checks.sql")


class _Authorities:
    """The readers of the dialects whose authority is not SQLite (whose module is small):
    PostgreSQL's parser (``postgres``, pglast) and sqlglot (``driver``, MySQL). Each is imported
    when the first policy of its dialect is built, so a policy loads only its own; a call reads
    the module from here (an attribute, no import)."""

    __slots__ = ("postgres", "sqlglot")

    def __init__(self) -> None:
        self.postgres: ModuleType | None = None
        self.sqlglot: ModuleType | None = None

    def load(self, dialect: str) -> None:
        if dialect == "postgres" and self.postgres is None:
            self.postgres = importlib.import_module("gateway.checks.sql.postgres")
        elif dialect not in ("postgres", "sqlite") and self.sqlglot is None:
            self.sqlglot = importlib.import_module("gateway.checks.sql.driver")


_AUTHORITIES = _Authorities()


@dataclass(frozen=True, slots=True)
class SqlVerdict:
    """What an allowed SQL text does, and the exact text to forward."""

    sql: str  # the text that was checked: the original, or the original plus ' LIMIT n'
    kinds: tuple[str, ...]  # statement kinds found, root and nested (sorted)
    tables: tuple[str, ...]  # real tables read or written (sorted, normalised)
    columns: tuple[str, ...]  # table.column references that could be resolved (best effort)
    rewritten: bool = False  # True when a LIMIT was appended (add_limit)


@dataclass(frozen=True, eq=False)
class SqlPolicy(SqlRules):
    """A compiled ``sql:`` policy. Build it with ``SqlPolicy.create``; ``check`` is thread-safe.

    Security parameters come from the policy file only, never from the call.
    """

    rule_id: str | None = None
    _verdicts: Lru[str, SqlVerdict | Refusal] = field(
        default_factory=lambda: Lru(VERDICT_CACHE_SIZE, VERDICT_CACHE_CHARS), repr=False
    )
    _scratch: sqlite.SqliteScratch | None = field(default=None, repr=False)
    _shapes: Lru[bytes, Any] = field(
        default_factory=lambda: Lru(SHAPE_CACHE_SIZE, SHAPE_CACHE_CHARS), repr=False
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
        max_joins: int = DEFAULT_MAX_JOINS,
        server_version: int | None = None,
        standard_conforming_strings: bool | None = None,
        sql_mode: str | None = None,
        parameters: Iterable[str] = (),
        rule_id: str | None = None,
    ) -> SqlPolicy:
        """Build a policy from plain values; raise ``SqlSettingsError`` (a ValueError) naming
        the first bad one, with every problem found in its ``problems``."""
        settings = SqlSettings(
            dialect=dialect,
            tables=tuple(tables),
            statements=tuple(statements),
            max_statements=max_statements,
            default_schema=default_schema,
            schema=None if schema is None else {t: tuple(c) for t, c in schema.items()},
            deny_columns=tuple(deny_columns),
            functions=tuple(functions),
            max_limit=max_limit,
            add_limit=add_limit,
            allow=tuple(allow),
            max_length=max_length,
            max_joins=max_joins,
            server_version=server_version,
            standard_conforming_strings=standard_conforming_strings,
            sql_mode=sql_mode,
            parameters=tuple(parameters),
        )
        return cls.from_settings(settings, rule_id=rule_id)

    @classmethod
    def from_settings(cls, settings: SqlSettings, *, rule_id: str | None = None) -> SqlPolicy:
        """Build a policy from ``SqlSettings``; raise ``SqlSettingsError`` when they are bad."""
        rules = settings.resolve()
        _AUTHORITIES.load(rules.dialect)
        values = {f.name: getattr(rules, f.name) for f in fields(SqlRules)}
        scratch = sqlite.SqliteScratch(dict(rules.schema)) if rules.dialect == "sqlite" else None
        return cls(**values, rule_id=rule_id, _scratch=scratch)

    # -- the check -------------------------------------------------------------------------------

    def check(self, text: str) -> SqlVerdict:
        """The verdict for ``text``, or raise ``SqlDenied`` saying what was found and where."""
        if not isinstance(text, str):
            raise SqlDenied("the SQL must be a string", rule=self.rule_id)
        cacheable = len(text) <= CACHE_MAX_TEXT
        if cacheable:
            hit = self._verdicts.get(text)
            if hit is not None:
                if isinstance(hit, Refusal):
                    raise hit.error(self.rule_id)
                return hit
        result: SqlVerdict | Refusal
        learned: list[Any] = []  # shapes this check's readings would remember
        started = time.perf_counter()
        try:
            result = self._evaluate(text, rewrite=self.add_limit, learned=learned)
        except Refusal as refusal:
            result = refusal
        except RecursionError:
            result = Refusal.of(Denial.DEPTH, "the SQL is nested too deeply to be checked")
        except Exception as exc:  # fail closed: a bug or an unexpected input never allows it
            # Never the SQL, nor an exception's message or traceback (they may quote it).
            logger.warning(
                "the SQL check failed unexpectedly (%s); the SQL is denied", type(exc).__name__
            )
            result = Refusal.of(Denial.UNCHECKED, "the SQL could not be checked")
        if time.perf_counter() - started > CHECK_BACKSTOP_SECONDS:
            # The wall-clock backstop: never remembered (a loaded machine's stall must not
            # become the verdict for this text); what it would have allowed is refused.
            if isinstance(result, Refusal):
                raise result.error(self.rule_id)
            raise Refusal.of(
                Denial.COMPLEX,
                f"the SQL took longer than {CHECK_BACKSTOP_SECONDS} s to check",
                "time",
            ).error(self.rule_id)
        if cacheable:
            self._verdicts.put(text, result, len(text))
        if isinstance(result, Refusal):
            raise result.error(self.rule_id)
        for key, known, weight in learned:  # an allowed check within the backstop, only
            self._shapes.put(key, known, weight)
        return result

    def costly(self, text: str) -> bool:
        """Whether checking ``text`` may take long enough to belong off the event loop: it is
        at least ``OFFLOAD_MIN_CHARS`` long and its verdict is not cached."""
        return len(text) >= OFFLOAD_MIN_CHARS and text not in self._verdicts

    def cache_info(self) -> dict[str, int]:
        """Hits and misses of this policy's verdict cache."""
        return self._verdicts.info()

    def _evaluate(self, text: str, *, rewrite: bool, learned: list[Any]) -> SqlVerdict:
        if len(text) > self.max_length:
            raise Refusal.of(
                Denial.SIZE, f"the SQL is longer than {self.max_length} characters", "length"
            )
        refuse_blank(text)
        reading = self._read(text, learned)
        if reading.missing_limit:
            if not rewrite or reading.statements != 1 or reading.end < 0:
                detail = f"the query has no LIMIT; the rule requires LIMIT <= {self.max_limit}"
                if rewrite and reading.statements == 1:
                    detail += " (the text does not end in code, so none can be appended)"
                raise Refusal.of(Denial.LIMIT, detail, "no limit")
            # Append to the checked text (never regenerate it), then check the new text whole.
            new_text = f"{text[: reading.end]} LIMIT {self.max_limit}"
            checked = self._evaluate(new_text, rewrite=False, learned=learned)
            return SqlVerdict(
                sql=new_text,
                kinds=checked.kinds,
                tables=checked.tables,
                columns=checked.columns,
                rewritten=True,
            )
        return SqlVerdict(
            sql=text,
            kinds=tuple(sorted(reading.kinds)),
            tables=tuple(sorted(reading.tables)),
            columns=tuple(sorted(reading.columns)),
        )

    def _read(self, text: str, learned: list[Any]) -> Reading:
        """The authority's reading of ``text`` for this policy's dialect (PostgreSQL: a
        reading by a remembered shape, or one to remember in ``learned``)."""
        if self._scratch is not None:
            return sqlite.read(self, self._scratch, text)
        if self.dialect == "postgres":
            assert _AUTHORITIES.postgres is not None  # loaded when the policy was built
            read_pg: Callable[..., Reading] = _AUTHORITIES.postgres.read
            return read_pg(self, text, self._shapes, learned)
        assert _AUTHORITIES.sqlglot is not None
        read: Callable[[SqlRules, str], Reading] = _AUTHORITIES.sqlglot.read
        return read(self, text)
