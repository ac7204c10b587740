"""gateway/protocols/mcp.py: JSON-RPC parsing, listing filters (JSON and SSE), the server's
requests remembered from its streams, and adversarial messages."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BodyInvalid, GatewayError
from gateway.protocols.mcp import (
    Allowed,
    ResponseScan,
    filter_json,
    filter_sse,
    parse_messages,
)


def tools_scan(ids: set[object], tools: set[str], seen: list[object] | None = None) -> ResponseScan:
    """A scan filtering the tools/list answers with ``ids`` to ``tools``."""

    def remember(msg_id: object, method: str) -> None:
        if seen is not None:
            seen.append((msg_id, method))

    return ResponseScan(
        {(type(i).__name__, i): "tools/list" for i in ids},
        Allowed(frozenset(tools), frozenset(), ()),
        remember,
    )


def call_tool(name: object, arguments: object = None, msg_id: object = 1) -> bytes:
    params: dict[str, object] = {"name": name}
    if arguments is not None:
        params["arguments"] = arguments
    return json.dumps(
        {"jsonrpc": "2.0", "id": msg_id, "method": "tools/call", "params": params}
    ).encode()


def test_single_tool_call() -> None:
    [msg], batch = parse_messages(call_tool("search_orders", {"customer_id": 1}))
    assert not batch and msg.tool == "search_orders" and msg.arguments == {"customer_id": 1}
    assert msg.is_request and msg.id == 1


def test_batch_and_notifications_and_responses() -> None:
    body = json.dumps(
        [
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": "a", "result": {}},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
        ]
    ).encode()
    messages, batch = parse_messages(body)
    assert batch
    assert [(m.method, m.is_request) for m in messages] == [
        ("notifications/initialized", False),
        (None, False),
        ("tools/list", True),
    ]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[]",
        b"null",
        b'"tools/call"',
        b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}',
        b'{"id": 1, "method": "ping"}',
        b'{"jsonrpc": "2.0", "id": 1, "method": 5}',
        b'{"jsonrpc": "2.0", "id": true, "method": "ping"}',
        b'{"jsonrpc": "2.0", "id": {"x": 1}, "method": "ping"}',
        b'{"jsonrpc": "2.0", "id": 1}',
        call_tool(None),
        call_tool(""),
        call_tool(["delete_order"]),
        call_tool("search_orders", ["not", "an", "object"]),
        b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": "x"}',
        # The same key twice: parsers disagree on which wins, so it is refused.
        b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "search_orders",'
        b' "name": "delete_order"}}',
        b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "method": "ping"}',
        b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "x": NaN}',
        b"[" + b",".join([b'{"jsonrpc":"2.0","method":"ping","id":1}'] * 101) + b"]",
        b"[" * 100 + b"]" * 100,
        b"\xff\xfe",
    ],
)
def test_malformed_messages_are_refused(body: bytes) -> None:
    with pytest.raises(BodyInvalid):
        parse_messages(body)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_random_bodies_never_crash(body: bytes) -> None:
    try:
        parse_messages(body)
    except GatewayError as exc:
        assert exc.reason.value == "body_invalid"


async def chunks_of(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


TOOLS = {
    "jsonrpc": "2.0",
    "id": 7,
    "result": {"tools": [{"name": "search_orders"}, {"name": "delete_order"}, {"name": "x"}]},
}


async def collect(gen: AsyncIterator[bytes]) -> bytes:
    return b"".join([c async for c in gen])


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
async def test_sse_answer_is_filtered_across_chunk_boundaries(size: int) -> None:
    stream = (
        b"event: message\r\nid: 1\r\ndata: " + json.dumps(TOOLS).encode() + b"\r\n\r\n"
        b": keep-alive\n\n"
        b"data: "
        + json.dumps({"jsonrpc": "2.0", "id": 8, "result": {"tools": [{"name": "x"}]}}).encode()
        + b"\n\n"
    )
    out = await collect(
        filter_sse(chunks_of(stream, size), tools_scan({7}, {"search_orders"}), 1 << 20)
    )
    events = [e for e in out.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    first = json.loads(events[0].split(b"data: ", 1)[1])
    assert [t["name"] for t in first["result"]["tools"]] == ["search_orders"]
    assert b"event: message" in events[0] and b"id: 1" in events[0]
    assert events[1] == b": keep-alive"
    # An answer to another request id is passed as it came.
    assert json.loads(events[2].split(b"data: ", 1)[1])["result"]["tools"] == [{"name": "x"}]


async def test_json_answer_is_filtered() -> None:
    out = await collect(
        filter_json(chunks_of(json.dumps(TOOLS).encode(), 5), tools_scan({7}, {"x"}), 1 << 20)
    )
    assert [t["name"] for t in json.loads(out)["result"]["tools"]] == ["x"]


async def test_json_answer_too_large_or_not_json_is_refused() -> None:
    with pytest.raises(BodyInvalid):
        await collect(filter_json(chunks_of(b"x" * 100, 10), tools_scan({7}, {"x"}), 50))
    with pytest.raises(BodyInvalid):
        await collect(filter_json(chunks_of(b"not json", 3), tools_scan({7}, {"x"}), 1000))


async def test_sse_event_too_large_is_refused() -> None:
    with pytest.raises(BodyInvalid):
        await collect(
            filter_sse(chunks_of(b"data: " + b"x" * 200, 10), tools_scan({7}, {"x"}), 100)
        )


async def test_the_servers_requests_in_a_stream_are_remembered() -> None:
    stream = (
        b"data: "
        + json.dumps({"jsonrpc": "2.0", "id": 41, "method": "roots/list", "params": {}}).encode()
        + b"\n\ndata: "
        + json.dumps({"jsonrpc": "2.0", "method": "notifications/progress"}).encode()
        + b"\n\n"
    )
    seen: list[object] = []
    out = await collect(filter_sse(chunks_of(stream, 5), tools_scan(set(), set(), seen), 1 << 20))
    assert out.replace(b"\r", b"") == stream  # passed as it came
    assert seen == [(41, "roots/list")]  # a request (with an id); the notification is not
