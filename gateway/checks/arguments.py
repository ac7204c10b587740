"""MCP tool arguments: the rule's JSON Schema (Draft 2020-12) for a ``tools/call``'s input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator

from gateway.checks.body import compile_schema, schema_errors
from gateway.errors import InternalError, ToolDenied
from gateway.payload import CheckContext, Payload, ToolCallPayload
from gateway.policy_file import Node


@dataclass(frozen=True, slots=True)
class ArgumentsCheck:
    """The rule's JSON Schema for one tool call's ``arguments``."""

    kind = "arguments"
    validator: Draft202012Validator
    rule_id: str | None

    def check(self, payload: Payload) -> None:
        if not isinstance(payload, ToolCallPayload):
            raise InternalError(f"rule {self.rule_id!r}: an arguments check was given a body")
        errors = schema_errors(self.validator, payload.arguments)
        if errors:
            first = errors[0]
            raise ToolDenied(
                f"arguments of tool {payload.tool!r} do not match the rule's schema at "
                f"{first['pointer'] or '/'}: {first['message']}",
                rule=self.rule_id,
                errors=errors,
            )


ARGUMENTS_KEY_SCHEMA: dict[str, Any] = {
    "type": ["object", "boolean"],
    "description": "MCP: a JSON Schema (Draft 2020-12) for the tool call's arguments",
}


def compile_arguments(node: Node, context: CheckContext) -> ArgumentsCheck | None:
    if context.tool is None:
        node.fail(f"{node.where}: 'arguments' needs the rule to name a 'tool'")
        return None
    validator = compile_schema(node)
    if validator is None:
        return None
    return ArgumentsCheck(validator, context.rule_id)
