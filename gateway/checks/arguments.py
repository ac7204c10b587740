"""MCP arguments: the rule's JSON Schema (Draft 2020-12) for the arguments of a ``tools/call``
or a ``prompts/get``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator

from gateway.checks.json_schema import compile_schema, schema_errors
from gateway.errors import InternalError, McpDenied, ToolDenied
from gateway.payload import ArgumentsPayload, CheckContext, Payload, ToolCallPayload
from gateway.policy_file import Node


@dataclass(frozen=True, slots=True)
class ArgumentsCheck:
    """The rule's JSON Schema for one tool call's ``arguments``."""

    kind = "arguments"
    validator: Draft202012Validator
    rule_id: str | None

    def check(self, payload: Payload) -> None:
        if not isinstance(payload, ArgumentsPayload):
            raise InternalError(f"rule {self.rule_id!r}: an arguments check was given a body")
        errors = schema_errors(self.validator, payload.arguments)
        if errors:
            first = errors[0]
            error = ToolDenied if isinstance(payload, ToolCallPayload) else McpDenied
            raise error(
                f"arguments of {payload.what} {payload.name!r} do not match the rule's schema "
                f"at {first['pointer'] or '/'}: {first['message']}",
                rule=self.rule_id,
                errors=errors,
            )


ARGUMENTS_KEY_SCHEMA: dict[str, Any] = {
    "type": ["object", "boolean"],
    "description": "MCP: a JSON Schema (Draft 2020-12) for the tool's or prompt's arguments",
}


def compile_arguments(node: Node, context: CheckContext) -> ArgumentsCheck | None:
    if context.tool is None and context.prompt is None:
        node.fail(f"{node.where}: 'arguments' needs the rule to name a 'tool' or a 'prompt'")
        return None
    validator = compile_schema(node)
    if validator is None:
        return None
    return ArgumentsCheck(validator, context.rule_id)
