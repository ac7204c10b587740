"""JSON bodies: strict parsing and JSON Schema (Draft 2020-12) validation.

A rule's ``body:`` gives a ``schema`` (compiled once, when the policy loads) and optionally
``max_size``. A body that is not UTF-8 JSON, has a duplicated key (parsers disagree on which
value wins), is nested absurdly deep, or fails the schema is refused with ``body_invalid``;
``errors`` carries the failing JSON pointer and the schema keyword.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from gateway.errors import BodyInvalid, PayloadTooLarge
from gateway.policy.load import register_payload_check
from gateway.policy.source import Node

if TYPE_CHECKING:
    from gateway.call import Call

MAX_DEPTH = 64


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise BodyInvalid(f"the JSON body has a duplicated key {key!r}")
        out[key] = value
    return out


def _depth(value: Any, limit: int = MAX_DEPTH) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise BodyInvalid(f"the JSON body is nested deeper than {limit} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _reject_constant(name: str) -> Any:
    raise BodyInvalid(f"the JSON body contains {name}, which is not JSON")


def parse_json(data: bytes) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, bounded depth."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyInvalid("the body is not UTF-8 text") from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except BodyInvalid:
        raise
    except RecursionError:
        raise BodyInvalid(f"the JSON body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise BodyInvalid(f"the body is not valid JSON: {exc.args[0]}") from None
    _depth(value)
    return value


def call_json(call: Call) -> Any:
    """The call's body parsed as strict JSON, once per call (checks share the result)."""
    if "json" not in call.facts:
        content_type = call.headers.get("Content-Type", "")
        media = content_type.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise BodyInvalid("the body must be sent with Content-Type: application/json")
        call.facts["json"] = parse_json(call.body or b"")
    return call.facts["json"]


def pointer(path: Any) -> str:
    return (
        "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path) if path else ""
    )


def schema_errors(
    validator: Draft202012Validator, value: Any, limit: int = 5
) -> list[dict[str, Any]]:
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    out: list[dict[str, Any]] = []
    for err in errors[:limit]:
        out.append(
            {
                "pointer": pointer(err.absolute_path),
                "keyword": str(err.validator),
                "message": err.message[:300],
            }
        )
    return out


def compile_schema(node: Node) -> Draft202012Validator | None:
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
    # jsonschema never fetches remote $refs by default: an unknown $ref fails closed.
    return Draft202012Validator(schema)


@dataclass(frozen=True, slots=True)
class BodyCheck:
    kind = "body"
    validator: Draft202012Validator
    max_size: int | None
    rule_id: str | None

    def check(self, call: Call) -> None:
        body = call.body or b""
        if self.max_size is not None and len(body) > self.max_size:
            raise PayloadTooLarge(
                f"the body is larger than the rule's limit of {self.max_size} bytes",
                rule=self.rule_id,
            )
        value = call_json(call)
        errors = schema_errors(self.validator, value)
        if errors:
            first = errors[0]
            raise BodyInvalid(
                f"the body does not match the rule's schema at {first['pointer'] or '/'}: "
                f"{first['message']}",
                rule=self.rule_id,
                errors=errors,
            )


def compile_body(node: Node, context: dict[str, Any]) -> BodyCheck | None:
    m = node.as_map(required=("schema",), optional=("max_size",))
    if m is None or "schema" not in m:
        return None
    validator = compile_schema(m["schema"])
    max_size = m["max_size"].as_size() if "max_size" in m else None
    if validator is None:
        return None
    return BodyCheck(validator=validator, max_size=max_size, rule_id=context.get("rule_id"))


register_payload_check("body", compile_body)
