"""A held MCP tools/call past the client's patience: answered approval_pending, the approval
stays, the same call sent again attaches to it and runs once approved, once.

The real ``mcp`` client through the gateway against the MCP mock server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from mcp import MCPError

from gateway.app import build_gateway
from gateway.config import Settings
from mocks.demo import Workspace
from tests.conftest import Mocks, audit_lines
from tests.test_approvals import token_file  # noqa: F401 (a fixture)
from tests.test_mcp_gateway import mcp_client

GET_ORDER = "      - id: mcp-get-order\n        upstream: tools\n        allow: POST /mcp\n"
TOOLS = "    kind: mcp\n  kind-tools:\n"
APPROVAL_ID = re.compile(r"approval ([0-9a-f]{16})")


def patient_policy(policy_file: Path, patience: str = "300ms") -> Path:
    text = policy_file.read_text()
    assert GET_ORDER in text and TOOLS in text
    text = text.replace(GET_ORDER, GET_ORDER + "        approval: required\n")
    text = text.replace(
        TOOLS, f"    kind: mcp\n    mcp: {{approval_patience: {patience}}}\n  kind-tools:\n"
    )
    path = policy_file.with_name("patient.yaml")
    path.write_text(text)
    return path


@pytest.fixture
def start(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    token_file: Path,  # noqa: F811 (the fixture)
    mocks: Mocks,
) -> Any:
    async def started(patience: str) -> Any:
        s = dataclasses.replace(
            settings,
            policy=patient_policy(policy_file, patience),
            admin_port=0,
            admin_token_file=token_file,
            approval_timeout=10.0,
        )
        mocks.clear()
        gw = build_gateway(s, workspace.environ())
        client = await serve_gateway(gw)
        return gw, client, s

    return started


@pytest.fixture
async def patient(start: Any) -> Any:
    return await start("300ms")


def tool_calls_received(mocks: Mocks) -> list[dict[str, Any]]:
    """The tools/call messages the MCP server received (its request log)."""
    calls = []
    for request in mocks.requests("mcp"):
        if request["path"] != "/mcp" or not request["body"]:
            continue
        message = json.loads(request["body"])
        if isinstance(message, dict) and message.get("method") == "tools/call":
            calls.append(message)
    return calls


def sse_messages(data: bytes) -> list[Any]:
    """The JSON-RPC messages of an event stream's ``data`` lines, event by event."""
    messages = []
    for event in re.split(rb"\r\n\r\n|\n\n|\r\r", data):
        lines = [ln[5:].lstrip(b" ") for ln in event.splitlines() if ln.startswith(b"data:")]
        if lines:
            messages.append(json.loads(b"\n".join(lines)))
    return messages


def pending_id(result: Any) -> str:
    assert result.is_error
    [content] = result.content
    assert "approval_pending" in content.text
    assert "same arguments" in content.text
    found = APPROVAL_ID.search(content.text)
    assert found is not None, content.text
    return found.group(1)


async def test_answered_past_patience_then_the_retry_runs_once(
    patient: Any, token: Any, mocks: Mocks
) -> None:
    gw, client, s = patient
    async with mcp_client(client, token("mcp-bot", ["mcp-agent"])) as mcp:
        first = pending_id(await mcp.call_tool("get_order", {"order_id": 1}))
        assert [p["id"] for p in await gw.approvals.pending()] == [first]
        assert tool_calls_received(mocks) == []
        # Undecided: the retry waits again, on the same approval.
        assert pending_id(await mcp.call_tool("get_order", {"order_id": 1})) == first
        assert await gw.approvals.decide(first, True, "alice") == "decided"
        result = await mcp.call_tool("get_order", {"order_id": 1})
        assert not result.is_error and result.structured_content is not None
        assert len(tool_calls_received(mocks)) == 1
        # The approval was taken: the same call again is held anew.
        again = pending_id(await mcp.call_tool("get_order", {"order_id": 1}))
        assert again != first
    assert len(tool_calls_received(mocks)) == 1
    lines = [line for line in audit_lines(s, gw) if line.get("approval") == first]
    reasons = [line["reason"] for line in lines]
    assert reasons[:2] == ["approval_pending", "approval_pending"] and len(reasons) == 3
    # The run: forwarded once. Its line says allowed, or client_closed when the session ended
    # while the server's event stream was still open after the result (timing, under load).
    assert reasons[2] in ("allowed", "client_closed")


async def test_the_answer_is_a_tool_result_for_that_message(
    patient: Any, token: Any, mocks: Mocks
) -> None:
    gw, client, _ = patient
    headers = {
        "Authorization": f"Bearer {token('mcp-bot', ['mcp-agent'])}",
        "Accept": "application/json, text/event-stream",
    }
    message = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "get_order", "arguments": {"order_id": 3}},
    }
    resp = await client.post("/tools/mcp", headers=headers, json=message)
    assert resp.status == 200 and resp.headers["X-Capgate-Reason"] == "approval_pending"
    body = await resp.json()
    assert body["id"] == 7 and body["result"]["isError"] is True
    [pending] = await gw.approvals.pending()
    assert pending["id"] in body["result"]["content"][0]["text"]
    # Another JSON-RPC id (and progress token) is the same call: the same approval. (With a
    # progress token it is kept alive on an event stream: the answer is its last event.)
    message = {**message, "id": "x-8"}
    message["params"] = {**message["params"], "_meta": {"progressToken": 5}}
    resp = await client.post("/tools/mcp", headers=headers, json=message)
    assert resp.headers["Content-Type"] == "text/event-stream"
    *notes, body = sse_messages(await resp.read())
    assert [n["method"] for n in notes] == ["notifications/progress"]
    assert body["id"] == "x-8" and pending["id"] in body["result"]["content"][0]["text"]
    assert len(await gw.approvals.pending()) == 1
    assert tool_calls_received(mocks) == []


async def test_another_argument_is_another_call(patient: Any, token: Any, mocks: Mocks) -> None:
    gw, client, _ = patient
    async with mcp_client(client, token("mcp-bot", ["mcp-agent"])) as mcp:
        one = pending_id(await mcp.call_tool("get_order", {"order_id": 1}))
        two = pending_id(await mcp.call_tool("get_order", {"order_id": 2}))
        assert one != two
        assert {p["id"] for p in await gw.approvals.pending()} == {one, two}
        assert await gw.approvals.decide(two, False, "alice", "not that one") == "decided"
        with pytest.raises(MCPError) as err:
            await mcp.call_tool("get_order", {"order_id": 2})
        assert "approval_denied" in str(err.value)
        # Still pending, still the same approval.
        assert pending_id(await mcp.call_tool("get_order", {"order_id": 1})) == one
    assert tool_calls_received(mocks) == []


async def test_concurrent_retries_after_approval_run_once(
    patient: Any, token: Any, mocks: Mocks
) -> None:
    gw, client, _ = patient
    tok = token("mcp-bot", ["mcp-agent"])
    async with mcp_client(client, tok) as one, mcp_client(client, tok) as two:
        first = pending_id(await one.call_tool("get_order", {"order_id": 4}))
        assert await gw.approvals.decide(first, True, "alice") == "decided"
        results = await asyncio.gather(
            one.call_tool("get_order", {"order_id": 4}),
            two.call_tool("get_order", {"order_id": 4}),
        )
    ran = [r for r in results if not r.is_error]
    held = [pending_id(r) for r in results if r.is_error]
    assert len(ran) == 1 and len(held) == 1 and held[0] != first
    assert len(tool_calls_received(mocks)) == 1


async def test_a_retry_after_the_expiry_is_approval_timeout(
    patient: Any, token: Any, mocks: Mocks
) -> None:
    gw, client, _ = patient
    gw.approvals.timeout = 0.5
    async with mcp_client(client, token("mcp-bot", ["mcp-agent"])) as mcp:
        pending_id(await mcp.call_tool("get_order", {"order_id": 5}))
        await asyncio.sleep(0.4)
        with pytest.raises(MCPError) as err:
            await mcp.call_tool("get_order", {"order_id": 5})
        assert "approval_timeout" in str(err.value)
    assert tool_calls_received(mocks) == []


async def test_a_revocation_ends_the_call_and_its_approval(
    start: Any, token: Any, mocks: Mocks
) -> None:
    gw, client, _ = await start("30s")
    tok = token("mcp-bot", ["mcp-agent"])
    headers = {"Authorization": f"Bearer {tok}", "Accept": "application/json, text/event-stream"}
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "get_order", "arguments": {"order_id": 6}},
    }
    answer = asyncio.ensure_future(client.post("/tools/mcp", headers=headers, json=message))
    for _ in range(200):
        if await gw.approvals.pending():
            break
        await asyncio.sleep(0.01)
    assert len(await gw.approvals.pending()) == 1
    await gw.state.revoke("agent", "mcp-bot")
    body = await (await answer).json()
    assert body["error"]["data"]["reason"] == "token_revoked"
    assert await gw.approvals.pending() == []
    assert tool_calls_received(mocks) == []
