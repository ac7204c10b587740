"""MCP (Streamable HTTP): each JSON-RPC message is an operation; ``tools/list`` is filtered.

An upstream of ``kind: mcp`` speaks JSON-RPC 2.0 over Streamable HTTP. For each POST the
gateway parses the JSON-RPC message (or batch) before anything is matched:

- ``tools/call``: the tool name selects the rule (``tool: <name>``); a tool that no rule of
  the token's roles allows is refused with ``tool_denied`` and never reaches the server.
  The rule's ``arguments`` schema and SQL policy check that message's ``arguments``, and its
  rate limits and quotas count that message.
- protocol methods (``initialize``, ``ping``, ``tools/list``, notifications, and the
  client's answers to server requests) pass when the roles grant any rule on the endpoint.
- every other method (``resources/read``, ``prompts/get``, ...) is refused: nothing is
  allowed that the policy does not name.
- batches are governed message by message, each under its own rule; one refused message
  refuses the whole batch, and nothing of it is forwarded.
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

from gateway.call import Operation, Refusal, Rewriter
from gateway.errors import BadRequest, BodyInvalid, GatewayError, TokenError, ToolDenied
from gateway.payload import ToolCallPayload, dump_json, parse_json

if TYPE_CHECKING:
    from gateway.call import Call
    from gateway.transport import UpstreamResponse

# Protocol methods that carry no tool call: the handshake (initialize, or server/discover in
# the 2026-07-28 protocol), liveness, and the tool listing (filtered on the way back).
PASS_METHODS = frozenset({"initialize", "server/discover", "ping", "tools/list"})
JSONRPC_DENIED = -32001  # implementation-defined server error range (-32000..-32099)
MAX_BATCH = 100
# Streamable HTTP request headers forwarded to MCP upstreams. Mcp-Method and Mcp-Name are
# compared with the JSON-RPC body first (``_check_routing_headers``); Mcp-Param-* headers are
# forwarded as sent, without such a comparison.
REQUEST_HEADERS = frozenset(
    {"mcp-session-id", "mcp-protocol-version", "last-event-id", "mcp-method", "mcp-name"}
)
PARAM_HEADER_PREFIX = "mcp-param-"
# Streamable HTTP: GET opens the server's event stream and DELETE ends the session, on an
# endpoint the roles may POST to; they carry no tool call.
SESSION_METHODS = frozenset({"GET", "DELETE"})


@dataclass(slots=True)
class McpMessage:
    id: Any
    method: str | None
    tool: str | None
    arguments: dict[str, Any] | None
    is_request: bool


@dataclass(slots=True)
class McpRequest:
    """A POST's JSON-RPC messages as parsed (``value`` is the whole parsed body)."""

    value: Any
    messages: list[McpMessage]
    batch: bool


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
        # Absent arguments are checked as {} (what servers read); the bytes stay as sent.
        arguments = params.get("arguments", {})
        if not isinstance(arguments, dict):
            raise BodyInvalid(f"{where}: tools/call 'params.arguments' must be an object")
    return McpMessage(msg_id, method, tool, arguments, "id" in value)


def parse_request(body: bytes) -> McpRequest:
    """The JSON-RPC messages of a POST body and whether it was a batch."""
    value = parse_json(body)
    if isinstance(value, list):
        if not value:
            raise BodyInvalid("an empty JSON-RPC batch")
        if len(value) > MAX_BATCH:
            raise BodyInvalid(f"a JSON-RPC batch of more than {MAX_BATCH} messages")
        return McpRequest(value, [_message(v, i) for i, v in enumerate(value)], True)
    return McpRequest(value, [_message(value, -1)], False)


def parse_messages(body: bytes) -> tuple[list[McpMessage], bool]:
    request = parse_request(body)
    return request.messages, request.batch


def _inspection(call: Call) -> McpRequest | None:
    return call.inspection if isinstance(call.inspection, McpRequest) else None


class Mcp:
    kind = "mcp"
    forwarded_headers: frozenset[str] = REQUEST_HEADERS
    forwarded_header_prefixes: tuple[str, ...] = (PARAM_HEADER_PREFIX,)

    async def inspect(self, call: Call) -> list[Operation]:
        if call.method in SESSION_METHODS:
            return [Operation(kind="protocol", method="POST")]
        if call.method != "POST":
            return [Operation(kind="request", method=call.method)]
        assert call.upstream is not None
        request = parse_request(await call.read_body(call.upstream.max_request_body))
        call.inspection = request
        for msg in request.messages:
            if msg.method is None or msg.method in PASS_METHODS:
                continue
            if msg.method.startswith("notifications/") and not msg.is_request:
                continue
            if msg.method != "tools/call":
                raise ToolDenied(f"the MCP method {msg.method!r} is not allowed by the policy")
        _check_routing_headers(call, request)
        ops: list[Operation] = []
        for msg in request.messages:
            if msg.tool is None:
                ops.append(Operation(kind="protocol", method="POST"))
            else:
                assert msg.arguments is not None
                payload = ToolCallPayload(msg.tool, msg.arguments, call.findings)
                ops.append(Operation(kind="tool", method="POST", tool=msg.tool, payload=payload))
        return ops

    def finish(self, call: Call) -> None:
        request = _inspection(call)
        if request is None:
            return
        rewritten = False
        items = request.value if request.batch else [request.value]
        for item, op in zip(items, call.operations, strict=True):
            if isinstance(op.payload, ToolCallPayload) and op.payload.rewritten:
                item["params"]["arguments"] = op.payload.arguments
                rewritten = True
        if rewritten:
            call.body = dump_json(request.value)

    def rewrite_response(self, call: Call, response: UpstreamResponse) -> Rewriter | None:
        if not 200 <= response.status < 300:
            return None
        ids = tools_list_ids(call)
        if not ids:
            return None
        allowed = allowed_tools(call)
        media = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
        rewrite = filter_sse if media == "text/event-stream" else filter_json
        return lambda chunks, limit: rewrite(chunks, ids, allowed, limit)

    def refusal(self, call: Call, err: GatewayError) -> Refusal | None:
        if isinstance(err, TokenError):
            return None
        body = jsonrpc_error_body(call, err)
        if body is None:
            return None
        return Refusal(200, "application/json", body, {"X-Capgate-Reason": err.reason.value})


def allowed_tools(call: Call) -> set[str]:
    """The tools the token's roles (narrowed by caps) may call on this endpoint."""
    assert call.claims is not None and call.policy is not None and call.target is not None
    rules = call.policy.candidates(
        call.claims.roles, call.claims.caps, call.target.upstream, "POST"
    )
    return {r.tool for r in rules if r.tool is not None}


def _check_routing_headers(call: Call, request: McpRequest) -> None:
    """The 2026-07-28 routing headers must say what the body says: anything that routes or
    logs by header would otherwise act on a call other than the one checked."""
    method_header = call.headers.getall("Mcp-Method", [])
    name_header = call.headers.getall("Mcp-Name", [])
    if not method_header and not name_header:
        return
    if request.batch or len(method_header) > 1 or len(name_header) > 1:
        raise BodyInvalid("MCP routing headers are ambiguous for this request")
    msg = request.messages[0]
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


# --- answers ------------------------------------------------------------------------------


def jsonrpc_error_body(call: Call, err: GatewayError) -> bytes | None:
    """A JSON-RPC error answer for a refused MCP POST, or None when HTTP status is better."""
    request = _inspection(call)
    if request is None or isinstance(err, BadRequest) and not isinstance(err, BodyInvalid):
        return None
    data = err.problem(call.request_id)
    answers = []
    for msg in request.messages:
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
    payload: Any = answers if request.batch else answers[0]
    return json.dumps(payload, separators=(",", ":")).encode()


def tools_list_ids(call: Call) -> set[Any]:
    request = _inspection(call)
    if request is None:
        return set()
    return {m.id for m in request.messages if m.method == "tools/list" and m.is_request}


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
