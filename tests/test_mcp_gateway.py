"""MCP through the gateway with the real ``mcp`` client and server (Streamable HTTP)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import Mocks


@asynccontextmanager
async def mcp_client(client: Any, token: str, mode: str = "legacy") -> AsyncIterator[Client]:
    url = str(client.make_url("/tools/mcp"))
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=10)
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode) as mcp:
        yield mcp


def tool_calls(mocks: Mocks) -> dict[str, int]:
    return mocks.stats("mcp")["tool_calls"]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_allowed_tool_and_filtered_list(client, token, mocks: Mocks, mode: str) -> None:
    before = tool_calls(mocks)
    async with mcp_client(client, token("mcp-bot", ["mcp-agent"]), mode) as mcp:
        listed = await mcp.list_tools()
        assert sorted(t.name for t in listed.tools) == ["get_order", "search_orders"]
        result = await mcp.call_tool("search_orders", {"customer_id": 2, "limit": 3})
        assert not result.is_error
        assert result.structured_content is not None
    after = tool_calls(mocks)
    assert after.get("search_orders", 0) == before.get("search_orders", 0) + 1


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_denied_tool_never_reaches_the_server(client, token, mocks: Mocks, mode: str) -> None:
    from mcp import MCPError

    before = tool_calls(mocks)
    async with mcp_client(client, token("mcp-bot", ["mcp-agent"]), mode) as mcp:
        with pytest.raises(MCPError) as err:
            await mcp.call_tool("delete_order", {"order_id": 1})
        assert "tool_denied" in str(err.value)
        with pytest.raises(MCPError) as err:
            await mcp.call_tool("search_orders", {"customer_id": 2, "limit": 500})
        assert "tool_denied" in str(err.value)
        assert "/limit" in str(err.value.error.data)
    after = tool_calls(mocks)
    assert after.get("delete_order", 0) == before.get("delete_order", 0)
    assert after.get("search_orders", 0) == before.get("search_orders", 0)


async def test_jsonrpc_error_body(client, token, mocks: Mocks) -> None:
    tok = token("mcp-bot", ["mcp-agent"])
    headers = {"Authorization": f"Bearer {tok}", "Accept": "application/json, text/event-stream"}
    resp = await client.post(
        "/tools/mcp",
        headers=headers,
        json={
            "jsonrpc": "2.0",
            "id": 7,
            "method": "tools/call",
            "params": {"name": "delete_order", "arguments": {"order_id": 1}},
        },
    )
    assert resp.status == 200
    body = await resp.json()
    assert body["id"] == 7 and body["error"]["data"]["reason"] == "tool_denied"
    assert resp.headers["X-Capgate-Reason"] == "tool_denied"
    # A batch with one denied message is refused whole, each request answered.
    resp = await client.post(
        "/tools/mcp",
        headers=headers,
        json=[
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/call",
                "params": {"name": "get_order", "arguments": {"order_id": 1}},
            },
            {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": "delete_order", "arguments": {"order_id": 1}},
            },
        ],
    )
    answers = await resp.json()
    assert [a["id"] for a in answers] == [1, 2]
    # This server takes no batches (current MCP): refused whole, each request answered.
    assert all(a["error"]["data"]["reason"] == "mcp_denied" for a in answers)
    # Methods the policy does not name are refused too.
    resp = await client.post(
        "/tools/mcp",
        headers=headers,
        json={
            "jsonrpc": "2.0",
            "id": 3,
            "method": "resources/read",
            "params": {"uri": "file:///etc/passwd"},
        },
    )
    assert (await resp.json())["error"]["data"]["reason"] == "mcp_denied"
    # Routing headers must agree with the body.
    resp = await client.post(
        "/tools/mcp",
        headers={**headers, "Mcp-Method": "tools/list"},
        json={
            "jsonrpc": "2.0",
            "id": 4,
            "method": "tools/call",
            "params": {"name": "get_order", "arguments": {"order_id": 1}},
        },
    )
    assert (await resp.json())["error"]["data"]["reason"] == "body_invalid"
    assert all(
        r["path"] != "/mcp" or b"delete_order" not in r["body"].encode()
        for r in mocks.requests("mcp")
    )


async def test_mcp_without_token_is_401_with_a_jsonrpc_error(client, mocks: Mocks) -> None:
    before = len(mocks.requests("mcp"))
    resp = await client.post("/tools/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"].startswith('Bearer realm="capgate"')
    body = await resp.json()
    # The request id is not echoed: the body was not read before the token was checked.
    assert body["jsonrpc"] == "2.0" and body["id"] is None
    assert body["error"]["data"]["reason"] == "token_missing"
    assert len(mocks.requests("mcp")) == before


async def test_role_without_mcp_rules_cannot_initialize(client, token) -> None:
    resp = await client.post(
        "/tools/mcp",
        headers={"Authorization": f"Bearer {token('tester', ['tester'])}"},
        json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}},
    )
    body = await resp.json()
    assert body["error"]["data"]["reason"] == "no_rule"
