"""The settings of a ``sql:`` policy, and the one place that decides whether they are valid.

``SqlSettings`` holds the values as given (from Python, or as read from a policy file);
``resolve`` checks all of them in one pass and either returns ``SqlRules``, the normalised
values the rules read (a ``SqlPolicy`` is ``SqlRules`` with a check and a verdict cache), or
raises ``SqlSettingsError`` listing every problem. Each
``SettingProblem`` names its key and, for a list or a mapping, the item at fault, so the policy
file reader can point at that item's FILE:LINE:COL; ``str(problem)`` names them for a caller
of ``SqlPolicy.create``.

Types are the reader's business (a YAML value that is not a list, a string or an integer is
reported where it is read); the values themselves are judged here only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from gateway.checks.sql.limits import (
    DEFAULT_MAX_JOINS,
    MAX_JOINS,
    MAX_LIMIT,
    MAX_SQL_LENGTH,
    MAX_STATEMENTS,
)
from gateway.checks.sql.names import (
    TableName,
    column_key,
    is_catalog,
    parse_column_name,
    parse_function_name,
    parse_identifier,
    parse_table_name,
)
from gateway.checks.sql.options import DEFAULT_FUNCTIONS, DIALECTS, SqlFamily, SqlKind

_KINDS = tuple(k.value for k in SqlKind)

MYSQL_MODES = frozenset(
    {
        "ALLOW_INVALID_DATES", "ANSI_QUOTES", "EMPTY_STRING_IS_NULL",
        "ERROR_FOR_DIVISION_BY_ZERO", "HIGH_NOT_PRECEDENCE", "IGNORE_BAD_TABLE_OPTIONS",
        "IGNORE_SPACE", "NO_AUTO_CREATE_USER", "NO_AUTO_VALUE_ON_ZERO", "NO_BACKSLASH_ESCAPES",
        "NO_DIR_IN_CREATE", "NO_ENGINE_SUBSTITUTION", "NO_FIELD_OPTIONS", "NO_KEY_OPTIONS",
        "NO_TABLE_OPTIONS", "NO_UNSIGNED_SUBTRACTION", "NO_ZERO_DATE", "NO_ZERO_IN_DATE",
        "ONLY_FULL_GROUP_BY", "PAD_CHAR_TO_FULL_LENGTH", "PIPES_AS_CONCAT", "REAL_AS_FLOAT",
        "SIMULTANEOUS_ASSIGNMENT", "STRICT_ALL_TABLES", "STRICT_TRANS_TABLES",
        "TIME_TRUNCATE_FRACTIONAL", "TIME_ROUND_FRACTIONAL",
    }
)  # fmt: skip
"""MySQL 8 and MariaDB sql_mode flags (what matters to capgate's reading: ANSI_QUOTES and
NO_BACKSLASH_ESCAPES change the tokens, PIPES_AS_CONCAT what '||' is)."""
MYSQL_COMBINED_MODES = {
    "ANSI": frozenset(
        {"REAL_AS_FLOAT", "PIPES_AS_CONCAT", "ANSI_QUOTES", "IGNORE_SPACE", "ONLY_FULL_GROUP_BY"}
    ),
    "TRADITIONAL": frozenset(
        {
            "STRICT_TRANS_TABLES",
            "STRICT_ALL_TABLES",
            "NO_ZERO_IN_DATE",
            "NO_ZERO_DATE",
            "ERROR_FOR_DIVISION_BY_ZERO",
            "NO_ENGINE_SUBSTITUTION",
        }
    ),  # fmt: skip
}
MYSQL_GRAMMAR_MODES = frozenset(
    {"ORACLE", "MSSQL", "DB2", "MAXDB", "POSTGRESQL", "MYSQL323", "MYSQL40"}
)
"""MariaDB's compatibility modes change the grammar itself (PL/SQL blocks, other quoting)."""
MYSQL_PARAMETER_FORMS = frozenset({"?"})
_FAMILIES = tuple(f.value for f in SqlFamily)


@dataclass(frozen=True, slots=True)
class SettingProblem:
    """One invalid setting: its key, the item at fault (a list index or a schema table), why."""

    key: str
    item: int | str | None
    message: str

    def __str__(self) -> str:
        if self.item is None:
            return f"{self.key}: {self.message}"
        if isinstance(self.item, int):
            return f"{self.key}[{self.item}]: {self.message}"
        return f"{self.key}.{self.item}: {self.message}"


class SqlSettingsError(ValueError):
    """Invalid settings; ``str()`` names the first problem, ``problems`` lists them all."""

    def __init__(
        self, problems: Sequence[SettingProblem], unread: frozenset[str] = frozenset()
    ) -> None:
        self.problems = tuple(problems)
        self.unread = unread
        if self.problems:
            message = str(self.problems[0])
        else:
            message = f"settings that could not be read: {', '.join(sorted(unread))}"
        super().__init__(message)


@dataclass(frozen=True, eq=False, slots=True)
class SqlRules:
    """A ``sql:`` policy's settings, checked and normalised: what the rules read.

    Compared by identity, like the ``SqlPolicy`` that extends it.
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
    max_joins: int = DEFAULT_MAX_JOINS
    server_version: int | None = None  # PostgreSQL: the server's major version
    standard_conforming_strings: bool | None = None  # PostgreSQL: None when not stated
    sql_mode: frozenset[str] | None = None  # MySQL: the server's sql_mode; None: not stated
    parameters: frozenset[str] = frozenset()  # MySQL: the parameter forms allowed ("?")

    def canonical(self, table: TableName) -> TableName:
        """``table`` as the rules name it: in ``default_schema`` when it names no schema."""
        return TableName(table.catalog, table.db or self.default_schema or "", table.name)


@dataclass(frozen=True, slots=True)
class SqlSettings:
    """The settings of one ``sql:`` policy as given, before they are checked."""

    dialect: str
    tables: Sequence[str]
    statements: Sequence[str] = ("select",)
    max_statements: int = 1
    default_schema: str | None = None
    schema: Mapping[str, Sequence[str]] | None = None
    deny_columns: Sequence[str] = ()
    functions: Sequence[str] = ()
    max_limit: int | None = None
    add_limit: bool = False
    allow: Sequence[str] = ()
    max_length: int = MAX_SQL_LENGTH
    max_joins: int = DEFAULT_MAX_JOINS
    server_version: int | None = None
    standard_conforming_strings: bool | None = None
    sql_mode: str | None = None
    parameters: Sequence[str] = ()
    unread: frozenset[str] = frozenset()
    """Keys a reader could not read in full (and has said why): their own checks are skipped,
    and settings with any such key are never valid."""

    def resolve(self) -> SqlRules:
        """The settings checked and normalised; raise ``SqlSettingsError``.

        Every setting is judged, in the order of the fields, and every problem is named.
        """
        found = _Problems()
        dialect = self._dialect(found)
        kinds = self._statements(found)
        families = self._allow(found)
        default = self._default_schema(dialect, found)
        allowed = self._tables(dialect, default, families, found)
        columns = self._schema(dialect, default, found)
        denied = self._deny_columns(dialect, default, allowed, columns, found)
        self._limits(found)
        functions = self._functions(found)
        self._authority(dialect, allowed, columns, found)
        modes = self._mysql(dialect, found)
        if found or self.unread:
            raise SqlSettingsError(found, self.unread)
        assert dialect is not None  # else a problem, or 'dialect' unread
        return SqlRules(
            dialect=dialect,
            tables=frozenset(allowed),
            statements=frozenset(kinds),
            max_statements=self.max_statements,
            default_schema=default,
            schema=MappingProxyType(columns),
            deny_columns=MappingProxyType({t: frozenset(c) for t, c in denied.items()}),
            denied_names=frozenset(c for cols in denied.values() for c in cols),
            functions=DEFAULT_FUNCTIONS | functions,
            max_limit=self.max_limit,
            add_limit=self.add_limit,
            allow=frozenset(families),
            max_length=self.max_length,
            max_joins=self.max_joins,
            server_version=self.server_version,
            standard_conforming_strings=self.standard_conforming_strings,
            sql_mode=modes,
            parameters=frozenset(self.parameters),
        )

    # -- one setting (or a few that belong together) each; None: not judged -----------------

    def _dialect(self, found: _Problems) -> str | None:
        if "dialect" in self.unread:
            return None
        if isinstance(self.dialect, str) and self.dialect in DIALECTS:
            return self.dialect
        found.add("dialect", f"expected one of {list(DIALECTS)}, got {self.dialect!r}")
        return None

    def _statements(self, found: _Problems) -> set[SqlKind]:
        kinds: set[SqlKind] = set()
        for i, kind in enumerate(self.statements):
            if kind in _KINDS:
                kinds.add(SqlKind(kind))
            else:
                found.add("statements", f"expected one of {list(_KINDS)}, got {kind!r}", i)
        if not self.statements and "statements" not in self.unread:
            # The wording the policy file reader has always used for an empty list.
            found.add("statements", "expected at least one a statement kind")
        if "max_statements" not in self.unread:
            found.in_range("max_statements", self.max_statements, 1, MAX_STATEMENTS)
        return kinds

    def _allow(self, found: _Problems) -> set[SqlFamily]:
        families: set[SqlFamily] = set()
        for i, family in enumerate(self.allow):
            if family in ("dml", "ddl"):
                found.add(
                    "allow",
                    f"{family!r} is allowed by listing statement kinds in 'statements' "
                    "(insert, update, delete, merge / create, drop, alter, truncate)",
                    i,
                )
            elif family in _FAMILIES:
                families.add(SqlFamily(family))
            else:
                found.add("allow", f"expected one of {list(_FAMILIES)}, got {family!r}", i)
        return families

    def _default_schema(self, dialect: str | None, found: _Problems) -> str | None:
        if dialect is None or self.default_schema is None:
            return None
        try:
            return parse_identifier(self.default_schema, dialect)
        except ValueError as exc:
            found.add("default_schema", str(exc))
            return None

    def _tables(
        self,
        dialect: str | None,
        default: str | None,
        families: set[SqlFamily],
        found: _Problems,
    ) -> set[TableName]:
        named: list[tuple[int, str, TableName]] = []
        if dialect is not None:
            for i, text in enumerate(self.tables):
                try:
                    named.append((i, text, _in_schema(parse_table_name(text, dialect), default)))
                except ValueError as exc:
                    found.add("tables", str(exc), i)
        if not self.tables and "tables" not in self.unread:
            found.add("tables", "expected at least one a table name")
        allowed: set[TableName] = set()
        for i, text, table in named:
            assert dialect is not None
            if is_catalog(table, dialect) and SqlFamily.SYSTEM_CATALOGS not in families:
                found.add(
                    "tables",
                    f"{text!r} is a system catalog; add system_catalogs to 'allow' to let the "
                    "rule read catalogs",
                    i,
                )
            else:
                allowed.add(table)
        return allowed

    def _schema(
        self, dialect: str | None, default: str | None, found: _Problems
    ) -> dict[TableName, frozenset[str]]:
        columns: dict[TableName, frozenset[str]] = {}
        if dialect is None or self.schema is None or "schema" in self.unread:
            return columns
        for name, listed in self.schema.items():
            try:
                table = _in_schema(parse_table_name(name, dialect), default)
                columns[table] = frozenset(
                    column_key(parse_identifier(c, dialect), dialect) for c in listed
                )
            except ValueError as exc:
                found.add("schema", str(exc), name)
        return columns

    def _deny_columns(
        self,
        dialect: str | None,
        default: str | None,
        allowed: set[TableName],
        columns: Mapping[TableName, frozenset[str]],
        found: _Problems,
    ) -> dict[TableName, set[str]]:
        denied: dict[TableName, set[str]] = {}
        if dialect is None:
            return denied
        for i, text in enumerate(self.deny_columns):
            try:
                table, column = parse_column_name(text, dialect)
            except ValueError as exc:
                found.add("deny_columns", str(exc), i)
                continue
            canon = _in_schema(table, default)
            known = columns.get(canon)
            if canon not in allowed:
                found.add("deny_columns", f"{text!r} names a table that is not in 'tables'", i)
            elif known is not None and column_key(column, dialect) not in known:
                found.add(
                    "deny_columns", f"the schema of {str(table)!r} has no column {column!r}", i
                )
            else:
                denied.setdefault(canon, set()).add(column_key(column, dialect))
        return denied

    def _limits(self, found: _Problems) -> None:
        if self.max_limit is not None and "max_limit" not in self.unread:
            found.in_range("max_limit", self.max_limit, 1, MAX_LIMIT)
        if self.add_limit and self.max_limit is None and "max_limit" not in self.unread:
            found.add("add_limit", "add_limit needs max_limit")
        if "max_length" not in self.unread:
            found.in_range("max_length", self.max_length, 1, MAX_SQL_LENGTH)
        if "max_joins" not in self.unread:
            found.in_range("max_joins", self.max_joins, 0, MAX_JOINS)

    def _authority(
        self,
        dialect: str | None,
        allowed: set[TableName],
        columns: Mapping[TableName, frozenset[str]],
        found: _Problems,
    ) -> None:
        """What the dialect's authority needs: SQLite compiles each statement against a
        schema-only database, so it needs the columns of every table, and one statement."""
        if dialect == "postgres":
            self._server(found)
        elif self.server_version is not None or self.standard_conforming_strings is not None:
            key = (
                "server_version"
                if self.server_version is not None
                else ("standard_conforming_strings")
            )
            found.add(key, "is a PostgreSQL setting (dialect: postgres)")
        if dialect != "sqlite":
            return
        if self.schema is None and "schema" not in self.unread:
            found.add(
                "schema",
                "a SQLite rule needs 'schema' (or 'schema_file'): the columns of every table in "
                "'tables', which SQLite's own compiler checks each statement against",
            )
        elif "schema" not in self.unread:
            for table in sorted(allowed - set(columns), key=str):
                found.add("schema", f"the table {str(table)!r} of 'tables' has no columns here")
            for table in sorted(set(columns), key=str):
                if table.db not in ("", "main") or table.catalog:
                    found.add("schema", f"{str(table)!r}: SQLite tables are named without a schema")
        if self.max_statements != 1 and "max_statements" not in self.unread:
            found.add("max_statements", "a SQLite rule allows one statement per call")

    def _server(self, found: _Problems) -> None:
        """The server's major version is the one whose parser is installed."""
        if "server_version" in self.unread:
            return
        # Only a PostgreSQL rule loads PostgreSQL's parser (pglast): to read its major here.
        from gateway.checks.sql.pg_version import PARSER_MAJOR, PGLAST_VERSION

        parser = f"PostgreSQL {PARSER_MAJOR}'s parser (pglast {PGLAST_VERSION})"
        if self.server_version is None:
            found.add(
                "server_version",
                f"a PostgreSQL rule states the server's major version (server_version: N); "
                f"capgate reads SQL with {parser}",
            )
        elif self.server_version != PARSER_MAJOR:
            found.add(
                "server_version",
                f"the server is PostgreSQL {self.server_version} but capgate reads SQL with "
                f"{parser}: install the pglast major that embeds PostgreSQL "
                f"{self.server_version}'s parser (see README, 'SQL checks')",
            )

    def _mysql(self, dialect: str | None, found: _Problems) -> frozenset[str] | None:
        """MySQL's ``sql_mode`` (as ``SELECT @@GLOBAL.sql_mode`` prints it) and the
        parameter forms; both MySQL settings only."""
        if dialect != "mysql":
            for key in ("sql_mode", "parameters"):
                if getattr(self, key) not in (None, ()) and key not in self.unread:
                    found.add(key, "is a MySQL setting (dialect: mysql)")
            return None
        for i, form in enumerate(self.parameters):
            if form not in MYSQL_PARAMETER_FORMS:
                found.add("parameters", f"{form!r}: MySQL's parameter form is '?'", i)
        if self.sql_mode is None or "sql_mode" in self.unread:
            return None
        modes: set[str] = set()
        for name in (m.strip().upper() for m in self.sql_mode.split(",")):
            if not name:
                continue
            if name in MYSQL_GRAMMAR_MODES:
                found.add(
                    "sql_mode",
                    f"{name} changes MySQL's grammar beyond what capgate reads; not supported",
                )
            elif name in MYSQL_COMBINED_MODES:
                modes |= MYSQL_COMBINED_MODES[name]
            elif name in MYSQL_MODES:
                modes.add(name)
            else:
                found.add("sql_mode", f"{name!r} is not a MySQL or MariaDB sql_mode")
        return frozenset(modes)

    def _functions(self, found: _Problems) -> set[str]:
        functions: set[str] = set()
        for i, name in enumerate(self.functions):
            try:
                functions.add(parse_function_name(name))
            except ValueError as exc:
                found.add("functions", str(exc), i)
        return functions


class _Problems(list[SettingProblem]):
    """The problems found while resolving settings, in the order found."""

    def add(self, key: str, message: str, item: int | str | None = None) -> None:
        self.append(SettingProblem(key, item, message))

    def in_range(self, key: str, value: int, minimum: int, maximum: int) -> None:
        if value < minimum:
            self.add(key, f"must be at least {minimum}, got {value}")
        elif value > maximum:
            self.add(key, f"must be at most {maximum}, got {value}")


def _in_schema(table: TableName, default: str | None) -> TableName:
    """``table`` in the default schema when it names none (as ``SqlRules.canonical`` does)."""
    return TableName(table.catalog, table.db or default or "", table.name)
