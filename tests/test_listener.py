"""The agents' listener under hostile connections (``gateway/listener.py``): a cap on
connections, head and idle timeouts, a body deadline, floods summarised, not logged each."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import pytest

from gateway.app import build_gateway
from gateway.config import load_settings
from mocks.demo import Workspace

PROBLEM = "application/problem+json"


def base(workspace: Workspace) -> dict[str, Any]:
    return {
        "policy": str(workspace.policy),
        "jwks": str(workspace.jwks),
        "upstream_key": str(workspace.upstream_key),
        "secrets_dir": str(workspace.secrets_dir),
        "audit": "-",
    }


@pytest.fixture
async def guarded(serve_gateway: Any, workspace: Workspace) -> Any:
    """The test policy's gateway with a small cap (16 connections) and short timeouts."""
    settings = load_settings(
        {
            **base(workspace),
            "max_connections": 16,
            "head_timeout": "0.5s",
            "idle_timeout": "1s",
        },
        {},
    )
    gw = build_gateway(settings, workspace.environ())
    client = await serve_gateway(gw)
    client.gw = gw
    return client


OPENED: list[asyncio.StreamWriter] = []


@pytest.fixture(autouse=True)
async def close_connections() -> Any:
    yield
    while OPENED:
        writer = OPENED.pop()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def connect(client: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(client.host, client.port)
    OPENED.append(writer)
    return reader, writer


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the gateway sent before closing, which it must do within ``seconds``."""
    return await asyncio.wait_for(reader.read(), seconds)


async def test_connections_over_the_cap_get_503_and_the_others_keep_working(
    guarded: Any, token: Any
) -> None:
    held = [await connect(guarded) for _ in range(16)]
    await asyncio.sleep(0.05)
    assert guarded.gw.guard.open == 16
    reader, writer = await connect(guarded)
    answer = await closed_within(reader, 2)
    assert answer.startswith(b"HTTP/1.1 503 ") and b"concurrency_limited" in answer
    writer.close()
    # A connection already open is served.
    reader, writer = held[0]
    writer.write(
        (
            "GET /metrics/metrics/cpu?window=5m HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {token('sre-bot', ['sre-diagnostics'])}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
    )
    assert (await closed_within(reader, 5)).startswith(b"HTTP/1.1 200 ")
    for _, w in held:
        w.close()
    for _ in range(100):
        if guarded.gw.guard.open == 0:
            break
        await asyncio.sleep(0.02)
    assert guarded.gw.guard.open == 0
    assert guarded.gw.guard.totals["connections refused at the cap"] == 1
    resp = await guarded.get("/_capgate/health")  # room again
    assert resp.status == 200


async def trickle_head(writer: asyncio.StreamWriter) -> None:
    """A request head sent a byte every 50 ms (5 s in all), until the gateway closes."""
    head = b"GET /metrics/metrics/cpu HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    for byte in head:
        if writer.is_closing():
            return
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.05)


async def test_a_trickled_head_is_closed_at_the_head_timeout(guarded: Any) -> None:
    reader, writer = await connect(guarded)
    loop = asyncio.get_running_loop()
    started = loop.time()
    sender = asyncio.create_task(trickle_head(writer))
    assert await closed_within(reader, 3) == b""
    assert loop.time() - started < 1.5
    sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)
    assert guarded.gw.guard.totals["request heads not complete in time"] == 1


async def test_a_head_trickled_after_a_quick_request_is_closed_at_its_own_deadline(
    guarded: Any, workspace: Workspace
) -> None:
    """On a keep-alive connection the timer armed for the first head outlives that head (it
    is not cancelled per request): a second head trickled later still gets the whole head
    timeout from its own first byte, and no more."""
    reader, writer = await connect(guarded)
    loop = asyncio.get_running_loop()
    token = workspace.token("tester", ["tester"])
    writer.write(
        b"GET /metrics/metrics/cpu HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + token.encode()
        + b"\r\n\r\n"
    )
    status = await asyncio.wait_for(reader.readline(), 3)
    assert status.startswith(b"HTTP/1.1 "), status
    await asyncio.sleep(0.3)  # the first head's timer (0.5 s) fires during the second head
    started = loop.time()
    sender = asyncio.create_task(trickle_head(writer))
    await closed_within(reader, 3)  # the rest of the first answer, then the close
    elapsed = loop.time() - started
    assert 0.45 < elapsed < 1.5, elapsed
    sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)
    assert guarded.gw.guard.totals["request heads not complete in time"] == 1


async def test_an_idle_connection_is_closed_at_the_idle_timeout(guarded: Any) -> None:
    reader, _ = await connect(guarded)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await closed_within(reader, 4) == b""
    assert 0.5 < loop.time() - started < 3


async def test_a_trickled_body_is_refused_at_its_deadline(
    guarded: Any, token: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gateway.call

    monkeypatch.setattr(gateway.call, "BODY_READ_TIMEOUT", 0.5)
    reader, writer = await connect(guarded)
    writer.write(
        (
            "POST /services/services/restart HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {token('sre-bot', ['sre-diagnostics'])}\r\n"
            "Content-Type: application/json\r\nContent-Length: 40\r\n\r\n{"
        ).encode()
    )
    await writer.drain()

    async def trickle() -> None:
        for _ in range(30):
            await asyncio.sleep(0.1)
            writer.write(b" ")
            await writer.drain()

    sender = asyncio.create_task(trickle())
    answer = await closed_within(reader, 3)
    sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer


async def test_a_flood_of_bad_requests_is_one_summary_not_a_traceback_each(
    guarded: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for _ in range(40):
        reader, writer = await connect(guarded)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n")
        await writer.drain()
        answer = await closed_within(reader, 2)
        assert answer.startswith((b"HTTP/1.1 400 ", b"HTTP/1.0 400 ")), answer
        assert b"application/problem+json" in answer and b'"reason":"http_invalid"' in answer
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert tracebacks == []
    guard = guarded.gw.guard
    assert guard.totals["requests refused by the HTTP parser or cut by the peer"] == 40
    summary = guard.summarise(10**9)
    assert summary is not None and "40 requests refused by the HTTP parser" in summary
    assert guard.summarise(10**9) is None  # counted once


async def test_the_cap_stays_below_the_descriptor_limit(workspace: Workspace) -> None:
    import resource

    from gateway.app import _fit_connections

    settings = load_settings(
        {**base(workspace), "max_connections": 1_000_000},
        {},
    )
    gw = build_gateway(settings, workspace.environ())
    _fit_connections(gw)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    upstreams = sum(up.concurrency for up in gw.policy.upstreams.values())
    assert gw.guard.max_connections + upstreams < soft


def test_head_and_idle_settings_reach_the_listener(workspace: Workspace, tmp_path: Path) -> None:
    settings = load_settings(
        base(workspace),
        {"CAPGATE_HEAD_TIMEOUT": "3s", "CAPGATE_IDLE_TIMEOUT": "20s"},
    )
    gw = build_gateway(settings, workspace.environ())
    assert (gw.guard.head_timeout, gw.guard.idle_timeout) == (3.0, 20.0)
