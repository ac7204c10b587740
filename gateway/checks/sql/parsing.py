"""(MySQL) Tokens to trees: one parse per (lexer, text), identifiers normalised, in a bounded cache.

sqlglot parses ``""`` and ``";"`` to no statement without an error and ``SELEC * FRM t`` to
an alias expression; what the trees are is decided by the rules, not here. A parse error is a
denial with the positions sqlglot reports; a partial tree is never used.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, SqlglotError
from sqlglot.optimizer.normalize_identifiers import normalize_identifiers
from sqlglot.tokenizer_core import TokenType
from sqlglot.tokens import SQLGLOTC_INSTALLED

from gateway.checks.sql.cache import Lru
from gateway.checks.sql.lexing import DIALECT_OBJECTS, tokenize
from gateway.checks.sql.limits import (
    CACHE_MAX_TEXT,
    MAX_ERRORS,
    PARSE_CACHE_CHARS,
    PARSE_CACHE_SIZE,
)
from gateway.checks.sql.violations import Denial, Refusal, Violation

SQLGLOT_VERSION: str = importlib.metadata.version("sqlglot")
SQLGLOT_COMPILED: bool = bool(SQLGLOTC_INSTALLED)
"""True when the compiled ``sqlglotc`` build is active (same API, ~4-5x faster parsing)."""


@dataclass(frozen=True, slots=True)
class Parsed:
    """One text parsed by one dialect, identifiers normalised. Shared: never mutated."""

    statements: tuple[exp.Expr | None, ...]
    quoted: Mapping[int, str]  # source offset -> text of each quoted identifier token
    last_end: int  # offset of the last character of the last token that is not ';'


_PARSES: Lru[tuple[str, frozenset[str], str], Parsed | Refusal] = Lru(
    PARSE_CACHE_SIZE, PARSE_CACHE_CHARS
)


def cache_info() -> dict[str, Any]:
    """Counters of the shared parse cache, and which sqlglot build is active."""
    return {
        "parse": _PARSES.info(),
        "sqlglot": SQLGLOT_VERSION,
        "compiled": SQLGLOT_COMPILED,
    }


def clear_parse_cache() -> None:
    """Empty the shared parse cache (tests and benchmarks)."""
    _PARSES.clear()


def _parse_uncached(lexer: str, text: str, parameters: frozenset[str]) -> Parsed:
    tokens = tokenize(lexer, text, parameters)
    d = DIALECT_OBJECTS[lexer]
    dialect = lexer.partition(":")[0]
    try:
        statements = d.parser().parse(tokens, text)
        # Identifiers compared as the database compares them (PostgreSQL folds unquoted names
        # to lower case; SQLite ignores case). Done once here: the cached trees are read-only.
        for statement in statements:
            if statement is not None:
                normalize_identifiers(statement, dialect=d)
    except ParseError as exc:
        errors = [
            Violation(
                Denial.PARSE,
                f"the SQL is not valid {dialect}: {e.get('description') or 'syntax error'} "
                f"(line {e.get('line')}, column {e.get('col')})",
                str(e.get("highlight") or "")[:80] or "syntax",
                line=e.get("line"),
                col=e.get("col"),
            )
            for e in (exc.errors or [{}])[:MAX_ERRORS]
        ]
        raise Refusal(errors) from None
    quoted = {t.start: t.text for t in tokens if t.token_type is TokenType.IDENTIFIER}
    last = next(t for t in reversed(tokens) if t.token_type is not TokenType.SEMICOLON)
    return Parsed(tuple(statements), MappingProxyType(quoted), last.end)


def parse(lexer: str, text: str, parameters: frozenset[str] = frozenset()) -> Parsed:
    """Tokenize, measure and parse ``text`` once per (lexer, parameter forms, text), where
    ``lexer`` is a ``lexing.lexer_key`` (the dialect and its lexing modes); raise
    ``Refusal``."""
    cacheable = len(text) <= CACHE_MAX_TEXT
    key = (lexer, parameters, text)
    if cacheable:
        hit = _PARSES.get(key)
        if hit is not None:
            if isinstance(hit, Refusal):
                raise hit.with_traceback(None)
            return hit
    result: Parsed | Refusal
    try:
        result = _parse_uncached(lexer, text, parameters)
    except Refusal as refusal:
        result = refusal
    except RecursionError:
        result = Refusal.of(Denial.DEPTH, "the SQL is nested too deeply to be checked")
    if cacheable:
        _PARSES.put(key, result, len(text))
    if isinstance(result, Refusal):
        raise result.with_traceback(None)
    return result


def normalise_sql(text: str, dialect: str | None) -> str:
    """SQL as sqlglot prints it (keywords upper-case, single spaces); on a parse error,
    whitespace collapsed. Identifiers and literals are kept as written. Recordings compare
    SQL in this form, so a reformatted query still finds its recording."""
    try:
        statements = sqlglot.transpile(text, read=dialect, write=dialect)
    except (SqlglotError, ValueError, RecursionError):
        return " ".join(text.split())
    return "; ".join(statements)
