"""A held MCP tools/call kept alive: progress notifications on an event stream while it
waits, then the decision's answer as the stream's last event.

The real ``mcp`` client (and raw HTTP where the wire matters) through the gateway against
the MCP mock server; decisions through the admin API."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import pytest
from aiohttp import web
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from gateway.admin import create_admin_app
from gateway.app import build_gateway
from gateway.config import Settings
from gateway.held_stream import sse_message
from mocks.demo import Workspace
from mocks.mcp_server import start_mcp_server
from tests.conftest import Mocks, audit_lines
from tests.redis_server import RedisServer
from tests.state.conftest import needs_redis
from tests.test_approvals import (
    ADMIN_TOKEN,
    token_file,  # noqa: F401 (a fixture)
)
from tests.test_mcp_approvals import (
    GET_ORDER,
    TOOLS,
    pending_id,
    sse_messages,
    tool_calls_received,
)
from tests.test_mcp_gateway import mcp_client

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
EVENT_STREAM = {"Accept": "application/json, text/event-stream"}


def kept_policy(policy_file: Path, options: str, url: str | None = None) -> Path:
    text = policy_file.read_text()
    assert GET_ORDER in text and TOOLS in text
    text = text.replace(GET_ORDER, GET_ORDER + "        approval: required\n")
    text = text.replace(TOOLS, f"    kind: mcp\n    mcp: {{{options}}}\n  kind-tools:\n")
    if url is not None:  # another MCP server for the tools upstream
        head, tools, tail = text.partition("  tools:\n    url: ")
        assert tools
        tail = tail.split("\n", 1)[1]
        text = f"{head}{tools}{url}\n{tail}"
    path = policy_file.with_name("kept.yaml")
    path.write_text(text)
    return path


@pytest.fixture
def start(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    token_file: Path,  # noqa: F811 (the fixture)
    mocks: Mocks,
) -> Any:
    members: list[str] = []

    async def started(options: str, url: str | None = None, state: str | None = None) -> Any:
        s = dataclasses.replace(
            settings,
            policy=kept_policy(policy_file, options, url),
            admin_port=0,
            admin_token_file=token_file,
            approval_timeout=10.0,
        )
        if state is not None:  # a member of a fleet sharing its state, with its own audit
            members.append(state)
            assert settings.audit is not None
            audit = settings.audit.with_name(f"audit-{len(members)}.jsonl")
            s = dataclasses.replace(s, state=state, audit=audit)
        else:
            mocks.clear()
        gw = build_gateway(s, workspace.environ())
        client = await serve_gateway(gw)
        assert gw.operators is not None
        admin = await aiohttp_client(create_admin_app(gw, gw.operators))
        return gw, client, admin, s

    return started


@pytest.fixture
async def kept(start: Any) -> Any:
    return await start("approval_patience: 30s, approval_keepalive: 200ms")


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition did not come true in time")


async def pending_one(admin: Any) -> str:
    for _ in range(500):
        pending = (await (await admin.get("/approvals", headers=ADMIN)).json())["pending"]
        if pending:
            [one] = pending
            return str(one["id"])
        await asyncio.sleep(0.01)
    raise AssertionError("nothing became pending")


async def decide(admin: Any, approval: str, verb: str) -> None:
    resp = await admin.post(f"/approvals/{approval}/{verb}", headers=ADMIN)
    assert resp.status == 200, await resp.text()


async def session_headers(client: Any, token: str) -> dict[str, str]:
    """Raw HTTP's headers for a session opened through the gateway (the MCP handshake)."""
    headers = {"Authorization": f"Bearer {token}", **EVENT_STREAM}
    hello = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"},
        },
    }
    resp = await client.post("/tools/mcp", headers=headers, json=hello)
    assert resp.status == 200
    await resp.read()
    headers["Mcp-Session-Id"] = resp.headers["Mcp-Session-Id"]
    headers["Mcp-Protocol-Version"] = "2025-06-18"
    done = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    resp = await client.post("/tools/mcp", headers=headers, json=done)
    assert resp.status == 202
    return headers


Progress = list[tuple[float, float | None, str | None]]


def progress_log() -> tuple[Progress, Any]:
    seen: Progress = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    return seen, on_progress


def assert_kept_alive(seen: Progress, approval: str) -> None:
    values = [p for p, _, _ in seen]
    assert len(values) >= 2 and values == sorted(set(values)), values
    assert {m for _, _, m in seen} == {f"capgate: awaiting approval {approval}"}


def call_lines(s: Settings, gw: Any, approval: str) -> list[dict[str, Any]]:
    return [line for line in audit_lines(s, gw) if line.get("approval") == approval]


@pytest.mark.parametrize("answer", ["sse", "json"])
async def test_progress_while_held_then_the_result(
    start: Any, token: Any, mocks: Mocks, answer: str
) -> None:
    url, stop = (None, None) if answer == "sse" else await start_mcp_server(json_response=True)
    url = url.removesuffix("/mcp") if url is not None else None
    try:
        gw, client, admin, s = await start("approval_patience: 30s, approval_keepalive: 200ms", url)
        seen, on_progress = progress_log()
        async with mcp_client(client, token("mcp-bot", ["mcp-agent"])) as mcp:
            call = asyncio.ensure_future(
                mcp.call_tool("get_order", {"order_id": 1}, progress_callback=on_progress)
            )
            approval = await pending_one(admin)
            await until(lambda: len(seen) >= 2)
            assert tool_calls_received(mocks) == []
            await decide(admin, approval, "approve")
            result = await call
    finally:
        if stop is not None:
            await stop()
    assert not result.is_error and result.structured_content is not None
    assert result.structured_content["id"] == 1
    assert_kept_alive(seen, approval)
    if answer == "sse":
        assert len(tool_calls_received(mocks)) == 1
    [line] = call_lines(s, gw, approval)
    assert line["status"] == 200 and line["operator"] == "admin"
    # Forwarded once; the line may say client_closed when the session ended while the
    # server's stream was still open after the result (as in test_mcp_approvals).
    assert line["reason"] in ("allowed", "client_closed") and line["decision"] == "allow"


@pytest.mark.redis
@needs_redis
async def test_kept_alive_by_one_gateway_approved_through_another(
    redis_server: RedisServer, start: Any, token: Any, mocks: Mocks
) -> None:
    """Redis state: the console of another gateway of the fleet approves the held call."""
    mocks.clear()
    options = "approval_patience: 30s, approval_keepalive: 200ms"
    holder, client, _, _ = await start(options, state=redis_server.url)
    other, _, other_admin, _ = await start(options, state=redis_server.url)
    seen, on_progress = progress_log()
    async with mcp_client(client, token("mcp-bot", ["mcp-agent"])) as mcp:
        call = asyncio.ensure_future(
            mcp.call_tool("get_order", {"order_id": 11}, progress_callback=on_progress)
        )
        approval = await pending_one(other_admin)  # listed by the gateway that does not hold it
        await until(lambda: len(seen) >= 2)
        await decide(other_admin, approval, "approve")
        result = await call
    assert not result.is_error and result.structured_content is not None
    assert_kept_alive(seen, approval)
    assert len(tool_calls_received(mocks)) == 1


async def test_a_denial_is_the_last_event(kept: Any, token: Any, mocks: Mocks) -> None:
    gw, client, admin, s = kept
    seen, on_progress = progress_log()
    async with mcp_client(client, token("mcp-bot", ["mcp-agent"])) as mcp:
        call = asyncio.ensure_future(
            mcp.call_tool("get_order", {"order_id": 2}, progress_callback=on_progress)
        )
        approval = await pending_one(admin)
        await until(lambda: len(seen) >= 2)
        await decide(admin, approval, "deny")
        with pytest.raises(MCPError) as err:
            await call
    assert "approval_denied" in str(err.value)
    assert err.value.error.data["reason"] == "approval_denied"
    assert_kept_alive(seen, approval)
    assert tool_calls_received(mocks) == []
    [line] = [ln for ln in audit_lines(s, gw) if ln["reason"] == "approval_denied"]
    # The stream's status, 200 (as any MCP refusal's), and the refusal's reason.
    assert line["status"] == 200 and line["decision"] == "deny" and line["operator"] == "admin"


async def test_the_wire_progress_then_the_answer(kept: Any, token: Any, mocks: Mocks) -> None:
    gw, client, admin, _ = kept
    headers = {"Authorization": f"Bearer {token('mcp-bot', ['mcp-agent'])}", **EVENT_STREAM}
    message = {
        "jsonrpc": "2.0",
        "id": 41,
        "method": "tools/call",
        "params": {
            "name": "get_order",
            "arguments": {"order_id": 3},
            "_meta": {"progressToken": "tok-\n\ndata: forged"},
        },
    }
    resp = await client.post("/tools/mcp", headers=headers, json=message)
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    assert resp.headers["Cache-Control"] == "no-store" and "X-Request-Id" in resp.headers
    approval = await pending_one(admin)
    await asyncio.sleep(0.5)
    await decide(admin, approval, "deny")
    raw = await resp.read()
    *notes, answer = sse_messages(raw)
    assert raw.count(b"event: message\n") == len(notes) + 1 and b"\ndata: forged" not in raw
    assert len(notes) >= 2
    for n, note in enumerate(notes, 1):
        assert note == {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {
                "progressToken": "tok-\n\ndata: forged",
                "progress": n,
                "message": f"capgate: awaiting approval {approval}",
            },
        }
    assert answer["id"] == 41 and answer["error"]["data"]["reason"] == "approval_denied"
    assert tool_calls_received(mocks) == []


async def test_a_short_read_timeout_survives_thanks_to_the_keepalive(
    kept: Any, token: Any, mocks: Mocks
) -> None:
    gw, client, admin, _ = kept
    url = str(client.make_url("/tools/mcp"))
    auth = {"Authorization": f"Bearer {token('mcp-bot', ['mcp-agent'])}"}
    # The client gives up when it has read nothing for 1 s: on a silent call.
    timeout = httpx2.Timeout(10, read=1.0)

    async def held_for(order_id: int, on_progress: Any) -> Any:
        http = httpx2.AsyncClient(headers=auth, timeout=timeout)
        call: asyncio.Future[Any] | None = None
        try:
            async with http, Client(streamable_http_client(url, http_client=http)) as mcp:
                arguments = {"order_id": order_id}
                call = asyncio.ensure_future(
                    mcp.call_tool("get_order", arguments, progress_callback=on_progress)
                )
                approval = await pending_one(admin)
                await asyncio.sleep(2.5)  # well past the read timeout
                await decide(admin, approval, "approve")
                return await asyncio.wait_for(call, 10)
        finally:
            if call is not None and call.done() and not call.cancelled():
                call.exception()  # retrieved (a client that gave up: "Connection closed")

    seen, on_progress = progress_log()
    result = await held_for(5, on_progress)
    assert not result.is_error and result.structured_content is not None
    assert len(seen) >= 8
    assert len(tool_calls_received(mocks)) == 1
    # Without a progress token (no callback) the call is silent: the same client gives up.
    with pytest.raises(ExceptionGroup) as err:
        await held_for(6, None)
    assert err.group_contains(httpx2.ReadTimeout)
    assert len(tool_calls_received(mocks)) == 1


async def test_a_client_that_hangs_up_leaves_the_approval_for_its_retry(
    kept: Any, token: Any, mocks: Mocks, caplog: pytest.LogCaptureFixture
) -> None:
    gw, client, admin, s = kept
    caplog.set_level(logging.DEBUG, logger="capgate")
    headers = await session_headers(client, token("mcp-bot", ["mcp-agent"]))
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {
            "name": "get_order",
            "arguments": {"order_id": 7},
            "_meta": {"progressToken": 1},
        },
    }
    tasks_before = {t for t in asyncio.all_tasks() if t.get_name() == "capgate-keepalive"}
    resp = await client.post("/tools/mcp", headers=headers, json=message)
    first = await resp.content.readuntil(b"\n\n")
    approval = await pending_one(admin)
    assert approval.encode() in first
    resp.close()  # the agent hangs up mid-hold
    await until(lambda: any(ln["reason"] == "client_closed" for ln in audit_lines(s, gw)))
    await asyncio.sleep(0.5)  # a keepalive or two would have been due
    assert {t for t in asyncio.all_tasks() if t.get_name() == "capgate-keepalive"} == tasks_before
    assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert await pending_one(admin) == approval  # still pending
    # The retry (another id and progress token) waits on the same approval, then runs once.
    retry = {**message, "id": 2, "params": {**message["params"], "_meta": {"progressToken": 2}}}
    resp = await client.post("/tools/mcp", headers=headers, json=retry)
    note = await resp.content.readuntil(b"\n\n")
    assert f"awaiting approval {approval}".encode() in note
    await decide(admin, approval, "approve")
    *_, answer = sse_messages(note + await resp.read())
    assert answer["id"] == 2 and "result" in answer, answer
    assert answer["result"]["structuredContent"]["id"] == 7
    assert len(tool_calls_received(mocks)) == 1
    reasons = [ln["reason"] for ln in audit_lines(s, gw) if ln.get("rule") == "mcp-get-order"]
    assert reasons == ["client_closed", "allowed"]


async def test_past_patience_on_the_stream_then_the_retry(start: Any, token: Any) -> None:
    gw, client, admin, _ = await start("approval_patience: 700ms, approval_keepalive: 200ms")
    seen, on_progress = progress_log()
    async with mcp_client(client, token("mcp-bot", ["mcp-agent"])) as mcp:
        first = pending_id(
            await mcp.call_tool("get_order", {"order_id": 8}, progress_callback=on_progress)
        )
        assert_kept_alive(seen, first)
        await decide(admin, first, "approve")
        result = await mcp.call_tool("get_order", {"order_id": 8})
        assert not result.is_error


async def test_a_revocation_is_the_last_event(kept: Any, token: Any, mocks: Mocks) -> None:
    gw, client, admin, _ = kept
    headers = {"Authorization": f"Bearer {token('mcp-bot', ['mcp-agent'])}", **EVENT_STREAM}
    message = {
        "jsonrpc": "2.0",
        "id": 9,
        "method": "tools/call",
        "params": {
            "name": "get_order",
            "arguments": {"order_id": 9},
            "_meta": {"progressToken": 9},
        },
    }
    resp = await client.post("/tools/mcp", headers=headers, json=message)
    first = await resp.content.readuntil(b"\n\n")
    await pending_one(admin)
    await gw.state.revoke("agent", "mcp-bot")
    *notes, answer = sse_messages(first + await resp.read())
    assert notes and answer["id"] == 9 and answer["error"]["data"]["reason"] == "token_revoked"
    assert (await (await admin.get("/approvals", headers=ADMIN)).json())["pending"] == []
    assert tool_calls_received(mocks) == []


@pytest.mark.parametrize(
    ("options", "accept", "meta"),
    [
        ("approval_keepalive: 200ms", "application/json, text/event-stream", {}),
        ("approval_keepalive: 200ms", "application/json", {"progressToken": 3}),
        ("approval_keepalive: none", "application/json, text/event-stream", {"progressToken": 3}),
    ],
    ids=["no-progress-token", "no-event-stream", "keepalive-none"],
)
async def test_otherwise_nothing_changes(
    start: Any, token: Any, options: str, accept: str, meta: dict[str, Any]
) -> None:
    gw, client, admin, _ = await start(f"approval_patience: 600ms, {options}")
    headers = {"Authorization": f"Bearer {token('mcp-bot', ['mcp-agent'])}", "Accept": accept}
    params: dict[str, Any] = {"name": "get_order", "arguments": {"order_id": 4}}
    if meta:
        params["_meta"] = meta
    message = {"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": params}
    resp = await client.post("/tools/mcp", headers=headers, json=message)
    # Silent while held, then the approval_pending answer in a JSON body, as before.
    assert resp.headers["Content-Type"].startswith("application/json")
    assert resp.headers["X-Capgate-Reason"] == "approval_pending"
    body = await resp.json()
    assert body["id"] == 4 and body["result"]["isError"] is True
    assert "approval_pending" in body["result"]["content"][0]["text"]


UP_KEY = "Hunter2-Xy7Q9pLm4Rt"  # the credential the gateway injects (X-Api-Key)


async def _reflecting(request: web.Request) -> web.StreamResponse:
    """An MCP server that answers a tools/call with the credential it was sent."""
    message = await request.json()
    text = f"the key is {request.headers['X-Api-Key']}"
    answer = {
        "jsonrpc": "2.0",
        "id": message["id"],
        "result": {"content": [{"type": "text", "text": text}], "isError": False},
    }
    data = json.dumps(answer).encode()
    if request.match_info["kind"] == "json":
        return web.json_response(answer)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    cut = data.index(b"Hunter2") + 4  # the credential split across two writes
    await resp.write(b"event: message\ndata: " + data[:cut])
    await asyncio.sleep(0.05)
    await resp.write(data[cut:] + b"\n\n")
    await resp.write_eof()
    return resp


@pytest.mark.parametrize("kind", ["json", "sse"])
async def test_a_reflected_credential_is_masked_on_the_stream(
    aiohttp_server: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    token_file: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
    kind: str,
) -> None:
    app = web.Application()
    app.router.add_post("/{kind}/mcp", _reflecting)
    server = await aiohttp_server(app)
    policy = tmp_path / "reflecting.yaml"
    policy.write_text(
        "version: 1\nupstreams:\n"
        f'  up: {{url: "http://127.0.0.1:{server.port}/{kind}", kind: mcp,'
        " mcp: {approval_keepalive: 200ms},"
        ' credentials: {type: header, header: X-Api-Key, secret: "env:UP_KEY"}}\n'
        'agents: {"*": [r]}\nroles:\n  r:\n    rules:\n'
        "      - {id: echo, upstream: up, allow: POST /mcp, tool: echo, approval: required}\n"
    )
    s = dataclasses.replace(
        settings, policy=policy, admin_port=0, admin_token_file=token_file, audit=None
    )
    gw = build_gateway(s, {**workspace.environ(), "UP_KEY": UP_KEY})
    client = await serve_gateway(gw)
    headers = {"Authorization": f"Bearer {workspace.token('a1', ['r'])}", **EVENT_STREAM}
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "echo", "arguments": {}, "_meta": {"progressToken": 1}},
    }
    resp = await client.post("/up/mcp", headers=headers, json=message)
    first = await resp.content.readuntil(b"\n\n")
    [pending] = await gw.approvals.pending()
    assert await gw.approvals.decide(pending["id"], True, "alice") == "decided"
    raw = first + await resp.read()
    assert UP_KEY.encode() not in raw and b"Hunter2" not in raw
    *notes, answer = sse_messages(raw)
    assert notes and answer["id"] == 1
    assert answer["result"]["content"][0]["text"].startswith("the key is ")


def test_a_json_answer_is_one_event_whatever_its_lines() -> None:
    body = b'{\n  "a": 1,\r\n\r\n  "event: x": "data: y",\r"b": "\\n\\ndata: z"}'
    event = sse_message(body)
    assert event.startswith(b"event: message\n") and event.endswith(b"\n\n")
    assert event.count(b"\n\n") == 1 and b"\r" not in event
    assert sse_messages(event) == [json.loads(body)]


async def _awkward(request: web.Request) -> web.StreamResponse:
    """An MCP server whose answers cannot all be passed on a held call's event stream."""
    message = await request.json()
    kind = request.match_info["kind"]
    text = "x" * (4096 if kind.startswith("big") else 10)
    answer = {"jsonrpc": "2.0", "id": message["id"], "result": {"content": [], "text": text}}
    if kind == "status":
        return web.json_response({"jsonrpc": "2.0", "id": None, "error": {}}, status=500)
    if kind == "html":
        return web.Response(text="<p>hi</p>", content_type="text/html")
    if kind == "bigjson":
        return web.json_response(answer)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b": a comment the gateway passes on\n\n")
    await asyncio.sleep(0.05)
    await resp.write(b"event: message\ndata: " + json.dumps(answer).encode() + b"\n\n")
    await resp.write_eof()
    return resp


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("status", "upstream_unavailable"),
        ("html", "upstream_unavailable"),
        ("bigjson", "payload_too_large"),
        ("bigsse", "payload_too_large"),
    ],
)
async def test_an_answer_that_cannot_go_on_the_stream(
    aiohttp_server: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    token_file: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
    kind: str,
    reason: str,
) -> None:
    app = web.Application()
    app.router.add_post("/{kind}/mcp", _awkward)
    server = await aiohttp_server(app)
    policy = tmp_path / "awkward.yaml"
    policy.write_text(
        "version: 1\nupstreams:\n"
        f'  up: {{url: "http://127.0.0.1:{server.port}/{kind}", kind: mcp,'
        " mcp: {approval_keepalive: 200ms}, limits: {response_body: 1KiB}}\n"
        'agents: {"*": [r]}\nroles:\n  r:\n    rules:\n'
        "      - {id: echo, upstream: up, allow: POST /mcp, tool: echo, approval: required}\n"
    )
    s = dataclasses.replace(settings, policy=policy, admin_port=0, admin_token_file=token_file)
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    headers = {"Authorization": f"Bearer {workspace.token('a1', ['r'])}", **EVENT_STREAM}
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "echo", "arguments": {}, "_meta": {"progressToken": 1}},
    }
    resp = await client.post("/up/mcp", headers=headers, json=message)
    first = await resp.content.readuntil(b"\n\n")
    [pending] = await gw.approvals.pending()
    assert await gw.approvals.decide(pending["id"], True, "alice") == "decided"
    if kind == "bigsse":
        # Part of the server's stream was passed on: the connection is cut, no answer.
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    else:
        *_, answer = sse_messages(first + await resp.read())
        assert answer["id"] == 1 and answer["error"]["data"]["reason"] == reason
    [line] = [ln for ln in audit_lines(s, gw) if ln.get("approval") == pending["id"]]
    assert line["reason"] == reason and line["status"] == 200 and line["decision"] == "allow"
