"""Pause, resume and stop through the whole gateway, with the memory store and with Redis
(and two gateways sharing one Redis): ``Gateway.pause``, ``resume`` and ``stop``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.app import Gateway, build_gateway
from gateway.config import Settings
from gateway.errors import StateUnavailable
from mocks.demo import Workspace
from tests.conftest import Mocks
from tests.redis_server import RedisServer
from tests.state.conftest import BACKENDS, needs_redis

PROBLEM = "application/problem+json"
ECHO = "/echo/echo/x"


def bearer(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


@pytest.fixture(params=BACKENDS)
def state_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "memory":
        yield "memory"
        return
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.close()


def make_gateway(
    settings: Settings, workspace: Workspace, tmp_path: Path, name: str = "gw", **changes: Any
) -> Gateway:
    s = dataclasses.replace(settings, audit=tmp_path / f"{name}-audit.jsonl", **changes)
    return build_gateway(s, workspace.environ())


@pytest.fixture
async def served(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    mocks: Mocks,
    tmp_path: Path,
    state_url: str,
) -> tuple[Gateway, Any]:
    mocks.clear()
    gw = make_gateway(settings, workspace, tmp_path, state=state_url, pause_hold=5.0)
    return gw, await serve_gateway(gw)


async def held(gw: Gateway, count: int = 1) -> None:
    """Wait until ``count`` calls are held by a pause at ``gw``."""
    for _ in range(200):
        if gw.pipeline.pause.held.in_use >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{count} call(s) never held (held: {gw.pipeline.pause.held.in_use})")


async def problem(resp: Any, status: int, reason: str) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    body = await resp.json(content_type=PROBLEM)
    assert body["reason"] == reason
    return body


async def test_a_paused_agents_call_waits_and_goes_on_when_resumed(
    served: tuple[Gateway, Any], token: Any, mocks: Mocks, caplog: pytest.LogCaptureFixture
) -> None:
    gw, client = served
    caplog.set_level(logging.INFO, logger="capgate")
    await gw.pause("agent", "tester", until=None, by="ops-alice", reason="checking its plan")
    assert [(p["kind"], p["value"], p["by"]) for p in gw.state.pauses()] == [
        ("agent", "tester", "ops-alice")
    ]
    call = asyncio.ensure_future(client.get(ECHO, headers=bearer(token())))
    await held(gw)
    await asyncio.sleep(0.1)
    assert not call.done()
    assert mocks.requests("echo") == []  # nothing sent while paused
    health = await (await client.get("/_capgate/health")).json()
    assert health["held_by_pause"]["in_use"] == 1
    assert await gw.resume("agent", "tester", by="ops-alice") is True
    resp = await asyncio.wait_for(call, 2.0)
    assert resp.status == 200
    assert len(mocks.requests("echo")) == 1  # reached the upstream once
    assert gw.pipeline.pause.held.in_use == 0
    assert await gw.resume("agent", "tester", by="ops-alice") is False
    logged = [r.getMessage() for r in caplog.records]
    assert any("paused by ops-alice" in m for m in logged)
    assert any("resumed by ops-alice" in m for m in logged)


async def test_past_the_hold_a_call_is_refused_agent_paused(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    mocks: Mocks,
    tmp_path: Path,
    state_url: str,
    token: Any,
) -> None:
    mocks.clear()
    gw = make_gateway(settings, workspace, tmp_path, state=state_url, pause_hold=0.3)
    client = await serve_gateway(gw)
    await gw.pause("agent", "tester", until=None, by="ops", reason="investigating")
    began = time.monotonic()
    resp = await client.get(ECHO, headers=bearer(token()))
    assert 0.25 < time.monotonic() - began < 2.0
    body = await problem(resp, 503, "agent_paused")
    assert resp.headers["Retry-After"] == "30"
    assert "investigating" not in body["detail"]
    assert mocks.requests("echo") == []
    gw.audit.flush()
    lines = [json.loads(x) for x in (tmp_path / "gw-audit.jsonl").read_text().splitlines()]
    assert lines[-1]["reason"] == "agent_paused" and lines[-1]["decision"] == "deny"


async def test_other_agents_and_runs_are_unaffected(
    served: tuple[Gateway, Any], token: Any, mocks: Mocks
) -> None:
    gw, client = served
    await gw.pause("agent", "tester", until=None, by="ops", reason="")
    resp = await client.get(ECHO, headers=bearer(token("other-bot")))
    assert resp.status == 200
    await gw.resume("agent", "tester", by="ops")

    await gw.pause("run", "run-1", until=None, by="ops", reason="")
    resp = await client.get(ECHO, headers=bearer(token("tester", run="run-2")))
    assert resp.status == 200  # another run of the same agent
    call = asyncio.ensure_future(client.get(ECHO, headers=bearer(token("tester", run="run-1"))))
    await held(gw)
    assert not call.done()
    await gw.resume("run", "run-1", by="ops")
    assert (await asyncio.wait_for(call, 2.0)).status == 200


async def test_stop_cuts_calls_in_flight_and_calls_held_by_a_pause(
    served: tuple[Gateway, Any], token: Any, mocks: Mocks, caplog: pytest.LogCaptureFixture
) -> None:
    gw, client = served
    caplog.set_level(logging.INFO, logger="capgate")
    tok = token("tester", run="run-1")
    slow = asyncio.ensure_future(client.get("/echo/echo/slow?delay=0.9", headers=bearer(tok)))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if len(gw.inflight):
            break
    assert len(gw.inflight) == 1
    await gw.pause("run", "run-1", until=None, by="ops", reason="")
    waiting = asyncio.ensure_future(client.get(ECHO, headers=bearer(tok)))
    await held(gw)
    bystander = await client.get(ECHO, headers=bearer(token("other-bot")))
    assert bystander.status == 200

    cut = await gw.stop("run", "run-1", by="ops-bob", reason="it went rogue")
    assert cut == 2
    for resp in await asyncio.wait_for(asyncio.gather(slow, waiting), 2.0):
        await problem(resp, 401, "token_revoked")
    assert gw.pipeline.pause.held.in_use == 0 and len(gw.inflight) == 0
    [revoked] = gw.state.revocations()
    assert (revoked["kind"], revoked["value"]) == ("run", "run-1")
    assert (revoked["by"], revoked["reason"]) == ("ops-bob", "it went rogue")
    assert any("stopped by ops-bob" in r.getMessage() for r in caplog.records)
    # Stopped means refused from now on, paused or not.
    await problem(await client.get(ECHO, headers=bearer(tok)), 401, "token_revoked")
    assert await gw.stop("run", "run-1", by="ops-bob", reason="again") == 0


async def test_a_stop_survives_a_restart_of_the_gateway_with_memory_state(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    mocks: Mocks,
    tmp_path: Path,
    token: Any,
) -> None:
    """The README promises a stop lasts: with memory state it is kept in the gateway's
    revocation journal (beside the audit file) and restored at start."""
    tok = token("tester", run="run-7")
    first = make_gateway(settings, workspace, tmp_path)
    assert first.journal is not None
    assert first.journal.path == tmp_path / "gw-audit.jsonl.revocations"
    client = await serve_gateway(first)
    assert (await client.get(ECHO, headers=bearer(tok))).status == 200
    await first.stop("run", "run-7", by="ops-bob", reason="rogue")
    await problem(await client.get(ECHO, headers=bearer(tok)), 401, "token_revoked")

    again = make_gateway(settings, workspace, tmp_path)  # a new process, the same disk
    client = await serve_gateway(again)
    await problem(await client.get(ECHO, headers=bearer(tok)), 401, "token_revoked")
    assert (await client.get(ECHO, headers=bearer(token("tester", run="run-8")))).status == 200
    [kept] = again.state.revocations()
    assert (kept["by"], kept["reason"]) == ("ops-bob", "rogue")
    status, health = await again.health_report()
    assert status == 200 and health["revocations_journal"]["ok"] is True


async def test_an_agent_cancelling_a_held_call_is_client_closed(
    served: tuple[Gateway, Any], token: Any, settings: Settings, tmp_path: Path
) -> None:
    gw, client = served
    await gw.pause("agent", "tester", until=None, by="ops", reason="")
    call = asyncio.ensure_future(client.get(ECHO, headers=bearer(token())))
    await held(gw)
    call.cancel()
    for _ in range(200):
        await asyncio.sleep(0.01)
        if gw.pipeline.pause.held.in_use == 0:
            break
    assert gw.pipeline.pause.held.in_use == 0
    gw.audit.flush()
    lines = [json.loads(x) for x in (tmp_path / "gw-audit.jsonl").read_text().splitlines()]
    assert lines[-1]["reason"] == "client_closed"


@pytest.mark.redis
@needs_redis
async def test_two_gateways_on_one_redis_share_pauses(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    mocks: Mocks,
    tmp_path: Path,
    token: Any,
) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        mocks.clear()
        first = make_gateway(settings, workspace, tmp_path, "first", state=server.url)
        second = make_gateway(settings, workspace, tmp_path, "second", state=server.url)
        await serve_gateway(first)
        client = await serve_gateway(second)

        await first.pause("agent", "tester", until=None, by="ops-alice", reason="")
        for _ in range(100):
            if second.state.pauses():
                break
            await asyncio.sleep(0.01)
        call = asyncio.ensure_future(client.get(ECHO, headers=bearer(token())))
        await held(second)
        await asyncio.sleep(0.1)
        assert not call.done() and mocks.requests("echo") == []
        assert await first.resume("agent", "tester", by="ops-alice") is True
        assert (await asyncio.wait_for(call, 2.0)).status == 200
        assert len(mocks.requests("echo")) == 1

        # A stop made at one gateway cuts the call the other holds.
        await first.pause("agent", "tester", until=None, by="ops-alice", reason="")
        for _ in range(100):
            if second.state.pauses():
                break
            await asyncio.sleep(0.01)
        call = asyncio.ensure_future(client.get(ECHO, headers=bearer(token())))
        await held(second)
        assert await first.stop("agent", "tester", by="ops-bob", reason="stop") == 0
        await problem(await asyncio.wait_for(call, 2.0), 401, "token_revoked")
        assert [r["by"] for r in second.state.revocations()] == ["ops-bob"]
    finally:
        server.close()


async def test_stop_takes_agent_or_run_only(gateway: Gateway, client: Any) -> None:
    with pytest.raises(ValueError, match="agent' or 'run"):
        await gateway.stop("jti", "j1", by="ops", reason="")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="by"):
        await gateway.stop("agent", "tester", by="", reason="")
    assert gateway.state.revocations() == []


async def test_a_stop_the_store_did_not_take_still_cuts_here(
    gateway: Gateway,
    client: Any,
    token: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="capgate")
    revoke = gateway.state.revoke

    async def failing(*args: Any, **kw: Any) -> None:
        await revoke(*args, **kw)  # the local mirror takes it first, as Redis's does
        raise StateUnavailable("redis did not answer revoke")

    monkeypatch.setattr(gateway.state, "revoke", failing)
    await gateway.pause("agent", "tester", until=None, by="ops", reason="")
    call = asyncio.ensure_future(client.get(ECHO, headers=bearer(token())))
    await held(gateway)
    with pytest.raises(StateUnavailable):
        await gateway.stop("agent", "tester", by="ops-bob", reason="now")
    await problem(await asyncio.wait_for(call, 2.0), 401, "token_revoked")
    assert any("at this gateway only (1 call(s) cut)" in r.getMessage() for r in caplog.records)
