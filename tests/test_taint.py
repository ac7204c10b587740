"""Taint: once a run has read untrusted content, its sensitive calls need a person (or are
refused), on both state backends; other runs are not affected; the mark is set before the
untrusted call is forwarded and outlives a store that restarts empty."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gateway.app import build_gateway
from gateway.config import Settings
from gateway.errors import ConfigError
from gateway.policy.load import load_policy
from gateway.policy_file import PolicyError
from mocks.demo import Workspace
from tests.conftest import Mocks
from tests.redis_server import RedisServer

LOGS = "/logs/logs/application?level=info&limit=5"


def tainting_policy(policy_file: Path, when: str = "approve") -> Path:
    text = policy_file.read_text()
    upstream = "  logs:\n"
    rule = "      - id: restart-service\n"
    assert upstream in text and rule in text
    text = text.replace(upstream, upstream + "    trust: untrusted\n", 1)
    extra = "        sensitive: true\n"
    if when != "approve":
        extra += f"        when_tainted: {when}\n"
    text = text.replace(rule, rule + extra, 1)
    path = policy_file.with_name(f"tainting-{when}.yaml")
    path.write_text(text)
    return path


async def make(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    *,
    when: str = "approve",
    state: str = "memory",
) -> Any:
    token_file = policy_file.with_name("admin.token")
    if not token_file.exists():
        token_file.write_text("admin-token-0123456789abcdef\n")
        token_file.chmod(0o600)
    s = dataclasses.replace(
        settings,
        policy=tainting_policy(policy_file, when),
        admin_port=0,
        admin_token_file=token_file,
        approval_timeout=10.0,
        state=state,
    )
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    return gw, client


def sre(workspace: Workspace, run: str | None, *roles: str) -> dict[str, str]:
    token = workspace.token("sre-bot", ["sre-diagnostics", *roles], run=run)
    return {"Authorization": f"Bearer {token}"}


async def restart(client: Any, headers: dict[str, str]) -> Any:
    return await client.post("/services/services/restart", json={"service": "web"}, headers=headers)


async def held(gw: Any) -> dict[str, Any]:
    for _ in range(200):
        pending = await gw.approvals.pending()
        if pending:
            return pending[0]  # type: ignore[no-any-return]
        await asyncio.sleep(0.02)
    raise AssertionError("nothing was held")


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


async def test_a_sensitive_call_goes_before_an_untrusted_read_and_is_held_after(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    mocks: Mocks,
    backend: str,
) -> None:
    mocks.clear()
    gw, client = await make(serve_gateway, settings, workspace, policy_file, state=backend)
    run_a, run_b = sre(workspace, "run-a"), sre(workspace, "run-b")
    assert (await restart(client, run_a)).status == 200  # not tainted: forwarded
    assert (await client.get(LOGS, headers=run_a)).status == 200  # reads untrusted content
    assert await gw.state.taint_of("run-a") is not None
    call = asyncio.ensure_future(restart(client, run_a))
    pending = await held(gw)
    assert "upstream logs" in pending["why"] and "run-a" in pending["why"]
    assert len(mocks.requests("services")) == 1  # only the first restart so far
    assert (await restart(client, run_b)).status == 200  # another run: not affected
    assert await gw.approvals.decide(pending["id"], True, by="alice") == "decided"
    assert (await call).status == 200
    assert len(mocks.requests("services")) == 3
    # Taint never clears within the run: the next sensitive call is held again.
    again = asyncio.ensure_future(restart(client, run_a))
    pending = await held(gw)
    assert await gw.approvals.decide(pending["id"], False, by="alice") == "decided"
    assert (await again).status == 403


async def test_when_tainted_deny_refuses_with_the_cause(
    serve_gateway: Any, settings: Settings, workspace: Workspace, policy_file: Path, mocks: Mocks
) -> None:
    mocks.clear()
    gw, client = await make(serve_gateway, settings, workspace, policy_file, when="deny")
    run = sre(workspace, "run-d")
    await client.get(LOGS, headers=run)
    answer = await restart(client, run)
    body = await answer.json(content_type="application/problem+json")
    assert answer.status == 403 and body["reason"] == "run_tainted"
    assert "upstream logs" in body["detail"] and body["rule"] == "restart-service"
    assert mocks.requests("services") == []


async def test_a_token_without_a_run_is_tainted_by_itself(
    serve_gateway: Any, settings: Settings, workspace: Workspace, policy_file: Path, mocks: Mocks
) -> None:
    mocks.clear()
    gw, client = await make(serve_gateway, settings, workspace, policy_file, when="deny")
    first, second = sre(workspace, None), sre(workspace, None)
    await client.get(LOGS, headers=first)
    assert (await restart(client, first)).status == 403
    assert (await restart(client, second)).status == 200  # another token, untainted


async def test_the_mark_is_set_before_the_untrusted_call_is_forwarded(
    serve_gateway: Any, settings: Settings, workspace: Workspace, policy_file: Path, mocks: Mocks
) -> None:
    """While the untrusted answer is still on its way, the run is already tainted: a
    sensitive call made at that moment is refused, never forwarded first."""
    mocks.clear()
    gw, client = await make(serve_gateway, settings, workspace, policy_file, when="deny")
    run = sre(workspace, "run-r", "tester")
    stream = await client.get("/logs/logs/stream?chunks=5&delay=0.3", headers=run)
    assert stream.status == 200 and not stream.content.at_eof()  # still on its way
    answer = await restart(client, run)
    assert answer.status == 403
    assert mocks.requests("services") == []
    await stream.read()


async def test_a_store_that_restarts_empty_does_not_clear_a_taint_this_gateway_set(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    mocks: Mocks,
    redis_server: RedisServer,
) -> None:
    mocks.clear()
    gw, client = await make(
        serve_gateway, settings, workspace, policy_file, when="deny", state=redis_server.url
    )
    run = sre(workspace, "run-s")
    await client.get(LOGS, headers=run)
    redis_server.restart()  # empty
    for _ in range(100):  # until the store is back in sync (503 state_unavailable before)
        answer = await restart(client, run)
        if answer.status != 503:
            break
        await asyncio.sleep(0.05)
    assert await gw.state.taint_of("run-s") is None  # the store forgot it...
    body = await answer.json(content_type="application/problem+json")
    assert answer.status == 403 and body["reason"] == "run_tainted", body  # ...we did not
    assert mocks.requests("services") == []


def test_when_tainted_needs_sensitive(tmp_path: Path, policy_file: Path) -> None:
    text = policy_file.read_text().replace(
        "      - id: restart-service\n",
        "      - id: restart-service\n        when_tainted: deny\n",
        1,
    )
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert "when_tainted applies to sensitive rules only" in str(err.value)


def test_a_sensitive_rule_that_may_be_held_needs_an_approver(
    settings: Settings, workspace: Workspace, policy_file: Path
) -> None:
    s = dataclasses.replace(settings, policy=tainting_policy(policy_file))
    with pytest.raises(ConfigError) as err:
        build_gateway(s, workspace.environ())
    assert "restart-service" in str(err.value)


async def test_the_admin_api_shows_a_runs_taint_and_its_cause(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    mocks: Mocks,
    backend: str,
) -> None:
    from gateway.admin import create_admin_app
    from tests.test_admin import conforms

    gw, client = await make(serve_gateway, settings, workspace, policy_file, state=backend)
    admin = await aiohttp_client(create_admin_app(gw, gw.operators))
    auth = {"Authorization": "Bearer admin-token-0123456789abcdef"}
    resp = await admin.get("/taint?run=run-t", headers=auth)
    body = await resp.json()
    assert body == {"key": "run-t", "tainted": False, "cause": None}
    conforms("/taint", "GET", 200, body)
    events = await admin.get("/events?type=taint", headers=auth)
    await events.content.readuntil(b"\n\n")
    await client.get(LOGS, headers=sre(workspace, "run-t"))
    frame = await asyncio.wait_for(events.content.readuntil(b"\n\n"), 2)
    assert b"event: taint" in frame and b"upstream logs" in frame
    events.close()
    body = await (await admin.get("/taint?run=run-t", headers=auth)).json()
    assert body["tainted"] is True and body["cause"]["source"] == "upstream logs"
    conforms("/taint", "GET", 200, body)
    for bad in ("/taint", "/taint?run=a&jti=b", "/taint?run="):
        assert (await admin.get(bad, headers=auth)).status == 400
