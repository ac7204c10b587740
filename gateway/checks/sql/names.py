"""Names of tables, columns and functions, normalised the way each dialect's database does.

PostgreSQL folds unquoted identifiers to lower case, SQLite ignores case, MySQL table names
follow the file system (sqlglot treats them as case-sensitive) while its column names never
depend on case. Names from the policy file are read here; names in the SQL are normalised once,
when the text is parsed.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.optimizer.normalize_identifiers import normalize_identifiers

_IDENT_PART = r'(?:[^\W\d][\w$]*|"(?:[^"]|"")+"|`(?:[^`]|``)+`)'
_TABLE_TEXT = re.compile(rf"{_IDENT_PART}(?:\.{_IDENT_PART}){{0,2}}")
_COLUMN_TEXT = re.compile(rf"{_IDENT_PART}(?:\.{_IDENT_PART}){{1,3}}")
_FUNCTION_TEXT = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")


class TableName(NamedTuple):
    """A table as the database resolves it: normalised parts, "" when absent."""

    catalog: str
    db: str
    name: str

    def __str__(self) -> str:
        return ".".join(p for p in self if p)


def _normalized_parts(node: exp.Expr, dialect: str) -> exp.Expr:
    return normalize_identifiers(node, dialect=dialect)


def parse_table_name(text: str, dialect: str) -> TableName:
    """``public.orders`` -> ``TableName`` normalised for ``dialect``; ValueError when bad."""
    if not isinstance(text, str) or not _TABLE_TEXT.fullmatch(text):
        raise ValueError(
            f"{text!r} is not a table name; expected [catalog.][schema.]table, each part an "
            "identifier or a quoted identifier"
        )
    try:
        table = sqlglot.parse_one(text, read=dialect, into=exp.Table)
    except SqlglotError:
        raise ValueError(f"{text!r} is not a table name for {dialect}") from None
    if not isinstance(table, exp.Table) or not isinstance(table.this, exp.Identifier):
        raise ValueError(f"{text!r} is not a table name for {dialect}")
    normalized = _normalized_parts(table, dialect)
    assert isinstance(normalized, exp.Table)
    return TableName(normalized.catalog, normalized.db, normalized.name)


def parse_column_name(text: str, dialect: str) -> tuple[TableName, str]:
    """``customers.ssn`` or ``public.customers.ssn`` -> (table, column); ValueError when bad."""
    if not isinstance(text, str) or not _COLUMN_TEXT.fullmatch(text):
        raise ValueError(
            f"{text!r} is not a column name; expected table.column or schema.table.column"
        )
    try:
        column = sqlglot.parse_one(text, read=dialect, into=exp.Column)
    except SqlglotError:
        raise ValueError(f"{text!r} is not a column name for {dialect}") from None
    if not isinstance(column, exp.Column) or not isinstance(column.this, exp.Identifier):
        raise ValueError(f"{text!r} is not a column name for {dialect}")
    normalized = _normalized_parts(column, dialect)
    assert isinstance(normalized, exp.Column)
    return TableName(normalized.catalog, normalized.db, normalized.table), normalized.name


def parse_identifier(text: str, dialect: str) -> str:
    """One identifier (a schema or a column name) normalised for ``dialect``."""
    if not isinstance(text, str) or not re.fullmatch(_IDENT_PART, text):
        raise ValueError(f"{text!r} is not an identifier")
    try:
        ident = exp.parse_identifier(text, dialect=dialect)
    except SqlglotError:
        raise ValueError(f"{text!r} is not an identifier for {dialect}") from None
    normalized = _normalized_parts(ident, dialect)
    assert isinstance(normalized, exp.Identifier)
    return normalized.name


def parse_function_name(text: str) -> str:
    if not isinstance(text, str) or not _FUNCTION_TEXT.fullmatch(text):
        raise ValueError(f"{text!r} is not a function name (letters, digits, '_' or '$')")
    return text.lower()


def column_key(name: str, dialect: str) -> str:
    """A column name as the database compares it.

    MySQL compares column names case-insensitively on every platform (table names follow the
    file system, which sqlglot's case-sensitive MySQL setting mirrors); PostgreSQL and SQLite
    identifiers are already normalised by sqlglot.
    """
    return name.lower() if dialect == "mysql" else name


def is_catalog(table: TableName, dialect: str) -> bool:
    db, name = table.db.lower(), table.name.lower()
    if db == "information_schema" or table.catalog.lower() == "information_schema":
        return True
    if dialect == "postgres":
        return db.startswith("pg_") or name.startswith("pg_")
    if dialect == "sqlite":
        return name.startswith("sqlite_")
    return db in ("mysql", "performance_schema", "sys")


_PG_PLAIN = re.compile(r"[a-z_][a-z0-9_$]*")


def quote_identifier(name: str, dialect: str) -> str:
    """``name`` as an identifier in ``dialect``'s SQL text: bare where the database reads the
    bare word back as the same name (PostgreSQL: lower case, not a reserved keyword), quoted
    otherwise (SQLite: always)."""
    if dialect == "postgres":
        from pglast.keywords import RESERVED_KEYWORDS, TYPE_FUNC_NAME_KEYWORDS

        if (
            _PG_PLAIN.fullmatch(name)
            and name not in RESERVED_KEYWORDS
            and name not in TYPE_FUNC_NAME_KEYWORDS
        ):
            return name
    return '"' + name.replace('"', '""') + '"'
