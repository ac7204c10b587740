"""The ``sql:`` key of a policy rule: read from the policy file into a ``SqlBodyCheck``.

The reader checks the shape of what is written (a mapping, lists of strings, integers, where
the SQL is) and hands the values to ``SqlSettings``, which alone decides whether they are
valid; each of its problems is reported at the FILE:LINE:COL of the key, list item or schema
entry it names (``Node.fail``), all of them in one pass. Importing this module registers the
reader for the ``sql`` rule key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from gateway.checks.sql.adapter import SqlBodyCheck
from gateway.checks.sql.limits import DEFAULT_MAX_JOINS, MAX_SQL_LENGTH
from gateway.checks.sql.options import DIALECTS, SqlFamily, SqlKind
from gateway.checks.sql.policy import SqlPolicy
from gateway.checks.sql.settings import SettingProblem, SqlSettings, SqlSettingsError
from gateway.payload import CheckContext
from gateway.policy_file import Node

_T = TypeVar("_T")

_FIELD_PATH = re.compile(r"[^.\s]+(?:\.[^.\s]+)*")


def _strings(description: str, items: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "array", "items": items or {"type": "string"}, "description": description}


# The ``sql:`` key, as the policy file's JSON Schema describes it (``policy/spec.py``).
SQL_KEY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "SQL in the call, checked as the database reads it",
    "properties": {
        "dialect": {"enum": list(DIALECTS), "description": "the database's SQL dialect"},
        "field": {"type": "string", "description": "the JSON body field holding the SQL"},
        "body": {"enum": ["raw"], "description": "raw: the whole body is the SQL"},
        "argument": {"type": "string", "description": "MCP: the tool argument holding it"},
        "statements": _strings(
            "statement kinds allowed (default select)", {"enum": [k.value for k in SqlKind]}
        ),
        "max_statements": {"type": "integer", "minimum": 1, "description": "default 1"},
        "tables": _strings("the only tables the SQL may name"),
        "default_schema": {"type": "string", "description": "schema of unqualified names"},
        "schema": {
            "type": "object",
            "additionalProperties": {"type": "array", "items": {"type": "string"}},
            "description": "table -> its columns (needed to see denied columns behind *)",
        },
        "schema_file": {"type": "string", "description": "the same, in a YAML/JSON file"},
        "deny_columns": _strings("table.column pairs never read or written"),
        "functions": _strings("functions allowed beyond the safe default list"),
        "max_limit": {"type": "integer", "minimum": 1, "description": "largest LIMIT"},
        "add_limit": {"type": "boolean", "description": "add LIMIT max_limit when absent"},
        "allow": _strings("constructs denied unless named", {"enum": [f.value for f in SqlFamily]}),
        "max_length": {"type": "integer", "minimum": 1, "description": "longest SQL text"},
        "max_joins": {
            "type": "integer",
            "minimum": 0,
            "description": "joins per statement (default 3): each one multiplies the rows read",
        },
        "server_version": {
            "type": "integer",
            "description": "PostgreSQL: the server's major version (required; must be the "
            "version whose parser capgate has installed)",
        },
        "standard_conforming_strings": {
            "type": ["boolean", "string"],
            "enum": [True, False, "on", "off"],
            "description": "PostgreSQL: the server's setting; when not stated, string literals "
            "with a backslash are refused",
        },
        "sql_mode": {
            "type": "string",
            "description": "MySQL: the server's sql_mode as SELECT @@GLOBAL.sql_mode prints it; "
            "when not stated, backslashes, double-quoted strings and || are refused",
        },
        "parameters": _strings("MySQL: the parameter forms allowed ('?')", {"enum": ["?"]}),
    },
    "required": ["dialect", "tables"],
    "additionalProperties": False,
}
# The keys the loader reads, from the schema above: the one place they are declared.
SQL_KEYS: tuple[str, ...] = tuple(SQL_KEY_SCHEMA["properties"])
SQL_REQUIRED: tuple[str, ...] = tuple(SQL_KEY_SCHEMA["required"])


class _Schema:
    """A schema as read (table -> column names), and the node to blame for each entry."""

    def __init__(self, file: Node | None = None, path: str = "") -> None:
        self.columns: dict[str, list[str]] = {}
        self.nodes: dict[str, Node] = {}
        self.file = file  # the schema_file node, when the schema was read from a file
        self.path = path

    def fail(self, table: str, message: str) -> None:
        entry = self.nodes[table]
        if self.file is None:
            entry.fail(f"{entry.where}: {message}")
        else:
            self.file.fail(f"{self.file.where}: in {self.path!r}: {entry.where}: {message}")


def _schema_from_node(node: Node, schema: _Schema) -> bool:
    """Read the entries of a schema mapping into ``schema``; False when it is not a mapping."""
    if not isinstance(node.value, dict):
        node.fail(f"{node.where}: expected a mapping of table -> list of columns")
        return False
    for key, value in node.entries():
        if isinstance(value.value, dict):
            names = [str(k) for k in value.value]
        else:
            listed = value.as_str_list()
            if listed is None:
                continue
            names = listed
        schema.columns[key.value] = names
        schema.nodes[key.value] = value
    return True


def _schema_from_file(node: Node) -> _Schema | None:
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
    schema = _Schema(file=node, path=str(path))
    _schema_from_node(sub, schema)
    for issue in sub.issues:
        node.fail(f"{node.where}: in {str(path)!r}: {issue.message}")
    return schema if not sub.issues else None


class _Reader:
    """Reads the values of a ``sql:`` mapping into ``SqlSettings``, checking only their types.

    Whether the values are valid is for ``SqlSettings`` to say; its problems are reported here
    at the node of the key, list item or schema entry they name.
    """

    def __init__(self, node: Node, m: dict[str, Node]) -> None:
        self.node = node
        self.m = m
        self.unread: set[str] = {key for key in ("dialect", "tables") if key not in m}
        self.items: dict[str, list[Node]] = {}  # list key -> the node of each item read
        self.schema: _Schema | None = None

    def settings(self) -> SqlSettings:
        m = self.m
        return SqlSettings(
            dialect=m["dialect"].value if "dialect" in m else "",
            tables=self.strings("tables", "a table name", empty_ok=True),
            statements=self.strings("statements", "a statement kind", ("select",), empty_ok=True),
            max_statements=self.integer("max_statements", 1),
            default_schema=self.string("default_schema", "a schema name"),
            schema=self.read_schema(),
            deny_columns=self.strings("deny_columns", "a column"),
            functions=self.strings("functions", "a function name"),
            max_limit=self.integer("max_limit", None),
            add_limit=self.boolean("add_limit"),
            allow=self.strings("allow", "a family to allow"),
            max_length=self.integer("max_length", MAX_SQL_LENGTH),
            max_joins=self.integer("max_joins", DEFAULT_MAX_JOINS),
            server_version=self.integer("server_version", None),
            standard_conforming_strings=self.on_off("standard_conforming_strings"),
            sql_mode=self.string("sql_mode", "a sql_mode"),
            parameters=self.strings("parameters", "a parameter form"),
            unread=frozenset(self.unread),
        )

    def strings(
        self, key: str, what: str, default: tuple[str, ...] = (), *, empty_ok: bool = False
    ) -> tuple[str, ...]:
        """A list of strings. An empty list says nothing and is refused here, except where the
        settings judge it themselves (``empty_ok``: statements and tables need at least one)."""
        if key not in self.m:
            return default
        node = self.m[key]
        items = node.as_list()
        if items is None:
            self.unread.add(key)
            return ()
        if not items and not empty_ok:
            node.fail(f"{node.where}: expected at least one {what}")
        values: list[str] = []
        nodes: list[Node] = []
        for item in items:
            value = item.as_str(what=what)
            if value is None:
                self.unread.add(key)
            else:
                values.append(value)
                nodes.append(item)
        self.items[key] = nodes
        return tuple(values)

    def string(self, key: str, what: str) -> str | None:
        if key not in self.m:
            return None
        value = self.m[key].as_str(what=what)
        if value is None:
            self.unread.add(key)
        return value

    def integer(self, key: str, default: _T) -> int | _T:
        if key not in self.m:
            return default
        value = self.m[key].as_int()
        if value is None:
            self.unread.add(key)
            return default
        return value

    def boolean(self, key: str) -> bool:
        if key not in self.m:
            return False
        value = self.m[key].as_bool()
        if value is None:
            self.unread.add(key)
        return bool(value)

    def on_off(self, key: str) -> bool | None:
        """A server setting: true/false, or PostgreSQL's on/off."""
        if key not in self.m:
            return None
        node = self.m[key]
        if isinstance(node.value, bool):
            return bool(node.value)
        if node.value in ("on", "off"):
            return str(node.value) == "on"
        node.fail(f"{node.where}: expected on or off, got {node.value!r}")
        self.unread.add(key)
        return None

    def read_schema(self) -> dict[str, list[str]] | None:
        m = self.m
        if "schema" in m and "schema_file" in m:
            m["schema_file"].fail(f"{self.node.where}: give 'schema' or 'schema_file', not both")
            self.schema = None
        elif "schema" in m:
            self.schema = _Schema()
            if not _schema_from_node(m["schema"], self.schema):
                self.schema = None
        elif "schema_file" in m:
            self.schema = _schema_from_file(m["schema_file"])
        else:
            return None
        if self.schema is None:
            self.unread.add("schema")
            return None
        return self.schema.columns

    def report(self, problem: SettingProblem) -> None:
        """Record a problem of the settings at the node it names."""
        if problem.key == "schema" and isinstance(problem.item, str) and self.schema is not None:
            self.schema.fail(problem.item, problem.message)
            return
        node = self.m.get(problem.key, self.node)
        if isinstance(problem.item, int):
            node = self.items[problem.key][problem.item]
        node.fail(f"{node.where}: {problem.message}")


def compile_sql_check(node: Node, context: CheckContext) -> SqlBodyCheck | None:
    """The ``sql:`` key of a rule -> ``SqlBodyCheck``; errors go to ``node.fail``."""
    issues_before = len(node.issues)
    m = node.as_map(required=SQL_REQUIRED, optional=SQL_KEYS)
    if m is None:
        return None
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

    # What it may do: read here, judged by SqlSettings.
    reader = _Reader(node, m)
    try:
        policy = SqlPolicy.from_settings(reader.settings(), rule_id=rule_id)
    except SqlSettingsError as exc:
        for problem in exc.problems:
            reader.report(problem)
        return None
    if len(node.issues) > issues_before:
        return None
    return SqlBodyCheck(
        policy=policy, rule_id=rule_id, field=field_path, raw=raw, argument=argument
    )
