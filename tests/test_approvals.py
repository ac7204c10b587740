"""Held calls: approve, deny, time out; the admin API and its token; fail closed."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from gateway.admin import create_admin_app, read_admin_token
from gateway.app import build_gateway
from gateway.approvals import Approvals, HeldCall
from gateway.config import Settings
from gateway.errors import ApprovalDenied, ApprovalPending, ApprovalTimeout, ConfigError
from mocks.demo import Workspace
from tests.conftest import Mocks

ADMIN_TOKEN = "admin-token-0123456789abcdef"


def held_policy(policy_file: Path) -> Path:
    text = policy_file.read_text()
    anchor = "      - id: restart-service\n"
    assert anchor in text
    path = policy_file.with_name("held.yaml")
    path.write_text(text.replace(anchor, anchor + "        approval: required\n"))
    return path


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(ADMIN_TOKEN + "\n")
    return path


@pytest.fixture
async def held(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    token_file: Path,
    mocks: Mocks,
) -> Any:
    s = dataclasses.replace(
        settings,
        policy=held_policy(policy_file),
        admin_port=0,
        admin_token_file=token_file,
        approval_timeout=1.0,
    )
    mocks.clear()
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    assert gw.operators is not None
    admin = await aiohttp_client(create_admin_app(gw, gw.operators))
    return gw, client, admin


async def restart(client: Any, workspace: Workspace) -> Any:
    tok = workspace.token("sre-bot", ["sre-diagnostics"])
    return await client.post(
        "/services/services/restart",
        json={"service": "web"},
        headers={"Authorization": f"Bearer {tok}"},
    )


async def pending_one(admin: Any) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for _ in range(100):
        resp = await admin.get("/approvals", headers=auth)
        pending = (await resp.json())["pending"]
        if pending:
            [one] = pending
            return one
        await asyncio.sleep(0.01)
    raise AssertionError("nothing became pending")


@pytest.mark.parametrize("verb", ["approve", "deny"])
async def test_a_person_decides(held: Any, workspace: Workspace, mocks: Mocks, verb: str) -> None:
    gw, client, admin = held
    call = asyncio.ensure_future(restart(client, workspace))
    pending = await pending_one(admin)
    assert pending["agent"] == "sre-bot" and pending["rule"] == "restart-service"
    assert pending["target"] == "/services/services/restart"
    assert pending["body"] == '{"service": "web"}'
    assert mocks.requests("services") == []  # held: nothing sent yet
    # Health shows the shares a held call takes (held records, and calls waiting on them).
    health = await (await client.get("/_capgate/health")).json()
    assert health["held_for_approval"]["in_use"] == 1
    assert health["waiting_for_approval"]["in_use"] == 1
    resp = await admin.post(
        f"/approvals/{pending['id']}/{verb}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert resp.status == 200
    answer = await call
    if verb == "approve":
        assert answer.status == 200
        assert await answer.json() == {"restarted": "web", "by": "sre-bot"}
    else:
        body = await answer.json(content_type="application/problem+json")
        assert answer.status == 403 and body["reason"] == "approval_denied"
        assert mocks.requests("services") == []


async def test_nobody_decides(held: Any, workspace: Workspace, mocks: Mocks) -> None:
    _, client, _ = held
    answer = await restart(client, workspace)
    body = await answer.json(content_type="application/problem+json")
    assert answer.status == 408 and body["reason"] == "approval_timeout"
    assert mocks.requests("services") == []


async def test_admin_api_needs_its_token(held: Any, workspace: Workspace) -> None:
    _, _, admin = held
    for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_TOKEN}):
        resp = await admin.get("/approvals", headers=auth)
        assert resp.status == 401
    resp = await admin.post(
        "/approvals/0123456789abcdef/approve", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert resp.status == 404


def test_approval_rules_need_an_approver(
    settings: Settings, workspace: Workspace, policy_file: Path
) -> None:
    s = dataclasses.replace(settings, policy=held_policy(policy_file))
    with pytest.raises(ConfigError) as err:
        build_gateway(s, workspace.environ())
    assert "restart-service" in str(err.value) and "--admin-port" in str(err.value)


def test_admin_token_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text(ADMIN_TOKEN)
    path.chmod(0o644)
    with pytest.raises(ConfigError):
        read_admin_token(path)
    path.chmod(0o600)
    assert read_admin_token(path) == ADMIN_TOKEN.encode()


def held_call(body: bytes | None = None, agent: str = "a") -> HeldCall:
    return HeldCall(
        agent=agent,
        run=None,
        rule="r",
        why="rule r requires approval",
        method="POST",
        target="/x?api_key=sk-live-0123456789abcdefghij",
        body=body,
        tools=(),
        policy="p1",
    )


async def test_hold_unit() -> None:
    approvals = Approvals(timeout=0.2)
    with pytest.raises(ApprovalTimeout):
        await approvals.hold(held_call())
    task = asyncio.ensure_future(approvals.hold(held_call()))
    await asyncio.sleep(0.01)
    [pending] = await approvals.pending()
    assert await approvals.decide(pending["id"], False, by="ops") == "decided"
    assert await approvals.decide(pending["id"], True, by="ops") == "not_found"  # decided once
    with pytest.raises(ApprovalDenied):
        await task
    assert await approvals.pending() == []


async def test_the_approver_sees_the_exact_call_with_secrets_masked() -> None:
    body = b'{"to": "ops@example.com", "password": "hunter2-hunter2", "n": 1}'
    approvals = Approvals(timeout=5)
    task = asyncio.ensure_future(approvals.hold(held_call(body)))
    await asyncio.sleep(0.01)
    [pending] = await approvals.pending()
    assert pending["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert pending["body_size"] == len(body) and pending["body_truncated"] is False
    assert "ops@example.com" in pending["body"] and "hunter2" not in pending["body"]
    assert "sk-live-0123456789abcdefghij" not in pending["target"]
    assert pending["target"].startswith("/x?api_key=")
    assert (pending["policy"], pending["why"]) == ("p1", "rule r requires approval")
    # A decision made on another body's digest decides nothing.
    other = hashlib.sha256(body + b" ").hexdigest()
    assert await approvals.decide(pending["id"], True, by="ops", body_sha256=other) == "mismatch"
    assert not task.done()
    assert (
        await approvals.decide(pending["id"], True, by="ops", body_sha256=pending["body_sha256"])
        == "decided"
    )
    approval_id, decision = await task
    assert approval_id == pending["id"] and decision.by == "ops"


async def test_revocation_stops_a_held_call(held: Any, workspace: Workspace, mocks: Mocks) -> None:
    gw, client, admin = held
    call = asyncio.ensure_future(restart(client, workspace))
    await pending_one(admin)
    await gw.state.revoke("agent", "sre-bot")
    answer = await call
    body = await answer.json(content_type="application/problem+json")
    assert answer.status == 401 and body["reason"] == "token_revoked"
    assert await gw.approvals.pending() == []
    assert mocks.requests("services") == []


async def test_the_approval_webhook_is_told_when_a_call_starts_waiting(
    aiohttp_client: Any,
    aiohttp_server: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    token_file: Path,
    mocks: Mocks,
) -> None:
    from aiohttp import web

    received: list[dict[str, Any]] = []
    arrived = asyncio.Event()

    async def hook(request: web.Request) -> web.Response:
        received.append(await request.json())
        arrived.set()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", hook)
    receiver = await aiohttp_server(app)
    s = dataclasses.replace(
        settings,
        policy=held_policy(policy_file),
        admin_port=0,
        admin_token_file=token_file,
        approval_timeout=5.0,
        approval_webhook=str(receiver.make_url("/hook")),
    )
    mocks.clear()
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    call = asyncio.ensure_future(restart(client, workspace))
    await asyncio.wait_for(arrived.wait(), 5)
    [told] = received
    assert told["capgate"] == "approval_waiting" and told["state"] == "held"
    assert (told["agent"], told["path"], told["rule"]) == (
        "sre-bot",
        "/services/services/restart",
        "restart-service",
    )
    assert '"web"' not in json.dumps(told) and "body" not in told  # never the body
    await gw.approvals.decide(told["id"], True, by="pager")
    assert (await call).status == 200
    assert gw.webhook is not None and gw.webhook.health()["sent"] == 1


async def test_a_dead_webhook_never_slows_a_held_call(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    token_file: Path,
    mocks: Mocks,
) -> None:
    s = dataclasses.replace(
        settings,
        policy=held_policy(policy_file),
        admin_port=0,
        admin_token_file=token_file,
        approval_timeout=5.0,
        approval_webhook="http://127.0.0.1:9/hook",
    )
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    call = asyncio.ensure_future(restart(client, workspace))
    for _ in range(200):
        pending = await gw.approvals.pending()
        if pending:
            break
        await asyncio.sleep(0.01)
    await gw.approvals.decide(pending[0]["id"], True, by="ops")
    assert (await call).status == 200
    for _ in range(200):
        if gw.webhook is not None and gw.webhook.health()["failed"] == 1:
            break
        await asyncio.sleep(0.01)
    assert gw.webhook is not None and gw.webhook.health()["failed"] == 1


async def test_a_keyed_approval_outlives_its_caller() -> None:
    approvals = Approvals(timeout=5.0)
    call = held_call()
    with pytest.raises(ApprovalPending) as err:
        await approvals.hold(call, key="k", patience=0.05)
    first = err.value.approval
    # The caller hung up (cancelled): the approval stays, the same key attaches to it.
    waiting = asyncio.ensure_future(approvals.hold(call, key="k"))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert [p["id"] for p in await approvals.pending()] == [first]
    assert await approvals.decide(first, True, by="ops") == "decided"
    assert (await approvals.hold(call, key="k"))[0] == first
    # Taken: the same call again is a new approval; withdrawn, it ends.
    with pytest.raises(ApprovalPending) as err:
        await approvals.hold(call, key="k", patience=0.05)
    assert err.value.approval != first
    assert approvals.slots.held_by("a") == 1
    approvals.withdraw("k")
    for _ in range(10):
        await asyncio.sleep(0)
    assert await approvals.pending() == []
    assert approvals.slots.held_by("a") == 0
    await approvals.close()
