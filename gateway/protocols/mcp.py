"""MCP (Streamable HTTP): every JSON-RPC message is an operation, governed by its own rule.

An upstream of ``kind: mcp`` speaks JSON-RPC 2.0 over Streamable HTTP. For each POST the
gateway parses the message (or batch, when the upstream takes batches) before anything is
matched, and every message must be allowed:

=============================  ==========================================================
message                        allowed by
=============================  ==========================================================
``tools/call``                 a rule naming the tool (``tool:``); ``arguments`` and
                               ``sql`` check its arguments
``prompts/get``                a rule naming the prompt (``prompt:``); ``arguments``
``resources/read``,            a rule whose ``resource:`` URI pattern matches ``uri``
``/subscribe``, ``/unsubscribe``
``completion/complete``        the rule allowing the prompt or resource it completes
``logging/setLevel``           a rule naming the method (``method:``)
an answer to the server        a rule naming the server's request (``method: roots/list``,
                               ``sampling/createMessage``, ``elicitation/create``), and
                               only an answer to a request this session's server made
handshake, ping, listings,     any rule on the endpoint; listings (tools, prompts,
notifications                  resources, templates) are filtered to what the token may use
anything else                  nothing: refused (``mcp_denied``)
=============================  ==========================================================

A session (``Mcp-Session-Id``) belongs to the agent that opened it through this gateway;
another agent's, or an unknown one, is refused before the body is read, with the HTTP status
and a problem+json body (403; 404 for an unknown one, so clients start a new session). Other
refusals are JSON-RPC answers (HTTP 200) whose ``error.data`` carries the
problem+json fields, or, for tool calls on an upstream with ``tool_refusals: result``, a
tool result with ``isError`` that the model can read; a bad token is a 401 with a JSON-RPC
error body.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.call import Operation, Refusal, Rewriter
from gateway.errors import (
    ApprovalPending,
    BadRequest,
    BodyInvalid,
    GatewayError,
    McpDenied,
    McpSessionUnknown,
    TokenError,
    UnsupportedMediaType,
)
from gateway.payload import (
    ArgumentsPayload,
    PromptPayload,
    ToolCallPayload,
    dump_json,
    media_type_of,
    parse_json,
)
from gateway.policy.model import Subject, UriPattern
from gateway.policy.spec import MCP_METHODS

if TYPE_CHECKING:
    from gateway.call import Call
    from gateway.transport import UpstreamResponse

# The handshake (initialize, or server/discover in the 2026-07-28 protocol) and liveness:
# allowed by any rule on the endpoint, nothing to check.
HANDSHAKE_METHODS = frozenset({"initialize", "server/discover", "ping"})
# Listings: allowed by any rule on the endpoint; the answer is filtered to what the token may
# use. The value is the key of the list in the result and the field that names an item.
LISTINGS: dict[str, tuple[str, str]] = {
    "tools/list": ("tools", "name"),
    "prompts/list": ("prompts", "name"),
    "resources/list": ("resources", "uri"),
    "resources/templates/list": ("resourceTemplates", "uriTemplate"),
}
# Requests that act on one resource, named by ``params.uri``.
RESOURCE_METHODS = frozenset({"resources/read", "resources/subscribe", "resources/unsubscribe"})
JSONRPC_DENIED = -32001  # implementation-defined server error range (-32000..-32099)
JSONRPC_UNAUTHORIZED = -32002
MAX_BATCH = 100
# From this protocol version on, results carry ``resultType`` (older clients refuse it).
TAGGED_RESULTS_VERSION = "2026-07-28"
MAX_SESSIONS = 10_000  # sessions remembered per gateway (oldest forgotten first)
MAX_PENDING_SERVER_REQUESTS = 10_000
# Streamable HTTP request headers forwarded to MCP upstreams. Mcp-Method and Mcp-Name are
# compared with the JSON-RPC body first (``_check_routing_headers``). Mcp-Param-* headers
# are not forwarded: the server reads the parameters from the body, which was checked.
REQUEST_HEADERS = frozenset(
    {"mcp-session-id", "mcp-protocol-version", "last-event-id", "mcp-method", "mcp-name"}
)
# Streamable HTTP: GET opens the server's event stream and DELETE ends the session, on an
# endpoint the roles may POST to; they carry no tool call.
SESSION_METHODS = frozenset({"GET", "DELETE"})


@dataclass(slots=True)
class McpMessage:
    id: Any
    method: str | None
    params: dict[str, Any]
    is_request: bool

    @property
    def tool(self) -> str | None:
        name = self.params.get("name") if self.method == "tools/call" else None
        return name if isinstance(name, str) else None

    @property
    def arguments(self) -> dict[str, Any]:
        """A tool call's or prompt's arguments; absent ones are {} (what servers read)."""
        arguments = self.params.get("arguments", {})
        return arguments if isinstance(arguments, dict) else {}


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
    msg_id = value.get("id")
    if "id" in value and (isinstance(msg_id, bool) or not isinstance(msg_id, str | int)):
        raise BodyInvalid(f"{where}: 'id' must be a string or an integer")
    method = value.get("method")
    if method is None:
        # The client's answer to a request of the server (roots, sampling, elicitation).
        if ("result" in value) == ("error" in value) or "id" not in value:
            raise BodyInvalid(f"{where} has no method and is not one answer with an id")
        return McpMessage(msg_id, None, {}, False)
    if not isinstance(method, str):
        raise BodyInvalid(f"{where}: 'method' must be a string")
    params = value.get("params", {})
    if not isinstance(params, dict):
        raise BodyInvalid(f"{where}: 'params' must be an object")
    msg = McpMessage(msg_id, method, params, "id" in value)
    if method in ("tools/call", "prompts/get"):
        _text_param(msg, "name", where)
        if not isinstance(params.get("arguments", {}), dict):
            raise BodyInvalid(f"{where}: {method} 'params.arguments' must be an object")
    elif method in RESOURCE_METHODS:
        _text_param(msg, "uri", where)
    elif method == "completion/complete":
        _completion_subject(msg, where)
    return msg


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


def _text_param(msg: McpMessage, name: str, where: str) -> str:
    value = msg.params.get(name)
    if not isinstance(value, str) or not value:
        raise BodyInvalid(f"{where}: {msg.method} needs 'params.{name}' as a string")
    return value


class _Bounded(OrderedDict[Any, Any]):
    """A dict that forgets its oldest entries beyond ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def remember(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class Mcp:
    """MCP over Streamable HTTP. Remembers, in this process, which agent opened each session
    and which requests each session's server sent to the client (to govern the answers)."""

    kind = "mcp"
    forwarded_headers: frozenset[str] = REQUEST_HEADERS
    forwarded_header_prefixes: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._sessions: _Bounded = _Bounded(MAX_SESSIONS)  # session id -> agent
        self._server_requests: _Bounded = _Bounded(MAX_PENDING_SERVER_REQUESTS)

    async def inspect(self, call: Call) -> list[Operation]:
        self._check_session(call)
        if call.method in SESSION_METHODS:
            return [Operation(kind="protocol", method="POST", rpc=call.method)]
        if call.method != "POST":
            return [Operation(kind="request", method=call.method)]
        assert call.upstream is not None
        media, charset = media_type_of(call.headers.get("Content-Type", ""))
        if media != "application/json" or charset not in (None, "utf-8", "utf8"):
            raise UnsupportedMediaType("an MCP message is sent as application/json, in UTF-8")
        call.content_type = "application/json"
        request = parse_request(await call.read_body(call.upstream.max_request_body))
        call.inspection = request
        session = call.headers.get("Mcp-Session-Id", "")
        # Built into the call as they are read, so even a refusal is audited per message.
        ops: list[Operation] = []
        call.operations = ops
        for i, msg in enumerate(request.messages):
            ops.append(self._operation(call, session, msg, i))
        if request.batch and not call.upstream.mcp_batches:
            raise McpDenied(
                f"upstream {call.upstream.name!r} does not take JSON-RPC batches "
                "(the policy can allow them with mcp: {batches: true})"
            )
        _check_routing_headers(call, request)
        return ops

    def _operation(self, call: Call, session: str, msg: McpMessage, index: int) -> Operation:
        request = _inspection(call)
        where = f"message {index}" if request is not None and request.batch else "the message"
        method = msg.method
        if method is None:
            # An answer of the client: allowed when it answers a request this session's
            # server made, of a method a rule names (roots/list, sampling, elicitation).
            asked = self._server_requests.get((session, _id_key(msg.id)))
            if asked is None:
                raise McpDenied(f"{where} answers a request the server did not make")
            return Operation(kind="method", method="POST", subject=("method", asked), rpc=asked)
        if method.startswith("notifications/") and not msg.is_request:
            return Operation(kind="protocol", method="POST", rpc=method)
        if method in HANDSHAKE_METHODS or method in LISTINGS:
            return Operation(kind="protocol", method="POST", rpc=method)
        # Parameters were checked when parsed (``_message``).
        if method == "tools/call":
            name = msg.params["name"]
            tool = ToolCallPayload(name, msg.arguments, call.findings)
            return Operation("tool", "POST", ("tool", name), method, tool)
        if method == "prompts/get":
            name = msg.params["name"]
            prompt = PromptPayload(name, msg.arguments, call.findings)
            return Operation("prompt", "POST", ("prompt", name), method, prompt)
        if method in RESOURCE_METHODS:
            return Operation("resource", "POST", ("resource", msg.params["uri"]), method)
        if method == "completion/complete":
            # Completions of a prompt or resource the token may use, under that rule.
            return Operation("protocol", "POST", _completion_subject(msg, where), method)
        if method in MCP_METHODS:
            return Operation("method", "POST", ("method", method), method)
        raise McpDenied(f"the MCP method {method[:100]!r} is not one capgate can govern")

    def bind_session(self, session: str, agent: str) -> None:
        """The server opened ``session`` for ``agent`` (seen on its answer)."""
        known = self._sessions.get(session)
        if known is None:
            self._sessions.remember(session, agent)
        elif known != agent:  # a server reusing a session id: never share one
            raise McpDenied("the MCP server gave this agent another agent's session")

    def _check_session(self, call: Call) -> None:
        """A session belongs to the agent that opened it through this gateway."""
        session = call.headers.get("Mcp-Session-Id")
        if session is None:
            return
        assert call.claims is not None
        owner = self._sessions.get(session)
        if owner is None:
            # Not opened here (or forgotten): the client must start a new session (404).
            raise McpSessionUnknown("this MCP session is not known to the gateway")
        if owner != call.claims.agent:
            raise McpDenied("this MCP session belongs to another agent")

    def finish(self, call: Call) -> None:
        request = _inspection(call)
        if request is None:
            return
        rewritten = False
        items = request.value if request.batch else [request.value]
        for item, op in zip(items, call.operations, strict=True):
            if isinstance(op.payload, ArgumentsPayload) and op.payload.rewritten:
                item["params"]["arguments"] = op.payload.arguments
                rewritten = True
        if rewritten:
            call.body = dump_json(request.value)

    def rewrite_response(self, call: Call, response: UpstreamResponse) -> Rewriter | None:
        assert call.claims is not None
        session = response.headers.get("Mcp-Session-Id")
        if session is not None and response.status < 300:
            self.bind_session(session, call.claims.agent)
        if call.method == "DELETE" and response.status < 300:
            ended = call.headers.get("Mcp-Session-Id")
            if ended is not None:
                self._sessions.pop(ended, None)
        if not 200 <= response.status < 300:
            return None
        media = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if media not in ("text/event-stream", "application/json"):
            return None
        listings = listing_ids(call)
        allowed = Allowed.of(call) if listings else None
        on_request = self._remember_server_request(
            call.headers.get("Mcp-Session-Id", session or "")
        )
        scan = ResponseScan(listings, allowed, on_request)
        if media == "text/event-stream":
            return lambda chunks, limit: filter_sse(chunks, scan, limit)
        if not listings:
            return None  # a JSON answer to a POST carries no server request
        return lambda chunks, limit: filter_json(chunks, scan, limit)

    def _remember_server_request(self, session: str) -> Callable[[Any, str], None]:
        def remember(msg_id: Any, method: str) -> None:
            self._server_requests.remember((session, _id_key(msg_id)), method)

        return remember

    def refusal(self, call: Call, err: GatewayError) -> Refusal | None:
        if isinstance(err, TokenError):
            unauthorized = json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": None,
                    "error": {
                        "code": JSONRPC_UNAUTHORIZED,
                        "message": f"capgate: {err.reason.value}: {err.detail}",
                        "data": err.problem(call.request_id),
                    },
                },
                separators=(",", ":"),
            ).encode()
            return Refusal(
                err.status, "application/json", unauthorized, {"X-Capgate-Reason": err.reason.value}
            )
        if isinstance(err, McpSessionUnknown):
            return None  # a plain 404: the client starts a new session
        body = jsonrpc_error_body(call, err)
        if body is None:
            return None
        return Refusal(200, "application/json", body, {"X-Capgate-Reason": err.reason.value})


def _id_key(msg_id: Any) -> tuple[str, Any]:
    return (type(msg_id).__name__, msg_id)


def _completion_subject(msg: McpMessage, where: str) -> Subject:
    ref = msg.params.get("ref")
    if isinstance(ref, dict):
        if ref.get("type") == "ref/prompt" and isinstance(ref.get("name"), str):
            return ("prompt", ref["name"])
        if ref.get("type") == "ref/resource" and isinstance(ref.get("uri"), str):
            return ("resource-ref", ref["uri"])
    raise BodyInvalid(f"{where}: completion/complete needs 'params.ref' of a prompt or resource")


@dataclass(frozen=True, slots=True)
class Allowed:
    """What a token may use on this endpoint, for filtering listings."""

    tools: frozenset[str]
    prompts: frozenset[str]
    resources: tuple[UriPattern, ...]

    @classmethod
    def of(cls, call: Call) -> Allowed:
        assert call.claims is not None and call.policy is not None and call.target is not None
        rules = call.policy.candidates(
            call.claims.roles, call.claims.caps, call.target.upstream, "POST"
        )
        return cls(
            frozenset(r.tool for r in rules if r.tool is not None),
            frozenset(r.prompt for r in rules if r.prompt is not None),
            tuple(r.resource for r in rules if r.resource is not None),
        )

    def lists(self, method: str, item: str) -> bool:
        if method == "tools/list":
            return item in self.tools
        if method == "prompts/list":
            return item in self.prompts
        if method == "resources/list":
            return any(isinstance(p.match(item), Mapping) for p in self.resources)
        if method == "resources/templates/list":
            return any(p.text == item for p in self.resources)
        return False


def allowed_tools(call: Call) -> set[str]:
    """The tools the token's roles (narrowed by caps) may call on this endpoint."""
    return set(Allowed.of(call).tools)


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
    named = msg.params.get("name") if isinstance(msg.params.get("name"), str) else None
    if name_header and named is not None and _header_text(name_header[0]) != named:
        raise BodyInvalid("the Mcp-Name header does not match the name in the body")


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
    """The answer to a refused MCP POST, one per request message, or None when the HTTP
    status is better (a body that is not JSON-RPC at all).

    A refused ``tools/call`` is answered as a tool result with ``isError`` when the upstream
    says ``mcp: {tool_refusals: result}``, so the model reads why; otherwise (and for every
    other method) as a JSON-RPC error whose ``data`` carries the problem+json fields."""
    request = _inspection(call)
    if request is None or isinstance(err, BadRequest) and not isinstance(err, BodyInvalid):
        return None
    data = err.problem(call.request_id)
    text = f"capgate: {err.reason.value}: {err.detail}"
    as_result = call.upstream is not None and call.upstream.mcp_tool_refusals == "result"
    # A call held past the client's patience is answered, not refused: the model reads it.
    as_result = as_result or isinstance(err, ApprovalPending)
    refused: dict[str, Any] = {"content": [{"type": "text", "text": text}], "isError": True}
    if call.headers.get("Mcp-Protocol-Version", "") >= TAGGED_RESULTS_VERSION:
        refused["resultType"] = "complete"
    answers: list[dict[str, Any]] = []
    for msg in request.messages:
        if not msg.is_request:
            continue
        if as_result and msg.method == "tools/call":
            answers.append({"jsonrpc": "2.0", "id": msg.id, "result": refused})
            continue
        answers.append(
            {
                "jsonrpc": "2.0",
                "id": msg.id,
                "error": {"code": JSONRPC_DENIED, "message": text, "data": data},
            }
        )
    if not answers:
        return None
    payload: Any = answers if request.batch else answers[0]
    return json.dumps(payload, separators=(",", ":")).encode()


def approval_key(call: Call) -> str | None:
    """What makes a held ``tools/call`` the same call when the client sends it again: the
    agent, run, upstream, target and policy, and the message but for its JSON-RPC id and
    progress token (each request has its own). None when the POST is not one tools/call."""
    request = _inspection(call)
    if request is None or request.batch or not isinstance(request.value, dict):
        return None
    msg = request.messages[0]
    if msg.method != "tools/call" or not msg.is_request:
        return None
    assert call.claims is not None and call.upstream is not None and call.policy is not None
    value = {k: v for k, v in request.value.items() if k != "id"}
    params = dict(msg.params)
    meta = params.pop("_meta", None)
    if isinstance(meta, dict):
        meta = {k: v for k, v in meta.items() if k != "progressToken"}
    if meta:
        params["_meta"] = meta
    value["params"] = params
    same = [
        call.claims.agent,
        call.claims.run,
        call.upstream.name,
        call.raw_target,
        call.policy.digest,
        value,
    ]
    text = json.dumps(same, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def progress_token(call: Call) -> str | int | None:
    """The progress token of a POST of one request (``params._meta.progressToken``): the
    server may send that request's ``notifications/progress`` with it, and only then."""
    request = _inspection(call)
    if request is None or request.batch or not request.messages[0].is_request:
        return None
    meta = request.messages[0].params.get("_meta")
    token = meta.get("progressToken") if isinstance(meta, dict) else None
    return token if isinstance(token, str | int) and not isinstance(token, bool) else None


def accepts_event_stream(call: Call) -> bool:
    """Whether the client accepts an event stream as the answer to its POST (``Accept``)."""
    for value in call.headers.getall("Accept", ()):
        for item in value.split(","):
            media, _, params = item.partition(";")
            if media.strip().lower() != "text/event-stream":
                continue
            q = [p.strip()[2:] for p in params.split(";") if p.strip().lower().startswith("q=")]
            try:
                return not q or float(q[0]) > 0
            except ValueError:
                return False
    return False


def listing_ids(call: Call) -> dict[Any, str]:
    """The ids of the call's listing requests, and which listing each one is."""
    request = _inspection(call)
    if request is None:
        return {}
    return {
        _id_key(m.id): m.method
        for m in request.messages
        if m.is_request and m.method is not None and m.method in LISTINGS
    }


def tools_list_ids(call: Call) -> set[Any]:
    return {key[1] for key, method in listing_ids(call).items() if method == "tools/list"}


@dataclass(slots=True)
class ResponseScan:
    """What to do with each JSON-RPC message the server sends back: filter the answers to
    listings, remember the requests it makes of the client."""

    listings: dict[Any, str]
    allowed: Allowed | None
    on_request: Callable[[Any, str], None]

    def message(self, message: Any) -> Any:
        if not isinstance(message, dict):
            return message
        method = message.get("method")
        if isinstance(method, str) and "id" in message:
            self.on_request(message.get("id"), method)
            return message
        listing = self.listings.get(_id_key(message.get("id"))) if "id" in message else None
        if listing is None or self.allowed is None:
            return message
        key, field = LISTINGS[listing]
        result = message.get("result")
        if isinstance(result, dict) and isinstance(result.get(key), list):
            result[key] = [
                item
                for item in result[key]
                if isinstance(item, dict)
                and isinstance(item.get(field), str)
                and self.allowed.lists(listing, item[field])
            ]
        return message

    def payload(self, data: bytes) -> bytes | None:
        """The payload with listing answers filtered, or None when it is left as it is."""
        value = json.loads(data)
        if not self.listings and not _makes_requests(value):
            return None
        if isinstance(value, list):
            value = [self.message(v) for v in value]
        else:
            value = self.message(value)
        return json.dumps(value, separators=(",", ":")).encode() if self.listings else None


def _makes_requests(value: Any) -> bool:
    items = value if isinstance(value, list) else [value]
    return any(isinstance(v, dict) and "method" in v and "id" in v for v in items)


async def filter_json(
    chunks: AsyncIterator[bytes], scan: ResponseScan, limit: int
) -> AsyncIterator[bytes]:
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > limit:
            raise BodyInvalid("the MCP server's answer is too large to filter")
    try:
        new = scan.payload(bytes(buf))
    except ValueError:
        # Not JSON: nothing we can vouch for, so nothing is passed on.
        raise BodyInvalid("the MCP server's answer to a listing is not JSON") from None
    yield bytes(buf) if new is None else new


async def filter_sse(
    chunks: AsyncIterator[bytes], scan: ResponseScan, limit: int
) -> AsyncIterator[bytes]:
    """Each SSE event: listing answers filtered, the server's requests remembered."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while True:
            end, sep_len = _event_end(buf)
            if end < 0:
                break
            event, buf = buf[: end + sep_len], buf[end + sep_len :]
            yield _rewrite_event(event, scan)
        if len(buf) > limit:
            raise BodyInvalid("an SSE event from the MCP server is too large")
    if buf:
        yield _rewrite_event(buf, scan)


def _event_end(buf: bytes) -> tuple[int, int]:
    best = (-1, 0)
    for sep in (b"\r\n\r\n", b"\n\n", b"\r\r"):
        i = buf.find(sep)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, len(sep))
    return best


def _rewrite_event(event: bytes, scan: ResponseScan) -> bytes:
    # The event's lines without the blank line that ends it (a blank line inside would end
    # the event early and split the answer from its event name and id).
    lines = [ln for ln in event.splitlines() if ln]
    data = [ln[5:].lstrip(b" ") if ln.startswith(b"data:") else None for ln in lines]
    payload = b"\n".join(d for d in data if d is not None)
    if not payload:
        return event
    try:
        new = scan.payload(payload)
    except ValueError:
        return event  # not JSON (a keep-alive, an endpoint event): nothing to filter
    if new is None:
        return event
    out = [ln for ln, d in zip(lines, data, strict=True) if d is None]
    out.append(b"data: " + new)
    return b"\n".join(out) + b"\n\n"
