"""One agent never hurts another: shares of an upstream's calls in flight and of held
approvals, and a connection flood that meets the cap instead of the other agents.

Structural assertions only (who got what, in which order); timings belong in the bench."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gateway.app import build_gateway
from gateway.config import load_settings
from mocks.chaos import ChaosUpstream
from mocks.demo import Workspace

PROBLEM = "application/problem+json"


def policy(url: str, *, held: bool = False) -> str:
    approval = "        approval: required\n" if held else ""
    return (
        "version: 1\n"
        "upstreams:\n"
        f'  up: {{url: "{url}", timeouts: {{connect: 1s, read: 10s, total: 20s}}}}\n'
        'agents:\n  "agent-*": [r]\n'
        "roles:\n  r:\n    rules:\n"
        "      - id: slow\n        upstream: up\n        allow: GET /slow\n"
        "        allow_extra_query: true\n"
        f"{approval}"
        "      - {id: ok, upstream: up, allow: GET /ok}\n"
    )


@pytest.fixture
async def chaos() -> Any:
    async with ChaosUpstream() as up:
        yield up


async def gateway(
    serve_gateway: Any, workspace: Workspace, tmp_path: Path, text: str, **extra: Any
) -> Any:
    path = tmp_path / "fair.yaml"
    path.write_text(text)
    settings = load_settings(
        {"policy": str(path), "jwks": str(workspace.jwks), "audit": "-", **extra}, {}
    )
    gw = build_gateway(settings, workspace.environ())
    client = await serve_gateway(gw)
    client.gw = gw
    return client


def auth(workspace: Workspace, agent: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {workspace.token(agent, ['r'])}"}


async def outcome(resp: Any) -> str:
    if resp.status == 200:
        return "200"
    return f"{resp.status} {(await resp.json(content_type=PROBLEM))['reason']}"


async def test_one_agents_64_slow_calls_leave_room_for_another_agent(
    serve_gateway: Any, workspace: Workspace, tmp_path: Path, chaos: ChaosUpstream
) -> None:
    """The finding: 64 slow calls of one agent filled the upstream's pool and another
    agent's calls got 504. Now the first agent holds at most its share (a quarter of the
    upstream's 64), the rest of its calls are refused after a short wait, and the other
    agent's calls go through while the slow ones are still running."""
    client = await gateway(serve_gateway, workspace, tmp_path, policy(chaos.url))
    a, b = auth(workspace, "agent-a"), auth(workspace, "agent-b")

    async def slow() -> str:
        return await outcome(await client.get("/up/slow?delay=3", headers=a))

    flood = [asyncio.create_task(slow()) for _ in range(64)]
    for _ in range(100):  # until agent a holds its whole share
        if chaos.stats["slow"] == 16:
            break
        await asyncio.sleep(0.02)
    assert client.gw.upstream_shares.snapshot()["up"]["agents_at_share"] == ["agent-a"]
    others = [await outcome(await client.get("/up/ok", headers=b)) for _ in range(10)]
    assert others == ["200"] * 10
    assert not any(t.done() and t.result() == "200" for t in flood)  # b went first
    results = Counter(await asyncio.gather(*flood))
    assert results == {"200": 16, "429 concurrency_limited": 48}
    assert chaos.stats["slow"] == 16  # the refused ones never reached the upstream


async def test_one_agents_full_approval_share_does_not_refuse_another(
    serve_gateway: Any, workspace: Workspace, tmp_path: Path, chaos: ChaosUpstream
) -> None:
    token_file = tmp_path / "admin.token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("admin-token-0123456789abcdef\n")
    client = await gateway(
        serve_gateway,
        workspace,
        tmp_path,
        policy(chaos.url, held=True),
        admin_port=0,
        admin_token_file=str(token_file),
        approvals_per_agent=3,
    )
    approvals = client.gw.approvals
    a, b = auth(workspace, "agent-a"), auth(workspace, "agent-b")
    held = [asyncio.create_task(client.get("/up/slow?delay=0", headers=a)) for _ in range(3)]
    for _ in range(100):
        if len(await approvals.pending()) == 3:
            break
        await asyncio.sleep(0.02)
    refused = await client.get("/up/slow?delay=0", headers=a)  # a's fourth: over its share
    assert await outcome(refused) == "429 concurrency_limited"
    b_call = asyncio.create_task(client.get("/up/slow?delay=0", headers=b))
    for _ in range(100):
        mine = [p for p in await approvals.pending() if p["agent"] == "agent-b"]
        if mine:
            break
        await asyncio.sleep(0.02)
    assert await approvals.decide(mine[0]["id"], True, by="operator") == "decided"
    assert await outcome(await b_call) == "200"
    for pending in await approvals.pending():
        await approvals.decide(pending["id"], False, by="operator")
    assert {await outcome(await t) for t in held} == {"403 approval_denied"}


async def test_a_connection_flood_meets_the_cap_and_leaves_open_connections_served(
    serve_gateway: Any, workspace: Workspace, tmp_path: Path, chaos: ChaosUpstream
) -> None:
    """Three times the cap in idle connections: the excess is refused at once (503), the
    process never runs out of descriptors, a connection opened before the flood is still
    served, and the flood's connections are closed at the idle timeout, making room."""
    cap = 32
    client = await gateway(
        serve_gateway,
        workspace,
        tmp_path,
        policy(chaos.url),
        max_connections=cap,
        idle_timeout="3s",
    )
    guard = client.gw.guard
    reader, writer = await asyncio.open_connection(client.host, client.port)  # before
    flood: list[asyncio.StreamWriter] = []

    async def first_bytes(r: asyncio.StreamReader) -> bytes:
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(r.read(12), 0.5)
        return b""

    try:
        opened = [await asyncio.open_connection(client.host, client.port) for _ in range(3 * cap)]
        flood = [w for _, w in opened]
        answers = await asyncio.gather(*(first_bytes(r) for r, _ in opened))
        refused = sum(a.startswith(b"HTTP/1.1 503") for a in answers)
        assert guard.open == cap and refused == 2 * cap + 1
        token = workspace.token("agent-a", ["r"])
        writer.write(
            f"GET /up/ok HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
        )
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(
            b"HTTP/1.1 200 "
        )
        for _ in range(300):  # the idle ones go at the idle timeout
            if guard.open <= 1:
                break
            await asyncio.sleep(0.02)
        assert guard.open <= 1
        resp = await client.get("/up/ok", headers=auth(workspace, "agent-b"))
        assert resp.status == 200
        assert guard.totals["connections refused at the cap"] == 2 * cap + 1
    finally:
        for w in [writer, *flood]:
            w.close()


def sql_policy(url: str) -> str:
    return (
        "version: 1\n"
        "upstreams:\n"
        f'  up: {{url: "{url}", timeouts: {{connect: 1s, read: 10s, total: 20s}}}}\n'
        'agents:\n  "agent-*": [r]\n'
        "roles:\n  r:\n    rules:\n"
        "      - id: query\n        upstream: up\n        allow: POST /ok\n"
        "        attempts: none\n"
        "        sql: {field: sql, dialect: postgres, server_version: 15, tables: [orders],\n"
        "              schema: {orders: [id, status, total_cents]}}\n"
        "      - {id: ok, upstream: up, allow: GET /ok}\n"
    )


def heavy_sql(n: int) -> str:
    """A new ~10 KB statement for each n (uncached: ~20 ms to check alone)."""
    terms = " OR ".join(f"(total_cents > {n * 1000 + i} AND status = 's{i}')" for i in range(230))
    return f"SELECT id, status FROM orders WHERE {terms}"


async def test_one_agents_heavy_sql_flood_leaves_another_agents_calls_fast(
    serve_gateway: Any, workspace: Workspace, tmp_path: Path, chaos: ChaosUpstream
) -> None:
    """One agent sends 40 never-seen ~10 KB statements at once. Their checks run in the
    check workers, at most its share (one) at a time; those that cannot get a worker within
    the wait are refused concurrency_limited. Meanwhile another agent's small calls are
    answered promptly: the event loop is never held for a whole heavy check, let alone for a
    queue of them (inline, each of b's calls waited behind every check queued before it)."""
    client = await gateway(serve_gateway, workspace, tmp_path, sql_policy(chaos.url))
    a, b = auth(workspace, "agent-a"), auth(workspace, "agent-b")
    assert len(heavy_sql(0)) > 9_000
    workers = client.gw.check_workers
    loop = asyncio.get_running_loop()

    async def heavy(n: int) -> str:
        return await outcome(await client.post("/up/ok", json={"sql": heavy_sql(n)}, headers=a))

    # As `capgate serve` does after start-up: what exists now is never scanned again, so a
    # full collection (which holds every thread) walks only what the calls allocate.
    gc.collect()
    gc.freeze()
    try:
        flood = [asyncio.create_task(heavy(n)) for n in range(40)]
        for _ in range(400):  # until agent a holds its whole share of the workers
            if workers.snapshot()["agents_at_share"] == ["agent-a"]:
                break
            await asyncio.sleep(0.005)
        assert workers.shares.held_by("agent-a") == 1  # its share, never more
        latencies = []
        for _ in range(10):
            started = loop.time()
            assert await outcome(await client.get("/up/ok", headers=b)) == "200"
            latencies.append(loop.time() - started)
            assert workers.shares.held_by("agent-a") <= 1
        still_running = sum(not t.done() for t in flood)
        results = Counter(await asyncio.gather(*flood))
    finally:
        gc.unfreeze()
    assert still_running > 0  # b's calls were answered while a's flood was being checked
    # A few interpreter turns at most (~40 ms alone; the bound leaves room for a busy box).
    assert max(latencies) < 0.25, latencies
    assert set(results) <= {"200", "429 concurrency_limited", "403 sql_too_complex"}
    assert results["200"] >= 2
    assert workers.shares.in_use == 0  # every worker given back
