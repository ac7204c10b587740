"""JSON bodies: strict parsing and JSON Schema (Draft 2020-12) validation.

A rule's ``body:`` gives a ``schema`` (compiled once, when the policy loads, and read
strictly: ``checks/json_schema.py``) and optionally ``max_size``. A body that is not UTF-8
JSON, has a duplicated key (parsers disagree on which value wins), is nested absurdly deep,
or fails the schema is refused with ``body_invalid``; ``errors`` carries the failing JSON
pointer and the schema keyword.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator

from gateway.checks.json_schema import compile_schema, schema_errors
from gateway.errors import BodyInvalid, InternalError, PayloadTooLarge
from gateway.payload import BodyPayload, CheckContext, Payload
from gateway.policy_file import Node


@dataclass(frozen=True, slots=True)
class BodyCheck:
    """A rule's ``body:``: the body it takes, up to ``max_size``, and its JSON Schema (none:
    any bytes, which the rule accepts knowingly)."""

    kind = "body"
    validator: Draft202012Validator | None
    max_size: int | None
    rule_id: str | None

    def check(self, payload: Payload) -> None:
        if not isinstance(payload, BodyPayload):
            raise InternalError(f"rule {self.rule_id!r}: a body check was given a tool call")
        if self.max_size is not None and len(payload.raw) > self.max_size:
            raise PayloadTooLarge(
                f"the body is larger than the rule's limit of {self.max_size} bytes",
                rule=self.rule_id,
            )
        if self.validator is None:
            return
        errors = schema_errors(self.validator, payload.json())
        if errors:
            first = errors[0]
            raise BodyInvalid(
                f"the body does not match the rule's schema at {first['pointer'] or '/'}: "
                f"{first['message']}",
                rule=self.rule_id,
                errors=errors,
            )


# The ``body:`` key, as the policy file's JSON Schema describes it (``policy/spec.py``).
BODY_KEY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "the body the rule takes: a JSON Schema (Draft 2020-12) for a JSON body, "
    "and/or a size limit (a rule without body, sql or arguments takes no body)",
    "properties": {
        "schema": {"type": ["object", "boolean"], "description": "the body's JSON Schema"},
        "max_size": {
            "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string"}],
            "description": "largest body this rule takes (a size such as 16KiB)",
        },
    },
    "minProperties": 1,
    "additionalProperties": False,
}


def compile_body(node: Node, context: CheckContext) -> BodyCheck | None:
    if context.tool is not None or context.upstream_kind == "mcp":
        node.fail(
            f"{node.where}: 'body' checks a plain HTTP body; an MCP tool's input is checked "
            "with 'arguments'"
        )
        return None
    m = node.as_map(optional=tuple(BODY_KEY_SCHEMA["properties"]))
    if m is None:
        return None
    if not m:
        node.fail(f"{node.where}: say what body the rule takes: 'schema', 'max_size' or both")
        return None
    validator = compile_schema(m["schema"]) if "schema" in m else None
    max_size = m["max_size"].as_size() if "max_size" in m else None
    if "schema" in m and validator is None:
        return None
    return BodyCheck(validator=validator, max_size=max_size, rule_id=context.rule_id)
