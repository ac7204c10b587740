"""The example policy end to end: SQL against the real SQLite mock, MCP tools with SQL
arguments, through the gateway in-process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from gateway.app import build_gateway
from gateway.config import load_settings
from mocks.demo import Workspace
from tests.conftest import Mocks

PROBLEM = "application/problem+json"


@pytest.fixture
async def example(serve_gateway: Any, workspace: Workspace, mocks: Mocks, tmp_path: Path) -> Any:
    settings = load_settings(
        {
            "policy": str(workspace.policy),
            "jwks": str(workspace.jwks),
            "upstream_key": str(workspace.upstream_key),
            "secrets_dir": str(workspace.secrets_dir),
            "audit": str(tmp_path / "audit.jsonl"),
        },
        {},
    )
    mocks.clear()
    return await serve_gateway(build_gateway(settings, workspace.environ()))


def queries(mocks: Mocks) -> int:
    return int(mocks.stats("db")["queries_executed"])


async def sql(client: Any, token: str, text: str) -> Any:
    return await client.post(
        "/db/query", json={"sql": text}, headers={"Authorization": f"Bearer {token}"}
    )


async def test_allowed_query_returns_real_rows(example, workspace: Workspace, mocks: Mocks) -> None:
    tok = workspace.token("analyst-bot", ["analyst"])
    resp = await sql(
        example,
        tok,
        "SELECT c.name, count(*) AS n FROM orders o JOIN customers c ON c.id = o.customer_id "
        "GROUP BY c.name ORDER BY n DESC LIMIT 3",
    )
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["columns"] == ["name", "n"]
    assert len(body["rows"]) == 3 and all(row[1] == 5 for row in body["rows"])
    # The agent's own database credential was injected (the mock checks it).
    [seen] = [r for r in mocks.requests("db") if r["path"] == "/query"]
    assert seen["headers"]["Authorization"] == f"Bearer {workspace.db_tokens['analyst-bot']}"


async def test_missing_limit_is_added_and_forwarded(
    example, workspace: Workspace, mocks: Mocks
) -> None:
    tok = workspace.token("analyst-bot", ["analyst"])
    resp = await sql(example, tok, "SELECT id, status FROM orders")
    assert resp.status == 200
    assert len((await resp.json())["rows"]) == 100  # all rows: fewer than the 1000 added
    [seen] = [r for r in mocks.requests("db") if r["path"] == "/query"]
    assert json.loads(seen["body"]) == {"sql": "SELECT id, status FROM orders LIMIT 1000"}


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("SELECT * FROM customers LIMIT 5", "column"),
        ("SELECT ssn FROM customers LIMIT 5", "column"),
        ("SELECT lower(x.ssn) FROM (SELECT * FROM customers) x LIMIT 5", "column"),
        ("DELETE FROM orders", "statement"),
        # SQLite's compiler is the authority: it has no DML in CTEs, and no SELEC.
        ("WITH d AS (DELETE FROM orders RETURNING *) SELECT * FROM d LIMIT 1", "parse"),
        ("SELECT name FROM sqlite_master LIMIT 1", "catalog"),
        ("SELECT * FROM orders LIMIT 5000", "limit"),
        ("SELECT 1; DROP TABLE orders", "multiple"),
        ("ATTACH DATABASE '/tmp/x.db' AS x", "command"),
        ("SELECT load_extension('x') LIMIT 1", "function"),
        ("", "empty"),
        ("SELEC * FRM orders", "parse"),
    ],
)
async def test_denied_sql_never_reaches_the_database(
    example, workspace: Workspace, mocks: Mocks, text: str, kind: str
) -> None:
    before = queries(mocks)
    resp = await sql(example, workspace.token("analyst-bot", ["analyst"]), text)
    assert resp.status == 403, await resp.text()
    body = await resp.json(content_type=PROBLEM)
    assert body["reason"] == "sql_denied" and body["rule"] == "query-orders"
    assert body["errors"][0]["kind"] == kind, body
    assert queries(mocks) == before
    assert [r for r in mocks.requests("db") if r["path"] == "/query"] == []


async def test_sre_agent_cannot_query(example, workspace: Workspace, mocks: Mocks) -> None:
    resp = await sql(example, workspace.token("sre-bot", ["sre-diagnostics"]), "SELECT 1 LIMIT 1")
    assert resp.status == 403
    assert (await resp.json(content_type=PROBLEM))["reason"] == "no_rule"


async def test_mcp_tools_of_the_example_policy(example, workspace: Workspace, mocks: Mocks) -> None:
    url = str(example.make_url("/tools/mcp"))
    token = workspace.token("mcp-bot", ["order-support"])
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=10)
    async with http, Client(streamable_http_client(url, http_client=http), mode="legacy") as mcp:
        tools = sorted(t.name for t in (await mcp.list_tools()).tools)
        assert tools == ["get_order", "run_sql", "search_orders"]
        ok = await mcp.call_tool("run_sql", {"sql": "SELECT id FROM orders"})
        assert not ok.is_error
        # The checked SQL, with the LIMIT the policy adds, is what the server got (it echoes).
        assert "SELECT id FROM orders LIMIT 100" in json.dumps(ok.structured_content)
        with pytest.raises(MCPError) as err:
            await mcp.call_tool("run_sql", {"sql": "SELECT ssn FROM customers LIMIT 1"})
        assert err.value.error.data["reason"] == "sql_denied"
        with pytest.raises(MCPError) as err:
            await mcp.call_tool("delete_order", {"order_id": 1})
        assert err.value.error.data["reason"] == "tool_denied"
    calls = mocks.stats("mcp")["tool_calls"]
    assert calls.get("delete_order", 0) == 0
