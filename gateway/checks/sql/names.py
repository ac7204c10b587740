"""Names of tables, columns and functions, normalised the way each dialect's database does.

PostgreSQL folds unquoted identifiers to lower case, SQLite ignores case, MySQL table names
follow the file system (sqlglot treats them as case-sensitive) while its column names never
depend on case. Names from the policy file are read here; names in the SQL are normalised once,
when the text is parsed.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from sqlglot import exp

_IDENT_PART = r'(?:[^\W\d][\w$]*|"(?:[^"]|"")+"|`(?:[^`]|``)+`)'
_TABLE_TEXT = re.compile(rf"{_IDENT_PART}(?:\.{_IDENT_PART}){{0,2}}")
_COLUMN_TEXT = re.compile(rf"{_IDENT_PART}(?:\.{_IDENT_PART}){{1,3}}")
_FUNCTION_TEXT = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")

# --- names read without sqlglot -------------------------------------------------------------
#
# sqlglot reads a name of the policy file (``sqlglot_table_name`` and its siblings below) the
# way its PostgreSQL and SQLite readers read SQL; loading it costs ~30 MiB and ~0.1 s, so a
# SQLite or PostgreSQL policy (whose SQL PostgreSQL's parser or SQLite's compiler reads) would
# load it for its names alone. The names whose reading by sqlglot is plain are read here
# instead, and every other name by sqlglot itself (imported then): a part that is a quoted
# identifier, or a bare word of ASCII letters, digits and '_' that is no keyword and no start
# of one. A word sqlglot's tokenizer may read as something else is any prefix of
# ``_SQLGLOT_WORDS``: the leading word of every keyword, comment and string prefix of sqlglot's
# PostgreSQL and SQLite tokenizers (tests/checks/test_sql_names.py checks the list against the
# installed sqlglot, and that both readings agree on every name).
_SQLGLOT_WORDS = """
0X ALL ALTER ANALYZE AND ANTI ANY APPLY ARRAY AS ASC ASOF ATTACH AUTOINCREMENT
AUTO_INCREMENT B BEGIN BETWEEN BIGDECIMAL BIGINT BIGNUM BIGNUMERIC BIGSERIAL BINARY BIT BLOB
BOOL BOOLEAN BPCHAR BYTE BYTEA CACHE CALL CASE CHAR CHARACTER CLOB CLUSTER COLLATE COLUMN
COMMENT COMMIT CONNECT CONSTRAINT COPY CREATE CROSS CSTRING CUBE CURRENT_CATALOG
CURRENT_DATE CURRENT_SCHEMA CURRENT_TIME CURRENT_TIMESTAMP CURRENT_USER DATABASE DATE
DATEMULTIRANGE DATERANGE DATETIME DEC DECFLOAT DECIMAL DECIMAL128 DECIMAL256 DECIMAL32
DECIMAL64 DECLARE DEFAULT DELETE DESC DESCRIBE DETACH DISTINCT DISTRIBUTE DIV DO DOUBLE DROP
E ELSE END ENUM ESCAPE EXCEPT EXEC EXECUTE EXISTS EXPLAIN FALSE FETCH FILE FILTER FIRST
FIXED FLOAT FLOAT4 FLOAT8 FOR FOREIGN FORMAT FROM FULL FUNCTION GEOGRAPHY GEOMETRY GLOB
GRANT GROUP GROUPING HAVING HSTORE HUGEINT ILIKE IN INDEX INDEXED INET INNER INOUT INSERT
INT INT1 INT128 INT16 INT2 INT256 INT32 INT4 INT4MULTIRANGE INT4RANGE INT64 INT8
INT8MULTIRANGE INT8RANGE INTEGER INTERSECT INTERVAL INTO IS ISNULL JOIN JSON JSONB KEEP KILL
LATERAL LEFT LIKE LIMIT LIST LOAD LOCALTIME LOCALTIMESTAMP LOCK LONG LONGBLOB LONGTEXT
LONGVARCHAR MAP MATCH MEDIUMBLOB MEDIUMINT MEDIUMTEXT MERGE MONEY N NAME NAMESPACE NATURAL
NCHAR NEXT NOT NOTNULL NULL NULLABLE NUMBER NUMERIC NUMMULTIRANGE NUMRANGE NVARCHAR
NVARCHAR2 OBJECT OFFSET OID ON ONLY OPERATOR OPTIMIZE OR ORDER ORDINALITY OUT OUTER OVER
OVERLAPS OVERWRITE PARTITION PARTITIONED PARTITIONED_BY PERCENT PIVOT POINT PRAGMA PREPARE
PRIMARY PROCEDURE QUALIFY RANGE REAL RECURSIVE REF REFERENCES REFRESH REGCLASS REGCOLLATION
REGCONFIG REGDICTIONARY REGEXP REGNAMESPACE REGOPER REGOPERATOR REGPROC REGPROCEDURE REGROLE
REGTYPE REINDEX RENAME REPLACE RESET RETURNING REVOKE RIGHT RLIKE ROLLBACK ROLLUP ROW ROWS
SCHEMA SELECT SEMI SEQUENCE SERIAL SESSION SESSION_USER SET SETTINGS SHORT SHOW SIMILAR
SMALLINT SMALLSERIAL SOME SORT SQL STR STRAIGHT_JOIN STRING STRUCT TABLE TABLESAMPLE TEMP
TEMPORARY TEXT THEN TIME TIMESTAMP TIMESTAMPLTZ TIMESTAMPNTZ TIMESTAMPTZ TIMESTAMP_LTZ
TIMESTAMP_NTZ TIMETZ TIME_NS TINYBLOB TINYINT TINYTEXT TRIGGER TRUE TRUNCATE TSMULTIRANGE
TSRANGE TSTZMULTIRANGE TSTZRANGE TYPE U UHUGEINT UINT UINT128 UINT256 UNCACHE UNION UNIQUE
UNKNOWN UNNEST UNPIVOT UPDATE USE USER USING UUID VACUUM VALUES VARBINARY VARCHAR VARCHAR2
VARIADIC VARIANT VECTOR VIEW VOLATILE WHEN WHERE WINDOW WITH X XML XOR
"""
_SQLGLOT_PREFIXES = frozenset(
    word[:end] for word in _SQLGLOT_WORDS.split() for end in range(1, len(word) + 1)
)
_HAND_READ = ("postgres", "sqlite")  # dialects whose plain names are read here
_PART_AT = re.compile(r'([^\W\d][\w$]*)|"((?:[^"]|"")+)"|`((?:[^`]|``)+)`')
_PLAIN_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SAFE_IDENTIFIER = re.compile(r"[_a-zA-Z]\w*")  # sqlglot reads these without its parser
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _hand_part(match: re.Match[str], dialect: str) -> str | None:
    """One part as sqlglot reads it (PostgreSQL folds a bare word to lower case, SQLite every
    name, both in ASCII only), or None when sqlglot itself must read it."""
    bare, double, backtick = match.groups()
    if bare is not None:
        if not _PLAIN_WORD.fullmatch(bare) or bare.upper() in _SQLGLOT_PREFIXES:
            return None
        return bare.translate(_ASCII_LOWER)
    if double is not None:
        name = double.replace('""', '"')
    elif dialect == "sqlite":  # PostgreSQL has no backtick-quoted identifiers
        name = backtick.replace("``", "`")
    else:
        return None
    return name.translate(_ASCII_LOWER) if dialect == "sqlite" else name


def _hand_parts(text: str, dialect: str) -> list[str] | None:
    """The dot-separated parts of ``text``, normalised for ``dialect`` as sqlglot reads them,
    or None when a part needs sqlglot itself (``_hand_part``)."""
    if dialect not in _HAND_READ:
        return None
    parts: list[str] = []
    pos = 0
    while True:
        match = _PART_AT.match(text, pos)
        part = None if match is None else _hand_part(match, dialect)
        if match is None or part is None:
            return None
        parts.append(part)
        pos = match.end()
        if pos == len(text):
            return parts
        if text[pos] != ".":
            return None
        pos += 1


def _table_of(parts: list[str]) -> TableName:
    return TableName(*([""] * (3 - len(parts)) + parts))


class TableName(NamedTuple):
    """A table as the database resolves it: normalised parts, "" when absent."""

    catalog: str
    db: str
    name: str

    def __str__(self) -> str:
        if not self.catalog and not self.db:  # (nearly always: one part, no join to make)
            return self.name
        return ".".join([p for p in self if p])


def parse_table_name(text: str, dialect: str) -> TableName:
    """``public.orders`` -> ``TableName`` normalised for ``dialect``; ValueError when bad."""
    if not isinstance(text, str) or not _TABLE_TEXT.fullmatch(text):
        raise ValueError(
            f"{text!r} is not a table name; expected [catalog.][schema.]table, each part an "
            "identifier or a quoted identifier"
        )
    parts = _hand_parts(text, dialect)
    return _table_of(parts) if parts is not None else sqlglot_table_name(text, dialect)


def parse_column_name(text: str, dialect: str) -> tuple[TableName, str]:
    """``customers.ssn`` or ``public.customers.ssn`` -> (table, column); ValueError when bad."""
    if not isinstance(text, str) or not _COLUMN_TEXT.fullmatch(text):
        raise ValueError(
            f"{text!r} is not a column name; expected table.column or schema.table.column"
        )
    parts = _hand_parts(text, dialect)
    if parts is None:
        return sqlglot_column_name(text, dialect)
    return _table_of(parts[:-1]), parts[-1]


def parse_identifier(text: str, dialect: str) -> str:
    """One identifier (a schema or a column name) normalised for ``dialect``."""
    if not isinstance(text, str) or not re.fullmatch(_IDENT_PART, text):
        raise ValueError(f"{text!r} is not an identifier")
    if dialect in _HAND_READ:
        if _SAFE_IDENTIFIER.fullmatch(text):  # sqlglot reads it as an unquoted word: no keyword
            return text.translate(_ASCII_LOWER)
        parts = _hand_parts(text, dialect) if text[0] in '"`' else None
        if parts is not None:
            return parts[0]
    return sqlglot_identifier(text, dialect)


# --- sqlglot's reading ------------------------------------------------------------------------


def _normalized(node: exp.Expr, dialect: str) -> exp.Expr:
    from sqlglot.optimizer.normalize_identifiers import normalize_identifiers

    return normalize_identifiers(node, dialect=dialect)


def sqlglot_table_name(text: str, dialect: str) -> TableName:
    """``parse_table_name`` by sqlglot (MySQL, and names not read by hand)."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    try:
        table = sqlglot.parse_one(text, read=dialect, into=exp.Table)
    except (SqlglotError, TypeError, ValueError):  # sqlglot raises TypeError on some texts
        raise ValueError(f"{text!r} is not a table name for {dialect}") from None
    if not isinstance(table, exp.Table) or not isinstance(table.this, exp.Identifier):
        raise ValueError(f"{text!r} is not a table name for {dialect}")
    normalized = _normalized(table, dialect)
    assert isinstance(normalized, exp.Table)
    return TableName(normalized.catalog, normalized.db, normalized.name)


def sqlglot_column_name(text: str, dialect: str) -> tuple[TableName, str]:
    """``parse_column_name`` by sqlglot (MySQL, and names not read by hand)."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    try:
        column = sqlglot.parse_one(text, read=dialect, into=exp.Column)
    except (SqlglotError, TypeError, ValueError):  # sqlglot raises TypeError on some texts
        raise ValueError(f"{text!r} is not a column name for {dialect}") from None
    if not isinstance(column, exp.Column) or not isinstance(column.this, exp.Identifier):
        raise ValueError(f"{text!r} is not a column name for {dialect}")
    normalized = _normalized(column, dialect)
    assert isinstance(normalized, exp.Column)
    return TableName(normalized.catalog, normalized.db, normalized.table), normalized.name


def sqlglot_identifier(text: str, dialect: str) -> str:
    """``parse_identifier`` by sqlglot (MySQL, and names not read by hand)."""
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    try:
        ident = exp.parse_identifier(text, dialect=dialect)
    except (SqlglotError, TypeError, ValueError):  # sqlglot raises TypeError on some texts
        raise ValueError(f"{text!r} is not an identifier for {dialect}") from None
    normalized = _normalized(ident, dialect)
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
