"""PostgreSQL: PostgreSQL's own parser (libpg_query, through ``pglast``) reads the text.

The checks walk the parse tree PostgreSQL's grammar builds (its JSON form: fast to make and
to read), so a dollar-quote tag, a Unicode-escaped identifier, a parameter or a comment is
whatever PostgreSQL says it is. The parser's major version must be the server's: a rule
states ``server_version`` and a rule the installed parser does not match is refused when the
policy loads (``PARSER_MAJOR``).

What is checked, on the tree:

- statement kinds: the root, and data-modifying statements in CTEs; utility statements
  (SET, COPY, DO, CALL, EXPLAIN, LISTEN, transactions ...) never pass;
- tables, each ``RangeVar``: a CTE only where SQL's scoping makes it visible (a CTE body sees
  the CTEs before it; under RECURSIVE, itself too; a DML target is always a table), system
  catalogs (``pg_*``, ``information_schema``) need ``allow: [system_catalogs]``;
- denied columns, resolved through FROM scopes: qualified and unqualified references,
  ``*`` and ``t.*`` (EXISTS too: PostgreSQL checks the privileges of every column ``*``
  expands to), whole-row references (``SELECT c FROM customers c``, ``(c).ssn``), aliased
  joins (``(a JOIN b) AS j``: ``j.*``, ``j``, ``j.ssn`` reach the joined tables), column
  aliases on a guarded table, ``NATURAL JOIN`` and ``USING`` comparing a denied column, and
  INSERT / UPDATE / MERGE writes; a derived table or CTE is checked where it is defined, so
  what it outputs was checked already;
- functions: the allow-list, by the name PostgreSQL's grammar gives them (a schema-qualified
  or quoted name is not the plain one), table functions included; ``SQLValueFunction``
  (``current_user`` ...) by its SQL name;
- INTO and locking clauses, the outermost LIMIT.

Server settings the parser cannot know are stated by the rule (``standard_conforming_strings``);
a text whose reading would depend on one that is not stated is refused.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from pglast import parser as pg_parser

from gateway.checks.sql.cache import Lru
from gateway.checks.sql.limits import MAX_NESTING, MAX_NODES, SHAPE_MAX_JSON
from gateway.checks.sql.names import TableName, is_catalog
from gateway.checks.sql.options import SqlFamily, SqlKind
from gateway.checks.sql.pg_version import PARSER_MAJOR
from gateway.checks.sql.reading import Reading, count_statements
from gateway.checks.sql.violations import Denial, Refusal, Violation, at, position, ranked

if TYPE_CHECKING:
    from gateway.checks.sql.settings import SqlRules


Json = dict[str, Any]

_ROOT_KINDS: dict[str, SqlKind] = {
    "SelectStmt": SqlKind.SELECT,
    "InsertStmt": SqlKind.INSERT,
    "UpdateStmt": SqlKind.UPDATE,
    "DeleteStmt": SqlKind.DELETE,
    "MergeStmt": SqlKind.MERGE,
    "CreateStmt": SqlKind.CREATE,
    "CreateTableAsStmt": SqlKind.CREATE,
    "ViewStmt": SqlKind.CREATE,
    "IndexStmt": SqlKind.CREATE,
    "DropStmt": SqlKind.DROP,
    "AlterTableStmt": SqlKind.ALTER,
    "TruncateStmt": SqlKind.TRUNCATE,
}
# Functions PostgreSQL's grammar makes from SQL syntax (EXTRACT(... FROM ...), POSITION(... IN
# ...), TRIM(...), x AT TIME ZONE z, ...), named pg_catalog.<name> with COERCE_SQL_SYNTAX.
_SQL_SYNTAX = frozenset(
    {"extract", "position", "substring", "btrim", "ltrim", "rtrim", "overlay", "timezone"}
    | {"similar_to_escape", "overlaps", "normalize", "is_normalized"}
)
_SVF_NAMES = {
    "SVFOP_CURRENT_DATE": "current_date",
    "SVFOP_CURRENT_TIME": "current_time",
    "SVFOP_CURRENT_TIME_N": "current_time",
    "SVFOP_CURRENT_TIMESTAMP": "current_timestamp",
    "SVFOP_CURRENT_TIMESTAMP_N": "current_timestamp",
    "SVFOP_LOCALTIME": "localtime",
    "SVFOP_LOCALTIME_N": "localtime",
    "SVFOP_LOCALTIMESTAMP": "localtimestamp",
    "SVFOP_LOCALTIMESTAMP_N": "localtimestamp",
}


@dataclass(slots=True)
class _Source:
    """A FROM item as a scope sees it."""

    kind: str  # "table" (real), "join" (an aliased join), "derived" (subquery, CTE, function)
    table: TableName | None = None  # a real table on the rule's list (None: refused already)
    outputs: frozenset[str] | None = None  # derived: its column names, None when unknown
    members: list[_Source] = field(default_factory=list)  # join: the sources it joins
    plain: bool = True  # named by the table name itself (no alias): schema.table.col works

    def tables(self) -> tuple[_Source, ...]:
        """The real tables this source reads: itself, those of a join's members, or none."""
        if self.kind == "table":
            return (self,)
        if self.kind == "join":
            return tuple(t for member in self.members for t in member.tables())
        return ()


@dataclass(slots=True)
class _Scope:
    parent: _Scope | None
    sources: dict[str, _Source] = field(default_factory=dict)

    def chain(self) -> Iterator[_Scope]:
        scope: _Scope | None = self
        while scope is not None:
            yield scope
            scope = scope.parent


def _names(items: list[Json] | None) -> list[str]:
    return [str(i["String"]["sval"]) for i in items or () if "String" in i]


def _unwrap(node: Json) -> tuple[str, Json]:
    ((kind, value),) = node.items()
    return kind, value


# The node types ``_Reader.node`` looks at; the walk goes through every other one.
_LOOKED_AT = frozenset(
    {"ColumnRef", "A_Const", "FuncCall", "SubLink", "SQLValueFunction", "RangeVar", "A_Expr"}
    | {"SelectStmt", "InsertStmt", "UpdateStmt", "DeleteStmt", "MergeStmt"}
    | {"XmlExpr", "XmlSerialize", "RangeTableFunc"}
)


class _Reader:
    """One walk over one statement's tree, collecting what it reaches and what is wrong."""

    def __init__(self, rules: SqlRules, text: str, reading: Reading) -> None:
        self.rules = rules
        self.text = text
        self.reading = reading
        self.violations: list[Violation] = []
        self._ascii = text.isascii()
        self._bytes: bytes | None = None
        self.depth = 0  # queries nested in queries
        self.nodes = 0  # tree nodes walked
        self.joins = 0  # FROM items beyond the first, in every query

    # -- reporting -------------------------------------------------------------------------

    def where(self, location: Any) -> dict[str, Any]:
        if not isinstance(location, int) or location < 0:
            return {}
        offset = location
        if not self._ascii:  # the parser counts bytes of UTF-8
            self._bytes = self._bytes or self.text.encode("utf-8")
            offset = len(self._bytes[:location].decode("utf-8", errors="ignore"))
        return position(self.text, min(offset, len(self.text)))

    def refuse(self, kind: Denial, detail: str, found: str, location: Any = None) -> None:
        where = self.where(location)
        self.violations.append(Violation(kind, detail.replace("{at}", at(where)), found, **where))

    def denied(self, source: _Source) -> frozenset[str]:
        if source.table is None:
            return frozenset()
        return self.rules.deny_columns.get(source.table, frozenset())

    # -- statements ------------------------------------------------------------------------

    def root(self, node: Json) -> None:
        kind_name, body = _unwrap(node)
        kind = _ROOT_KINDS.get(kind_name)
        if kind is None:
            word = kind_name.removesuffix("Stmt").lower() or "statement"
            raise Refusal.of(Denial.COMMAND, f"a {word.upper()} statement is never allowed", word)
        self.reading.kinds.add(kind.value)
        if kind not in self.rules.statements:
            allowed = ", ".join(sorted(self.rules.statements))
            raise Refusal.of(
                Denial.STATEMENT,
                f"{kind.value.upper()} statements are not allowed by the rule (allowed: {allowed})",
                kind.value,
            )
        if kind_name == "SelectStmt":
            self.select(body, None, {})
        elif kind_name in ("InsertStmt", "UpdateStmt", "DeleteStmt", "MergeStmt"):
            self.dml(kind_name, body, None, {})
        else:
            self.ddl(kind_name, body)
            self.walk(body, _Scope(None), {})

    def ddl(self, kind_name: str, body: Json) -> None:
        """The tables a DDL statement creates, changes or drops are on the rule's list."""
        for key in ("relation", "view"):
            if isinstance(body.get(key), dict):
                self.range_var(body[key], {}, source=False)
        into = body.get("into")
        if isinstance(into, dict) and isinstance(into.get("rel"), dict):
            self.range_var(into["rel"], {}, source=False)
        if kind_name == "DropStmt":
            for item in body.get("objects", ()):
                names = _names(item.get("List", {}).get("items"))
                if names:
                    self.range_var(
                        dict(
                            zip(
                                ("catalogname", "schemaname", "relname"),
                                (["", "", ""] + names)[-3:],
                                strict=True,
                            )
                        ),
                        {},
                        source=False,
                    )

    def statement(self, node: Json, parent: _Scope | None, ctes: dict[str, _Source]) -> Any:
        """A statement below the root (in a CTE, a subquery): its output names."""
        kind_name, body = _unwrap(node)
        if kind_name == "SelectStmt":
            return self.select(body, parent, ctes)
        kind = _ROOT_KINDS.get(kind_name)
        if kind_name in ("InsertStmt", "UpdateStmt", "DeleteStmt", "MergeStmt"):
            assert kind is not None
            self.reading.kinds.add(kind.value)
            if kind not in self.rules.statements:
                self.refuse(
                    Denial.STATEMENT,
                    f"a {kind.value.upper()} nested inside the statement (in a CTE){{at}} is not "
                    "allowed by the rule",
                    kind.value,
                    body.get("relation", {}).get("location"),
                )
            return self.dml(kind_name, body, parent, ctes)
        self.refuse(Denial.COMMAND, "a statement inside the SQL is never allowed", kind_name)
        return None

    def with_clause(
        self, clause: Json, parent: _Scope | None, ctes: dict[str, _Source]
    ) -> dict[str, _Source]:
        visible = dict(ctes)
        recursive = bool(clause.get("recursive"))
        if recursive and SqlFamily.RECURSIVE not in self.rules.allow:
            self.refuse(
                Denial.RECURSIVE,
                "WITH RECURSIVE{at} generates rows without a bound; it is not allowed "
                "(allow: [recursive] opts in)",
                "recursive",
                clause.get("location"),
            )
        for item in clause.get("ctes", ()):
            cte = item["CommonTableExpr"]
            name = str(cte["ctename"])
            declared = _names(cte.get("aliascolnames"))
            own = _Source("derived", outputs=frozenset(declared) if declared else None)
            body_sees = dict(visible)
            if recursive:
                body_sees[name] = own
            outputs = self.statement(cte["ctequery"], parent, body_sees)
            if not declared:
                own.outputs = outputs
            visible[name] = own
        return visible

    def select(
        self, s: Json, parent: _Scope | None, ctes: dict[str, _Source]
    ) -> frozenset[str] | None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise Refusal.of(
                Denial.DEPTH,
                f"the SQL nests queries more than {MAX_NESTING} levels deep",
                "nesting",
            )
        try:
            return self._select(s, parent, ctes)
        finally:
            self.depth -= 1

    def _select(
        self, s: Json, parent: _Scope | None, ctes: dict[str, _Source]
    ) -> frozenset[str] | None:
        if "withClause" in s:
            ctes = self.with_clause(s["withClause"], parent, ctes)
        self.clauses(s, ctes)
        if s.get("op", "SETOP_NONE") != "SETOP_NONE":
            outputs = self.select(s["larg"], parent, ctes)
            self.select(s["rarg"], parent, ctes)
            scope = _Scope(parent)  # ORDER BY / LIMIT of a set operation: its output columns
            for key in ("sortClause", "limitCount", "limitOffset"):
                if key in s:
                    self.walk(s[key], scope, ctes)
            return outputs
        scope = _Scope(parent)
        for item in s.get("fromClause", ()):
            self.from_item(item, scope, ctes)
        self.count_joins(len(s.get("fromClause", ())) - 1)
        for key in (
            "targetList", "whereClause", "groupClause", "havingClause", "windowClause",
            "sortClause", "distinctClause", "limitCount", "limitOffset", "valuesLists",
        ):  # fmt: skip
            if key in s:
                self.walk(s[key], scope, ctes)
        return _outputs(s.get("targetList"))

    def clauses(self, s: Json, ctes: dict[str, _Source]) -> None:
        """INTO and locking clauses of one SELECT."""
        allow = self.rules.allow
        into = s.get("intoClause")
        if into is not None:
            rel = into.get("rel", {})
            if SqlFamily.INTO not in allow:
                self.refuse(
                    Denial.INTO,
                    "SELECT ... INTO{at} writes a table; it is not allowed (allow: [into] opts in)",
                    "into",
                    rel.get("location"),
                )
            else:
                self.range_var(rel, ctes, source=False)
        for lock in s.get("lockingClause", ()):
            if SqlFamily.LOCKING not in allow:
                self.refuse(
                    Denial.LOCK,
                    "a locking clause (FOR UPDATE / FOR SHARE) is not allowed "
                    "(allow: [locking] opts in)",
                    "lock",
                )
                break
            self.walk(lock, _Scope(None), ctes)

    def dml(
        self, kind_name: str, s: Json, parent: _Scope | None, ctes: dict[str, _Source]
    ) -> frozenset[str] | None:
        if "withClause" in s:
            ctes = self.with_clause(s["withClause"], parent, ctes)
        relation = s["relation"]
        target = self.range_var(relation, ctes, source=False)
        scope = _Scope(parent)
        alias = relation.get("alias", {}).get("aliasname")
        scope.sources[str(alias or relation["relname"])] = target
        if kind_name == "InsertStmt":
            self.insert(s, target, scope, ctes)
        elif kind_name == "MergeStmt":
            self.from_item(s["sourceRelation"], scope, ctes)
            self.merge_writes(s, target)
        else:
            self.writes(s.get("targetList", ()), target)
            for item in [*s.get("fromClause", ()), *s.get("usingClause", ())]:
                self.from_item(item, scope, ctes)
        for key in ("targetList", "whereClause", "returningList", "joinCondition"):
            if key in s:
                self.walk(s[key], scope, ctes)
        if "mergeWhenClauses" in s:
            self.walk(s["mergeWhenClauses"], scope, ctes)
        return _outputs(s.get("returningList"))

    def insert(self, s: Json, target: _Source, scope: _Scope, ctes: dict[str, _Source]) -> None:
        if "selectStmt" in s:
            self.statement(s["selectStmt"], scope.parent, ctes)
        denied = self.denied(target)
        cols = [rt["ResTarget"] for rt in s.get("cols", ())]
        if denied and not cols:
            self.refuse(
                Denial.COLUMN,
                f"an INSERT into {target.table} without a column list writes its denied "
                "column(s); list the columns",
                f"{target.table}.*",
                s["relation"].get("location"),
            )
        self.writes(s.get("cols", ()), target)
        conflict = s.get("onConflictClause")
        if conflict is not None:
            self.writes(conflict.get("targetList", ()), target)
            scope.sources["excluded"] = target
            self.walk(conflict, scope, ctes)

    def merge_writes(self, s: Json, target: _Source) -> None:
        for clause in s.get("mergeWhenClauses", ()):
            when = clause.get("MergeWhenClause", {})
            self.writes(when.get("targetList", ()), target)
            if when.get("commandType") == "CMD_INSERT" and not when.get("targetList"):
                if self.denied(target):
                    self.refuse(
                        Denial.COLUMN,
                        f"a MERGE ... INSERT into {target.table} without a column list writes "
                        "its denied column(s)",
                        f"{target.table}.*",
                    )

    def writes(self, targets: Any, target: _Source) -> None:
        """SET col = ... / INSERT (col, ...): no denied column is written."""
        denied = self.denied(target)
        for item in targets or ():
            rt = item.get("ResTarget", {})
            name = rt.get("name")
            if name in denied:
                self.refuse(
                    Denial.COLUMN,
                    f"the statement writes the denied column {target.table}.{name}{{at}}",
                    f"{target.table}.{name}",
                    rt.get("location"),
                )

    # -- FROM ----------------------------------------------------------------------------------

    def range_var(self, rv: Json, ctes: dict[str, _Source], *, source: bool) -> _Source:
        """A table name: a visible CTE (as a FROM source), or a table the rule must allow."""
        rel = str(rv.get("relname", ""))
        schema = str(rv.get("schemaname", ""))
        catalog = str(rv.get("catalogname", ""))
        plain = "alias" not in rv
        if source and not schema and not catalog and rel in ctes:
            cte = ctes[rel]
            return _Source("derived", outputs=cte.outputs, plain=plain)
        name = TableName(catalog, schema, rel)
        location = rv.get("location")
        if is_catalog(name, "postgres"):
            if SqlFamily.SYSTEM_CATALOGS in self.rules.allow:
                self.reading.tables.add(str(name))
                return _Source("table", plain=plain)
            self.refuse(
                Denial.CATALOG,
                f"the system catalog {name}{{at}} is not allowed",
                str(name),
                location,
            )
            return _Source("table", plain=plain)
        canon = self.rules.canonical(name)
        if canon not in self.rules.tables:
            listed = ", ".join(sorted(str(t) for t in self.rules.tables))
            self.refuse(
                Denial.TABLE,
                f"the table {name}{{at}} is not in the rule's tables ({listed})",
                str(name),
                location,
            )
            return _Source("table", plain=plain)
        self.reading.tables.add(str(canon))
        return _Source("table", table=canon, plain=plain)

    def from_item(self, item: Json, scope: _Scope, ctes: dict[str, _Source]) -> _Source:
        kind, node = _unwrap(item)
        alias = node.get("alias") or {}
        name = alias.get("aliasname")
        colnames = _names(alias.get("colnames"))
        if kind == "RangeVar":
            source = self.range_var(node, ctes, source=True)
            name = name or node.get("relname")
            if colnames and self.denied(source):
                self.refuse(
                    Denial.COLUMN,
                    f"{source.table} has denied column(s) and cannot be given column aliases{{at}}",
                    str(name),
                    node.get("location"),
                )
        elif kind == "RangeSubselect":
            sees = scope if node.get("lateral") else scope.parent
            outputs = self.statement(node["subquery"], sees, ctes)
            source = _Source("derived", outputs=frozenset(colnames) if colnames else outputs)
        elif kind == "JoinExpr":
            source = self.join(node, scope, ctes, colnames)
        elif kind == "RangeFunction":
            sees = scope if node.get("lateral") else (scope.parent or _Scope(None))
            self.walk(node.get("functions"), sees, ctes, table_function=True)
            source = _Source("derived", outputs=frozenset(colnames) if colnames else None)
            name = name or "function"
        elif kind == "RangeTableSample":
            source = self.from_item(node["relation"], scope, ctes)
            self.walk(node.get("args"), scope, ctes)
            return source
        else:
            self.refuse(Denial.FUNCTION, f"the FROM item {kind}{{at}} is not allowed", kind.lower())
            return _Source("derived")
        if name is not None:
            scope.sources[str(name)] = source
        return source

    def join(
        self, node: Json, scope: _Scope, ctes: dict[str, _Source], colnames: list[str]
    ) -> _Source:
        alias = (node.get("alias") or {}).get("aliasname")
        # An aliased join hides the names inside it; its ON clause still sees them.
        inner = _Scope(scope.parent) if alias else scope
        left = self.from_item(node["larg"], inner, ctes)
        right = self.from_item(node["rarg"], inner, ctes)
        joined = _Source("join", members=[left, right])
        self.count_joins(1)
        guarded = [t for t in joined.tables() if self.denied(t)]
        if guarded and node.get("isNatural"):
            self.refuse(
                Denial.COLUMN,
                "NATURAL JOIN compares every same-named column, including the denied column(s) "
                f"of {guarded[0].table}; join ON named columns instead",
                "natural join",
            )
        for using in _names(node.get("usingClause")):
            for table in guarded:
                if using in self.denied(table):
                    self.refuse(
                        Denial.COLUMN,
                        f"JOIN ... USING ({using}) compares the denied column "
                        f"{table.table}.{using}",
                        f"{table.table}.{using}",
                    )
        if colnames and guarded:
            self.refuse(
                Denial.COLUMN,
                f"a join of {guarded[0].table} (denied column(s)) cannot be given column aliases",
                str(alias),
            )
        if "quals" in node:
            self.walk(node["quals"], inner, ctes)
        if alias:
            return _Source("join", members=[left, right], plain=False)
        return joined

    def count_joins(self, more: int) -> None:
        self.joins += max(more, 0)
        if self.joins > self.rules.max_joins:
            raise Refusal.of(
                Denial.COMPLEX,
                f"the SQL joins more than {self.rules.max_joins} times (max_joins); each join "
                "multiplies what the database may have to read",
                "joins",
            )

    # -- expressions -------------------------------------------------------------------------

    def walk(
        self, node: Any, scope: _Scope, ctes: dict[str, _Source], *, table_function: bool = False
    ) -> None:
        """Every node below ``node`` (iteratively: operator chains are deep).

        A node is a one-key dict whose key is a node type (``{"ColumnRef": {...}}``); the
        types ``_LOOKED_AT`` are looked at (``node``), every other is walked through."""
        stack: list[Any] = [node]
        pop, push, extend = stack.pop, stack.append, stack.extend
        looked_at = _LOOKED_AT
        while stack:
            item = pop()
            kind = type(item)  # orjson makes exactly dict and list
            if kind is list:
                extend(item)
                continue
            if kind is not dict:
                continue
            self.nodes += 1
            if self.nodes > MAX_NODES:
                raise Refusal.of(
                    Denial.COMPLEX, f"the SQL has more than {MAX_NODES} syntax nodes", "nodes"
                )
            if len(item) == 1:
                ((key, value),) = item.items()
                if type(value) is dict and key[:1].isupper():
                    if key in looked_at:
                        children = self.node(key, value, scope, ctes, table_function)
                        if children is not None:
                            push(children)
                    else:
                        push(value)
                    continue
            extend(item.values())

    def node(
        self, kind: str, value: Json, scope: _Scope, ctes: dict[str, _Source], table_fn: bool
    ) -> Any:
        """Look at one node; return what is still to be walked below it."""
        if kind == "ColumnRef":
            self.column_ref(value, scope)
            return None
        if kind == "A_Const":  # a literal value: nothing in it is checked (see ``shape``)
            return None
        if kind == "FuncCall":
            self.function(value, table_fn)
            return [value.get(k) for k in ("args", "agg_order", "agg_filter", "over")]
        if kind == "SubLink":
            if (
                value.get("subLinkType") == "ARRAY_SUBLINK"
                and "array_agg" not in self.rules.functions
            ):
                self.refuse(
                    Denial.FUNCTION,
                    "ARRAY(subquery){at} packs every row into one value; it is allowed only "
                    "with array_agg in the rule's functions",
                    "array_agg",
                    value.get("location"),
                )
            self.statement(value["subselect"], scope, ctes)
            return value.get("testexpr")
        if kind == "SQLValueFunction":
            self.value_function(value)
            return None
        if kind in ("SelectStmt", "InsertStmt", "UpdateStmt", "DeleteStmt", "MergeStmt"):
            self.statement({kind: value}, scope, ctes)
            return None
        if kind == "RangeVar":
            self.range_var(value, ctes, source=False)
            return None
        if kind == "A_Expr" and len(value.get("name", ())) > 1:
            self.refuse(
                Denial.FUNCTION,
                "a schema-qualified operator OPERATOR(...){at} is not allowed",
                ".".join(_names(value["name"])),
                value.get("location"),
            )
        if kind in ("XmlExpr", "XmlSerialize", "RangeTableFunc"):
            self.refuse(
                Denial.FUNCTION, "XML functions{at} are not allowed", "xml", value.get("location")
            )
            return None
        return value

    def function(self, call: Json, table_fn: bool) -> None:
        names = _names(call.get("funcname"))
        location = call.get("location")
        what = "table function" if table_fn else "function"
        if call.get("funcformat") == "COERCE_SQL_SYNTAX" and names[:1] == ["pg_catalog"]:
            name = names[-1]
            if name in _SQL_SYNTAX or name in self.rules.functions:
                return
        elif len(names) > 1:
            qualified = ".".join(names)
            self.refuse(
                Denial.FUNCTION,
                f"the schema-qualified function {qualified}(){{at}} is not allowed",
                qualified,
                location,
            )
            return
        else:
            name = names[0] if names else ""
            if name in self.rules.functions:
                return
        self.refuse(
            Denial.FUNCTION,
            f"the {what} {name}(){{at}} is not on the rule's list of allowed functions",
            name,
            location,
        )

    def value_function(self, value: Json) -> None:
        op = str(value.get("op", ""))
        name = _SVF_NAMES.get(op) or op.removeprefix("SVFOP_").lower()
        if name not in self.rules.functions:
            self.refuse(
                Denial.FUNCTION,
                f"the function {name}{{at}} is not on the rule's list of allowed functions",
                name,
                value.get("location"),
            )

    # -- columns -----------------------------------------------------------------------------

    def column_ref(self, ref: Json, scope: _Scope) -> None:
        fields = ref.get("fields", ())
        names = _names(fields)
        location = ref.get("location")
        if fields and "A_Star" in fields[-1]:
            self.star(names, scope, location)
        elif len(names) == 1:
            self.unqualified(names[0], scope, location)
        elif names:
            self.qualified(names[:-1], names[-1], scope, location)

    def lookup(self, qualifier: list[str], scope: _Scope) -> tuple[_Source, _Scope] | None:
        for level in scope.chain():
            if len(qualifier) == 1:
                found = level.sources.get(qualifier[0])
                if found is not None:
                    return found, level
                continue
            wanted = self.rules.canonical(TableName(*(["", "", ""] + qualifier)[-3:]))
            for source in level.sources.values():
                if source.plain and source.table == wanted:
                    return source, level
        return None

    def star(self, qualifier: list[str], scope: _Scope, location: Any) -> None:
        if qualifier:
            found = self.lookup(qualifier, scope)
            sources = [found[0]] if found is not None else []
        else:
            sources = list(scope.sources.values())
        for source in sources:
            for table in source.tables():
                denied = self.denied(table)
                if denied:
                    self.refuse(
                        Denial.COLUMN,
                        f"* over {table.table}{{at}} includes the denied column(s) "
                        f"{', '.join(sorted(denied))}; name the columns instead",
                        f"{table.table}.*",
                        location,
                    )

    def qualified(self, qualifier: list[str], name: str, scope: _Scope, location: Any) -> None:
        found = self.lookup(qualifier, scope)
        if found is None:
            if name in self.rules.denied_names:
                self.refuse(
                    Denial.COLUMN,
                    f"the column {'.'.join(qualifier)}.{name}{{at}} cannot be resolved to a "
                    "table, and a column of that name is denied",
                    f"{'.'.join(qualifier)}.{name}",
                    location,
                )
            return
        for table in found[0].tables():
            if table.table is not None:
                self.reading.columns.add(f"{table.table}.{name}")
            if name in self.denied(table):
                self.refuse(
                    Denial.COLUMN,
                    f"the column {table.table}.{name}{{at}} is denied by the rule",
                    f"{table.table}.{name}",
                    location,
                )

    def unqualified(self, name: str, scope: _Scope, location: Any) -> None:
        sources = list(scope.sources.values())
        if len(sources) == 1 and sources[0].kind == "table" and sources[0].table is not None:
            self.reading.columns.add(f"{sources[0].table}.{name}")
        if not self.rules.deny_columns:
            return
        self.whole_row(name, scope, location)
        if name not in self.rules.denied_names:
            return
        for level in scope.chain():
            certain = False
            for source in level.sources.values():
                if source.kind == "derived":
                    certain = certain or (source.outputs is not None and name in source.outputs)
                    continue
                for table in source.tables():
                    columns = self.rules.schema.get(table.table) if table.table else None
                    if columns is not None and name not in columns:
                        continue
                    if name in self.denied(table):
                        self.refuse(
                            Denial.COLUMN,
                            f"the column {name}{{at}} may be {table.table}.{name}, which is "
                            "denied by the rule",
                            f"{table.table}.{name}",
                            location,
                        )
                        return
                    certain = certain or columns is not None
            if certain:
                return

    def whole_row(self, name: str, scope: _Scope, location: Any) -> None:
        """A table or alias used as a value is the whole row, unless a column of that name
        is certainly in scope first (PostgreSQL prefers the column)."""
        found = self.lookup([name], scope)
        if found is None:
            return
        source, level = found
        guarded = [t for t in source.tables() if self.denied(t)]
        if not guarded:
            return
        for inner in scope.chain():
            for other in inner.sources.values():
                if other.kind == "derived":
                    if other.outputs and name in other.outputs:
                        return
                    continue
                for table in other.tables():
                    if table.table and name in self.rules.schema.get(table.table, ()):
                        return
            if inner is level:
                break
        self.refuse(
            Denial.COLUMN,
            f"{name}{{at}} refers to whole rows of {guarded[0].table}, which include a denied "
            "column",
            name,
            location,
        )


def _outputs(targets: Any) -> frozenset[str] | None:
    """The column names a target list outputs; None when a * makes them unknown."""
    names: set[str] = set()
    for item in targets or ():
        rt = item.get("ResTarget", {})
        if "name" in rt:
            names.add(str(rt["name"]))
            continue
        val = rt.get("val", {})
        ref = val.get("ColumnRef")
        if ref is None:
            continue
        fields = ref.get("fields", ())
        if fields and "A_Star" in fields[-1]:
            return None
        names.update(_names(fields)[-1:])
    return frozenset(names)


# --- the text, as PostgreSQL's lexer reads it ---------------------------------------------


def _parse_error(text: str, exc: Exception) -> Refusal:
    message = str(exc.args[0]) if exc.args else "syntax error"
    offset = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], int) else None
    where = position(text, min(max(offset, 0), len(text))) if offset is not None else {}
    return Refusal.of(
        Denial.PARSE,
        f"the SQL is not valid PostgreSQL {PARSER_MAJOR}: {message}{at(where)}",
        message[:80],
        **where,
    )


def _strings_problems(rules: SqlRules, text: str) -> None:
    """Refuse string literals whose reading depends on standard_conforming_strings, unless
    the rule states the server's setting (and the parser reads it the same way: on)."""
    if "\\" not in text or rules.standard_conforming_strings is True:
        return
    try:
        tokens = pg_parser.scan(text)
    except pg_parser.ParseError as exc:
        raise _parse_error(text, exc) from None
    for token in tokens:
        if token.name not in ("SCONST", "USCONST"):
            continue
        literal = text[token.start : token.end + 1]
        if "\\" not in literal or literal.startswith("$"):
            continue
        stated = rules.standard_conforming_strings
        why = (
            "the rule does not state the server's standard_conforming_strings"
            if stated is None
            else "the server has standard_conforming_strings off, which the parser does not read"
        )
        where = position(text, token.start)
        raise Refusal.of(
            Denial.PARSE,
            f"a string literal with a backslash{at(where)}: its end depends on the server's "
            f"setting, and {why}",
            literal[:40],
            **where,
        )


def _end_in_code(text: str) -> int:
    """Offset after the last token that is code (not a comment, not ';'), from the lexer."""
    try:
        tokens = pg_parser.scan(text)
    except pg_parser.ParseError:
        return -1
    for token in reversed(tokens):
        if token.name in ("SQL_COMMENT", "C_COMMENT") or text[token.start : token.end + 1] == ";":
            continue
        return int(token.end) + 1
    return -1


def _limit(rules: SqlRules, root: Json) -> bool:
    """True when the outermost query has no LIMIT; refuse one that is not a small literal."""
    maximum = rules.max_limit
    kind, s = _unwrap(root)
    if maximum is None or kind != "SelectStmt":
        return False
    option = s.get("limitOption", "LIMIT_OPTION_DEFAULT")
    if option == "LIMIT_OPTION_DEFAULT":
        return True
    if option != "LIMIT_OPTION_COUNT":
        raise Refusal.of(
            Denial.LIMIT, "FETCH ... WITH TIES can return more rows than the rule allows", "fetch"
        )
    count = s.get("limitCount", {})
    const = count.get("A_Const", {})
    value = const.get("ival", {}).get("ival", 0) if "ival" in const else None
    if not isinstance(value, int) or value < 0:
        raise Refusal.of(
            Denial.LIMIT,
            f"the LIMIT is not a literal integer; the rule requires LIMIT <= {maximum}",
            "limit",
        )
    if value > maximum:
        raise Refusal.of(
            Denial.LIMIT, f"LIMIT {value} is above the rule's maximum of {maximum}", str(value)
        )
    return False


# --- the tree's shape: texts that differ only in their literals ---------------------------
#
# The walk's verdict depends on the tree PostgreSQL's parser builds, but never on a location
# (those only place a refusal's message) nor on a literal's value (the walk does not enter an
# ``A_Const``), except the LIMIT's, which ``_limit`` reads. So an allowed reading is
# remembered under the tree's shape: its JSON with every location and every literal's value
# but a ``limitCount``'s taken out. Two texts of the same shape (``o.id > 41``, ``o.id > 42``)
# are one walk. The shape is the parser's own tree, not a normalized text or a fingerprint:
# a parameter ($1) is a ``ParamRef``, never confused with a literal, and aliases, names,
# operators and types all stay. No pattern can start inside a JSON string (every quote in one
# is escaped), so only the parser's own keys match; ``tests/checks/test_sql_pg_shape.py``
# holds the result equal to the same cut made on the decoded tree.

_LOCATIONS = re.compile(r',"location":-?[0-9]+')  # a first key stays: sound, only less shared
_STATEMENT_PLACES = re.compile(r',"stmt_(?:location|len)":[0-9]+')
_VALUE = re.compile(
    r'("A_Const":(?<!"limitCount":\{"A_Const":)\{"(ival|fval|sval|bsval|boolval)":\{)'
    r'"\2":(?:-?[0-9]+|true|false|"(?:[^"\\]|\\.)*")\}'
)


def shape(tree_json: str) -> str:
    """The parser's JSON tree without locations and literal values (but a LIMIT's)."""
    cut = _LOCATIONS.sub("", _VALUE.sub(r"\1}", tree_json))
    return _STATEMENT_PLACES.sub("", cut) if '"stmt_' in cut else cut


@dataclass(frozen=True, slots=True)
class _Known:
    """An allowed reading, remembered by shape."""

    kinds: frozenset[str]
    tables: frozenset[str]
    columns: frozenset[str]
    statements: int
    missing_limit: bool

    def reading(self) -> Reading:
        return Reading(
            set(self.kinds),
            set(self.tables),
            set(self.columns),
            self.statements,
            self.missing_limit,
        )


Shapes = Lru[bytes, _Known]


def read(
    rules: SqlRules,
    text: str,
    shapes: Shapes | None = None,
    learned: list[tuple[bytes, _Known, int]] | None = None,
) -> Reading:
    """PostgreSQL's reading of ``text`` under ``rules``; raise ``Refusal``. With ``shapes``,
    a text of a remembered shape is not walked; an allowed reading's shape is added to
    ``learned`` (the caller remembers it once the whole check has allowed the text within
    its backstop)."""
    _strings_problems(rules, text)
    try:
        tree_json = pg_parser.parse_sql_json(text)
    except pg_parser.ParseError as exc:
        raise _parse_error(text, exc) from None
    key = None
    if shapes is not None and len(tree_json) <= SHAPE_MAX_JSON:
        key = hashlib.blake2b(shape(tree_json).encode(), digest_size=32).digest()
        known = shapes.get(key)
        if known is not None:
            return _ended(rules, text, known.reading())
    try:
        tree = orjson.loads(tree_json)
    except orjson.JSONDecodeError:
        raise Refusal.of(Denial.DEPTH, "the SQL is nested too deeply to be checked") from None
    statements = [s["stmt"] for s in tree.get("stmts", ())]
    count_statements(len(statements), rules.max_statements)
    reading = Reading(statements=len(statements))
    for root in statements:
        reader = _Reader(rules, text, reading)
        reader.root(root)
        if reader.violations:
            raise ranked(reader.violations)
    for root in statements:
        if _limit(rules, root):
            reading.missing_limit = True
    if key is not None and learned is not None:
        known = _Known(
            frozenset(reading.kinds),
            frozenset(reading.tables),
            frozenset(reading.columns),
            reading.statements,
            reading.missing_limit,
        )
        learned.append((key, known, len(text)))  # its names come from the text: bounded by it
    return _ended(rules, text, reading)


def _ended(rules: SqlRules, text: str, reading: Reading) -> Reading:
    """Where a LIMIT could be appended to ``text``, when one is missing (from its tokens)."""
    if reading.missing_limit and rules.add_limit and reading.statements == 1:
        reading.end = _end_in_code(text)
    return reading
