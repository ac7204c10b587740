"""MCP (Streamable HTTP) calls: tool names and arguments checked, ``tools/list`` filtered.

An upstream of ``kind: mcp`` speaks JSON-RPC 2.0 over Streamable HTTP. For each POST the
gateway parses the JSON-RPC message (or batch) before anything is matched:

- ``tools/call``: the tool name selects the rule (``tool: <name>``); a tool that no rule of
  the token's roles allows is refused with ``tool_denied`` and never reaches the server.
  The rule's ``arguments`` schema and SQL policy check the call's ``arguments``.
- protocol methods (``initialize``, ``ping``, ``tools/list``, notifications, and the
  client's answers to server requests) pass when the roles grant any rule on the endpoint.
- every other method (``resources/read``, ``prompts/get``, ...) is refused: nothing is
  allowed that the policy does not name.
- batches are checked message by message; one refused message refuses the batch.
- the result of ``tools/list`` (JSON or SSE) is filtered to the tools the token may call.

Denials of an MCP call are answered as JSON-RPC errors (HTTP 200), so MCP clients surface
the gateway's reason; ``error.data`` carries the same fields as problem+json.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator

from gateway.checks.body import compile_schema, parse_json, schema_errors
from gateway.errors import BadRequest, BodyInvalid, GatewayError, ToolDenied
from gateway.policy.load import register_payload_check
from gateway.policy.source import Node

if TYPE_CHECKING:
    from gateway.call import Call
    from gateway.policy.model import Upstream

# Protocol methods that carry no tool call: the handshake (initialize, or server/discover in
# the 2026-07-28 protocol), liveness, and the tool listing (filtered on the way back).
PASS_METHODS = frozenset({"initialize", "server/discover", "ping", "tools/list"})
JSONRPC_DENIED = -32001  # implementation-defined server error range (-32000..-32099)


@dataclass(slots=True)
class McpMessage:
    id: Any
    method: str | None
    tool: str | None
    arguments: dict[str, Any] | None
    is_request: bool


def _message(value: Any, index: int) -> McpMessage:
    where = f"message {index}" if index >= 0 else "the message"
    if not isinstance(value, dict) or value.get("jsonrpc") != "2.0":
        raise BodyInvalid(f"{where} is not a JSON-RPC 2.0 object")
    method = value.get("method")
    if method is None:
        # A response from the client to a server request (sampling, elicitation, roots).
        if "result" not in value and "error" not in value:
            raise BodyInvalid(f"{where} has neither a method nor a result")
        return McpMessage(value.get("id"), None, None, None, False)
    if not isinstance(method, str):
        raise BodyInvalid(f"{where}: 'method' must be a string")
    msg_id = value.get("id")
    if "id" in value and (isinstance(msg_id, bool) or not isinstance(msg_id, str | int)):
        raise BodyInvalid(f"{where}: 'id' must be a string or an integer")
    tool, arguments = None, None
    if method == "tools/call":
        params = value.get("params")
        if not isinstance(params, dict):
            raise BodyInvalid(f"{where}: tools/call needs 'params' as an object")
        tool = params.get("name")
        if not isinstance(tool, str) or not tool:
            raise BodyInvalid(f"{where}: tools/call needs 'params.name' as a string")
        arguments = params.get("arguments", {})
        if not isinstance(arguments, dict):
            raise BodyInvalid(f"{where}: tools/call 'params.arguments' must be an object")
    return McpMessage(msg_id, method, tool, arguments, "id" in value)


def parse_messages(body: bytes) -> tuple[list[McpMessage], bool]:
    """The JSON-RPC messages of a POST body and whether it was a batch."""
    value = parse_json(body)
    if isinstance(value, list):
        if not value:
            raise BodyInvalid("an empty JSON-RPC batch")
        if len(value) > 100:
            raise BodyInvalid("a JSON-RPC batch of more than 100 messages")
        return [_message(v, i) for i, v in enumerate(value)], True
    return [_message(value, -1)], False


class McpGate:
    """Parses MCP requests for ``match_policy`` and rewrites ``tools/list`` responses."""

    def __init__(self, gw: Any) -> None:
        self.gw = gw

    async def inspect_request(self, call: Call, upstream: Upstream) -> None:
        if call.method != "POST":
            # GET opens the server's event stream; DELETE ends the session.
            return
        body = await call.read_body(upstream.max_request_body)
        messages, batch = parse_messages(body)
        call.facts["mcp"] = {"messages": messages, "batch": batch}
        for msg in messages:
            if msg.method is None or msg.method in PASS_METHODS:
                continue
            if msg.method.startswith("notifications/") and not msg.is_request:
                continue
            if msg.method != "tools/call":
                raise ToolDenied(f"the MCP method {msg.method!r} is not allowed by the policy")
        _check_routing_headers(call, messages, batch)
        tools = [m.tool for m in messages if m.tool is not None]
        if len(tools) > 1:
            # SECURITY: a batch of tool calls was checked, limited and counted as its first
            # tool only; until every message is governed on its own, such a batch is refused.
            raise ToolDenied(
                f"a JSON-RPC batch may carry at most one tools/call (this one has {len(tools)})"
            )
        if tools:
            call.tool = tools[0]

    def allowed_tools(self, call: Call) -> set[str]:
        assert call.claims is not None and call.policy is not None and call.target is not None
        rules = call.policy.candidates(
            call.claims.roles, call.claims.caps, call.target.upstream, "POST"
        )
        return {r.tool for r in rules if r.tool is not None}


def _check_routing_headers(call: Call, messages: list[McpMessage], batch: bool) -> None:
    """The 2026-07-28 routing headers must say what the body says: anything that routes or
    logs by header would otherwise act on a call other than the one checked."""
    method_header = call.headers.getall("Mcp-Method", [])
    name_header = call.headers.getall("Mcp-Name", [])
    if not method_header and not name_header:
        return
    if batch or len(method_header) > 1 or len(name_header) > 1:
        raise BodyInvalid("MCP routing headers are ambiguous for this request")
    msg = messages[0]
    if method_header and method_header[0] != msg.method:
        raise BodyInvalid("the Mcp-Method header does not match the JSON-RPC method")
    if name_header and msg.tool is not None and _header_text(name_header[0]) != msg.tool:
        raise BodyInvalid("the Mcp-Name header does not match the tool name")


def _header_text(value: str) -> str | None:
    """MCP header values that are not plain ASCII travel as ``=?base64?...?=``."""
    if value.startswith("=?base64?") and value.endswith("?="):
        try:
            return base64.b64decode(value[9:-2], validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None
    return value


def tool_messages(call: Call, tool: str | None = None) -> list[McpMessage]:
    info = call.facts.get("mcp")
    if not info:
        return []
    return [m for m in info["messages"] if m.tool is not None and (tool is None or m.tool == tool)]


@dataclass(frozen=True, slots=True)
class ArgumentsCheck:
    """The rule's JSON Schema for the tool's ``arguments``."""

    kind = "arguments"
    validator: Draft202012Validator
    rule_id: str | None
    tool: str | None

    def check(self, call: Call) -> None:
        for msg in tool_messages(call, self.tool):
            errors = schema_errors(self.validator, msg.arguments or {})
            if errors:
                first = errors[0]
                raise ToolDenied(
                    f"arguments of tool {msg.tool!r} do not match the rule's schema at "
                    f"{first['pointer'] or '/'}: {first['message']}",
                    rule=self.rule_id,
                    errors=errors,
                )


def compile_arguments(node: Node, context: dict[str, Any]) -> ArgumentsCheck | None:
    if context.get("tool") is None:
        node.fail(f"{node.where}: 'arguments' needs the rule to name a 'tool'")
        return None
    validator = compile_schema(node)
    if validator is None:
        return None
    return ArgumentsCheck(validator, context.get("rule_id"), context.get("tool"))


register_payload_check("arguments", compile_arguments)


# --- answers ------------------------------------------------------------------------------


def jsonrpc_error_body(call: Call, err: GatewayError) -> bytes | None:
    """A JSON-RPC error answer for a refused MCP POST, or None when HTTP status is better."""
    info = call.facts.get("mcp")
    if not info or isinstance(err, BadRequest) and not isinstance(err, BodyInvalid):
        return None
    data = err.problem(call.request_id)
    answers = []
    for msg in info["messages"]:
        if not msg.is_request:
            continue
        answers.append(
            {
                "jsonrpc": "2.0",
                "id": msg.id,
                "error": {
                    "code": JSONRPC_DENIED,
                    "message": f"capgate: {err.reason.value}: {err.detail}",
                    "data": data,
                },
            }
        )
    if not answers:
        return None
    payload: Any = answers if info["batch"] else answers[0]
    return json.dumps(payload, separators=(",", ":")).encode()


def _filter_tools(message: Any, allowed: set[str]) -> Any:
    if not isinstance(message, dict):
        return message
    result = message.get("result")
    if isinstance(result, dict) and isinstance(result.get("tools"), list):
        result["tools"] = [
            t for t in result["tools"] if isinstance(t, dict) and t.get("name") in allowed
        ]
    return message


def _filter_payload(data: bytes, ids: set[Any], allowed: set[str]) -> bytes | None:
    """The payload with ``tools/list`` answers filtered, or None when it answers none."""
    value = json.loads(data)
    if isinstance(value, list):
        if not any(_is_answer(v, ids) for v in value):
            return None
        value = [_filter_tools(v, allowed) if _is_answer(v, ids) else v for v in value]
    elif _is_answer(value, ids):
        value = _filter_tools(value, allowed)
    else:
        return None
    return json.dumps(value, separators=(",", ":")).encode()


def _is_answer(value: Any, ids: set[Any]) -> bool:
    return isinstance(value, dict) and value.get("id") in ids


def tools_list_ids(call: Call) -> set[Any]:
    info = call.facts.get("mcp")
    if not info:
        return set()
    return {m.id for m in info["messages"] if m.method == "tools/list" and m.is_request}


async def filter_json(
    chunks: AsyncIterator[bytes], ids: set[Any], allowed: set[str], limit: int
) -> AsyncIterator[bytes]:
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > limit:
            raise BodyInvalid("the MCP server's tools/list answer is too large to filter")
    try:
        new = _filter_payload(bytes(buf), ids, allowed)
    except ValueError:
        # Not JSON: nothing we can vouch for, so nothing is passed on.
        raise BodyInvalid("the MCP server's answer to tools/list is not JSON") from None
    yield bytes(buf) if new is None else new


async def filter_sse(
    chunks: AsyncIterator[bytes], ids: set[Any], allowed: set[str], limit: int
) -> AsyncIterator[bytes]:
    """Rewrite the ``data`` of each SSE event that answers a ``tools/list`` request."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while True:
            end, sep_len = _event_end(buf)
            if end < 0:
                break
            event, buf = buf[: end + sep_len], buf[end + sep_len :]
            yield _rewrite_event(event, ids, allowed)
        if len(buf) > limit:
            raise BodyInvalid("an SSE event from the MCP server is too large")
    if buf:
        yield _rewrite_event(buf, ids, allowed)


def _event_end(buf: bytes) -> tuple[int, int]:
    best = (-1, 0)
    for sep in (b"\r\n\r\n", b"\n\n", b"\r\r"):
        i = buf.find(sep)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, len(sep))
    return best


def _rewrite_event(event: bytes, ids: set[Any], allowed: set[str]) -> bytes:
    # The event's lines without the blank line that ends it (a blank line inside would end
    # the event early and split the answer from its event name and id).
    lines = [ln for ln in event.splitlines() if ln]
    data = [ln[5:].lstrip(b" ") if ln.startswith(b"data:") else None for ln in lines]
    payload = b"\n".join(d for d in data if d is not None)
    if not payload:
        return event
    try:
        new = _filter_payload(payload, ids, allowed)
    except ValueError:
        return event  # not JSON (a keep-alive, an endpoint event): nothing to filter
    if new is None:
        return event
    out = [ln for ln, d in zip(lines, data, strict=True) if d is None]
    out.append(b"data: " + new)
    return b"\n".join(out) + b"\n\n"
