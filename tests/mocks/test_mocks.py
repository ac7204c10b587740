"""The mock upstreams, exercised over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from mcp import Client

from mocks.data import CUSTOMERS, ORDERS, orders_for_customer
from mocks.launcher import MOCK_NAMES, MockSettings, start_mocks
from mocks.mcp_server import TOOL_NAMES, start_mcp_server
from mocks.servers import (
    DB_SCHEMA,
    LOG_LINES,
    db_app,
    echo_app,
    logs_app,
    metrics_app,
    services_app,
)
from mocks.tokens import SigningKey, merge_jwks

REPO_ROOT = Path(__file__).resolve().parents[2]
METRICS_TOKEN = "metrics-secret-1"
DB_TOKENS = frozenset({"db-token-a", "db-token-b"})


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[aiohttp.ClientSession]:
    """Run `app` on a free port; yield a session whose base URL is that server."""
    async with (
        TestServer(app, host="127.0.0.1") as server,
        aiohttp.ClientSession(base_url=str(server.make_url(""))) as http,
    ):
        yield http


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- metrics


async def test_metrics_happy_path_is_deterministic() -> None:
    async with serve(metrics_app(METRICS_TOKEN)) as http:
        async with http.get("/metrics/cpu?window=1m", headers=bearer(METRICS_TOKEN)) as resp:
            assert resp.status == 200
            first = await resp.json()
        async with http.get("/metrics/cpu?window=1m", headers=bearer(METRICS_TOKEN)) as resp:
            assert await resp.json() == first
        async with http.get("/metrics/cpu", headers=bearer(METRICS_TOKEN)) as resp:
            default = await resp.json()
    assert first["metric"] == "cpu" and first["window"] == "1m" and first["host"] == "web-1"
    assert len(first["values"]) == 6 and all(isinstance(v, float) for v in first["values"])
    assert default["window"] == "5m" and len(default["values"]) == 10


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong-token",
        f"bearer {METRICS_TOKEN}",
        f"Bearer  {METRICS_TOKEN}",
        f"Basic {METRICS_TOKEN}",
        METRICS_TOKEN,
    ],
)
async def test_metrics_rejects_anything_but_the_exact_bearer_header(
    authorization: str | None,
) -> None:
    headers = {"Authorization": authorization} if authorization is not None else {}
    async with serve(metrics_app(METRICS_TOKEN)) as http:
        async with http.get("/metrics/cpu?window=5m", headers=headers) as resp:
            assert resp.status == 401
            assert await resp.json() == {"error": "unauthorized"}
            assert resp.headers["X-Mock-Auth-Error"]


async def test_metrics_bad_window_is_400() -> None:
    async with serve(metrics_app(METRICS_TOKEN)) as http:
        async with http.get("/metrics/cpu?window=2h", headers=bearer(METRICS_TOKEN)) as resp:
            assert resp.status == 400
            assert "window" in (await resp.json())["error"]


async def test_requests_are_recorded_even_when_refused_and_can_be_cleared() -> None:
    async with serve(metrics_app(METRICS_TOKEN)) as http:
        await (await http.get("/metrics/cpu?window=15m", headers=bearer("nope"))).release()
        headers = {**bearer(METRICS_TOKEN), "X-Trace": "a"}
        await (await http.get("/metrics/cpu?window=1m&x=%20y", headers=headers)).release()
        async with http.get("/_mock/requests") as resp:  # no credentials needed
            assert resp.status == 200
            recorded = await resp.json()
        assert [r["path"] for r in recorded] == [
            "/metrics/cpu?window=15m",
            "/metrics/cpu?window=1m&x=%20y",
        ]
        assert recorded[0]["method"] == "GET"
        assert recorded[0]["headers"]["Authorization"] == "Bearer nope"
        assert recorded[1]["headers"]["X-Trace"] == "a"
        assert recorded[1]["body"] == ""
        async with http.delete("/_mock/requests") as resp:
            assert resp.status == 200
        async with http.get("/_mock/requests") as resp:
            assert await resp.json() == []


# --------------------------------------------------------------------------- logs


async def test_logs_application_filters_and_limits() -> None:
    async with serve(logs_app()) as http:
        async with http.get("/logs/application?level=error&limit=3") as resp:
            assert resp.status == 200
            body = await resp.json()
        async with http.get("/logs/application") as resp:
            everything = await resp.json()
        async with http.get("/logs/application?limit=lots") as resp:
            assert resp.status == 400
        async with http.get("/logs/application?level=loud") as resp:
            assert resp.status == 400
    assert body["count"] == 3 and [line["level"] for line in body["lines"]] == ["ERROR"] * 3
    assert everything["lines"] == list(LOG_LINES[:50])


async def test_logs_stream_arrives_in_pieces() -> None:
    async with serve(logs_app()) as http:
        started = time.monotonic()
        async with http.get("/logs/stream") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("application/x-ndjson")
            assert resp.headers.get("Transfer-Encoding") == "chunked"
            arrivals: list[float] = []
            lines: list[dict[str, Any]] = []
            async for raw in resp.content:
                arrivals.append(time.monotonic() - started)
                lines.append(json.loads(raw))
    assert [line["seq"] for line in lines] == [0, 1, 2, 3, 4]
    assert arrivals[-1] - arrivals[0] >= 0.15  # 4 gaps of 50 ms


async def test_logs_big_returns_exactly_the_requested_size() -> None:
    async with serve(logs_app()) as http:
        async with http.get("/logs/big?size=200001") as resp:
            assert resp.headers["Content-Length"] == "200001"
            assert len(await resp.read()) == 200001
        async with http.get("/logs/big?size=70000&chunked=1") as resp:
            assert "Content-Length" not in resp.headers
            assert len(await resp.read()) == 70000
        async with http.get("/logs/big?size=0") as resp:
            assert await resp.read() == b""


# --------------------------------------------------------------------------- services


@pytest.fixture(scope="module")
def ed_key() -> SigningKey:
    return SigningKey.generate("EdDSA", kid="ed-1")


@pytest.fixture(scope="module")
def ec_key() -> SigningKey:
    return SigningKey.generate("ES256", kid="ec-1")


async def test_services_accepts_eddsa_and_es256_tokens(
    ed_key: SigningKey, ec_key: SigningKey
) -> None:
    async with serve(services_app(merge_jwks(ed_key, ec_key))) as http:
        for key, service in ((ed_key, "web"), (ec_key, "worker")):
            token = key.mint(f"agent-{key.alg}")
            async with http.post(
                "/services/restart", json={"service": service}, headers=bearer(token)
            ) as resp:
                assert resp.status == 200, resp.headers.get("X-Mock-Auth-Error")
                assert await resp.json() == {"restarted": service, "by": f"agent-{key.alg}"}
        token = ed_key.mint("agent")
        async with http.post(
            "/services/restart", json={"service": "db"}, headers=bearer(token)
        ) as resp:
            assert resp.status == 400


def _forged_tokens(ed_key: SigningKey, ec_key: SigningKey) -> dict[str, str]:
    now = time.time()
    stranger = SigningKey.generate("EdDSA", kid=ed_key.kid)  # right kid, wrong key
    ec_as_ed = SigningKey(kid=ed_key.kid, alg="ES256", private_key=ec_key.private_key)
    claims = {"sub": "agent", "aud": "services", "iss": "capgate", "iat": int(now)}
    return {
        "expired": ed_key.mint("agent", now=now - 3600, ttl_seconds=60),
        "wrong audience": ed_key.mint("agent", audience="metrics"),
        "wrong issuer": ed_key.mint("agent", issuer="someone-else"),
        "unknown kid": SigningKey.generate("EdDSA", kid="ed-unknown").mint("agent"),
        "wrong key": stranger.mint("agent"),
        "algorithm not pinned to key": ec_as_ed.mint("agent"),
        "no exp": jwt.encode(claims, ed_key.private_key, "EdDSA", headers={"kid": ed_key.kid}),
        "no sub": jwt.encode(
            {k: v for k, v in claims.items() if k != "sub"} | {"exp": int(now) + 60},
            ed_key.private_key,
            "EdDSA",
            headers={"kid": ed_key.kid},
        ),
        "hmac": jwt.encode(
            claims | {"exp": int(now) + 60},
            "a-shared-secret-long-enough-for-hs256!",
            "HS256",
            headers={"kid": ed_key.kid},
        ),
        "garbage": "not.a.jwt",
    }


async def test_services_rejects_bad_tokens(ed_key: SigningKey, ec_key: SigningKey) -> None:
    async with serve(services_app(merge_jwks(ed_key, ec_key))) as http:
        async with http.post("/services/restart", json={"service": "web"}) as resp:
            assert resp.status == 401
        for reason, token in _forged_tokens(ed_key, ec_key).items():
            async with http.post(
                "/services/restart", json={"service": "web"}, headers=bearer(token)
            ) as resp:
                assert resp.status == 401, reason
                assert await resp.json() == {"error": "unauthorized"}


def test_services_refuses_unusable_jwks() -> None:
    with pytest.raises(ValueError):
        services_app({"keys": []})
    with pytest.raises(ValueError):
        services_app({"keys": [{"kty": "oct", "k": "c2VjcmV0", "kid": "h"}]})


# --------------------------------------------------------------------------- echo


async def test_echo_reflects_the_request() -> None:
    async with serve(echo_app()) as http:
        headers = [("X-Multi", "one"), ("X-Multi", "two"), ("Content-Type", "text/plain")]
        async with http.put("/any/th%2Fing?b=2&a=%20", data="hello body", headers=headers) as resp:
            assert resp.status == 200
            echoed = await resp.json()
        async with http.delete("/") as resp:
            root = await resp.json()
        async with http.post("/echo/status/503", data="x") as resp:
            assert resp.status == 503
            assert (await resp.json())["method"] == "POST"
    assert echoed["method"] == "PUT"
    assert echoed["path"] == "/any/th%2Fing"
    assert echoed["query"] == "b=2&a=%20"
    assert echoed["body"] == "hello body"
    assert echoed["headers"]["X-Multi"] == "one, two"
    assert echoed["headers"]["Content-Type"] == "text/plain"
    assert root["method"] == "DELETE" and root["path"] == "/" and root["query"] == ""


async def test_echo_slow_waits_and_can_time_out() -> None:
    async with serve(echo_app()) as http:
        started = time.monotonic()
        async with http.get("/echo/slow?delay=0.2") as resp:
            assert (await resp.json())["path"] == "/echo/slow"
        assert time.monotonic() - started >= 0.2
        with pytest.raises(TimeoutError):
            await http.get("/echo/slow?delay=5", timeout=aiohttp.ClientTimeout(total=0.1))


async def test_echo_sse_sends_three_events() -> None:
    async with serve(echo_app()) as http:
        async with http.get("/echo/sse") as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            text = (await resp.read()).decode()
    events = [block for block in text.split("\n\n") if block.strip()]
    assert len(events) == 3
    assert events[0].splitlines() == ["id: 1", "event: tick", 'data: {"n": 1, "of": 3}']


# --------------------------------------------------------------------------- db


async def _query(
    http: aiohttp.ClientSession, sql: str, params: Any = None, token: str | None = None
) -> tuple[int, dict[str, Any]]:
    payload: dict[str, Any] = {"sql": sql}
    if params is not None:
        payload["params"] = params
    headers = bearer(token) if token else {}
    async with http.post("/query", json=payload, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_db_returns_seeded_rows_and_counts_queries() -> None:
    async with serve(db_app()) as http:
        status, body = await _query(http, "SELECT id, name, ssn FROM customers ORDER BY id")
        assert status == 200
        assert body["columns"] == ["id", "name", "ssn"]
        assert body["rowcount"] == len(CUSTOMERS) == 20
        assert body["rows"][0] == [CUSTOMERS[0].id, CUSTOMERS[0].name, CUSTOMERS[0].ssn]

        status, body = await _query(
            http,
            "SELECT id, total_cents FROM orders WHERE customer_id = ? ORDER BY id",
            [3],
        )
        assert status == 200
        assert body["rows"] == [[o.id, o.total_cents] for o in orders_for_customer(3)]

        status, body = await _query(http, "SELECT count(*) AS n FROM orders")
        assert body == {"columns": ["n"], "rows": [[len(ORDERS)]], "rowcount": 1}

        status, body = await _query(http, "UPDATE orders SET status = 'void' WHERE id <= 4")
        assert status == 200 and body["rowcount"] == 4 and body["columns"] == []

        async with http.get("/_mock/stats") as resp:
            assert await resp.json() == {"queries_executed": 4}
        async with http.delete("/_mock/stats") as resp:
            assert resp.status == 200
        async with http.get("/_mock/stats") as resp:
            assert await resp.json() == {"queries_executed": 0}


@pytest.mark.parametrize(
    "payload",
    [
        {"sql": "SELEC nothing"},
        {"sql": "SELECT * FROM no_such_table"},
        {"sql": "SELECT 1; SELECT 2"},
        {"sql": "SELECT ?", "params": [1, 2]},
        {"sql": 42},
        {"sql": "SELECT 1", "params": "oops"},
    ],
)
async def test_db_bad_sql_is_400(payload: dict[str, Any]) -> None:
    async with serve(db_app()) as http:
        async with http.post("/query", json=payload) as resp:
            assert resp.status == 400
            assert isinstance((await resp.json())["error"], str)
        async with http.post("/query", data="not json") as resp:
            assert resp.status == 400


async def test_db_checks_tokens_when_given() -> None:
    async with serve(db_app(tokens=DB_TOKENS)) as http:
        status, body = await _query(http, "SELECT 1")
        assert (status, body) == (401, {"error": "unauthorized"})
        status, _ = await _query(http, "SELECT 1", token="db-token-c")
        assert status == 401
        for token in DB_TOKENS:
            status, body = await _query(http, "SELECT 1 AS one", token=token)
            assert (status, body["rows"]) == (200, [[1]])
        async with http.get("/_mock/stats") as resp:  # refused queries never reach SQLite
            assert await resp.json() == {"queries_executed": 2}


async def test_db_file_is_created_with_the_documented_schema(tmp_path: Path) -> None:
    db_file = tmp_path / "mock.sqlite3"
    async with serve(db_app(str(db_file))) as http:
        status, _ = await _query(http, "DELETE FROM orders")
        assert status == 200
    with contextlib.closing(sqlite3.connect(db_file)) as conn:
        for table, columns in DB_SCHEMA.items():
            assert [row[1] for row in conn.execute(f"PRAGMA table_info({table})")] == columns
    async with serve(db_app(str(db_file))) as http:  # re-seeded on start
        _, body = await _query(http, "SELECT count(*) FROM orders")
        assert body["rows"] == [[len(ORDERS)]]


# --------------------------------------------------------------------------- mcp


@pytest.mark.parametrize("json_response", [False, True], ids=["sse", "json"])
async def test_mcp_server_with_the_sdk_client(json_response: bool) -> None:
    url, stop = await start_mcp_server(json_response=json_response)
    try:
        async with Client(url, mode="legacy") as client:
            assert client.server_info is not None
            assert client.server_info.name == "capgate-mock-mcp"
            tools = await client.list_tools()
            assert {tool.name for tool in tools.tools} == set(TOOL_NAMES)
            result = await client.call_tool("search_orders", {"customer_id": 2, "limit": 3})
            assert not result.is_error
            expected = [o.as_dict() for o in orders_for_customer(2, 3)]
            assert result.structured_content == {"customer_id": 2, "orders": expected}
            missing = await client.call_tool("get_order", {"order_id": 10_000})
            assert missing.is_error
            echoed = await client.call_tool("run_sql", {"sql": "DROP TABLE orders"})
            assert echoed.structured_content == {"sql": "DROP TABLE orders"}
        async with aiohttp.ClientSession() as http:
            async with http.get(url.removesuffix("/mcp") + "/_mock/stats") as resp:
                stats = await resp.json()
            async with http.get(url.removesuffix("/mcp") + "/_mock/requests") as resp:
                recorded = await resp.json()
    finally:
        await stop()
    assert stats == {"tool_calls": {"search_orders": 1, "get_order": 1, "run_sql": 1}}
    assert recorded[0]["method"] == "POST" and '"initialize"' in recorded[0]["body"]
    session_ids = {r["headers"].get("mcp-session-id") for r in recorded[1:]}
    assert len(session_ids) == 1 and None not in session_ids


async def test_mcp_raw_http_session_and_json_response() -> None:
    url, stop = await start_mcp_server(json_response=True)
    headers = {"Accept": "application/json, text/event-stream"}
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "raw-test", "version": "0"},
        },
    }
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json=initialize, headers=headers) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("application/json")
                session_id = resp.headers["Mcp-Session-Id"]
                assert (await resp.json())["result"]["serverInfo"]["name"] == "capgate-mock-mcp"
            session = {
                **headers,
                "Mcp-Session-Id": session_id,
                "Mcp-Protocol-Version": "2025-06-18",
            }
            note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            async with http.post(url, json=note, headers=session) as resp:
                assert resp.status == 202
            call = {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": "delete_order", "arguments": {"order_id": 7}},
            }
            async with http.post(url, json=call, headers=session) as resp:
                assert (await resp.json())["result"]["structuredContent"] == {"deleted": 7}
            async with http.post(
                url, json=call, headers={**session, "Mcp-Session-Id": "x"}
            ) as resp:
                assert resp.status == 404
            async with http.delete(url, headers=session) as resp:
                assert resp.status == 200
    finally:
        await stop()


async def test_mcp_server_speaks_the_modern_protocol_too() -> None:
    url, stop = await start_mcp_server()
    try:
        async with Client(url) as client:  # mode="auto": server/discover, no session
            result = await client.call_tool("list_files", {"path": "/srv/app/"})
            assert result.structured_content is not None
            assert result.structured_content["path"] == "/srv/app"
            denied = await client.call_tool("list_files", {"path": "/nope"})
            assert denied.is_error
    finally:
        await stop()


# --------------------------------------------------------------------------- launcher + CLI


async def test_start_mocks_serves_everything_and_closes(ed_key: SigningKey) -> None:
    settings = MockSettings(
        metrics_token=METRICS_TOKEN, services_jwks=ed_key.jwks(), db_tokens=DB_TOKENS
    )
    mocks = await start_mocks(settings)
    try:
        assert set(mocks.urls) == set(MOCK_NAMES)
        async with aiohttp.ClientSession() as http:
            checks = [
                ("metrics", "/metrics/cpu?window=5m", bearer(METRICS_TOKEN)),
                ("logs", "/logs/application?limit=1", {}),
                ("echo", "/hello", {}),
            ]
            for name, path, headers in checks:
                async with http.get(mocks.urls[name] + path, headers=headers) as resp:
                    assert resp.status == 200, name
            async with http.post(
                mocks.urls["services"] + "/services/restart",
                json={"service": "web"},
                headers=bearer(ed_key.mint("launcher-test")),
            ) as resp:
                assert (await resp.json())["by"] == "launcher-test"
            async with http.post(
                mocks.urls["db"] + "/query",
                json={"sql": "SELECT count(*) FROM customers"},
                headers=bearer("db-token-a"),
            ) as resp:
                assert (await resp.json())["rows"] == [[20]]
            async with http.get(mocks.urls["mcp"].removesuffix("/mcp") + "/_mock/stats") as resp:
                assert await resp.json() == {"tool_calls": {}}
    finally:
        await mocks.close()
        await mocks.close()
    async with aiohttp.ClientSession() as http:
        for url in mocks.urls.values():
            with pytest.raises(aiohttp.ClientConnectionError):
                await http.get(url)


async def test_start_mocks_on_fixed_ports_and_generated_services_key() -> None:
    ports = {name: free_port() for name in MOCK_NAMES}
    async with await start_mocks(MockSettings(fixed_ports=True, ports=ports)) as mocks:
        assert mocks.urls["echo"] == f"http://127.0.0.1:{ports['echo']}"
        assert mocks.urls["mcp"] == f"http://127.0.0.1:{ports['mcp']}/mcp"
        assert mocks.services_key is not None
        async with aiohttp.ClientSession() as http:
            async with http.post(
                mocks.urls["services"] + "/services/restart",
                json={"service": "worker"},
                headers=bearer(mocks.services_key.mint("generated")),
            ) as resp:
                assert resp.status == 200
        with pytest.raises(OSError):  # the ports are taken now; nothing is left running
            await start_mocks(MockSettings(fixed_ports=True, ports=ports))


async def test_serve_cli_prints_ready_line_and_exits_on_sigterm(
    tmp_path: Path, ed_key: SigningKey
) -> None:
    (tmp_path / "metrics.token").write_text(f"  {METRICS_TOKEN}\n")
    (tmp_path / "db.tokens").write_text("# accepted\ndb-token-a\n\ndb-token-b\n")
    (tmp_path / "jwks.json").write_text(json.dumps(ed_key.jwks()))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mocks.serve",
        "--metrics-token-file",
        str(tmp_path / "metrics.token"),
        "--services-jwks",
        str(tmp_path / "jwks.json"),
        "--db-tokens-file",
        str(tmp_path / "db.tokens"),
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=10)
        ready = json.loads(line)
        assert ready["ready"] is True and set(ready["urls"]) == set(MOCK_NAMES)
        async with aiohttp.ClientSession() as http:
            metrics_url = ready["urls"]["metrics"] + "/metrics/cpu"
            async with http.get(metrics_url, headers=bearer(METRICS_TOKEN)) as resp:
                assert resp.status == 200
            async with http.post(
                ready["urls"]["db"] + "/query",
                json={"sql": "SELECT 1"},
                headers=bearer("db-token-b"),
            ) as resp:
                assert resp.status == 200
            async with http.post(
                ready["urls"]["services"] + "/services/restart",
                json={"service": "web"},
                headers=bearer(ed_key.mint("cli")),
            ) as resp:
                assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=10)
        assert proc.returncode == 0, stderr.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
