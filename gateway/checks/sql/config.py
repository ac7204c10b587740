"""The ``sql:`` key of a policy rule: read from the policy file into a ``SqlBodyCheck``.

Errors are reported with the FILE:LINE:COL of the value at fault (``Node.fail``), all of them
in one pass. Importing this module registers the reader for the ``sql`` rule key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from gateway.checks.sql.adapter import SqlBodyCheck
from gateway.checks.sql.limits import MAX_LIMIT, MAX_SQL_LENGTH, MAX_STATEMENTS
from gateway.checks.sql.names import (
    TableName,
    _is_catalog,
    column_key,
    parse_column_name,
    parse_function_name,
    parse_identifier,
    parse_table_name,
)
from gateway.checks.sql.options import DIALECTS, SqlFamily, SqlKind
from gateway.checks.sql.policy import SqlPolicy
from gateway.policy.load import register_payload_check
from gateway.policy.source import Node

_FIELD_PATH = re.compile(r"[^.\s]+(?:\.[^.\s]+)*")

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


def compile_sql_check(node: Node, context: dict[str, Any]) -> SqlBodyCheck | None:
    """The ``sql:`` key of a rule -> ``SqlBodyCheck``; errors go to ``node.fail``."""
    issues_before = len(node.issues)
    m = node.as_map(required=("dialect", "tables"), optional=SQL_KEYS)
    if m is None:
        return None
    dialect = m["dialect"].as_choice(DIALECTS) if "dialect" in m else None
    rule_id = context.get("rule_id")
    tool = context.get("tool")
    upstream = context.get("upstream")

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
    elif upstream is not None and getattr(upstream, "kind", "http") == "mcp":
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

    max_limit = m["max_limit"].as_int(minimum=1, maximum=MAX_LIMIT) if "max_limit" in m else None
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
        policy=policy, rule_id=rule_id, field=field_path, raw=raw, argument=argument, tool=tool
    )


register_payload_check("sql", compile_sql_check)
