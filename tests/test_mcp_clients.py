"""Refusals as MCP clients show them: the official ``mcp`` client and ``fastmcp``, through
capgate to the real MCP server (``mocks/mcp_server.py``)."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest
from fastmcp import Client as FastClient
from fastmcp.client.transports import StreamableHttpTransport
from fastmcp.exceptions import ToolError
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import Mocks


def tool_calls(mocks: Mocks) -> dict[str, int]:
    return dict(mocks.stats("mcp")["tool_calls"])


async def test_fastmcp_sees_the_reason_of_a_refused_tool_call(
    client: Any, token: Any, mocks: Mocks
) -> None:
    before = tool_calls(mocks)
    headers = {"Authorization": f"Bearer {token('mcp-bot', ['mcp-agent'])}"}
    transport = StreamableHttpTransport(str(client.make_url("/tools/mcp")), headers=headers)
    async with FastClient(transport) as mcp:
        ok = await mcp.call_tool("search_orders", {"customer_id": 1})
        assert not ok.is_error
        # A JSON-RPC error: fastmcp raises it, with capgate's reason in the message.
        with pytest.raises((ToolError, MCPError), match="tool_denied"):
            await mcp.call_tool("delete_order", {"order_id": 1})
    assert tool_calls(mocks).get("delete_order", 0) == before.get("delete_order", 0)


async def test_a_refusal_as_a_tool_result_reaches_the_model(
    client: Any, token: Any, mocks: Mocks
) -> None:
    """With ``tool_refusals: result`` the refusal is a tool result with ``isError``: both
    clients return it like any failed tool, and its text says why."""
    before = tool_calls(mocks)
    headers = {"Authorization": f"Bearer {token('mcp-bot', ['mcp-kind'])}"}
    url = str(client.make_url("/kind-tools/mcp"))
    async with FastClient(StreamableHttpTransport(url, headers=headers)) as mcp:
        result = await mcp.call_tool("delete_order", {"order_id": 1}, raise_on_error=False)
        assert result.is_error
        assert "capgate: tool_denied" in result.content[0].text
    http = httpx2.AsyncClient(headers=headers, timeout=10)
    async with http, Client(streamable_http_client(url, http_client=http), mode="legacy") as mcp2:
        result2 = await mcp2.call_tool("delete_order", {"order_id": 1})
        assert result2.is_error
        assert "tool_denied" in result2.content[0].text
        listed = await mcp2.list_tools()
        assert [t.name for t in listed.tools] == ["search_orders"]
    assert tool_calls(mocks).get("delete_order", 0) == before.get("delete_order", 0)
