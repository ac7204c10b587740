"""The gateway against an upstream that misbehaves (``mocks/chaos.py``): every fault ends the
call with the right reason, in bounded time, audited; the upstream connection and the
agent's share of calls in flight are given back; the next call works."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.app import build_gateway
from gateway.audit_trail import call_records
from gateway.config import load_settings
from mocks.chaos import ChaosUpstream, down_url
from mocks.demo import Workspace

PROBLEM = "application/problem+json"


def chaos_policy(url: str, extra_upstream: str = "") -> str:
    return (
        "version: 1\n"
        "upstreams:\n"
        f'  up: {{url: "{url}", timeouts: {{connect: 1s, read: 0.5s, total: 2s}},'
        " limits: {response_body: 1MiB, concurrency: 8, per_agent: 4}}\n"
        f"{extra_upstream}"
        'agents:\n  "*": [r]\n'
        "roles:\n  r:\n    rules:\n"
        "      - {id: any, upstream: up, allow: 'GET /{fault}', allow_extra_query: true}\n"
        "      - {id: down, upstream: down, allow: 'GET /{fault}'}\n"
    )


@pytest.fixture
async def chaos() -> AsyncIterator[ChaosUpstream]:
    async with ChaosUpstream() as up:
        yield up


@pytest.fixture
async def gateway_to(serve_gateway: Any, workspace: Workspace, tmp_path: Path) -> Any:
    async def make(url: str) -> Any:
        policy = tmp_path / "chaos.yaml"
        policy.write_text(chaos_policy(url, f'  down: {{url: "{down_url()}"}}\n'))
        audit = tmp_path / "audit.jsonl"
        settings = load_settings(
            {"policy": str(policy), "jwks": str(workspace.jwks), "audit": str(audit)}, {}
        )
        gw = build_gateway(settings, workspace.environ())
        client = await serve_gateway(gw)
        client.gw, client.audit_path = gw, audit
        client.auth = {"Authorization": f"Bearer {workspace.token('agent-a', ['r'])}"}
        return client

    return make


def last_audit(client: Any) -> dict[str, Any]:
    client.gw.audit.flush()
    lines = client.audit_path.read_text().splitlines()
    return call_records(json.loads(x) for x in lines)[-1]


async def settled(chaos: ChaosUpstream, client: Any) -> None:
    """The upstream connection closed and the share given back (soon, not eventually)."""
    for _ in range(100):
        shares = client.gw.upstream_shares.snapshot()
        if chaos.open_connections == 0 and not shares:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not released: {chaos.open_connections} open, shares {shares}")


@pytest.mark.parametrize(
    ("target", "status", "reason"),
    [
        ("/up/slow?delay=3", 504, "upstream_timeout"),
        ("/up/hang", 504, "upstream_timeout"),
        ("/up/trickle-head?every=0.2", 504, "upstream_timeout"),  # each byte in time; not all
        ("/up/trickle?every=0.2&bytes=30", 504, "upstream_timeout"),  # body under the deadline
        ("/up/reset", 502, "upstream_unavailable"),
        ("/up/reset-mid?bytes=100", 502, "upstream_unavailable"),
        ("/up/close", 502, "upstream_unavailable"),
        ("/up/garbage", 502, "upstream_unavailable"),
        ("/up/huge?declared=1", 502, "payload_too_large"),
        ("/down/ok", 502, "upstream_unavailable"),
    ],
)
async def test_each_fault_ends_the_call_with_its_reason(
    chaos: ChaosUpstream, gateway_to: Any, target: str, status: int, reason: str
) -> None:
    client = await gateway_to(chaos.url)
    loop = asyncio.get_running_loop()
    started = loop.time()
    resp = await client.get(target, headers=client.auth)
    elapsed = loop.time() - started
    assert resp.status == status, await resp.text()
    assert (await resp.json(content_type=PROBLEM))["reason"] == reason
    assert elapsed < 2.0 + 1.0  # the deadline (total: 2s) holds, whatever the fault
    line = last_audit(client)
    assert line["reason"] == reason and line["status"] == status
    await settled(chaos, client)
    ok = await client.get("/up/ok", headers=client.auth)  # and the next call is served
    assert ok.status == 200


async def test_a_trickled_stream_is_cut_at_the_deadline(
    chaos: ChaosUpstream, gateway_to: Any
) -> None:
    """An answer already streaming when the deadline passes: the connection is cut (the
    only signal left once the head is sent), audited as upstream_timeout."""
    client = await gateway_to(chaos.url)
    resp = await client.get("/up/trickle?every=0.1&bytes=200&chunked=1", headers=client.auth)
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    line = last_audit(client)
    assert line["reason"] == "upstream_timeout"
    await settled(chaos, client)


async def test_an_endless_answer_is_cut_at_the_size_limit(
    chaos: ChaosUpstream, gateway_to: Any
) -> None:
    client = await gateway_to(chaos.url)
    resp = await client.get("/up/huge", headers=client.auth)
    assert resp.status == 200  # the head was passed on before the size was known
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    assert last_audit(client)["reason"] == "payload_too_large"
    await settled(chaos, client)


async def test_an_upstream_answering_an_error_is_passed_on(
    chaos: ChaosUpstream, gateway_to: Any
) -> None:
    client = await gateway_to(chaos.url)
    resp = await client.get("/up/status?code=503", headers=client.auth)
    assert resp.status == 503
    assert last_audit(client)["status"] == 503


async def test_the_background_loop_stops_when_a_tick_swallows_its_cancellation(
    gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collaborator that turns a cancellation into an error (or swallows it) mid-tick must
    not keep the background loop alive: the shutdown that cancelled it would wait forever."""
    import gateway.app as app_module

    async def swallowing_tick(gw: Any, now: float) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("a library's own error, raised on cancellation") from None

    monkeypatch.setattr(app_module, "_tick", swallowing_tick)
    watcher = asyncio.ensure_future(app_module._watch(gateway))
    await asyncio.sleep(gateway.settings.reload_interval + 0.1)  # inside a tick
    watcher.cancel()
    await asyncio.wait({watcher}, timeout=2.0)
    assert watcher.cancelled(), "the background loop kept running after its cancellation"


async def test_health_shows_how_long_the_event_loop_was_held(client: Any) -> None:
    """Something that holds the loop (a blocking call, a long check) delays every call; the
    health report says how long the worst hold of the last minute was."""
    import time

    await asyncio.sleep(0.2)  # the probe runs
    health = await (await client.get("/_capgate/health")).json()
    assert health["event_loop"]["worst_lag_ms"] < 200
    before = health["event_loop"]["stalls_over_10ms"]
    time.sleep(0.12)  # noqa: ASYNC251 (holding the loop on purpose)
    await asyncio.sleep(0.2)
    health = await (await client.get("/_capgate/health")).json()
    assert health["event_loop"]["worst_lag_ms"] >= 60
    assert health["event_loop"]["stalls_over_10ms"] >= before + 1
