"""SQL in a call: parsed with sqlglot, checked against the rule's ``sql:`` policy, fail closed.

A rule that forwards SQL to a database names where the SQL is and what it may do::

    sql:
      dialect: postgres            # postgres | sqlite | mysql (required)
      field: sql                   # dotted path of the JSON body field holding the SQL
      # body: raw                  # ... or: the whole request body is the SQL (UTF-8)
      # argument: sql              # ... or, for an MCP tool rule: the tool argument
      statements: [select]         # statement kinds allowed (default [select])
      max_statements: 1            # statements per call (default 1)
      tables: [orders, customers]  # the only tables that may be named (required)
      default_schema: public       # optional: 'orders' and 'public.orders' are the same table
      schema:                      # optional: columns per table (a list, or a mapping to types)
        customers: [id, name, email, ssn, country]
      # schema_file: schema.yaml   # ... or the same mapping in a YAML/JSON file next to the policy
      deny_columns: [customers.ssn]
      functions: [md5]             # allowed on top of DEFAULT_FUNCTIONS
      max_limit: 1000              # the outermost query needs a literal LIMIT <= 1000 ...
      add_limit: true              # ... or, when it has none, gets 'LIMIT 1000' appended
      allow: [locking]             # opt-ins: locking, into, system_catalogs, variables
      max_length: 100000           # characters (default and ceiling 100000)

``SqlPolicy.check(text)`` returns a ``SqlVerdict`` (the SQL to forward: the original text,
unless a LIMIT was appended) or raises ``SqlDenied``. ``errors[0]["kind"]`` of a denial is one
of the stable ``Denial`` categories; each entry also says what was ``found`` and, when known,
its ``line`` and ``col``.

Why each check exists (see /work/shared/PITFALLS.md, "sqlglot"):

- sqlglot parses ``""`` and ``";"`` to no statement without an error, ``SELEC * FRM t`` to an
  alias expression, and statements it does not model (``SET ROLE``, ``DO $$..$$``, ``CALL``,
  ``VACUUM``, ``LOCK TABLE``, ``EXPLAIN ANALYZE ...``) to an opaque ``exp.Command``: exactly the
  allowed statement classes are accepted at the root, nothing else.
- Data-modifying statements hide in CTEs (``WITH x AS (DELETE ...)``): every node is visited.
- ``find_all(exp.Table)`` also yields CTE names and table functions: a name is a CTE only where
  SQL's scoping makes that CTE visible (a CTE body sees the CTEs before it; an INSERT/UPDATE/
  DELETE target is always a table), compared after normalising identifiers the way the database
  does (otherwise ``WITH "Customers" AS (...) SELECT * FROM Customers`` reads the real
  ``customers`` table in PostgreSQL while looking like the CTE). Table functions are functions.
- Table names match ``tables`` exactly after normalisation: ``public.orders`` is not ``orders``
  (the search_path decides what an unqualified name means) unless ``default_schema: public``
  says they are the same table.
- Functions are an allow-list: unknown ones (``pg_sleep``, ``dblink``, ``load_extension``, ...)
  are ``exp.Anonymous`` and a deny-list would miss new ones. Names are taken from the source
  text, so ``to_char`` is ``to_char`` even though sqlglot models it as ``TimeToStr``.
- Lexing differences between sqlglot and the database are refused outright: MySQL executable
  comments ``/*! */``, sqlglot's own comment directives (``/* sqlglot.meta case_sensitive */``
  switches identifier normalisation off for a node), PostgreSQL ``U&"..."`` identifiers (sqlglot
  reads ``U & "\\0073sn"``, PostgreSQL reads ``ssn``), identifiers PostgreSQL would truncate,
  and on MySQL backslashes and double-quoted strings (their meaning depends on ``sql_mode``).
- Deep nesting makes sqlglot raise ``RecursionError`` or, with the compiled build, crash the
  process; some shapes parse in quadratic time (``a[1][1]...``). The token stream is measured
  before anything is parsed: length, tokens, nesting and subscripts are capped.
- sqlglot's ``qualify`` is quadratic in the length of AND/OR chains (2,000 terms take seconds),
  so denied columns are resolved here, over sqlglot's scopes, in linear time. Refused: a
  denied column anywhere (select list, alias, function argument, WHERE, GROUP/ORDER BY, JOIN),
  ``*`` or ``t.*`` over its table (also inside derived tables and CTEs), a whole-row reference
  (``SELECT c FROM customers c``, ``(c).ssn``), column aliases on its table
  (``customers AS c(a, b, c, s)``), ``NATURAL JOIN`` and ``USING`` comparing it, and every
  column of that name whose table cannot be told for sure (no schema, or ambiguous).
- Regenerating SQL can change its meaning, so the checked text itself is forwarded; an
  appended LIMIT is added to the text and the new text is parsed and checked again.

Any unexpected error while checking denies the call (``Denial.UNCHECKED``). Parses are cached
per (dialect, text) and verdicts per (policy, text), both bounded LRU caches.

This check is defence in depth: the database role behind a read tool should be read-only.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, NamedTuple, TypeVar

import sqlglot
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.errors import ParseError, SqlglotError, TokenError
from sqlglot.optimizer.normalize_identifiers import normalize_identifiers
from sqlglot.optimizer.scope import Scope, traverse_scope, walk_in_scope
from sqlglot.tokenizer_core import Token, TokenType
from sqlglot.tokens import SQLGLOTC_INSTALLED

from gateway.errors import BodyInvalid, SqlDenied, ToolDenied
from gateway.payload import BodyPayload, CheckContext, Payload, ToolCallPayload
from gateway.policy_file import Node

logger = logging.getLogger("capgate.checks.sql")

SQLGLOT_VERSION: str = importlib.metadata.version("sqlglot")
SQLGLOT_COMPILED: bool = bool(SQLGLOTC_INSTALLED)
"""True when the compiled ``sqlglotc`` build is active (same API, ~4-5x faster parsing)."""

# --- limits: each bounds the work one call can cause ------------------------------------------

MAX_SQL_LENGTH = 100_000
"""Characters; the ceiling and default of ``max_length``."""
MAX_TOKENS = 10_000
"""Parsing is roughly linear in tokens (~10 µs each compiled); this bounds one parse."""
MAX_NESTING = 32
"""Depth of ( [ { . sqlglot recurses per level; the compiled build can crash past ~5,000."""
MAX_SUBSCRIPTS = 32
"""``[`` tokens: sqlglot parses chained subscripts in super-linear time (a[1]x1000: ~3 s)."""
MAX_TREE_DEPTH = 600
"""Depth of the parsed tree (long AND/OR chains are left-deep)."""
MAX_STATEMENTS = 50
"""Ceiling of ``max_statements``."""
MAX_ERRORS = 10
"""Entries kept in ``SqlDenied.errors``."""
PG_MAX_IDENTIFIER_BYTES = 63
"""PostgreSQL silently truncates longer identifiers; sqlglot does not."""

PARSE_CACHE_SIZE = 1024
PARSE_CACHE_CHARS = 1_000_000
"""Total text length of cached parses: a tree takes ~110 bytes per character (~110 MB)."""
VERDICT_CACHE_SIZE = 4096
VERDICT_CACHE_CHARS = 4_000_000
"""Total text length of one policy's cached verdicts (the texts are the keys)."""
CACHE_MAX_TEXT = 16_384
"""Texts longer than this are checked every time instead of being cached."""

DIALECTS = ("postgres", "sqlite", "mysql")


class SqlKind(StrEnum):
    """Statement kinds a rule may allow in ``statements``."""

    SELECT = "select"
    INSERT = "insert"
    UPDATE = "update"
    DELETE = "delete"
    MERGE = "merge"
    CREATE = "create"
    DROP = "drop"
    ALTER = "alter"
    TRUNCATE = "truncate"


class SqlFamily(StrEnum):
    """Constructs denied unless the rule opts in with ``allow``."""

    LOCKING = "locking"  # SELECT ... FOR UPDATE / FOR SHARE / LOCK IN SHARE MODE
    INTO = "into"  # SELECT ... INTO new_table / INTO @variable
    SYSTEM_CATALOGS = "system_catalogs"  # pg_catalog, information_schema, sqlite_master, mysql.*
    VARIABLES = "variables"  # MySQL @@system variables and @user := assignments


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
            Denial.FUNCTION,
            Denial.CATALOG,
            Denial.TABLE,
            Denial.COLUMN,
            Denial.LIMIT,
        )
    )
}

# Statement classes that may be allowed, by kind. exp.Insert is also a DDL subclass in sqlglot.
_KIND_OF: dict[type[exp.Expr], SqlKind] = {
    exp.Insert: SqlKind.INSERT,
    exp.Update: SqlKind.UPDATE,
    exp.Delete: SqlKind.DELETE,
    exp.Merge: SqlKind.MERGE,
    exp.Create: SqlKind.CREATE,
    exp.Drop: SqlKind.DROP,
    exp.Alter: SqlKind.ALTER,
    exp.TruncateTable: SqlKind.TRUNCATE,
}
_QUERY_ROOTS = (exp.Select, exp.SetOperation, exp.Subquery)

# Utility statements that are never allowed, wherever they appear. Looked up by name so a
# class missing from another sqlglot version is simply skipped; anything else that is a DDL or
# DML subclass without a kind (exp.Copy is a DML) is caught by the isinstance test below.
_UTILITY_NAMES = (
    "Command", "Set", "Pragma", "Copy", "Grant", "Revoke", "Analyze", "Use", "Transaction",
    "Commit", "Rollback", "Attach", "Detach", "Kill", "Refresh", "Cache", "Uncache", "LoadData",
    "Summarize", "Describe", "Show", "Comment", "Install", "Execute", "Declare", "Export",
    "Semicolon",
)  # fmt: skip
_UTILITY: tuple[type[exp.Expr], ...] = tuple(
    c for c in (getattr(exp, n, None) for n in _UTILITY_NAMES) if isinstance(c, type)
)

DEFAULT_FUNCTIONS: frozenset[str] = frozenset(
    {
        # aggregates
        "count", "sum", "avg", "min", "max", "string_agg", "array_agg", "group_concat",
        "bool_and", "bool_or", "every", "stddev", "stddev_pop", "stddev_samp", "variance",
        "var_pop", "var_samp", "total",
        # window functions
        "row_number", "rank", "dense_rank", "percent_rank", "cume_dist", "ntile", "lag", "lead",
        "first_value", "last_value", "nth_value",
        # nulls and conditions
        "coalesce", "nullif", "ifnull", "greatest", "least", "iif", "if",
        # strings (no repeat/lpad/rpad: one call can allocate gigabytes)
        "lower", "upper", "length", "char_length", "character_length", "octet_length", "substr",
        "substring", "trim", "ltrim", "rtrim", "btrim", "replace", "concat", "concat_ws", "left",
        "right", "position", "strpos", "instr", "locate", "split_part", "initcap", "reverse",
        "starts_with",
        # numbers
        "abs", "round", "ceil", "ceiling", "floor", "trunc", "truncate", "mod", "sign", "power",
        "pow", "sqrt",
        # dates and times
        "now", "current_date", "current_time", "current_timestamp", "localtime",
        "localtimestamp", "date_trunc", "date_part", "extract", "date", "time", "datetime",
        "julianday", "strftime", "unixepoch", "to_char", "to_date", "to_timestamp", "age",
        "make_date", "date_add", "date_sub", "adddate", "subdate", "datediff", "timestampdiff",
        "date_format", "year", "month", "day", "hour", "minute", "second", "curdate", "curtime",
        "unix_timestamp", "from_unixtime",
        # constructors and casts
        "cast", "row", "array",
    }
)  # fmt: skip
"""Function names allowed by default (as written in the SQL, lower case)."""

# sqlglot classes built from syntax rather than a name followed by '(' (CAST(x AS t), x::t,
# CASE, EXTRACT(y FROM x), x ~ 'r', a -> 'k', ARRAY[...], EXISTS (...)): they carry no source
# position, so they are matched by class key.
_SYNTAX_FUNCTIONS = frozenset(
    {
        "case", "if", "cast", "trycast", "extract", "substring", "trim", "strposition", "exists",
        "array", "currentdate", "currenttime", "currenttimestamp", "localtime", "localtimestamp",
        "regexplike", "regexpilike", "jsonextract", "jsonextractscalar", "jsonbextract",
        "jsonbextractscalar", "collate", "overlay",
        # conversions sqlglot synthesises around arguments (SQLite strftime(f, x) wraps x)
        "tsordstotimestamp", "tsordstodate", "tsordstotime", "timestrtotime", "strtotime",
        "unixtotime", "timetostr", "datestrtodate",
    }
)  # fmt: skip

# Operators that sqlglot models as functions (exp.And is an exp.Func): checked by class key,
# whatever the source text, since they are written as symbols or keywords, not names.
_OPERATOR_BASES = (exp.Binary, exp.Unary, exp.Connector, exp.Predicate)
_SAFE_OPERATORS = frozenset(
    {
        "and", "or", "xor", "pow", "regexplike", "regexpilike", "regexpfullmatch", "collate",
        "exists", "arraycontains", "arraycontainsall", "arraycontainedby", "arrayoverlaps",
        "jsonarraycontains", "jsonbcontains", "jsonbcontainsalltopkeys", "jsonbcontainstopkey",
        "jsonbcontainsanytopkeys", "jsonbpathexists", "jsonbextract", "jsonbextractscalar",
        "jsonextract", "jsonextractscalar",
    }
)  # fmt: skip

# Lexical markers refused in the raw text, for every dialect (case-insensitive).
_RAW_MARKERS = (
    ("/*!", "a MySQL executable comment '/*!' (MySQL runs what sqlglot reads as a comment)"),
    ("/*m!", "a MariaDB executable comment '/*M!' (MariaDB runs what sqlglot reads as a comment)"),
    ("sqlglot.", "a sqlglot comment directive ('sqlglot.meta', 'sqlglot.anonymous')"),
)

_IDENT_PART = r'(?:[^\W\d][\w$]*|"(?:[^"]|"")+"|`(?:[^`]|``)+`)'
_TABLE_TEXT = re.compile(rf"{_IDENT_PART}(?:\.{_IDENT_PART}){{0,2}}")
_COLUMN_TEXT = re.compile(rf"{_IDENT_PART}(?:\.{_IDENT_PART}){{1,3}}")
_FUNCTION_TEXT = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
_FIELD_PATH = re.compile(r"[^.\s]+(?:\.[^.\s]+)*")
_DIGITS = re.compile(r"[0-9]+")


# --- results ----------------------------------------------------------------------------------


class TableName(NamedTuple):
    """A table as the database resolves it: normalised parts, "" when absent."""

    catalog: str
    db: str
    name: str

    def __str__(self) -> str:
        return ".".join(p for p in self if p)


@dataclass(frozen=True, slots=True)
class SqlVerdict:
    """What an allowed SQL text does, and the exact text to forward."""

    sql: str  # the text that was checked: the original, or the original plus ' LIMIT n'
    kinds: tuple[str, ...]  # statement kinds found, root and nested (sorted)
    tables: tuple[str, ...]  # real tables read or written (sorted, normalised)
    columns: tuple[str, ...]  # table.column references that could be resolved (best effort)
    rewritten: bool = False  # True when a LIMIT was appended (add_limit)


@dataclass(frozen=True, slots=True)
class _Violation:
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


class _Refusal(Exception):
    """Internal: the SQL is denied; converted to a fresh ``SqlDenied`` per call (cacheable)."""

    def __init__(self, violations: list[_Violation]) -> None:
        super().__init__(violations[0].detail)
        self.violations = violations

    @classmethod
    def of(cls, kind: Denial, detail: str, found: str = "", **where: Any) -> _Refusal:
        return cls([_Violation(kind, detail, found or kind.value, **where)])

    def error(self, rule_id: str | None) -> SqlDenied:
        first = self.violations[0]
        detail = first.detail
        if len(self.violations) > 1:
            detail += f" (and {len(self.violations) - 1} more problem(s), listed in errors)"
        return SqlDenied(
            detail,
            rule=rule_id,
            errors=[v.as_dict() for v in self.violations[:MAX_ERRORS]],
        )


# --- caches -----------------------------------------------------------------------------------

K = TypeVar("K")
V = TypeVar("V")


class _Lru(Generic[K, V]):
    """A small thread-safe LRU map, bounded in entries and in total weight (text length)."""

    def __init__(self, size: int, max_weight: int) -> None:
        self.size = size
        self.max_weight = max_weight
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: K, value: V, weight: int) -> None:
        if weight > self.max_weight:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._weight -= old[1]
            self._data[key] = (value, weight)
            self._weight += weight
            while len(self._data) > self.size or self._weight > self.max_weight:
                _, (_, dropped) = self._data.popitem(last=False)
                self._weight -= dropped

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._weight = 0
            self.hits = self.misses = 0

    def info(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._data)}


@dataclass(frozen=True, slots=True)
class _Parsed:
    """One text parsed by one dialect, identifiers normalised. Shared: never mutated."""

    statements: tuple[exp.Expr | None, ...]
    quoted: Mapping[int, str]  # source offset -> text of each quoted identifier token
    last_end: int  # offset of the last character of the last token that is not ';'


_PARSES: _Lru[tuple[str, str], _Parsed | _Refusal] = _Lru(PARSE_CACHE_SIZE, PARSE_CACHE_CHARS)
_DIALECT_OBJECTS: dict[str, Dialect] = {name: Dialect.get_or_raise(name) for name in DIALECTS}


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


# --- tokens and parsing -----------------------------------------------------------------------

_OPEN = {TokenType.L_PAREN, TokenType.L_BRACKET, TokenType.L_BRACE}
_CLOSE = {TokenType.R_PAREN, TokenType.R_BRACKET, TokenType.R_BRACE}


def _position(text: str, offset: int) -> dict[str, Any]:
    """line and col (1-based) of a character offset, and the offset itself for ordering."""
    line = text.count("\n", 0, offset) + 1
    col = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return {"line": line, "col": col, "order": offset}


def _where_token(text: str, token: Token) -> dict[str, Any]:
    return _position(text, token.start)


def _lexical_problems(dialect: str, text: str, tokens: list[Token]) -> None:
    """Refuse token streams that are too big, too deep, or that the database lexes otherwise."""
    if len(tokens) > MAX_TOKENS:
        raise _Refusal.of(Denial.SIZE, f"the SQL has more than {MAX_TOKENS} tokens")
    depth = 0
    subscripts = 0
    for token in tokens:
        kind = token.token_type
        if kind in _OPEN:
            depth += 1
            if depth > MAX_NESTING:
                raise _Refusal.of(
                    Denial.DEPTH,
                    f"the SQL nests brackets more than {MAX_NESTING} levels deep",
                    "nesting",
                    **_where_token(text, token),
                )
            if kind is TokenType.L_BRACKET:
                subscripts += 1
                if subscripts > MAX_SUBSCRIPTS:
                    raise _Refusal.of(
                        Denial.SIZE,
                        f"the SQL has more than {MAX_SUBSCRIPTS} '[' subscripts",
                        "[",
                        **_where_token(text, token),
                    )
        elif kind in _CLOSE:
            depth -= 1
    if _ODD_CHARACTER.search(text) is not None:
        _odd_characters(text, tokens)
    if dialect == "postgres":
        _postgres_lexing(text, tokens)
    elif dialect == "mysql" and '"' in text:
        for token in tokens:
            if token.token_type is TokenType.STRING and text[token.start] == '"':
                raise _Refusal.of(
                    Denial.PARSE,
                    "a double-quoted string: with sql_mode ANSI_QUOTES MySQL reads it as an "
                    "identifier; use single quotes",
                    '"',
                    **_where_token(text, token),
                )


# Control characters and Unicode spaces: sqlglot splits tokens on every str.isspace()
# character, PostgreSQL and SQLite read U+00A0, U+3000, U+2028 ... as identifier characters,
# MySQL follows its character set. Refused outside string literals.
_ODD_CHARACTER = re.compile(
    "[\x01-\x08\x0b\x0c\x0e-\x1f\x7f\x85\xa0\u1680\u2000-\u200f\u2028\u2029\u202f"
    "\u205f\u3000\ufeff]"
)
_STRING_TOKENS = frozenset(
    t
    for t in (
        getattr(TokenType, name, None)
        for name in (
            "STRING", "NATIONAL_STRING", "RAW_STRING", "HEREDOC_STRING", "BYTE_STRING",
            "UNICODE_STRING", "HEX_STRING", "BIT_STRING", "NATIONAL_RAW_STRING",
        )
    )
    if t is not None
)  # fmt: skip


def _odd_characters(text: str, tokens: list[Token]) -> None:
    spans = [(t.start, t.end) for t in tokens if t.token_type in _STRING_TOKENS]
    for match in _ODD_CHARACTER.finditer(text):
        offset = match.start()
        if not any(start <= offset <= end for start, end in spans):
            raise _Refusal.of(
                Denial.PARSE,
                f"the SQL contains the character U+{ord(match.group()):04X} outside a string "
                "literal; databases disagree on whether it separates words",
                f"U+{ord(match.group()):04X}",
                **_position(text, offset),
            )


# A prefilter: more than 63 UTF-8 bytes take at least 16 characters (4 bytes each at most).
_LONG_WORD = re.compile(r'[^\s"()\[\],;.]{16,}|"(?:[^"]|""){16,}')


def _postgres_lexing(text: str, tokens: list[Token]) -> None:
    """U&"..." identifiers (sqlglot: 'U & "..."') and identifiers PostgreSQL truncates."""
    if "&" in text:
        for previous, token in zip(tokens, tokens[1:], strict=False):
            if (
                token.token_type is TokenType.IDENTIFIER
                and previous.token_type is TokenType.AMP
                and previous.start > 0
                and text[previous.start - 1] in "uU"
                and previous.end + 1 == token.start
            ):
                raise _Refusal.of(
                    Denial.PARSE,
                    'a Unicode-escaped identifier U&"...": sqlglot reads it as \'U & "..."\', '
                    "PostgreSQL decodes it",
                    'U&"',
                    **_where_token(text, token),
                )
    if _LONG_WORD.search(text) is None:
        return  # no run of characters long enough to make a 64-byte identifier
    for token in tokens:
        if (
            token.token_type in (TokenType.IDENTIFIER, TokenType.VAR)
            and len(token.text.encode("utf-8")) > PG_MAX_IDENTIFIER_BYTES
        ):
            raise _Refusal.of(
                Denial.PARSE,
                f"an identifier is longer than {PG_MAX_IDENTIFIER_BYTES} bytes, which "
                "PostgreSQL would truncate",
                token.text[:80],
                **_where_token(text, token),
            )


def _parse_uncached(dialect: str, text: str) -> _Parsed:
    d = _DIALECT_OBJECTS[dialect]
    if dialect == "mysql" and "\\" in text:
        raise _Refusal.of(
            Denial.PARSE,
            "the SQL contains a backslash: MySQL lexes it differently depending on sql_mode "
            "(NO_BACKSLASH_ESCAPES), so the gateway cannot know what the server would run",
            "\\",
            **_position(text, text.index("\\")),
        )
    try:
        tokens = d.tokenize(text)
    except TokenError:
        raise _Refusal.of(
            Denial.PARSE,
            "the SQL could not be tokenized: an unterminated string, quoted identifier or comment?",
            "token",
        ) from None
    if not tokens or all(t.token_type is TokenType.SEMICOLON for t in tokens):
        raise _Refusal.of(Denial.EMPTY, "the SQL has no statement (only comments or ';')")
    _lexical_problems(dialect, text, tokens)
    try:
        statements = d.parser().parse(tokens, text)
        # Identifiers compared as the database compares them (PostgreSQL folds unquoted names
        # to lower case; SQLite ignores case). Done once here: the cached trees are read-only.
        for statement in statements:
            if statement is not None:
                normalize_identifiers(statement, dialect=d)
    except ParseError as exc:
        errors = [
            _Violation(
                Denial.PARSE,
                f"the SQL is not valid {dialect}: {e.get('description') or 'syntax error'} "
                f"(line {e.get('line')}, column {e.get('col')})",
                str(e.get("highlight") or "")[:80] or "syntax",
                line=e.get("line"),
                col=e.get("col"),
            )
            for e in (exc.errors or [{}])[:MAX_ERRORS]
        ]
        raise _Refusal(errors) from None
    quoted = {t.start: t.text for t in tokens if t.token_type is TokenType.IDENTIFIER}
    last = next(t for t in reversed(tokens) if t.token_type is not TokenType.SEMICOLON)
    return _Parsed(tuple(statements), MappingProxyType(quoted), last.end)


def _parse(dialect: str, text: str) -> _Parsed:
    """Tokenize, measure and parse ``text`` once per (dialect, text); raise ``_Refusal``."""
    cacheable = len(text) <= CACHE_MAX_TEXT
    key = (dialect, text)
    if cacheable:
        hit = _PARSES.get(key)
        if hit is not None:
            if isinstance(hit, _Refusal):
                raise hit.with_traceback(None)
            return hit
    result: _Parsed | _Refusal
    try:
        result = _parse_uncached(dialect, text)
    except _Refusal as refusal:
        result = refusal
    except RecursionError:
        result = _Refusal.of(Denial.DEPTH, "the SQL is nested too deeply to be checked")
    if cacheable:
        _PARSES.put(key, result, len(text))
    if isinstance(result, _Refusal):
        raise result.with_traceback(None)
    return result


# --- names ------------------------------------------------------------------------------------


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


def _is_catalog(table: TableName, dialect: str) -> bool:
    db, name = table.db.lower(), table.name.lower()
    if db == "information_schema" or table.catalog.lower() == "information_schema":
        return True
    if dialect == "postgres":
        return db.startswith("pg_") or name.startswith("pg_")
    if dialect == "sqlite":
        return name.startswith("sqlite_")
    return db in ("mysql", "performance_schema", "sys")


# --- the policy -------------------------------------------------------------------------------


def _where(text: str, node: exp.Expr | None) -> dict[str, Any]:
    """line/col/order of a node, from its own source offset or that of its first identifier."""
    for candidate in (node, getattr(node, "this", None)):
        if isinstance(candidate, exp.Expr):
            start = candidate.meta.get("start")
            if isinstance(start, int) and 0 <= start < len(text):
                return _position(text, start)
    return {}


def _at(where: dict[str, Any]) -> str:
    return f" at line {where['line']}, column {where['col']}" if where else ""


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
        if "\x00" in text:
            raise _Refusal.of(Denial.PARSE, "the SQL contains a NUL character", "\\x00")
        if not text.strip():
            raise _Refusal.of(Denial.EMPTY, "the SQL is empty")
        lowered = text.lower()
        for marker, what in _RAW_MARKERS:
            offset = lowered.find(marker)
            if offset >= 0:
                where = _position(text, offset)
                raise _Refusal.of(
                    Denial.COMMENT,
                    f"the SQL contains {what}{_at(where)}",
                    text[offset : offset + len(marker)],
                    **where,
                )
        parsed = _parse(self.dialect, text)
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

    # -- helpers used by _StatementCheck -------------------------------------------------------

    def canonical(self, table: TableName) -> TableName:
        return TableName(table.catalog, table.db or self.default_schema or "", table.name)


@dataclass(slots=True)
class _StatementResult:
    kinds: set[str]
    tables: set[str]
    columns: set[str]
    missing_limit: bool


class _Category(StrEnum):
    """What ``_node_problem`` has to look at for a node class (computed once per class)."""

    OTHER = "other"
    FUNCTION = "function"
    INSPECT = "inspect"


def _categorize(cls: type[exp.Expr]) -> _Category:
    if issubclass(cls, exp.Func):
        return _Category.FUNCTION
    watched = (*_UTILITY, *_KIND_OF, exp.DDL, exp.DML, exp.Into, exp.Lock)
    if issubclass(cls, watched + (exp.SessionParameter, exp.PropertyEQ)):
        return _Category.INSPECT
    return _Category.OTHER


_NODE_CATEGORY: dict[type[exp.Expr], _Category] = {}


class _StatementCheck:
    """The checks of one parsed statement, in stages; each stage raises its violations."""

    def __init__(self, policy: SqlPolicy, parsed: _Parsed, text: str, root: exp.Expr) -> None:
        self.policy = policy
        self.parsed = parsed
        self.text = text
        self.root = root
        self.dialect = policy.dialect
        self.kinds: set[str] = set()
        self.tables: set[str] = set()
        self.columns: set[str] = set()

    def _where(self, node: exp.Expr | None) -> dict[str, Any]:
        return _where(self.text, node)

    def run(self) -> _StatementResult:
        self._check_root()
        self._check_nodes()
        tree = self.root  # normalised when parsed; nothing below changes it
        try:
            scopes = traverse_scope(tree)
        except SqlglotError:
            raise _Refusal.of(
                Denial.UNCHECKED, "the SQL's sources could not be resolved", "scope"
            ) from None
        real = self._check_tables(tree)
        self._check_columns(tree, scopes, real)
        missing = self._check_limit()
        return _StatementResult(self.kinds, self.tables, self.columns, missing)

    # -- stage 1: what the statement is --------------------------------------------------------

    def _check_root(self) -> None:
        root = self.root
        if isinstance(root, exp.Command):
            name = str(root.this or "command").upper()
            raise _Refusal.of(
                Denial.COMMAND,
                f"{name} is a statement the gateway cannot inspect (sqlglot keeps its body "
                "opaque); it is never allowed",
                name.lower(),
            )
        if isinstance(root, _UTILITY):
            raise _Refusal.of(
                Denial.COMMAND,
                f"a {root.key.upper()} statement is never allowed through this rule",
                root.key,
            )
        if isinstance(root, _QUERY_ROOTS):
            if isinstance(root, exp.Subquery) and not isinstance(root.unnest(), exp.Query):
                raise _Refusal.of(Denial.STATEMENT, "the SQL is not a statement", root.key)
            kind = SqlKind.SELECT
        else:
            found = _KIND_OF.get(type(root))
            if found is None:
                raise _Refusal.of(
                    Denial.STATEMENT,
                    f"the SQL is not a statement the rule can allow (it parses as "
                    f"{type(root).__name__}); check the spelling of the keywords",
                    root.key,
                )
            kind = found
        self.kinds.add(kind.value)
        if kind not in self.policy.statements:
            raise _Refusal.of(
                Denial.STATEMENT,
                f"{kind.value.upper()} statements are not allowed by the rule "
                f"(allowed: {', '.join(sorted(self.policy.statements))})",
                kind.value,
            )

    def _check_nodes(self) -> None:
        """One walk over every node: nested statements, INTO, locks, variables, functions."""
        violations: list[_Violation] = []
        stack: list[tuple[exp.Expr, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            if depth > MAX_TREE_DEPTH:
                raise _Refusal.of(
                    Denial.DEPTH,
                    f"the SQL's syntax tree is deeper than {MAX_TREE_DEPTH} levels",
                    "depth",
                )
            below = depth + 1
            for value in node.args.values():  # faster than iter_expressions()
                if isinstance(value, exp.Expr):
                    stack.append((value, below))
                elif isinstance(value, list):
                    stack.extend((v, below) for v in value if isinstance(v, exp.Expr))
            if node is not self.root:
                problem = self._node_problem(node)
                if problem is not None:
                    violations.append(problem)
        self._raise(violations)

    def _node_problem(self, node: exp.Expr) -> _Violation | None:
        category = _NODE_CATEGORY.get(type(node))
        if category is None:
            category = _NODE_CATEGORY.setdefault(type(node), _categorize(type(node)))
        if category is _Category.OTHER:
            return None  # most nodes: identifiers, literals, operators, clauses
        allow = self.policy.allow
        if category is _Category.FUNCTION:
            assert isinstance(node, exp.Func)
            return self._function_problem(node)
        if isinstance(node, _UTILITY):  # exp.Command is one of them
            where = self._where(node)
            return _Violation(
                Denial.COMMAND,
                f"a {node.key.upper()} statement inside the SQL{_at(where)} is never allowed",
                node.key,
                **where,
            )
        kind = _KIND_OF.get(type(node))
        if kind is not None:
            self.kinds.add(kind.value)
            if kind in self.policy.statements:
                return None
            where = self._where(node)
            return _Violation(
                Denial.STATEMENT,
                f"a {kind.value.upper()} nested inside the statement (in a CTE or a "
                f"subquery){_at(where)} is not allowed by the rule",
                kind.value,
                **where,
            )
        if isinstance(node, exp.DDL | exp.DML):
            where = self._where(node)
            return _Violation(
                Denial.COMMAND,
                f"a {node.key.upper()} inside the SQL{_at(where)} is never allowed",
                node.key,
                **where,
            )
        if isinstance(node, exp.Into) and SqlFamily.INTO not in allow:
            where = self._where(node.this)
            return _Violation(
                Denial.INTO,
                f"SELECT ... INTO{_at(where)} writes a table or variables; it is not allowed "
                "(allow: [into] opts in)",
                "into",
                **where,
            )
        if isinstance(node, exp.Lock) and SqlFamily.LOCKING not in allow:
            return _Violation(
                Denial.LOCK,
                "a locking clause (FOR UPDATE / FOR SHARE / LOCK IN SHARE MODE) is not allowed "
                "(allow: [locking] opts in)",
                "lock",
            )
        if SqlFamily.VARIABLES not in allow and (
            isinstance(node, exp.SessionParameter)
            or (isinstance(node, exp.PropertyEQ) and isinstance(node.this, exp.Parameter))
        ):
            where = self._where(node.this)
            return _Violation(
                Denial.VARIABLE,
                f"a server or session variable{_at(where)} is not allowed (allow: [variables] "
                "opts in)",
                node.sql(dialect=self.dialect)[:80],
                **where,
            )
        return None

    def _function_name(self, node: exp.Func) -> tuple[str, bool]:
        """(name as the database resolves it, whether it came from the source text)."""
        quoted = False
        if isinstance(node, _OPERATOR_BASES):
            return node.key, False
        if isinstance(node, exp.Anonymous):
            this = node.this
            name = this.name if isinstance(this, exp.Identifier) else str(this)
            quoted = isinstance(this, exp.Identifier) and bool(this.quoted)
            from_text = True
        else:
            start, end = node.meta.get("start"), node.meta.get("end")
            if isinstance(start, int) and isinstance(end, int):
                if start in self.parsed.quoted:
                    name, quoted = self.parsed.quoted[start], True
                else:
                    name = self.text[start : end + 1]
                from_text = True
            else:
                name, from_text = node.key, False
        if quoted and self.dialect == "postgres":
            return name, from_text  # a quoted name is exact in PostgreSQL: "LOWER" is not lower
        return name.lower(), from_text

    def _function_problem(self, node: exp.Func) -> _Violation | None:
        name, from_text = self._function_name(node)
        parent = node.parent
        if isinstance(parent, exp.Dot) and parent.expression is node:
            where = self._where(node)
            qualifier = parent.this.sql(dialect=self.dialect)
            return _Violation(
                Denial.FUNCTION,
                f"the schema-qualified function {qualifier}.{name}(){_at(where)} is not allowed",
                f"{qualifier}.{name}",
                **where,
            )
        allowed = self.policy.functions
        if isinstance(node, _OPERATOR_BASES):
            ok = node.key in _SAFE_OPERATORS
        elif from_text:
            ok = name in allowed
        else:
            names = {node.key, *(n.lower() for n in type(node).sql_names())}
            ok = node.key in _SYNTAX_FUNCTIONS or not names.isdisjoint(allowed)
        if ok:
            return None
        where = self._where(node)
        as_source = isinstance(parent, exp.Table)
        what = "table function" if as_source else "function"
        return _Violation(
            Denial.FUNCTION,
            f"the {what} {name}(){_at(where)} is not on the rule's list of allowed functions",
            name,
            **where,
        )

    # -- stage 2: tables -----------------------------------------------------------------------

    def _check_tables(self, tree: exp.Expr) -> list[exp.Table]:
        """Every table named is allowed; returns the real tables (not CTE references)."""
        policy = self.policy
        real: list[exp.Table] = []
        violations: list[_Violation] = []
        for table in tree.find_all(exp.Table):
            if _is_cte_reference(table):
                continue  # a reference to a CTE, whose own body is checked where it is defined
            this = table.this
            if isinstance(this, exp.Func):
                continue  # a table function: checked as a function
            if isinstance(this, exp.Parameter | exp.Placeholder) and isinstance(
                table.parent, exp.Into
            ):
                continue  # INTO @variable: refused (or allowed) as INTO
            where = self._where(table)
            if not isinstance(this, exp.Identifier):
                violations.append(
                    _Violation(
                        Denial.TABLE,
                        f"the source {table.sql(dialect=self.dialect)[:80]}{_at(where)} is not "
                        "a plain table name",
                        table.sql(dialect=self.dialect)[:80],
                        **where,
                    )
                )
                continue
            name = TableName(table.catalog, table.db, table.name)
            canon = policy.canonical(name)
            if _is_catalog(name, self.dialect):
                if SqlFamily.SYSTEM_CATALOGS in policy.allow:
                    real.append(table)
                    self.tables.add(str(name))
                    continue
                violations.append(
                    _Violation(
                        Denial.CATALOG,
                        f"the system catalog {name}{_at(where)} is not allowed",
                        str(name),
                        **where,
                    )
                )
                continue
            if canon not in policy.tables:
                violations.append(
                    _Violation(
                        Denial.TABLE,
                        f"the table {name}{_at(where)} is not in the rule's tables "
                        f"({', '.join(sorted(str(t) for t in policy.tables))})",
                        str(name),
                        **where,
                    )
                )
                continue
            real.append(table)
            self.tables.add(str(canon))
        self._raise(violations)
        return real

    # -- stage 3: columns ----------------------------------------------------------------------

    def _denied_for(self, table: exp.Table) -> frozenset[str]:
        name = TableName(table.catalog, table.db, table.name)
        return self.policy.deny_columns.get(self.policy.canonical(name), frozenset())

    def _schema_for(self, table: exp.Table) -> frozenset[str] | None:
        name = TableName(table.catalog, table.db, table.name)
        return self.policy.schema.get(self.policy.canonical(name))

    def _check_columns(self, tree: exp.Expr, scopes: list[Scope], real: list[exp.Table]) -> None:
        denied_any = bool(self.policy.deny_columns)
        owner: dict[int, Scope] = {}
        for scope in scopes:
            for node in walk_in_scope(scope.expression):
                if isinstance(node, exp.Column | exp.Star | exp.Join):
                    owner.setdefault(id(node), scope)
        # Sources seen by nodes outside any scope (the body of an INSERT/UPDATE/DELETE).
        top: dict[str, exp.Table | Scope] = {t.alias_or_name: t for t in real}
        violations: list[_Violation] = []
        if denied_any:
            for table in real:
                alias = table.args.get("alias")
                if isinstance(alias, exp.TableAlias) and alias.columns and self._denied_for(table):
                    # FROM customers AS c(a, b, c, s) renames ssn: its new name is not denied.
                    violations.append(
                        _Violation(
                            Denial.COLUMN,
                            f"{table.name} has denied column(s) and cannot be given column "
                            f"aliases ({alias.sql(dialect=self.dialect)[:80]})",
                            alias.name or table.name,
                            **self._where(alias),
                        )
                    )
        for node in tree.walk():
            if isinstance(node, exp.Column):
                if isinstance(node.this, exp.Star):
                    if denied_any:
                        violations.extend(self._star(node, owner.get(id(node)), top))
                    continue
                problem = self._column(node, owner.get(id(node)), top, denied_any)
                if problem is not None:
                    violations.append(problem)
            elif isinstance(node, exp.Star) and denied_any:
                if isinstance(node.parent, exp.Column | exp.Count):
                    continue  # t.* is handled with its column; COUNT(*) reads no column
                if _under_exists(node):
                    continue  # EXISTS (SELECT * ...) returns no column
                violations.extend(self._star(node, owner.get(id(node)), top))
            elif isinstance(node, exp.Join) and denied_any:
                violations.extend(self._join(node, owner.get(id(node)), top))
            elif isinstance(node, exp.Insert) and denied_any:
                violations.extend(self._insert(node))
        self._raise(violations)

    @staticmethod
    def _chain(
        scope: Scope | None, top: Mapping[str, exp.Table | Scope]
    ) -> Iterator[Mapping[str, exp.Table | Scope]]:
        while scope is not None:
            yield scope.sources
            scope = scope.parent
        yield top

    def _lookup(
        self, alias: str, scope: Scope | None, top: Mapping[str, exp.Table | Scope]
    ) -> exp.Table | Scope | None:
        for sources in self._chain(scope, top):
            if alias in sources:
                return sources[alias]
        return None

    def _column(
        self,
        column: exp.Column,
        scope: Scope | None,
        top: Mapping[str, exp.Table | Scope],
        denied_any: bool,
    ) -> _Violation | None:
        name = column_key(column.name, self.dialect)
        if column.table:
            source = self._lookup(column.table, scope, top)
            if isinstance(source, exp.Table) and isinstance(source.this, exp.Identifier):
                table = self.policy.canonical(TableName(source.catalog, source.db, source.name))
                self.columns.add(f"{table}.{name}")
                if name in self._denied_for(source):
                    where = self._where(column)
                    return _Violation(
                        Denial.COLUMN,
                        f"the column {source.name}.{name}{_at(where)} is denied by the rule",
                        f"{source.name}.{name}",
                        **where,
                    )
                return None
            if source is None and denied_any and self._denied_anywhere(name):
                where = self._where(column)
                return _Violation(
                    Denial.COLUMN,
                    f"the column {column.table}.{name}{_at(where)} cannot be resolved to a "
                    "table, and a column of that name is denied",
                    f"{column.table}.{name}",
                    **where,
                )
            return None
        if scope is not None and len(scope.sources) == 1:
            only = next(iter(scope.sources.values()))
            if isinstance(only, exp.Table) and isinstance(only.this, exp.Identifier):
                table = self.policy.canonical(TableName(only.catalog, only.db, only.name))
                self.columns.add(f"{table}.{name}")
        if not denied_any:
            return None
        # A table or alias used as a value is the whole row (PostgreSQL: SELECT c FROM t c),
        # unless the table has a column of that name, which PostgreSQL prefers.
        source = self._lookup(name, scope, top)
        if (
            isinstance(source, exp.Table)
            and self._denied_for(source)
            and name not in (self._schema_for(source) or ())
        ):
            where = self._where(column)
            return _Violation(
                Denial.COLUMN,
                f"{name}{_at(where)} refers to whole rows of {source.name}, which include a "
                "denied column",
                name,
                **where,
            )
        if not self._denied_anywhere(name):
            return None
        for candidate in self._candidates(name, scope, top):
            if name in self._denied_for(candidate):
                where = self._where(column)
                return _Violation(
                    Denial.COLUMN,
                    f"the column {name}{_at(where)} may be {candidate.name}.{name}, which is "
                    "denied by the rule",
                    f"{candidate.name}.{name}",
                    **where,
                )
        return None

    def _denied_anywhere(self, name: str) -> bool:
        return name in self.policy.denied_names

    def _candidates(
        self, name: str, scope: Scope | None, top: Mapping[str, exp.Table | Scope]
    ) -> Iterator[exp.Table]:
        """Real tables an unqualified column could come from, innermost scope first.

        A level where some source certainly has the column ends the search (the database stops
        there too); otherwise outer levels are searched as well (correlated references).
        """
        for sources in self._chain(scope, top):
            certain = False
            for source in sources.values():
                if isinstance(source, Scope):
                    outputs = _outputs(source, self.dialect)
                    if outputs is not None and name in outputs:
                        certain = True
                    continue
                if not isinstance(source.this, exp.Identifier):
                    continue
                columns = self._schema_for(source)
                if columns is None:
                    yield source  # unknown columns: it may have this one
                elif name in columns:
                    certain = True
                    yield source
            if certain:
                return

    def _star(
        self, star: exp.Expr, scope: Scope | None, top: Mapping[str, exp.Table | Scope]
    ) -> list[_Violation]:
        where = self._where(star)
        if isinstance(star, exp.Column) and star.table:
            found = self._lookup(star.table, scope, top)
            covered = [found] if found is not None else list(top.values())
        else:
            sources = scope.sources if scope is not None else top
            covered = list(sources.values())
        out: list[_Violation] = []
        for source in covered:
            if isinstance(source, exp.Table) and self._denied_for(source):
                denied = ", ".join(sorted(self._denied_for(source)))
                out.append(
                    _Violation(
                        Denial.COLUMN,
                        f"* over {source.name}{_at(where)} includes the denied column(s) "
                        f"{denied}; name the columns instead",
                        f"{source.name}.*",
                        **where,
                    )
                )
        return out

    def _join(
        self, join: exp.Join, scope: Scope | None, top: Mapping[str, exp.Table | Scope]
    ) -> list[_Violation]:
        sources = scope.sources if scope is not None else top
        guarded = [s for s in sources.values() if isinstance(s, exp.Table) and self._denied_for(s)]
        if not guarded:
            return []
        out: list[_Violation] = []
        if str(join.args.get("method") or "").upper() == "NATURAL":
            out.append(
                _Violation(
                    Denial.COLUMN,
                    f"NATURAL JOIN compares every same-named column, including the denied "
                    f"column(s) of {guarded[0].name}; join ON named columns instead",
                    "natural join",
                    **self._where(join.this),
                )
            )
        for ident in join.args.get("using") or []:
            name = column_key(ident.name, self.dialect)
            for table in guarded:
                if name in self._denied_for(table):
                    out.append(
                        _Violation(
                            Denial.COLUMN,
                            f"JOIN ... USING ({name}) compares the denied column "
                            f"{table.name}.{name}",
                            f"{table.name}.{name}",
                            **self._where(ident),
                        )
                    )
        return out

    def _insert(self, insert: exp.Insert) -> list[_Violation]:
        target = insert.this
        names: list[exp.Expr] | None = None
        if isinstance(target, exp.Schema):
            names = list(target.expressions)
            target = target.this
        if not isinstance(target, exp.Table):
            return []
        denied = self._denied_for(target)
        if not denied:
            return []
        if names is None:
            return [
                _Violation(
                    Denial.COLUMN,
                    f"an INSERT into {target.name} without a column list writes its denied "
                    "column(s); list the columns",
                    f"{target.name}.*",
                    **self._where(target),
                )
            ]
        return [
            _Violation(
                Denial.COLUMN,
                f"the INSERT writes the denied column {target.name}.{n.name}",
                f"{target.name}.{n.name}",
                **self._where(n),
            )
            for n in names
            if column_key(n.name, self.dialect) in denied
        ]

    # -- stage 4: LIMIT ------------------------------------------------------------------------

    def _check_limit(self) -> bool:
        """True when the outermost query has no LIMIT and one is required."""
        maximum = self.policy.max_limit
        node = self.root
        if maximum is None or not isinstance(node, _QUERY_ROOTS):
            return False
        limit = node.args.get("limit")
        while limit is None and isinstance(node, exp.Subquery):
            node = node.this
            limit = node.args.get("limit")
        if limit is None:
            return True
        where = self._where(limit)
        count: exp.Expr | None
        if isinstance(limit, exp.Fetch):
            options = limit.args.get("limit_options")
            if options is not None and (
                options.args.get("percent") or options.args.get("with_ties")
            ):
                raise _Refusal.of(
                    Denial.LIMIT,
                    "FETCH ... PERCENT / WITH TIES can return more rows than the rule allows",
                    "fetch",
                    **where,
                )
            count = limit.args.get("count")
            if count is None:
                return False  # FETCH FIRST ROW ONLY: one row
        elif isinstance(limit, exp.Limit):
            count = limit.expression
        else:
            count = None
        if not (
            isinstance(count, exp.Literal)
            and not count.is_string
            and _DIGITS.fullmatch(str(count.this))
        ):
            shown = count.sql(dialect=self.dialect)[:40] if count is not None else "?"
            raise _Refusal.of(
                Denial.LIMIT,
                f"LIMIT {shown} is not a literal integer; the rule requires LIMIT <= {maximum}",
                shown,
                **where,
            )
        if int(str(count.this)) > maximum:
            raise _Refusal.of(
                Denial.LIMIT,
                f"LIMIT {count.this} is above the rule's maximum of {maximum}",
                str(count.this),
                **where,
            )
        return False

    # -- reporting ------------------------------------------------------------------------------

    @staticmethod
    def _raise(violations: list[_Violation]) -> None:
        if violations:
            violations.sort(key=lambda v: (_PRIORITY.get(v.kind, 99), v.order))
            raise _Refusal(violations)


def _is_cte_reference(table: exp.Table) -> bool:
    """True when ``table`` names a CTE visible where it stands (SQL's lexical scoping).

    Only a FROM/JOIN/USING source can be a CTE: an INSERT/UPDATE/DELETE/DDL target always
    names a real table. A CTE body sees the CTEs before it, and itself WITH RECURSIVE.
    Identifiers are already normalised, so names compare as the database compares them.
    """
    if table.args.get("db") or table.args.get("catalog"):
        return False
    if not (isinstance(table.parent, exp.From | exp.Join) or table.arg_key == "using"):
        return False
    name = table.name
    child: exp.Expr = table
    node = table.parent
    while node is not None:
        if isinstance(node, exp.With):
            if isinstance(child, exp.CTE):
                # The strictest reading across databases: the CTEs before this one, and this
                # one itself under WITH RECURSIVE. (PostgreSQL also sees later CTEs under
                # RECURSIVE, MySQL resolves them as tables: treated as tables here, which can
                # only deny more.)
                ctes = node.expressions
                index = next(i for i, c in enumerate(ctes) if c is child)
                visible = ctes[: index + 1] if node.args.get("recursive") else ctes[:index]
                if any(c.alias == name for c in visible):
                    return True
        else:
            with_ = node.args.get("with_")
            if isinstance(with_, exp.With) and with_ is not child:
                if any(c.alias == name for c in with_.expressions):
                    return True
        child, node = node, node.parent
    return False


def _under_exists(star: exp.Expr) -> bool:
    """True for the bare * of a query that is the operand of EXISTS."""
    select = star.parent
    if not isinstance(select, exp.Select) or not any(e is star for e in select.expressions):
        return False
    parent = select.parent
    while isinstance(parent, exp.Subquery | exp.Paren):
        parent = parent.parent
    return isinstance(parent, exp.Exists)


def _outputs(scope: Scope, dialect: str) -> frozenset[str] | None:
    """Column names a derived table or CTE exposes, or None when unknown (a star)."""
    if scope.outer_columns:
        return frozenset(column_key(c, dialect) for c in scope.outer_columns)
    expression = scope.expression
    names = getattr(expression, "named_selects", None)
    if not isinstance(names, list) or "*" in names:
        return None
    selects = getattr(expression, "selects", [])
    if any(isinstance(s, exp.Star) or (isinstance(s, exp.Column) and s.is_star) for s in selects):
        return None
    return frozenset(column_key(n, dialect) for n in names)


# --- the payload check ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SqlBodyCheck:
    """Where a rule's SQL is (a JSON field, the raw body, or an MCP tool argument) + its policy."""

    kind = "sql"
    policy: SqlPolicy
    rule_id: str | None
    field: tuple[str, ...] | None = None  # JSON body field path, e.g. ("query", "text")
    raw: bool = False  # the whole body is the SQL
    argument: str | None = None  # MCP: the tools/call argument holding the SQL

    def check(self, payload: Payload) -> None:
        if isinstance(payload, ToolCallPayload):
            self._check_tool_call(payload)
        elif isinstance(payload, BodyPayload) and self.argument is None:
            if self.raw:
                self._check_raw(payload)
            else:
                self._check_field(payload)
        else:
            raise SqlDenied("the SQL could not be found where the rule says", rule=self.rule_id)

    def _check_raw(self, payload: BodyPayload) -> None:
        try:
            text = payload.raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BodyInvalid("the SQL body is not UTF-8 text", rule=self.rule_id) from None
        verdict = self.policy.check(text)
        payload.findings.note_sql(verdict.kinds, verdict.tables)
        if verdict.rewritten:
            payload.replace_raw(verdict.sql.encode("utf-8"))

    def _check_field(self, payload: BodyPayload) -> None:
        assert self.field is not None
        value = payload.json()
        container = value
        for part in self.field[:-1]:
            container = container.get(part) if isinstance(container, dict) else None
        key = self.field[-1]
        text = container.get(key) if isinstance(container, dict) else None
        pointer = "/" + "/".join(self.field)
        if not isinstance(text, str):
            raise BodyInvalid(
                f"the JSON body needs the SQL as a string at {pointer}",
                rule=self.rule_id,
                errors=[{"pointer": pointer, "keyword": "sql", "message": "a string is required"}],
            )
        verdict = self.policy.check(text)
        payload.findings.note_sql(verdict.kinds, verdict.tables)
        if verdict.rewritten:
            assert isinstance(container, dict)
            container[key] = verdict.sql
            payload.replace_json(value)

    def _check_tool_call(self, payload: ToolCallPayload) -> None:
        if self.argument is None:
            raise SqlDenied("the rule's SQL is not in a tool argument", rule=self.rule_id)
        text = payload.arguments.get(self.argument)
        if not isinstance(text, str):
            raise ToolDenied(
                f"tool {payload.tool!r} needs the SQL as a string in argument {self.argument!r}",
                rule=self.rule_id,
            )
        verdict = self.policy.check(text)
        payload.findings.note_sql(verdict.kinds, verdict.tables)
        if verdict.rewritten:
            payload.replace_argument(self.argument, verdict.sql)


def normalise_sql(text: str, dialect: str | None) -> str:
    """SQL as sqlglot prints it (keywords upper-case, single spaces); on a parse error,
    whitespace collapsed. Identifiers and literals are kept as written. Recordings compare
    SQL in this form, so a reformatted query still finds its recording."""
    try:
        statements = sqlglot.transpile(text, read=dialect, write=dialect)
    except (SqlglotError, ValueError, RecursionError):
        return " ".join(text.split())
    return "; ".join(statements)


# --- the policy file ----------------------------------------------------------------------------

SQL_KEYS = (
    "dialect",
    "field",
    "body",
    "argument",
    "statements",
    "max_statements",
    "tables",
    "default_schema",
    "schema",
    "schema_file",
    "deny_columns",
    "functions",
    "max_limit",
    "add_limit",
    "allow",
    "max_length",
)


def _str_items(node: Node, what: str) -> list[tuple[Node, str]]:
    items = node.as_list()
    if items is None:
        return []
    if not items:
        node.fail(f"{node.where}: expected at least one {what}")
    out: list[tuple[Node, str]] = []
    for item in items:
        value = item.as_str(what=what)
        if value is not None:
            out.append((item, value))
    return out


def _schema_from_node(node: Node, dialect: str | None) -> dict[str, list[str]] | None:
    if not isinstance(node.value, dict):
        node.fail(f"{node.where}: expected a mapping of table -> list of columns")
        return None
    out: dict[str, list[str]] = {}
    for key, value in node.entries():
        if isinstance(value.value, dict):
            names = [str(k) for k in value.value]
        else:
            listed = value.as_str_list()
            if listed is None:
                continue
            names = listed
        if dialect is not None:
            try:
                parse_table_name(key.value, dialect)
                for name in names:
                    parse_identifier(name, dialect)
            except ValueError as exc:
                value.fail(f"{value.where}: {exc}")
                continue
        out[key.value] = names
    return out


def _schema_from_file(node: Node, dialect: str | None) -> dict[str, list[str]] | None:
    text = node.as_str(what="a file path")
    if text is None:
        return None
    path = Path(node.path).parent / text
    try:
        data = YAML(typ="safe", pure=True).load(path.read_text("utf-8"))
    except OSError as exc:
        node.fail(f"{node.where}: cannot read {str(path)!r}: {exc.strerror}")
        return None
    except (YAMLError, UnicodeDecodeError) as exc:
        node.fail(f"{node.where}: {str(path)!r} is not YAML or JSON: {exc}")
        return None
    sub = Node(data, node.path, node.line, node.col, node.where, [])
    schema = _schema_from_node(sub, dialect)
    for issue in sub.issues:
        node.fail(f"{node.where}: in {str(path)!r}: {issue.message}")
    return schema if not sub.issues else None


def compile_sql_check(node: Node, context: CheckContext) -> SqlBodyCheck | None:
    """The ``sql:`` key of a rule -> ``SqlBodyCheck``; errors go to ``node.fail``."""
    issues_before = len(node.issues)
    m = node.as_map(required=("dialect", "tables"), optional=SQL_KEYS)
    if m is None:
        return None
    dialect = m["dialect"].as_choice(DIALECTS) if "dialect" in m else None
    rule_id = context.rule_id
    tool = context.tool

    # Where the SQL is.
    places = [k for k in ("field", "body", "argument") if k in m]
    field_path: tuple[str, ...] | None = None
    raw = False
    argument: str | None = None
    if tool is not None:
        if places != ["argument"]:
            node.fail(
                f"{node.where}: a rule for an MCP tool names the tool argument holding the SQL "
                "with 'argument: <name>' (and no 'field' or 'body')"
            )
        elif (value := m["argument"].as_str(what="an argument name")) is not None:
            argument = value
            if not value:
                m["argument"].fail(f"{m['argument'].where}: the argument name is empty")
    elif context.upstream_kind == "mcp":
        node.fail(f"{node.where}: SQL on an MCP upstream needs the rule to name a 'tool'")
    elif len(places) != 1 or places == ["argument"]:
        node.fail(
            f"{node.where}: say where the SQL is with exactly one of 'field: <json.path>' or "
            "'body: raw' ('argument' is for MCP tool rules)"
        )
    elif "field" in m:
        path = m["field"].as_str(pattern=_FIELD_PATH, what="a dotted JSON field path")
        if path is not None:
            field_path = tuple(path.split("."))
    else:
        raw = m["body"].as_choice(("raw",)) == "raw"

    statements = ["select"]
    if "statements" in m:
        statements = []
        for item, _ in _str_items(m["statements"], "a statement kind"):
            kind = item.as_choice(tuple(k.value for k in SqlKind))
            if kind is not None:
                statements.append(kind)
    max_statements = 1
    if "max_statements" in m:
        max_statements = m["max_statements"].as_int(minimum=1, maximum=MAX_STATEMENTS) or 1

    allow: list[str] = []
    if "allow" in m:
        for item, value in _str_items(m["allow"], "a family to allow"):
            if value in ("dml", "ddl"):
                item.fail(
                    f"{item.where}: {value!r} is allowed by listing statement kinds in "
                    "'statements' (insert, update, delete, merge / create, drop, alter, "
                    "truncate)"
                )
                continue
            family = item.as_choice(tuple(f.value for f in SqlFamily))
            if family is not None:
                allow.append(family)

    default_schema: str | None = None
    schema_name = ""  # default_schema, normalised
    if "default_schema" in m:
        default_schema = m["default_schema"].as_str(what="a schema name")
        if default_schema is not None and dialect is not None:
            try:
                schema_name = parse_identifier(default_schema, dialect)
            except ValueError as exc:
                m["default_schema"].fail(f"{m['default_schema'].where}: {exc}")

    def canon(t: TableName) -> TableName:
        return TableName(t.catalog, t.db or schema_name, t.name)

    tables: list[str] = []
    canonical: set[TableName] = set()
    for item, value in _str_items(m["tables"], "a table name") if "tables" in m else []:
        if dialect is None:
            continue
        try:
            name = canon(parse_table_name(value, dialect))
        except ValueError as exc:
            item.fail(f"{item.where}: {exc}")
            continue
        if _is_catalog(name, dialect) and "system_catalogs" not in allow:
            item.fail(
                f"{item.where}: {value!r} is a system catalog; add system_catalogs to 'allow' "
                "to let the rule read catalogs"
            )
            continue
        tables.append(value)
        canonical.add(name)

    schema: dict[str, list[str]] | None = None
    if "schema" in m and "schema_file" in m:
        m["schema_file"].fail(f"{node.where}: give 'schema' or 'schema_file', not both")
    elif "schema" in m:
        schema = _schema_from_node(m["schema"], dialect)
    elif "schema_file" in m:
        schema = _schema_from_file(m["schema_file"], dialect)

    known: dict[TableName, set[str]] = {}  # the schema, normalised (validated when read)
    if schema is not None and dialect is not None:
        for name_text, cols in schema.items():
            known[canon(parse_table_name(name_text, dialect))] = {
                column_key(parse_identifier(c, dialect), dialect) for c in cols
            }
    deny_columns: list[str] = []
    for item, value in _str_items(m["deny_columns"], "a column") if "deny_columns" in m else []:
        if dialect is None:
            continue
        try:
            table, column = parse_column_name(value, dialect)
        except ValueError as exc:
            item.fail(f"{item.where}: {exc}")
            continue
        if canon(table) not in canonical:
            item.fail(f"{item.where}: {value!r} names a table that is not in 'tables'")
            continue
        columns = known.get(canon(table))
        if columns is not None and column_key(column, dialect) not in columns:
            item.fail(f"{item.where}: the schema of {str(table)!r} has no column {column!r}")
            continue
        deny_columns.append(value)

    functions: list[str] = []
    for item, value in _str_items(m["functions"], "a function name") if "functions" in m else []:
        try:
            functions.append(parse_function_name(value))
        except ValueError as exc:
            item.fail(f"{item.where}: {exc}")

    max_limit = m["max_limit"].as_int(minimum=1, maximum=10**9) if "max_limit" in m else None
    add_limit = bool(m["add_limit"].as_bool()) if "add_limit" in m else False
    if add_limit and "max_limit" not in m:
        m["add_limit"].fail(f"{m['add_limit'].where}: add_limit needs max_limit")
    max_length = MAX_SQL_LENGTH
    if "max_length" in m:
        max_length = m["max_length"].as_int(minimum=1, maximum=MAX_SQL_LENGTH) or MAX_SQL_LENGTH

    if len(node.issues) > issues_before or dialect is None:
        return None
    try:
        policy = SqlPolicy.create(
            dialect,
            tables=tables,
            statements=statements,
            max_statements=max_statements,
            default_schema=default_schema,
            schema=schema,
            deny_columns=deny_columns,
            functions=functions,
            max_limit=max_limit,
            add_limit=add_limit,
            allow=allow,
            max_length=max_length,
            rule_id=rule_id,
        )
    except ValueError as exc:
        node.fail(f"{node.where}: {exc}")
        return None
    return SqlBodyCheck(
        policy=policy, rule_id=rule_id, field=field_path, raw=raw, argument=argument
    )
