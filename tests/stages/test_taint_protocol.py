"""Taint comes from what a rule governs: an MCP protocol message (the handshake, a listing)
is allowed by any rule on the endpoint, and must not taint the run because that rule happens
to be ``trust: untrusted`` (found by ``make eval``: a policy whose first MCP rule was an
untrusted tool tainted every session at ``initialize``)."""

from __future__ import annotations

import json
from typing import Any

from gateway.taint import untrusted_source
from gateway.testing import make_call, matching, policy_from_text, run_stages

POLICY = """
version: 1
upstreams:
  chat: {url: "http://127.0.0.1:9", kind: mcp}
  web: {url: "http://127.0.0.1:9", kind: mcp, trust: untrusted}
agents: {test-agent: [bot]}
roles:
  bot:
    rules:
      - {id: channels, upstream: chat, allow: POST /mcp, tool: get_channels, trust: untrusted}
      - {id: post, upstream: chat, allow: POST /mcp, tool: post, sensitive: true}
      - {id: page, upstream: web, allow: POST /mcp, tool: get_page}
"""


def message(method: str, msg_id: int | None = 1, **params: Any) -> bytes:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if msg_id is not None:
        msg["id"] = msg_id
    if params:
        msg["params"] = params
    return json.dumps(msg).encode()


async def source(upstream: str, body: bytes) -> str | None:
    call = make_call("POST", f"/{upstream}/mcp", body=body, roles=["bot"])
    await run_stages(call, *matching(policy_from_text(POLICY)))
    return untrusted_source(call)


async def test_protocol_messages_do_not_taint_through_an_untrusted_rule() -> None:
    init = message("initialize", protocolVersion="2025-06-18", capabilities={}, clientInfo={})
    assert await source("chat", init) is None
    assert await source("chat", message("notifications/initialized", None)) is None
    assert await source("chat", message("tools/list")) is None
    assert await source("chat", message("tools/call", name="post", arguments={})) is None


async def test_the_untrusted_tool_taints() -> None:
    call = message("tools/call", name="get_channels", arguments={})
    assert await source("chat", call) == "rule channels (tool get_channels)"


async def test_an_untrusted_upstream_taints_whatever_is_sent_to_it() -> None:
    init = message("initialize", protocolVersion="2025-06-18", capabilities={}, clientInfo={})
    assert await source("web", init) == "upstream web"
