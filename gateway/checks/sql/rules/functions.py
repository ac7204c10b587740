"""Functions are an allow-list, checked by the name the database resolves.

Unknown functions (``pg_sleep``, ``dblink``, ``load_extension``, ...) are ``exp.Anonymous``
and a deny-list would miss new ones. Names are taken from the source text, so ``to_char`` is
``to_char`` even though sqlglot models it as ``TimeToStr``; table functions are functions too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlglot import exp

from gateway.checks.sql.violations import Denial, Violation, at

if TYPE_CHECKING:
    from gateway.checks.sql.statement import Statement

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


def function_name(statement: Statement, node: exp.Func) -> tuple[str, bool]:
    """(name as MySQL resolves it, whether it came from the source text)."""
    if isinstance(node, _OPERATOR_BASES):
        return node.key, False
    if isinstance(node, exp.Anonymous):
        this = node.this
        name = this.name if isinstance(this, exp.Identifier) else str(this)
        from_text = True
    else:
        start, end = node.meta.get("start"), node.meta.get("end")
        if isinstance(start, int) and isinstance(end, int):
            if start in statement.parsed.quoted:
                name = statement.parsed.quoted[start]
            else:
                name = statement.text[start : end + 1]
            from_text = True
        else:
            name, from_text = node.key, False
    return name.lower(), from_text  # MySQL function names ignore case, quoted or not


def function_problem(statement: Statement, node: exp.Func) -> Violation | None:
    """The function is allowed by the rule, called by its plain name (not schema-qualified)."""
    name, from_text = function_name(statement, node)
    parent = node.parent
    if isinstance(parent, exp.Dot) and parent.expression is node:
        where = statement.where(node)
        qualifier = parent.this.sql(dialect=statement.dialect)
        return Violation(
            Denial.FUNCTION,
            f"the schema-qualified function {qualifier}.{name}(){at(where)} is not allowed",
            f"{qualifier}.{name}",
            **where,
        )
    allowed = statement.rules.functions
    if isinstance(node, _OPERATOR_BASES):
        ok = node.key in _SAFE_OPERATORS
    elif from_text:
        ok = name in allowed
    else:
        names = {node.key, *(n.lower() for n in type(node).sql_names())}
        ok = node.key in _SYNTAX_FUNCTIONS or not names.isdisjoint(allowed)
    if ok:
        return None
    where = statement.where(node)
    as_source = isinstance(parent, exp.Table)
    what = "table function" if as_source else "function"
    return Violation(
        Denial.FUNCTION,
        f"the {what} {name}(){at(where)} is not on the rule's list of allowed functions",
        name,
        **where,
    )
