"""JSON Schemas written in a policy: read strictly, compiled once, asserted fully.

A schema in a policy is a security rule, so a typo must not weaken it silently. Where a
validator would ignore what it does not know (``additionalProperty: false`` is an unknown
keyword, and so allows every extra field), ``compile_schema`` refuses the policy instead,
naming the file, line and column of the keyword:

- every keyword must be one of Draft 2020-12 (the ones the validator implements plus the
  annotations the specification defines); ``x-`` keywords are free-form annotations;
- ``$schema``, when given, must name Draft 2020-12; ``$id``, ``$dynamicRef``,
  ``$dynamicAnchor`` and ``$vocabulary`` are refused (a policy schema is self-contained);
- every ``$ref`` must point inside the schema (``#...``) and resolve when the policy loads:
  nothing is ever fetched, and no reference fails for the first time on an agent's call;
- ``format`` is an assertion, not an annotation: every format must be one the validator can
  check (the Draft 2020-12 set), and values that do not conform are refused.

``pattern`` and ``patternProperties`` follow the specification: they *search* (a match
anywhere in the string passes), so anchor them (``^...$``) to constrain a whole value.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Iterator
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from gateway.checks.format_libraries import load_format
from gateway.policy_file import Node

DRAFT = "https://json-schema.org/draft/2020-12/schema"
FORMAT_CHECKER = Draft202012Validator.FORMAT_CHECKER

# Keywords whose value is one schema, a list of schemas, or a mapping of names to schemas.
ONE_SCHEMA = frozenset(
    {
        "additionalProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "items",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
        "contentSchema",
    }
)
SCHEMA_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
SCHEMA_MAP = frozenset({"properties", "patternProperties", "dependentSchemas", "$defs"})

# Draft 2020-12 keywords the validator does not implement as assertions of their own:
# annotations, and the keywords read by another one (then/else by if, min/maxContains by
# contains).
ANNOTATIONS = frozenset(
    {
        "$schema",
        "$anchor",
        "$comment",
        "$defs",
        "title",
        "description",
        "default",
        "deprecated",
        "readOnly",
        "writeOnly",
        "examples",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
        "then",
        "else",
        "minContains",
        "maxContains",
    }
)
REFUSED = {
    "$id": "a policy schema is self-contained; it has no $id",
    "$dynamicRef": "dynamic references are not supported in policy schemas",
    "$dynamicAnchor": "dynamic references are not supported in policy schemas",
    "$vocabulary": "a policy schema uses Draft 2020-12's vocabularies only",
    "definitions": "'definitions' is not a Draft 2020-12 keyword; use '$defs'",
    "dependencies": "'dependencies' is not a Draft 2020-12 keyword; use 'dependentRequired' "
    "or 'dependentSchemas'",
}
KEYWORDS = frozenset(Draft202012Validator.VALIDATORS) - {"$dynamicRef"} | ANNOTATIONS


def _unknown(keyword: str) -> str:
    close = difflib.get_close_matches(keyword, sorted(KEYWORDS), n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown JSON Schema keyword {keyword!r}{hint}; a validator would ignore it"


def _subschemas(keyword: str, value: Node) -> Iterator[Node]:
    if keyword in ONE_SCHEMA:
        yield value
    elif keyword in SCHEMA_LIST and isinstance(value.value, list):
        yield from value.as_list() or ()
    elif keyword in SCHEMA_MAP and isinstance(value.value, dict):
        yield from (child for _, child in value.entries())


def _lint(node: Node, refs: list[Node]) -> None:
    """Report unknown or refused keywords, unchecked formats and collect ``$ref``s, anywhere
    in the schema under ``node``."""
    if not isinstance(node.value, dict):
        return  # a boolean schema, or a wrong type the meta-schema check reports
    for key, value in node.entries():
        keyword = key.value
        if keyword.startswith("x-"):
            continue
        if keyword in REFUSED:
            key.fail(f"{node.where}: {REFUSED[keyword]}")
        elif keyword not in KEYWORDS:
            key.fail(f"{node.where}: {_unknown(keyword)}")
        elif keyword == "$schema" and value.value != DRAFT:
            value.fail(f"{value.where}: policy schemas are Draft 2020-12 ({DRAFT!r})")
        elif keyword == "format" and value.value not in FORMAT_CHECKER.checkers:
            value.fail(
                f"{value.where}: format {value.value!r} cannot be checked; "
                f"known formats: {', '.join(sorted(FORMAT_CHECKER.checkers))}"
            )
        elif keyword == "$ref":
            refs.append(value)
        if keyword == "format" and isinstance(value.value, str):
            load_format(value.value)  # now, while the policy loads, not on an agent's call
        for sub in _subschemas(keyword, value):
            _lint(sub, refs)


def _check_refs(schema: Any, refs: list[Node]) -> None:
    resolver = Registry().resolver_with_root(DRAFT202012.create_resource(schema))
    for ref in refs:
        target = ref.value
        if not isinstance(target, str) or not target.startswith("#"):
            ref.fail(f"{ref.where}: $ref must point inside the schema ('#/...'), got {target!r}")
            continue
        try:
            resolver.lookup(target)
        except Unresolvable:
            ref.fail(f"{ref.where}: $ref {target!r} points to nothing in this schema")


def pointer(path: Any) -> str:
    return (
        "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path) if path else ""
    )


def compile_schema(node: Node) -> Draft202012Validator | None:
    """The validator for the schema at ``node``, or None with the problems recorded at their
    positions in the policy file."""
    schema = node.plain()
    if not isinstance(schema, dict | bool):
        node.fail(f"{node.where}: a JSON Schema must be a mapping")
        return None
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = pointer(exc.absolute_path) or "/"
        node.fail(f"{node.where}: invalid JSON Schema at {where}: {exc.message}")
        return None
    before = len(node.issues)
    refs: list[Node] = []
    _lint(node, refs)
    _check_refs(schema, refs)
    if len(node.issues) > before:
        return None
    return Draft202012Validator(schema, format_checker=FORMAT_CHECKER)


def schema_errors(
    validator: Draft202012Validator, value: Any, limit: int = 5
) -> list[dict[str, Any]]:
    """Up to ``limit`` errors of ``value`` against ``validator``, by JSON pointer (at most
    ``limit * 10`` are looked at: a body failing everywhere costs no more than one failing
    a little)."""
    found = itertools.islice(validator.iter_errors(value), limit * 10)
    errors = sorted(found, key=lambda e: [str(p) for p in e.absolute_path])
    return [
        {
            "pointer": pointer(err.absolute_path),
            "keyword": str(err.validator),
            "message": err.message[:300],
        }
        for err in errors[:limit]
    ]
