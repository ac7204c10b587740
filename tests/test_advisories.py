"""One test per security finding, named after it (the spirit of pyjwt's test_advisory.py).

Each test reproduces the attack or leak as it was found against a running gateway, and
fails if it comes back.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gzip
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from multidict import CIMultiDict

from gateway.app import build_gateway
from gateway.audit_trail import LINE_FIELDS, call_records
from gateway.config import load_settings
from mocks.demo import Workspace
from tests.conftest import Mocks

PROBLEM = "application/problem+json"
MCP_ACCEPT = "application/json, text/event-stream"


@pytest.fixture
async def example(serve_gateway: Any, workspace: Workspace, mocks: Mocks, tmp_path: Path) -> Any:
    """The example policy in-process, with the audit file and trace spans written to files."""
    settings = load_settings(
        {
            "policy": str(workspace.policy),
            "jwks": str(workspace.jwks),
            "upstream_key": str(workspace.upstream_key),
            "secrets_dir": str(workspace.secrets_dir),
            "audit": str(tmp_path / "audit.jsonl"),
            "traces": str(tmp_path / "spans.jsonl"),
        },
        {},
    )
    mocks.clear()
    gw = build_gateway(settings, workspace.environ())
    client = await serve_gateway(gw)
    client.gw = gw
    client.audit_path = tmp_path / "audit.jsonl"
    client.spans_path = tmp_path / "spans.jsonl"
    return client


def _written(client: Any) -> tuple[bytes, bytes]:
    client.gw.audit.flush()
    client.gw.telemetry.flush()
    return client.audit_path.read_bytes(), client.spans_path.read_bytes()


async def _answers(resp: Any) -> Any:
    """The JSON-RPC answer(s) of an MCP POST, sent as JSON or as server-sent events."""
    text = await resp.text()
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        found = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        return found if len(found) != 1 else found[0]
    return json.loads(text)


async def _mcp_session(client: Any, token: str) -> dict[str, str]:
    """Headers of an initialized MCP session through the gateway."""
    headers = {"Authorization": f"Bearer {token}", "Accept": MCP_ACCEPT}
    resp = await client.post(
        "/tools/mcp",
        headers=headers,
        json={
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "advisory-test", "version": "1"},
            },
        },
    )
    assert resp.status == 200, await resp.text()
    await resp.read()
    headers["Mcp-Session-Id"] = resp.headers["Mcp-Session-Id"]
    headers["Mcp-Protocol-Version"] = "2025-06-18"
    resp = await client.post(
        "/tools/mcp",
        headers=headers,
        json={"jsonrpc": "2.0", "method": "notifications/initialized"},
    )
    assert resp.status in (200, 202), await resp.text()
    return headers


def _rpc(msg_id: int, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": msg_id,
        "method": "tools/call",
        "params": {"name": tool, "arguments": arguments},
    }


async def test_audit_never_holds_bodies_query_values_headers_sql_or_tool_arguments(
    example: Any, workspace: Workspace, mocks: Mocks, caplog: pytest.LogCaptureFixture
) -> None:
    """CG-2026-01: ``Call.facts`` was written whole into the audit line, so a denied call's
    body (``{"db_password": ...}``), SQL text and MCP tool arguments were in the trail, and a
    900 KB body made a 900 KB line. The audit line, the trace span and the logs may hold ids,
    names and decisions only."""
    caplog.set_level(logging.DEBUG)
    secrets = {
        name: f"s3cr3t-{name}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
        for name in (
            "body",
            "body-allowed",
            "query",
            "query-value",
            "header",
            "sql-allowed",
            "sql-denied",
            "tool-allowed",
            "tool-denied",
            "batch-1",
            "batch-2",
            "batch-3",
            "big",
        )
    }
    sre = workspace.token("sre-bot", ["sre-diagnostics"])
    analyst = workspace.token("analyst-bot", ["analyst"])
    support = workspace.token("mcp-bot", ["order-support"])
    auth = lambda tok: {"Authorization": f"Bearer {tok}"}  # noqa: E731

    async def status(resp: Any) -> int:
        await resp.read()
        return int(resp.status)

    c = example
    # Bodies: a denied restart carrying a password, an allowed one with a secret header.
    assert (
        await status(
            await c.post(
                "/services/services/restart",
                headers=auth(sre),
                json={"service": "web", "db_password": secrets["body"]},
            )
        )
        == 400
    )
    assert (
        await status(
            await c.post(
                "/services/services/restart",
                headers={**auth(sre), "X-Leak": secrets["header"]},
                json={"service": "web"},
            )
        )
        == 200
    )
    # A body the rule never reads (no rule for this role).
    assert (
        await status(
            await c.post(
                "/services/services/restart",
                headers=auth(analyst),
                json={"service": secrets["body-allowed"]},
            )
        )
        == 403
    )
    # Query values, denied and allowed-shaped.
    assert (
        await status(
            await c.get(
                f"/metrics/metrics/cpu?window=5m&token={secrets['query']}", headers=auth(sre)
            )
        )
        == 400
    )
    assert (
        await status(
            await c.get(f"/metrics/metrics/cpu?window={secrets['query-value']}", headers=auth(sre))
        )
        == 400
    )
    # SQL: allowed with a secret literal, and denied.
    assert (
        await status(
            await c.post(
                "/db/query",
                headers=auth(analyst),
                json={
                    "sql": f"SELECT id FROM orders WHERE status = '{secrets['sql-allowed']}' "
                    "LIMIT 5"
                },
            )
        )
        == 200
    )
    assert (
        await status(
            await c.post(
                "/db/query",
                headers=auth(analyst),
                json={"sql": f"SELECT ssn FROM customers WHERE name = '{secrets['sql-denied']}'"},
            )
        )
        == 403
    )
    # MCP tool arguments: allowed, denied, and batched.
    mcp = await _mcp_session(c, support)
    sql_arg = f"SELECT id FROM orders WHERE status = '{secrets['tool-allowed']}'"
    resp = await c.post("/tools/mcp", headers=mcp, json=_rpc(1, "run_sql", {"sql": sql_arg}))
    assert resp.status == 200 and "error" not in await _answers(resp)
    resp = await c.post(
        "/tools/mcp",
        headers=mcp,
        json=_rpc(2, "get_order", {"order_id": 1, "note": secrets["tool-denied"]}),
    )
    assert (await _answers(resp))["error"]["data"]["reason"] == "tool_denied"
    resp = await c.post(
        "/tools/mcp",
        headers=mcp,
        json=[
            _rpc(3, "get_order", {"order_id": 1}),
            _rpc(4, "run_sql", {"sql": f"SELECT name, ssn FROM customers -- {secrets['batch-1']}"}),
            _rpc(5, "run_sql", {"sql": f"UPDATE orders SET status = '{secrets['batch-2']}'"}),
        ],
    )
    assert all("error" in a for a in await _answers(resp))
    resp = await c.post(
        "/tools/mcp",
        headers=mcp,
        json=[
            {"jsonrpc": "2.0", "id": 6, "method": "ping"},
            _rpc(7, "search_orders", {"customer_id": 1, "q": secrets["batch-3"]}),
        ],
    )
    answers = await _answers(resp)
    assert all("error" in a for a in (answers if isinstance(answers, list) else [answers]))
    # A large body: refused, and the line stays small.
    big = json.dumps({"sql": "SELECT 1 -- " + secrets["big"] * 20_000})
    assert (
        await status(
            await c.post(
                "/db/query", headers={**auth(analyst), "Content-Type": "application/json"}, data=big
            )
        )
        == 413
    )

    audit, spans = _written(c)
    raw_lines = [json.loads(line) for line in audit.splitlines()]
    # One record per call, but one per JSON-RPC message for MCP (a refused batch too);
    # an allowed call's decision and outcome lines joined.
    lines = call_records(raw_lines)
    assert len(lines) == 17
    # aiohttp's access log belongs to the test server; `capgate serve` runs without one.
    logs = "\n".join(r.getMessage() for r in caplog.records if r.name != "aiohttp.access").encode()
    forbidden = [s.encode() for s in secrets.values()] + [
        sre.encode(),
        analyst.encode(),
        support.encode(),
        workspace.metrics_token.encode(),
        workspace.db_tokens["analyst-bot"].encode(),
        b"SELECT",
        b"UPDATE",
        b"arguments",
        b"ssn",
    ]
    for needle in forbidden:
        assert needle not in audit, needle
        assert needle not in spans, needle
        assert needle not in logs, needle
    assert max(len(line) for line in audit.splitlines()) < 2048
    # Only the closed record's fields, in every line.
    closed = {
        "v",
        "time",
        "request_id",
        "agent",
        "jti",
        "run",
        "upstream",
        "method",
        "path",
        "query",
        "rule",
        "decision",
        "reason",
        "status",
        "duration_ms",
        "request_body",
        "response_body",
        "sql",
        "mcp",
        "approval",
        "operator",
        "state_error_allowed",
        "fault",
        "prev",
    }
    for line in raw_lines:
        allowed = LINE_FIELDS.get(line["type"], closed | {"type"})
        assert set(line) <= allowed, set(line) - allowed
    # Query parameter names are kept, their values never.
    assert lines[3]["query"] == ["window", "token"]
    # The allowed SQL call is described by kinds and tables, and its body by a keyed digest.
    allowed_sql = lines[5]
    assert allowed_sql["sql"] == {"kinds": ["select"], "tables": ["orders"]}
    digest = allowed_sql["request_body"]
    assert digest["size"] > 0 and len(digest["hmac"]) == 64
    assert allowed_sql["response_body"]["size"] > 0
    # The allowed MCP tool call names its method and tool, and its SQL by kinds and tables.
    [run_sql] = [
        line
        for line in lines
        if line.get("mcp") == {"method": "tools/call", "name": "run_sql"}
        and line["decision"] == "allow"
    ]
    assert run_sql["rule"] == "mcp-run-sql"
    assert run_sql["sql"] == {"kinds": ["select"], "tables": ["orders"]}
    # A batch is refused whole (this upstream takes none), one line per message.
    batch = [line for line in lines if line["reason"] == "mcp_denied"]
    assert len({line["request_id"] for line in batch}) == 2 and len(batch) == 5
    assert [line["mcp"]["name"] for line in batch[:3]] == ["get_order", "run_sql", "run_sql"]
    # The handshake and notifications are allowed by the endpoint, not by a rule.
    [init] = [line for line in lines if line.get("mcp", {}).get("method") == "initialize"]
    assert init["rule"] is None and init["decision"] == "allow"


async def test_audit_body_digest_is_keyed_not_a_plain_hash(
    example: Any, workspace: Workspace
) -> None:
    """CG-2026-01 (digests): a plain SHA-256 of a short body can be reversed by guessing, so
    the digest is an HMAC under the audit key, which lives in a 0600 file beside the trail."""
    body = b'{"service":"web"}'
    resp = await example.post(
        "/services/services/restart",
        headers={
            "Authorization": f"Bearer {workspace.token('sre-bot', ['sre-diagnostics'])}",
            "Content-Type": "application/json",
        },
        data=body,
    )
    assert resp.status == 200
    audit, _ = _written(example)
    line = call_records(json.loads(x) for x in audit.splitlines())[-1]
    assert line["request_body"]["size"] == len(body)
    assert line["request_body"]["hmac"] != hashlib.sha256(body).hexdigest()
    key_file = example.audit_path.with_name(example.audit_path.name + ".key")
    assert key_file.stat().st_mode & 0o777 == 0o600
    import hmac

    key = bytes.fromhex(key_file.read_text().strip())
    assert line["request_body"]["hmac"] == hmac.new(key, body, "sha256").hexdigest()


BATCH_POLICY = """
version: 1
agents: {"*": [order-support]}
upstreams:
  tools: {url: "URL", kind: mcp, mcp: {batches: true}}
roles:
  order-support:
    rules:
      - id: mcp-get-order
        upstream: tools
        allow: POST /mcp
        tool: get_order
        rate: 2/hour
        arguments:
          type: object
          required: [order_id]
          additionalProperties: false
          properties: {order_id: {type: integer, minimum: 1}}
      - id: mcp-run-sql
        upstream: tools
        allow: POST /mcp
        tool: run_sql
        sql:
          {argument: sql, dialect: sqlite, tables: [orders],
           schema: {orders: [id, status]}, max_limit: 100, add_limit: true}
"""


@pytest.fixture
async def batches(
    aiohttp_server: Any, serve_gateway: Any, workspace: Workspace, tmp_path: Path
) -> Any:
    """A gateway in front of an MCP server that takes JSON-RPC batches (``mocks.servers``)."""
    from mocks.servers import MCP_BATCH_TOOL_CALLS, mcp_batch_app

    app = mcp_batch_app()
    server = await aiohttp_server(app)
    policy = tmp_path / "batch-policy.yaml"
    policy.write_text(BATCH_POLICY.replace("URL", str(server.make_url("")).rstrip("/")))
    settings = load_settings(
        {
            "policy": str(policy),
            "jwks": str(workspace.jwks),
            "audit": str(tmp_path / "audit.jsonl"),
        },
        {},
    )
    gw = build_gateway(settings, workspace.environ())
    client = await serve_gateway(gw)
    client.gw = gw
    client.calls = app[MCP_BATCH_TOOL_CALLS]
    client.requests = app
    client.audit_path = tmp_path / "audit.jsonl"
    client.gw_headers = await _mcp_session(client, workspace.token("mcp-bot", ["order-support"]))
    return client


async def test_mcp_batch_cannot_smuggle_unchecked_tool_calls(
    example: Any, batches: Any, workspace: Workspace, mocks: Mocks
) -> None:
    """CG-2026-02: in a JSON-RPC batch only the first distinct tool was checked, so later
    messages skipped their argument schema, SQL check, rate limit and quota (``SELECT name,
    ssn FROM customers`` and an ``UPDATE`` ran behind an allowed ``get_order``). Every
    message is now checked under its own rule, and a batch to a server that declares none
    is refused whole."""
    smuggled = [
        _rpc(1, "get_order", {"order_id": 1}),
        _rpc(2, "run_sql", {"sql": "SELECT name, ssn FROM customers"}),
        _rpc(3, "run_sql", {"sql": "UPDATE orders SET status = 'x'"}),
    ]
    # A server that takes batches: each message checked, the batch refused, nothing sent.
    resp = await batches.post("/tools/mcp", headers=batches.gw_headers, json=smuggled)
    answers = await _answers(resp)
    assert sorted(a["id"] for a in answers) == [1, 2, 3]
    assert {a["error"]["data"]["reason"] for a in answers} == {"sql_denied"}
    assert batches.calls == {}
    # The example's MCP server takes no batches: refused before anything is matched.
    headers = await _mcp_session(example, workspace.token("mcp-bot", ["order-support"]))
    before = dict(mocks.stats("mcp")["tool_calls"])
    answers = await _answers(await example.post("/tools/mcp", headers=headers, json=smuggled))
    assert {a["error"]["data"]["reason"] for a in answers} == {"mcp_denied"}
    assert dict(mocks.stats("mcp")["tool_calls"]) == before


async def test_mcp_batch_counts_every_message_against_rate_limits(batches: Any) -> None:
    """CG-2026-02 (limits): a batch was counted once, so 60 tool calls ran on a 2/hour rule.
    Each message of a batch now spends its own unit; the batch that would exceed the rate is
    refused whole and nothing of it reaches the server."""
    three = [_rpc(i, "get_order", {"order_id": i}) for i in (1, 2, 3)]
    answers = await _answers(
        await batches.post("/tools/mcp", headers=batches.gw_headers, json=three)
    )
    assert {a["error"]["data"]["reason"] for a in answers} == {"rate_limited"}
    assert batches.calls == {}
    one = _rpc(4, "get_order", {"order_id": 1})
    answer = await _answers(await batches.post("/tools/mcp", headers=batches.gw_headers, json=one))
    assert answer["error"]["data"]["reason"] == "rate_limited"
    assert batches.calls == {}


async def test_an_allowed_batch_is_forwarded_as_checked_and_audited_per_message(
    batches: Any,
) -> None:
    """Each message of an allowed batch reaches the server as it was checked (the LIMIT the
    rule adds included), and the audit has one line per message, sharing the request id."""
    sent = [
        _rpc(1, "get_order", {"order_id": 7}),
        _rpc(2, "run_sql", {"sql": "SELECT id FROM orders"}),
        {"jsonrpc": "2.0", "id": 3, "method": "ping"},
    ]
    resp = await batches.post("/tools/mcp", headers=batches.gw_headers, json=sent)
    answers = await _answers(resp)
    assert [a["id"] for a in answers] == [1, 2, 3] and all("result" in a for a in answers)
    assert json.loads(answers[1]["result"]["content"][0]["text"])["arguments"] == {
        "sql": "SELECT id FROM orders LIMIT 100"
    }
    assert batches.calls == {"get_order": 1, "run_sql": 1}
    batches.gw.audit.flush()
    lines = call_records(json.loads(x) for x in batches.audit_path.read_text().splitlines())[-3:]
    assert len({line["request_id"] for line in lines}) == 1
    assert [(line["mcp"], line["rule"]) for line in lines] == [
        ({"method": "tools/call", "name": "get_order"}, "mcp-get-order"),
        ({"method": "tools/call", "name": "run_sql"}, "mcp-run-sql"),
        ({"method": "ping"}, None),
    ]


async def test_a_reflected_credential_never_reaches_the_agent(
    client: Any, token: Any, workspace: Workspace
) -> None:
    """PITFALLS (aiohttp client): an upstream can reflect the injected credential outside the
    body and header values: in the reason phrase and in a header name. The agent gets it
    masked, or not at all, in every place."""
    secret = (workspace.secrets_dir / "echo-tester.key").read_text().strip()
    resp = await client.get("/echo/echo/reflect", headers={"Authorization": f"Bearer {token()}"})
    body = await resp.read()
    assert resp.status == 200
    head = (resp.reason or "") + "".join(f"{k}: {v}\n" for k, v in resp.headers.items())
    assert secret not in head and secret.encode() not in body
    assert resp.reason == "OK " + "*" * len(secret)
    assert resp.headers["X-Seen"] == "*" * len(secret)
    assert not [k for k in resp.headers if k.lower().startswith("x-seen-")]
    # Encoded inside longer text (base64 at any alignment, URL-safe, percent-encoded): the
    # agent cannot decode the secret out of what it got.
    encoded = json.loads(body)["encoded"]
    assert secret.encode() not in base64.b64decode(encoded["b64"] + "==")
    assert secret.encode() not in base64.urlsafe_b64decode(encoded["b64url"] + "==")
    assert "*" in encoded["pct"] and secret not in encoded["pct"]
    # A compressed answer from an upstream holding the credential is not passed on at all.
    resp = await client.get(
        "/echo/echo/reflect?gzip=1", headers={"Authorization": f"Bearer {token()}"}
    )
    assert resp.status == 502 and secret.encode() not in await resp.read()


# --- [4/9] bytes checked are bytes forwarded ----------------------------------------------


async def test_a_checked_body_in_another_charset_is_refused(
    example: Any, workspace: Workspace, mocks: Mocks
) -> None:
    """CG-2026-04 (charset): ``charset=utf-7`` was checked as UTF-8 but decoded by the
    upstream as UTF-7, which smuggled a second "sql" key and returned SSNs. A checked body
    must be UTF-8; the upstream gets the type it was checked as."""
    smuggle = b'{"sql": "SELECT id FROM orders LIMIT 1" +ACIAcwBxAGwAIgA6ACI-x"}'
    before = int(mocks.stats("db")["queries_executed"])
    resp = await example.post(
        "/db/query",
        data=smuggle,
        headers={
            "Authorization": f"Bearer {workspace.token('analyst-bot', ['analyst'])}",
            "Content-Type": "application/json; charset=utf-7",
        },
    )
    assert resp.status == 415
    assert (await resp.json(content_type=PROBLEM))["reason"] == "unsupported_media_type"
    assert int(mocks.stats("db")["queries_executed"]) == before
    # UTF-8 declared in any spelling passes, and is forwarded normalised.
    mocks.clear()
    resp = await example.post(
        "/db/query",
        data=b'{"sql": "SELECT id FROM orders LIMIT 1"}',
        headers={
            "Authorization": f"Bearer {workspace.token('analyst-bot', ['analyst'])}",
            "Content-Type": 'application/json; charset="UTF-8"; profile=x',
        },
    )
    assert resp.status == 200
    [seen] = [r for r in mocks.requests("db") if r["path"] == "/query"]
    assert seen["headers"]["Content-Type"] == "application/json; charset=utf-8"


async def test_http10_with_transfer_encoding_is_refused_and_closed(client: Any, token: Any) -> None:
    """CG-2026-05: HTTP/1.0 with Transfer-Encoding was forwarded as a chunked HTTP/1.1 request
    and the connection kept open (RFC 9112 6.1: treat as faulty, close)."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(
        (
            "POST /echo/echo/post HTTP/1.0\r\nHost: x\r\n"
            f"Authorization: Bearer {token()}\r\nTransfer-Encoding: chunked\r\n\r\n"
            "5\r\nhello\r\n0\r\n\r\n"
        ).encode()
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)  # read to EOF: the gateway closes
    writer.close()
    assert answer.startswith(b"HTTP/1.0 400 ") or answer.startswith(b"HTTP/1.1 400 ")
    assert b"target_ambiguous" in answer


async def test_connection_naming_a_checked_header_is_refused(
    client: Any, token: Any, mocks: Mocks
) -> None:
    """CG-2026-06: ``Connection: X-Trace`` made the gateway drop a header the rule had just
    checked (``Connection: Content-Type``: the type a body check relied on)."""
    resp = await client.get(
        "/echo/echo/x",
        headers={"Authorization": f"Bearer {token()}", "X-Trace": "abc", "Connection": "X-Trace"},
    )
    assert resp.status == 400
    assert (await resp.json(content_type=PROBLEM))["reason"] == "query_invalid"
    assert mocks.requests("echo") == []


async def test_a_compressed_upload_is_refused_and_never_inflated(client: Any, mocks: Mocks) -> None:
    """CG-2026-07: gzip bodies that inflate to 1 GiB were inflated by the server even after a
    401, delaying other agents' calls. Request decompression is off; codings are refused."""
    import gzip

    bomb = gzip.compress(b"\0" * (50 * 1024 * 1024))  # ~50 KiB that inflate to 50 MiB
    resp = await client.post("/echo/echo/post", data=bomb, headers={"Content-Encoding": "gzip"})
    assert resp.status == 415
    assert (await resp.json(content_type=PROBLEM))["reason"] == "unsupported_media_type"
    assert mocks.requests("echo") == []


async def test_a_body_no_rule_takes_is_refused(client: Any, token: Any, mocks: Mocks) -> None:
    """CG-2026-08: a GET with a chunked body, and any body on a rule without body:/sql:, was
    forwarded unchecked. A rule says that it takes a body; otherwise a body is refused."""

    async def chunks() -> Any:
        yield b'{"smuggled": '
        yield b"true}"

    auth = {"Authorization": f"Bearer {token()}"}
    resp = await client.get("/echo/echo/x", headers=auth, data=chunks())
    assert resp.status == 400
    assert (await resp.json(content_type=PROBLEM))["reason"] == "body_invalid"
    resp = await client.get("/echo/echo/x", headers=auth, data=b"payload")
    assert resp.status == 400
    assert mocks.requests("echo") == []
    # A rule with body: takes one (here any bytes up to its size).
    resp = await client.post("/echo/echo/post", headers=auth, data=b"payload")
    assert resp.status == 200


def _gateway_for(upstream_url: str, tmp_path: Path, workspace: Workspace, rules: str) -> Any:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        f'version: 1\nupstreams:\n  up: {{url: "{upstream_url}"}}\nagents: {{"*": [r]}}\n'
        f"roles:\n  r:\n    rules:\n{rules}"
    )
    settings = load_settings({"policy": str(policy), "jwks": str(workspace.jwks), "audit": "-"}, {})
    return build_gateway(settings, workspace.environ())


async def test_no_call_is_sent_twice(
    serve_gateway: Any, workspace: Workspace, tmp_path: Path
) -> None:
    """CG-2026-09: on a connection reset the client resent GET, PUT and DELETE, so the
    upstream received them twice behind the policy's back. No retries."""
    seen: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # First request on a connection: answered, kept alive. Second: read, then reset.
        for answered in (True, False):
            head = await reader.readuntil(b"\r\n\r\n")
            seen.append(head.split(b"\r\n", 1)[0])
            if not answered:
                writer.transport.abort()
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    gw = _gateway_for(
        f"http://127.0.0.1:{port}", tmp_path, workspace,
        "      - {id: del, upstream: up, allow: 'DELETE /items/{id}'}\n",
    )  # fmt: skip
    client = await serve_gateway(gw)
    auth = {"Authorization": f"Bearer {workspace.token('a1', ['r'])}"}
    async with server:
        assert (await client.delete("/up/items/1", headers=auth)).status == 200
        resp = await client.delete("/up/items/2", headers=auth)
        assert resp.status == 502
        await asyncio.sleep(0.2)
    assert seen == [b"DELETE /items/1 HTTP/1.1", b"DELETE /items/2 HTTP/1.1"]


async def test_range_requests_cannot_rebuild_a_reflected_credential(
    client: Any, token: Any, mocks: Mocks
) -> None:
    """CG-2026-10: two Range requests for an answer reflecting the injected credential gave
    the agent its two halves, each too short to be masked. Range is forwarded only where a
    rule names it in ``headers:``."""
    resp = await client.get(
        "/echo/echo/reflect", headers={"Authorization": f"Bearer {token()}", "Range": "bytes=0-5"}
    )
    assert resp.status == 200
    [seen] = mocks.requests("echo")
    assert "Range" not in seen["headers"]


def test_a_malformed_approval_id_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CG-2026-11: ``capgate approvals approve <id>`` with a malformed id printed a traceback
    (http.client.InvalidURL). One readable line and exit 2, before any request is made."""
    from gateway.cli import main

    token_file = tmp_path / "admin-token"
    token_file.write_text("x" * 32)
    token_file.chmod(0o600)
    for bad in ("../../x", "abc def", "0123456789abcdeg", "ABCDEF0123456789", "a" * 17):
        argv = ["approvals", "approve", bad, "--admin", "http://127.0.0.1:9", "--token-file"]
        code = main([*argv, str(token_file)], {})
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and "Traceback" not in err
        assert err.count("\n") == 1 and "expected 16 hex digits" in err, err
    # A malformed admin URL is one line too (InvalidURL is raised inside urllib).
    argv = ["approvals", "list", "--admin", "http://127.0.0.1:99999x", "--token-file"]
    code = main([*argv, str(token_file)], {})
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err


def test_a_misspelt_schema_keyword_is_a_policy_error_not_an_open_door() -> None:
    """CG-2026-12: ``additionalProperty: false`` (a typo) was accepted silently, and the
    validator ignored the unknown keyword, letting every extra field through."""
    from gateway.policy_file import PolicyError
    from gateway.testing import policy_from_text

    text = (
        "version: 1\nupstreams:\n  s: {url: 'http://127.0.0.1:9'}\nroles:\n  r:\n    rules:\n"
        "      - id: p\n        upstream: s\n        allow: POST /x\n        body:\n"
        "          schema: {type: object, additionalProperty: false}\n"
        'agents: {"*": [r]}\n'
    )
    with pytest.raises(PolicyError) as info:
        policy_from_text(text)
    [issue] = info.value.issues
    assert (issue.line, issue.col) == (11, 34)
    assert "did you mean 'additionalProperties'" in issue.message


async def test_a_validly_signed_token_for_an_undeclared_agent_is_refused(
    example: Any, workspace: Workspace, mocks: Mocks
) -> None:
    """CG-2026-13: any ``sub`` with a valid signature passed: a token for an agent nobody
    declared got 200 through a shared credential (and a 500 through a per-agent one). Agents
    are declared with the roles each may hold; others are 403 before any check or upstream."""
    cases = [
        ("intruder", ["sre-diagnostics"], "GET", "/metrics/metrics/cpu?window=5m", "agent_unknown"),
        ("intruder", ["analyst"], "POST", "/db/query", "agent_unknown"),
        ("analyst-bot", ["sre-diagnostics"], "GET", "/metrics/metrics/cpu?window=5m",
         "role_not_granted"),
    ]  # fmt: skip
    for agent, roles, method, target, reason in cases:
        resp = await example.request(
            method,
            target,
            json={"sql": "SELECT id FROM orders LIMIT 1"} if method == "POST" else None,
            headers={"Authorization": f"Bearer {workspace.token(agent, roles)}"},
        )
        assert resp.status == 403, (agent, await resp.text())
        assert (await resp.json(content_type=PROBLEM))["reason"] == reason
    assert mocks.requests("metrics") == [] and mocks.requests("db") == []
    # The declared agent with its own role still passes.
    resp = await example.get(
        "/metrics/metrics/cpu?window=5m",
        headers={"Authorization": f"Bearer {workspace.token('sre-bot', ['sre-diagnostics'])}"},
    )
    assert resp.status == 200


# --- recordings: what an upstream echoes, and the recorder at scale --------------------------

UP_KEY = "Hunter2-Xy7Q9pLm4Rt"  # the per-agent credential the gateway injects (X-Api-Key)


def _escaped(text: str) -> str:
    """``text`` as a JSON string body would carry it with its first letter escaped."""
    return f"\\u{ord(text[0]):04x}" + text[1:]


async def _hostile(request: web.Request) -> web.Response:
    """An upstream that hands the X-Api-Key it got back in every channel but the obvious."""
    key = request.headers.get("X-Api-Key", "")
    kind = request.match_info["kind"]
    headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})
    body = b"{}"
    reason = "OK"
    if kind == "reason":
        reason = f"OK {key}"
    elif kind == "header-name":
        headers.add(f"x-seen-{key.lower()}", "1")  # as an HTTP/2 hop would lower-case it
        headers.add(f"X-Seen-{key}", "1")
    elif kind in ("gzip", "gzip-unlabelled"):
        body = gzip.compress(json.dumps({"echo": key, "msg": f"login as admin:{key}"}).encode())
        if kind == "gzip":  # declared after an identity coding: a check of the first passes
            headers.add("Content-Encoding", "identity")
            headers.add("Content-Encoding", "gzip")
        else:
            headers["Content-Type"] = "application/gzip"
    elif kind == "json-escaped":
        body = ('{"msg": "login as admin:' + _escaped(key) + ' failed"}').encode()
    elif kind == "url":
        headers["Location"] = f"https://h.example/cb?access_token={key}&sig=c2lnbmF0dXJl"
        body = json.dumps(
            {
                "next": f"https://agent:{key}@internal.example/x",
                "cb": f"https://h.example/cb?api_key={key}",
                "db": "https://admin:s3cr3t-pw@db.internal/?sig=abc&key=AKIAXX",
            }
        ).encode()
    return web.Response(body=body, reason=reason, headers=headers)


@pytest.fixture
async def hostile(
    aiohttp_server: Any, serve_gateway: Any, workspace: Workspace, tmp_path: Path
) -> Any:
    """A gateway recording calls to the hostile upstream into tmp_path/rec."""
    app = web.Application()
    app.router.add_get("/{kind}", _hostile)
    server = await aiohttp_server(app)
    policy = tmp_path / "hostile.yaml"
    policy.write_text(
        "version: 1\nupstreams:\n"
        f'  up: {{url: "http://127.0.0.1:{server.port}",'
        ' credentials: {type: header, header: X-Api-Key, secret: "env:UP_KEY"}}\n'
        'agents: {"*": [r]}\nroles:\n  r:\n    rules:\n'
        "      - {id: any, upstream: up, allow: 'GET /{kind}'}\n"
    )
    rec = tmp_path / "rec"
    settings = load_settings(
        {
            "policy": str(policy),
            "jwks": str(workspace.jwks),
            "audit": "-",
            "mode": "record",
            "recordings": str(rec),
        },
        {},
    )
    gw = build_gateway(settings, {**workspace.environ(), "UP_KEY": UP_KEY})
    client = await serve_gateway(gw)
    auth = {"Authorization": f"Bearer {workspace.token('a1', ['r'], run='r1')}"}

    async def record(kind: str, keep: bool = False) -> Any:
        """Call ``/up/<kind>``: the recording and the status; with ``keep``, also what the
        agent got (reason, headers and body, as bytes)."""
        resp = await client.get(f"/up/{kind}", headers=auth)
        body = await resp.read()
        await gw.transport.close()  # the recording as a stopped gateway leaves it
        if not keep:
            return rec, resp.status
        head = f"{resp.status} {resp.reason}\r\n".encode("latin-1") + b"".join(
            k + b": " + v + b"\r\n" for k, v in resp.raw_headers
        )
        return rec, resp.status, head + b"\r\n" + body

    return record


def _leaks(directory: Path, secret: str) -> list[str]:
    """Where any form of ``secret`` is in the recording: its files' bytes, each record's
    decoded bodies (base64, gzip) and JSON strings, and header names in any case."""
    from gateway.credentials import reflected_forms
    from gateway.recording.lint import lint
    from gateway.recording.reader import load_recording

    forms = [f.lower() for f in reflected_forms(secret)]
    found = [str(f) for f in lint(directory, known=[secret])]
    for path in directory.rglob("*"):
        if path.is_file() and any(f in path.read_bytes().lower() for f in forms):
            found.append(f"{path.name}: bytes")
    for entry in load_recording(directory).entries():
        assert entry.response is not None
        body = entry.response.body.read() if entry.response.body is not None else b""
        if body.startswith(b"\x1f\x8b"):
            body = gzip.decompress(body)
        text = json.dumps(json.loads(body)) if body.startswith(b"{") else body.decode("latin-1")
        head = entry.response.reason + repr(entry.response.headers)
        if any(f in (text + head).lower().encode() for f in forms):
            found.append(f"{entry.ref}: decoded")
    return found


async def test_recording_redacts_a_secret_echoed_in_the_reason_phrase(hostile: Any) -> None:
    """Recording leak (reason phrase): ``HTTP/1.1 200 OK <injected key>`` went into the
    recording's ``response.reason`` as sent, and ``capgate recording lint`` said ok."""
    rec, status = await hostile("reason")
    assert status == 200 and _leaks(rec, UP_KEY) == []
    [line] = (rec / "runs" / "r1.jsonl").read_text().splitlines()
    assert json.loads(line)["response"]["reason"] == "OK [secret:up:header]"


async def test_recording_redacts_a_secret_in_a_response_header_name(hostile: Any) -> None:
    """Recording leak (header name): ``X-Seen-<key>: 1`` kept the key as a header name; one
    lower-cased on the way (``x-seen-<key in lower case>``) matched no case-sensitive check."""
    rec, status = await hostile("header-name")
    assert status == 200 and _leaks(rec, UP_KEY) == []
    [line] = (rec / "runs" / "r1.jsonl").read_text().splitlines()
    names = [name.lower() for name, _ in json.loads(line)["response"]["headers"]]
    assert not [n for n in names if n.startswith("x-seen-")]


@pytest.mark.parametrize("kind", ["gzip", "gzip-unlabelled"])
async def test_recording_redacts_a_secret_inside_a_compressed_body(hostile: Any, kind: str) -> None:
    """Recording leak (gzip body): a gzip body (``Content-Encoding: identity`` then ``gzip``,
    or gzip bytes as ``application/gzip``) was stored compressed, where no scan saw the key.
    Now it is decoded, redacted and encoded again, and replay sends those stored bytes."""
    rec, status = await hostile(kind)
    # The agent is refused such an answer (test_the_agent_never_gets_the_credential_...);
    # the recording still keeps what the upstream said, redacted.
    assert status == 502 and _leaks(rec, UP_KEY) == []
    [line] = (rec / "runs" / "r1.jsonl").read_text().splitlines()
    stored = json.loads(line)["response"]["body"]
    if kind == "gzip":  # refused on its header: the body was never read, nor recorded
        assert stored is None
        return
    body = base64.b64decode(stored["base64"])
    assert json.loads(gzip.decompress(body)) == {
        "echo": "[secret:up:header]",
        "msg": "login as admin:[secret:up:header]",
    }


async def test_recording_redacts_password_echoed_inside_json_string(hostile: Any) -> None:
    """Recording leak (JSON escapes): ``{"msg": "login as admin:\\u0048unter2... failed"}``
    hid the key from every byte scan behind one JSON escape."""
    rec, status = await hostile("json-escaped")
    assert status == 200 and _leaks(rec, UP_KEY) == []
    [line] = (rec / "runs" / "r1.jsonl").read_text().splitlines()
    body = json.loads(json.loads(line)["response"]["body"]["text"])
    assert body == {"msg": "login as admin:[secret:up:header] failed"}


async def test_recording_redacts_credentials_inside_urls(hostile: Any) -> None:
    """Recording leak (URLs): URL userinfo (``https://user:pass@host/``) and credential query
    parameters (``?api_key=``, ``sig=``, ``key=``) in a body or a ``Location`` header were
    kept when the value was not the injected key."""
    rec, status = await hostile("url")
    assert status == 200 and _leaks(rec, UP_KEY) == []
    text = (rec / "runs" / "r1.jsonl").read_text()
    assert "s3cr3t-pw" not in text and "c2lnbmF0dXJl" not in text and "AKIAXX" not in text
    record = json.loads(text)
    assert json.loads(record["response"]["body"]["text"])["db"] == (
        "https://[redacted:userinfo]@db.internal/?sig=[redacted:key]&key=[redacted:key]"
    )


def test_recording_lint_finds_secrets_in_every_channel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Recording lint: ``capgate recording lint`` said ok on recordings holding a key in
    a reason phrase, a header name, a gzip body, a JSON-escaped string and a URL. It now reads
    every place of every record, decodes bodies and values, and exits 1, one line each."""
    from gateway.commands.recording import cmd_recording_lint
    from tests.recording.helpers import exchange, write

    jwt = (
        "eyJhbGciOiJFZERTQSIsImtpZCI6ImsxIn0"
        ".eyJzdWIiOiJzcmUtYm90IiwiYXVkIjoic2VydmljZXMifQ.Zm9vYmFyYmF6cXV4"
    )
    directory = write(tmp_path / "rec", *(exchange(i, "/x", b"{}") for i in range(1, 6)))
    path = directory / "runs" / "r1.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    # What a recorder without these fixes wrote (planted by hand).
    records[0]["response"]["reason"] = f"OK {jwt}"
    records[1]["response"]["headers"].append([f"X-Seen-{jwt}", "1"])
    records[2]["response"]["headers"].append(["Content-Encoding", "gzip"])
    records[2]["response"]["body"] = {
        "base64": base64.b64encode(gzip.compress(jwt.encode())).decode()
    }
    records[3]["response"]["body"] = {"text": '{"msg": "' + _escaped(jwt) + '"}'}
    records[4]["response"]["headers"].append(["Location", "https://u:pw@h/?api_key=k"])
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cmd_recording_lint(directory) == 1
    out = capsys.readouterr().out
    for line in (
        "runs/r1.jsonl:1: jwt: eyJh... (99 chars) in seq 1, response.reason",
        "runs/r1.jsonl:2: jwt: eyJh... (99 chars) in seq 2, response.headers[1] name",
        "runs/r1.jsonl:3: jwt: eyJh... (99 chars) in seq 3, response.body (gzip-decoded)",
        'runs/r1.jsonl:4: jwt: "\\u0... (106 chars) in seq 4, response.body',  # the JSON string
        "runs/r1.jsonl:5: url-userinfo: (4 chars) in seq 5, response.headers[1] value",
        "runs/r1.jsonl:5: url-credential: (1 chars) in seq 5, response.headers[1] value",
    ):
        assert line in out.splitlines(), out
    assert jwt not in out


async def test_recording_cost_per_call_does_not_grow_with_runs(tmp_path: Path) -> None:
    """Recording at scale (record mode slows down): 166 -> 64 calls/s over 1,000 runs. The
    manifest (O(runs) to write) was rewritten on every new run and every 100 records, and every call
    swept every open run. The gateway code a run's calls execute is now the same for the
    1,000th run as for the 5th (a count of calls and lines executed, not a timing; the
    figures are in ``bench/record_bench.py``)."""
    from tests.recording.helpers import FakeLive, FakeResponse, drain, mini_policy, request
    from tests.recording.test_durability import Ticks, gateway_work

    policy = mini_policy()
    from gateway.transports.record import RecordTransport

    rec = RecordTransport(FakeLive(FakeResponse()), tmp_path, clock=Ticks())
    work = {}
    for r in range(1000):
        with gateway_work() as counts:
            for _ in range(2):
                req = request(policy, "ping", "GET", "/ping", run=f"run-{r}")
                await drain(await rec.send(req))
        work[r] = sum(counts.values())
    assert work[999] == work[500] == work[5]
    assert rec.writer.manifest_writes == 1
    await rec.close()


async def test_recording_shutdown_with_many_runs_open_is_bounded(tmp_path: Path) -> None:
    """Recording at scale (slow SIGTERM): stopping with 1,000 runs open took over 20 s: each
    run's end rewrote the whole manifest. Now the runs end, then the manifest is written once."""
    from gateway.transports.record import RecordTransport
    from tests.recording.helpers import FakeLive, FakeResponse, drain, mini_policy, request
    from tests.recording.test_durability import Ticks

    policy = mini_policy()
    rec = RecordTransport(FakeLive(FakeResponse()), tmp_path, clock=Ticks())
    for r in range(1000):
        await drain(await rec.send(request(policy, "ping", "GET", "/ping", run=f"run-{r}")))
    before = rec.writer.manifest_writes
    await rec.close()
    assert rec.writer.manifest_writes == before + 1
    assert len(json.loads((tmp_path / "manifest.json").read_text())["runs"]) == 1000


def test_recording_manifest_counts_are_right_after_kill_9(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    """Recording after a crash: after ``kill -9`` of ``capgate serve --record`` the
    manifest's counts stayed wrong for good. Now every run file's records are counted
    (``capgate recording verify`` says what differs; ``--repair``, or the next recorder on the
    directory, mends it). ``tests/e2e/test_record_crash.py`` restarts and stops it too."""
    import subprocess
    import sys
    import urllib.request

    from tests.conftest import ROOT
    from tests.e2e.test_serve import start_capgate

    rec = tmp_path / "rec"
    args = [*workspace.serve_args(0, tmp_path / "audit.jsonl", policy_file), "--record", str(rec)]
    proc, ready = start_capgate(args, workspace.environ(), tmp_path)
    try:
        for r in range(3):
            tok = workspace.token("sre-bot", ["sre-diagnostics"], run=f"r{r}")
            for _ in range(r + 1):
                req = urllib.request.Request(
                    ready["url"] + "/metrics/metrics/cpu?window=1m",
                    headers={"Authorization": f"Bearer {tok}"},
                )
                with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (loopback)
                    assert resp.status == 200
    finally:
        proc.kill()
        proc.communicate(timeout=10)

    def verify(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", "recording", "verify", str(rec), *extra],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )

    check = verify()
    assert check.returncode == 1 and "3 run(s), 6 call(s)" in check.stdout, check.stdout
    assert verify("--repair").returncode == 0
    manifest = json.loads((rec / "manifest.json").read_text())
    assert {r["run"]: r["calls"] for r in manifest["runs"]} == {"r0": 1, "r1": 2, "r2": 3}


@pytest.mark.parametrize("kind", ["header-name", "gzip", "gzip-unlabelled", "json-escaped"])
async def test_the_agent_never_gets_the_credential_through_a_hostile_upstream(
    hostile: Any, kind: str
) -> None:
    """CG-2026-14: with a hostile upstream the agent still received the injected key: gzip
    declared after an ``identity`` coding (only the first header was read), gzip bytes with no
    coding at all, a JSON-escaped copy (``\\u0048unter2``) and a header name holding it in
    lower case. Each is now refused (compressed) or masked (escaped, header names any case)."""
    directory, status, answer = await hostile(kind, keep=True)
    text = answer.decode("latin-1").lower()
    assert UP_KEY.lower() not in text, kind
    if kind.startswith("gzip"):
        assert status == 502 and b"upstream_unavailable" in answer
        return
    assert status == 200
    if kind == "json-escaped":
        decoded = json.loads(answer.split(b"\r\n\r\n", 1)[-1])
        assert UP_KEY not in decoded["msg"] and "*" in decoded["msg"]


def test_the_agent_jwt_cache_is_bounded(tmp_path: Path) -> None:
    """CG-2026-15: the agent-jwt credential cache was never evicted (+11 MB per 15,000
    agents). It keeps at most MAX_CACHED_SECRETS entries, expired ones evicted first, and a
    recent agent's token still comes from the cache."""
    from gateway.credentials import MAX_CACHED_SECRETS, CredentialStore
    from gateway.policy.model import Credentials
    from gateway.tokens import load_private_key
    from mocks.demo import prepare_workspace

    ws = prepare_workspace(tmp_path / "ws")
    now = [1_700_000_000.0]
    store = CredentialStore(
        {}, tmp_path, signing_key=load_private_key(ws.upstream_key), clock=lambda: now[0]
    )
    creds = Credentials(type="agent-jwt", audience="services", ttl=60, prefix="Bearer ")
    for i in range(MAX_CACHED_SECRETS * 3 + 7):
        store.injection("services", creds, f"agent-{i}")
        now[0] += 0.001
    assert len(store._jwts) <= MAX_CACHED_SECRETS
    last = store.injection("services", creds, f"agent-{MAX_CACHED_SECRETS * 3 + 6}")
    again = store.injection("services", creds, f"agent-{MAX_CACHED_SECRETS * 3 + 6}")
    assert last is not None and again is not None
    assert last.secret.reveal() == again.secret.reveal()


# --- the background loop, shutdown, the listener ---------------------------------------------


@pytest.fixture
async def watched(serve_gateway: Any, workspace: Workspace, tmp_path: Path) -> Any:
    """The test policy, copied so the test can edit it, reloaded every 50 ms."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(workspace.policy.read_text())
    settings = load_settings(
        {
            "policy": str(policy),
            "jwks": str(workspace.jwks),
            "upstream_key": str(workspace.upstream_key),
            "secrets_dir": str(workspace.secrets_dir),
            "audit": "-",
            "reload_interval": "0.05s",
        },
        {},
    )
    gw = build_gateway(settings, workspace.environ())
    client = await serve_gateway(gw)
    client.gw = gw
    client.policy_path = policy
    return client


async def _until(predicate: Any, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not reached in time")


async def _health(client: Any) -> tuple[int, dict[str, Any]]:
    resp = await client.get("/_capgate/health")
    return resp.status, await resp.json()


def _edited(text: str) -> str:
    """The same policy with one more rule, so its digest changes."""
    marker = "roles:\n"
    assert marker in text
    extra = (
        "  advisory-extra:\n    rules:\n"
        "      - {id: advisory-extra, upstream: services, allow: GET /services/advisory}\n"
    )
    return text.replace(marker, marker + extra, 1)


async def test_a_policy_replaced_by_delete_then_create_is_still_reloaded(watched: Any) -> None:
    """CG-2026-16 (background loop): a policy file replaced the way ``git checkout`` does
    (deleted, then created) killed the loop that reloads the policy, so no later edit was
    applied. The gap is now said once and retried; the new file is applied."""
    before = watched.gw.policy.digest
    text = watched.policy_path.read_text()
    watched.policy_path.unlink()
    await asyncio.sleep(0.3)  # several passes see no file
    watched.policy_path.write_text(_edited(text))
    await _until(lambda: watched.gw.policy.digest != before)
    status, health = await _health(watched)
    assert status == 200 and health["background"]["ok"] is True
    assert "advisory-extra" in watched.gw.policy.roles


async def test_a_deeply_nested_policy_edit_is_refused_and_the_loop_goes_on(watched: Any) -> None:
    """CG-2026-16 (nesting): a policy edited into deeply nested YAML raised RecursionError in
    the loop and ended it. It is now a policy error (the policy in force is kept), and the
    next valid edit is applied."""
    before = watched.gw.policy.digest
    text = watched.policy_path.read_text()
    watched.policy_path.write_text(text + "deep: " + "[" * 100_000 + "]" * 100_000 + "\n")
    await asyncio.sleep(0.3)
    assert watched.gw.policy.digest == before
    watched.policy_path.write_text(_edited(text))
    await _until(lambda: watched.gw.policy.digest != before)
    assert watched.gw.watch.health()["ok"] is True


async def test_an_error_in_the_background_loop_is_shown_and_survived(
    watched: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CG-2026-16 (any error): an unexpected error (here the audit flush on a full disk) ended
    the loop silently. It now keeps running, health says ``degraded`` with the error while it
    lasts, and ``ok`` again after a clean pass; policy edits are applied meanwhile."""
    failing = True
    tick = watched.gw.audit.tick

    def full_disk() -> None:
        if failing:
            raise OSError(28, "No space left on device")
        tick()

    monkeypatch.setattr(watched.gw.audit, "tick", full_disk)
    await _until(lambda: not watched.gw.watch.health()["ok"])
    status, health = await _health(watched)
    assert status == 503 and health["status"] == "degraded"
    assert "No space left on device" in health["background"]["error"]
    before = watched.gw.policy.digest
    watched.policy_path.write_text(_edited(watched.policy_path.read_text()))
    await _until(lambda: watched.gw.policy.digest != before)  # the loop still reloads
    failing = False
    await _until(lambda: watched.gw.watch.health()["ok"])
    status, health = await _health(watched)
    assert status == 200 and health["status"] == "ok"


async def test_no_request_body_is_read_before_the_token_is_verified(client: Any) -> None:
    """CG-2026-17 (bodies before tokens): nothing of a request body is read or parsed before
    its token is verified. A call without a token that declares 10 MB and sends none of it
    gets its 401 at once, and the connection is closed rather than drained."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(
            b"POST /services/services/restart HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n{"
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 401 ")
        assert b"connection: close" in head.lower()
    finally:
        writer.close()


@pytest.mark.e2e
def test_sigterm_keeps_to_the_grace_and_audits_cut_calls(
    workspace: Workspace, mocks: Mocks, tmp_path: Path
) -> None:
    """CG-2026-18 (shutdown): SIGTERM took up to twice the grace period, and calls cut at
    shutdown were audited as allowed with no status. With a 2 s grace and a call that needs
    10 s, the process exits 0 within the grace (plus the half second cut calls get to unwind),
    the agent is answered 503 and the cut call's line says ``gateway_stopping``; the trail
    verifies."""
    import signal
    import subprocess
    import sys
    import threading
    import time
    import urllib.error
    import urllib.request

    from mocks.demo import rewrite_policy_urls
    from tests.conftest import ROOT, TEST_POLICY
    from tests.e2e.test_serve import start_capgate

    policy = tmp_path / "policy.yaml"
    text = TEST_POLICY.read_text()
    slow = "timeouts: {connect: 1s, read: 1s}\n    limits: {request_body: 4KiB}"
    assert slow in text  # the echo upstream's: give it longer than the grace
    text = text.replace(slow, slow.replace("read: 1s", "read: 30s"))
    policy.write_text(rewrite_policy_urls(text, mocks.urls))
    audit = tmp_path / "audit.jsonl"
    args = [*workspace.serve_args(0, audit, policy), "--shutdown-grace", "2s"]
    proc, ready = start_capgate(args, workspace.environ(), tmp_path)
    try:
        request = urllib.request.Request(ready["url"] + "/echo/echo/slow?delay=10")
        request.add_header("Authorization", f"Bearer {workspace.token('tester', ['tester'])}")
        seen: list[object] = []

        def call() -> None:
            try:
                with urllib.request.urlopen(request, timeout=20) as resp:  # noqa: S310
                    seen.append(resp.status)
            except urllib.error.HTTPError as err:
                seen.append(err.code)
            except (urllib.error.URLError, ConnectionError, OSError) as err:
                seen.append(type(err).__name__)

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.5)  # the call is waiting on the upstream
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        took = time.monotonic() - started
        caller.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    assert took < 2 + 1.5, took  # not twice the grace
    assert seen == [503]  # told, not left hanging
    lines = call_records(json.loads(x) for x in audit.read_text().splitlines())
    cut = [x for x in lines if x.get("path") == "/echo/echo/slow"]
    assert len(cut) == 1
    assert (cut[0]["reason"], cut[0]["status"]) == ("gateway_stopping", 503)
    check = subprocess.run(
        [sys.executable, "-m", "gateway", "audit", "verify", str(audit)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert check.returncode == 0, check.stdout + check.stderr


# --- findings guarded by tests that live beside the code they exercise -----------------------

GUARDED_ELSEWHERE = {
    "CG-2026-19 connections: a header trickled every 10 s kept a connection 150 s": (
        "tests/test_listener.py::test_a_trickled_head_is_closed_at_the_head_timeout"
    ),
    "CG-2026-19 connections: 20,000 slow connections exhausted file descriptors": (
        "tests/test_fairness.py::test_a_connection_flood_meets_the_cap_and_leaves_open_connections_served"
    ),
    "CG-2026-19 connections: 83 MB of tracebacks in 25 s": (
        "tests/test_listener.py::test_a_flood_of_bad_requests_is_one_summary_not_a_traceback_each"
    ),
    "CG-2026-19 connections: the cap below the process's file limit": (
        "tests/test_listener.py::test_the_cap_stays_below_the_descriptor_limit"
    ),
    "CG-2026-20 starvation: 64 slow calls filled an upstream's pool": (
        "tests/test_fairness.py::test_one_agents_64_slow_calls_leave_room_for_another_agent"
    ),
    "CG-2026-20 starvation: one agent's held approvals refused everyone's": (
        "tests/test_fairness.py::test_one_agents_full_approval_share_does_not_refuse_another"
    ),
    "CG-2026-21 deadline: an upstream sending 1 byte a second held a call 20 s": (
        "tests/test_faults.py::test_a_trickled_stream_is_cut_at_the_deadline"
    ),
    "CG-2026-21 deadline: an agent trickling its body": (
        "tests/test_listener.py::test_a_trickled_body_is_refused_at_its_deadline"
    ),
    "CG-2026-22 an agent hanging up was audited upstream_unavailable": (
        "tests/test_gateway.py::test_an_agent_hanging_up_is_client_closed_not_an_upstream_error"
    ),
    "CG-2026-23 record mode slowed down as runs accumulated": (
        "tests/test_advisories.py::test_recording_cost_per_call_does_not_grow_with_runs"
    ),
    "CG-2026-33 a malformed traceparent is ignored, never an error or a parent": (
        "tests/test_telemetry.py::test_a_malformed_traceparent_is_ignored"
    ),
    "CG-2026-33 our traceparent parser accepts what the SDK's propagator accepts": (
        "tests/test_telemetry.py::test_traceparent_parsing_agrees_with_the_sdk_propagator"
    ),
    "CG-2026-34 the agent's tracestate passes only where a rule names it": (
        "tests/test_telemetry.py::test_tracestate_passes_only_when_a_rule_names_it"
    ),
    "CG-2026-35 metric labels stay in the policy's closed set": (
        "tests/test_telemetry.py::test_metric_labels_stay_in_the_policys_closed_set"
    ),
}


@pytest.mark.parametrize("finding", sorted(GUARDED_ELSEWHERE))
def test_every_finding_guarded_elsewhere_still_has_its_test(finding: str) -> None:
    """The index above names the regression test of each finding whose test lives beside the
    code it exercises; a renamed or deleted guard fails here instead of vanishing quietly."""
    import ast

    from tests.conftest import ROOT

    path, name = GUARDED_ELSEWHERE[finding].split("::")
    tree = ast.parse((ROOT / path).read_text())
    tests = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }
    assert name in tests, f"{finding}: {path}::{name} is gone"


# --- the audit trail under faults (CG-2026-24 .. CG-2026-30) ---------------------------------


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Any:
    """A 256 KiB tmpfs, mounted for the test (root only; skipped elsewhere)."""
    import subprocess

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],  # noqa: S607
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)  # noqa: S607


def _fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` until it refuses a write (a real ENOSPC)."""
    import errno
    import os

    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        while True:  # the last partly used page too
            try:
                os.write(fd, b"\0")
            except OSError:
                break
    finally:
        os.close(fd)
    return filler


async def test_a_full_disk_refuses_calls_and_the_chain_verifies_after(
    serve_gateway: Any,
    workspace: Workspace,
    mocks: Mocks,
    policy_file: Path,
    tiny_fs: Path,
    tmp_path: Path,
) -> None:
    """CG-2026-24: with the audit on a full file system, 654 allowed calls reached the
    upstream, the agent got a plain-text 500, no line was written, health stayed ``ok``, and
    ``audit verify`` failed for good afterwards (the chain advanced before the failed write).
    Now the call is refused (503 ``audit_unavailable``, nothing forwarded), health says
    ``degraded``, a failed write is cut back, and once the disk has room calls pass again and
    the whole trail verifies, with a ``repair`` line saying what could not be written."""
    from gateway.audit_sign import load_verify_keys
    from gateway.audit_verify import verify_trail

    audit = tiny_fs / "audit.jsonl"
    settings = load_settings(
        {
            "policy": str(policy_file),
            "jwks": str(workspace.jwks),
            "upstream_key": str(workspace.upstream_key),
            "secrets_dir": str(workspace.secrets_dir),
            "audit": str(audit),
            "audit_key": str(tmp_path / "audit.key"),
        },
        {},
    )
    mocks.clear()
    gw = build_gateway(settings, workspace.environ())
    client = await serve_gateway(gw)
    auth = {"Authorization": f"Bearer {workspace.token('tester', ['tester'])}"}
    assert (await client.get("/echo/echo/before", headers=auth)).status == 200
    filler = _fill(tiny_fs)
    refused = []
    for n in range(40):
        resp = await client.get(f"/echo/echo/full-{n}", headers=auth)
        if resp.status != 200:
            assert resp.status == 503
            assert resp.headers["Content-Type"] == PROBLEM
            assert (await resp.json())["reason"] == "audit_unavailable"
            refused.append(f"/echo/full-{n}")
    assert len(refused) >= 30  # a line may still fit in the last page; then none does
    seen = {r["path"] for r in mocks.requests("echo")}
    assert not seen & set(refused), "a call was forwarded without its audit line"
    health = await client.get("/_capgate/health")
    body = await health.json()
    assert health.status == 503 and body["status"] == "degraded"
    assert body["audit"]["ok"] is False and body["audit"]["error"]
    filler.unlink()
    assert (await client.get("/echo/echo/after", headers=auth)).status == 200
    assert (await (await client.get("/_capgate/health")).json())["status"] == "ok"
    await client.close()
    gw.audit.close()
    keys = load_verify_keys(audit.with_name("audit.jsonl.jwks.json"))
    report = verify_trail([audit], keys)
    assert report.ok, report.problem
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    [repair] = [x for x in lines if x["type"] == "repair"]
    assert repair["what"] == "write_failed" and repair["unwritten_lines"] >= 30


def test_kill_9_under_load_loses_no_line_of_an_answered_or_forwarded_call(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    """CG-2026-25: ``kill -9`` lost the last second of lines (a 64 KiB user-space buffer):
    68-148 answered calls per crash, 45-96 of which had reached the upstream. Now every line
    is one unbuffered write, and an allowed call's decision line is written before it is
    forwarded: after ``kill -9`` under load, every answered call and every call the upstream
    received has its line, and the chain verifies (the tail open, as after any crash)."""
    import signal
    import subprocess
    import sys
    import threading
    import time
    import urllib.error
    import urllib.request

    from gateway.audit_trail import call_records
    from tests.conftest import ROOT
    from tests.e2e.test_serve import start_capgate

    audit = tmp_path / "audit.jsonl"
    mocks.clear()
    proc, ready = start_capgate(
        workspace.serve_args(0, audit, policy_file), workspace.environ(), tmp_path
    )
    tok = workspace.token("tester", ["tester"])
    answered: list[str] = []
    stop = threading.Event()

    def agent(k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            req = urllib.request.Request(
                f"{ready['url']}/echo/echo/k{k}-{n}", headers={"Authorization": f"Bearer {tok}"}
            )
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310 (loopback)
                    resp.read()
                    answered.append(resp.headers["X-Request-Id"])
            except (urllib.error.URLError, OSError, ValueError):
                return

    threads = [threading.Thread(target=agent, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    raw = audit.read_text().splitlines()
    calls = call_records(json.loads(x) for x in raw)
    ids = {c["request_id"] for c in calls}
    assert len(answered) > 20
    missing = [rid for rid in answered if rid not in ids]
    assert not missing, f"{len(missing)} answered calls have no line"
    upstream_paths = {r["path"] for r in mocks.requests("echo") if r["path"].startswith("/echo/k")}
    audited_paths = {c["path"].removeprefix("/echo") for c in calls}
    assert upstream_paths <= audited_paths
    check = subprocess.run(
        [sys.executable, "-m", "gateway", "audit", "verify", str(audit), "--open-tail"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # Without --open-tail a crashed trail is not passed as whole.
    check = subprocess.run(
        [sys.executable, "-m", "gateway", "audit", "verify", str(audit)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert check.returncode == 1 and "does not end with a shutdown checkpoint" in check.stdout


def test_a_torn_last_line_is_cut_back_on_reopen_and_recorded(tmp_path: Path) -> None:
    """CG-2026-26: a torn last line (a crash mid-write) was not repaired on restart: the next
    line was glued onto it. Now it is cut back on reopen, and a ``repair`` line records how
    many bytes were cut and their digest; the chain verifies across the restart."""
    import hashlib

    from gateway.audit_sign import CheckpointSigner, load_verify_keys
    from gateway.audit_trail import AuditTrail
    from gateway.audit_verify import verify_trail

    path = tmp_path / "audit.jsonl"
    signer = CheckpointSigner.load_or_create(tmp_path / "k.pem")
    signer.publish(tmp_path / "jwks.json")
    trail = AuditTrail(path, signer=signer)
    trail.open()
    trail.append({"v": 2, "type": "decision", "request_id": "a"})
    trail.close()
    torn = b'{"v":2,"type":"decision","request_id":"b","agen'
    with path.open("ab") as fh:
        fh.write(torn)
    again = AuditTrail(path, signer=signer)
    again.open()
    again.append({"v": 2, "type": "decision", "request_id": "c"})
    again.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    [repair] = [x for x in lines if x["type"] == "repair"]
    assert repair["what"] == "torn_line_cut" and repair["cut_bytes"] == len(torn)
    assert repair["cut_sha256"] == hashlib.sha256(torn).hexdigest()
    assert [x.get("request_id") for x in lines if x["type"] == "decision"] == ["a", "c"]
    assert verify_trail([path], load_verify_keys(tmp_path / "jwks.json")).ok


def test_a_cut_tail_or_a_recomputed_chain_no_longer_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CG-2026-27: ``head -n -5 audit.jsonl``, and a copy with one agent's lines removed and
    the chain recomputed, both verified as "ok, hash chain intact". Now the cut trail lacks
    its shutdown checkpoint, and the recomputed one breaks the first signed checkpoint after
    the first removed line; ``capgate audit verify`` names the record and exits 1.
    (``tests/test_audit_verify.py`` has each kind of tampering.)"""
    import hashlib

    from gateway.audit_sign import CheckpointSigner
    from gateway.audit_trail import GENESIS, AuditTrail, TrailOptions
    from gateway.cli import main

    path = tmp_path / "audit.jsonl"
    signer = CheckpointSigner.load_or_create(tmp_path / "audit.jsonl.signing.pem")
    signer.publish(tmp_path / "audit.jsonl.jwks.json")
    trail = AuditTrail(path, TrailOptions(checkpoint_lines=5), signer=signer)
    trail.open()
    for i in range(20):
        trail.append({"v": 2, "type": "decision", "agent": f"agent-{i % 3}", "n": i})
    trail.close()
    lines = path.read_bytes().splitlines()
    assert main(["audit", "verify", str(path)]) == 0
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(x + b"\n" for x in lines[:-5]))
    jwks = str(tmp_path / "audit.jsonl.jwks.json")
    capsys.readouterr()
    assert main(["audit", "verify", str(cut), "--jwks", jwks]) == 1
    assert f"{cut}:{len(lines) - 4}: the trail does not end" in capsys.readouterr().out
    prev, forged = GENESIS, []
    for raw in lines:
        if b'"agent":"agent-1"' in raw:
            continue
        head, _, rest = raw.partition(b'"prev":"')
        fixed = head + b'"prev":"' + prev.encode() + rest[64:]
        forged.append(fixed)
        prev = hashlib.sha256(fixed).hexdigest()
    rewritten = tmp_path / "rewritten.jsonl"
    rewritten.write_bytes(b"".join(x + b"\n" for x in forged))
    assert main(["audit", "verify", str(rewritten), "--jwks", jwks]) == 1
    assert "checkpoint signature does not verify" in capsys.readouterr().out


async def test_parser_refusals_and_unauthenticated_calls_are_summarised(
    example: Any, workspace: Workspace
) -> None:
    """CG-2026-28: requests refused by the HTTP parser got no line at all (and one line per
    unauthenticated call would let a flood without a token fill the disk, and so turn the
    fail-closed rule against every agent). Now both are counted by reason and source into
    one ``summary`` line per interval."""
    import asyncio

    for _ in range(30):
        assert (await example.get("/metrics/metrics/cpu?window=5m")).status == 401
    host, port = example.server.host, example.server.port
    for _ in range(5):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            b"GET /x HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
        )
        await writer.drain()
        await reader.read()
        writer.close()
    audit, _ = _written(example)
    lines = [json.loads(x) for x in audit.splitlines()]
    assert not [x for x in lines if x["type"] == "decision"]
    [summary] = [x for x in lines if x["type"] == "summary"]
    counts = {(c["reason"], c["source"]): c["n"] for c in summary["counts"]}
    assert counts == {("token_missing", "127.0.0.1"): 30, ("http_invalid", "127.0.0.1"): 5}


def test_a_moved_or_deleted_audit_file_is_reopened_and_the_chain_continues(
    tmp_path: Path,
) -> None:
    """CG-2026-29: a deleted or rotated audit file was never reopened: the gateway went on
    writing into the moved (or deleted) file. Now the background tick sees that the path
    names another file, closes the old one with a ``rotate`` checkpoint and continues the
    chain in a new file whose first line is a signed ``start`` checkpoint; a mirror on
    another volume holds every line in one unbroken chain."""
    from gateway.audit_sign import CheckpointSigner, load_verify_keys
    from gateway.audit_trail import AuditTrail, TrailOptions
    from gateway.audit_verify import verify_trail

    path = tmp_path / "audit.jsonl"
    mirror = tmp_path / "other-volume" / "audit.jsonl"
    signer = CheckpointSigner.load_or_create(tmp_path / "k.pem")
    signer.publish(tmp_path / "jwks.json")
    keys = load_verify_keys(tmp_path / "jwks.json")
    trail = AuditTrail(path, TrailOptions(mirror=mirror), signer=signer)
    trail.open()
    trail.append({"v": 2, "type": "decision", "request_id": "1"})
    moved = tmp_path / "audit.jsonl.1"
    path.rename(moved)  # logrotate's way
    trail.tick()
    trail.append({"v": 2, "type": "decision", "request_id": "2"})
    path.unlink()  # and deleted outright
    trail.tick()
    trail.append({"v": 2, "type": "decision", "request_id": "3"})
    trail.close()
    assert path.exists() and trail.error is None
    assert verify_trail([path], keys).ok  # continues from a file not given
    assert verify_trail([moved], keys, open_tail=True).ok
    whole = verify_trail([mirror], keys)
    assert whole.ok and whole.notes == [
        "no anchor given: a trail cut back to an earlier shutdown checkpoint cannot be told "
        "from a whole one (pass --anchor)"
    ]
    ids = [json.loads(x).get("request_id") for x in mirror.read_text().splitlines()]
    assert [i for i in ids if i] == ["1", "2", "3"]


def test_an_unwritable_audit_path_at_start_is_one_line_and_exit_2(
    workspace: Workspace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CG-2026-30: an unwritable audit path at start printed a 42-line traceback and exited
    1 (the README promises one line and exit 2)."""
    from gateway.cli import main

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    for audit, key in (
        (blocker / "audit.jsonl", tmp_path / "audit.key"),  # the trail itself
        (blocker / "audit.jsonl", None),  # its key beside it
    ):
        args = [*workspace.serve_args(0, audit)]
        if key is not None:
            args += ["--audit-key", str(key)]
        assert main(["serve", *args], workspace.environ()) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("capgate: error: ") and "not-a-directory" in err


# --- issue 12: OpenTelemetry -------------------------------------------------------------------

AGENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
AGENT_TRACEPARENT = f"00-{AGENT_TRACE}-b7ad6b7169203331-01"


def test_traces_given_a_url_never_makes_a_directory_named_http(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CG-2026-31 (issue 12): ``--traces http://collector:4318`` created a directory ``http:`` and
    wrote spans into a file under it. An http(s) URL is now the OTLP/HTTP endpoint; any other
    URL-looking value is one readable line and exit 2, before anything is created."""
    from gateway.cli import main
    from gateway.telemetry import plan

    monkeypatch.chdir(tmp_path)
    for bad in ("http:", "http://", "grpc://collector:4317", "collector:4318"):
        code = main(["serve", "--policy", "p.yaml", "--jwks", "j.json", "--traces", bad], {})
        out, err = capsys.readouterr()
        assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
        assert "http(s):// OTLP endpoint" in err
    assert list(tmp_path.iterdir()) == []
    flags = {"policy": "p", "jwks": "j", "traces": "http://collector:4318"}
    chosen = plan(load_settings(flags, {}))
    assert (chosen.spans, chosen.spans_file) == ("otlp", None)
    assert chosen.spans_endpoint == "http://collector:4318/v1/traces"


async def test_there_is_otlp_export_and_there_are_metrics(
    serve_gateway: Any, workspace: Workspace, mocks: Mocks, tmp_path: Path
) -> None:
    """CG-2026-32 (issue 12): no OTLP export and no metrics. The standard variables now send spans
    and metrics over OTLP/HTTP (checked at a real receiver that decodes the protobuf)."""
    from aiohttp.test_utils import TestServer

    from mocks import otlp_receiver

    app = otlp_receiver.create_app()
    receiver = TestServer(app, host="127.0.0.1")
    await receiver.start_server()
    try:
        settings = load_settings(
            {
                "policy": str(workspace.policy),
                "jwks": str(workspace.jwks),
                "upstream_key": str(workspace.upstream_key),
                "secrets_dir": str(workspace.secrets_dir),
                "audit": str(tmp_path / "audit.jsonl"),
            },
            {"OTEL_EXPORTER_OTLP_ENDPOINT": str(receiver.make_url("/"))},
        )
        gw = build_gateway(settings, workspace.environ())
        client = await serve_gateway(gw)
        tok = workspace.token("sre-bot", ["sre-diagnostics"])
        resp = await client.get("/metrics/metrics/cpu?window=5m", headers=_bearer(tok))
        assert resp.status == 200
        await asyncio.get_running_loop().run_in_executor(None, gw.telemetry.flush)
        got = app[otlp_receiver.RECEIVED]
        assert any(s["attributes"].get("capgate.rule") == "read-cpu" for s in got.spans)
        assert "capgate.calls" in {m["name"] for m in got.metrics}
        # Before the receiver goes (its last export has somewhere to go), off the loop (the
        # receiver answering that export runs on it).
        await asyncio.get_running_loop().run_in_executor(None, gw.telemetry.close)
    finally:
        await receiver.close()


def _bearer(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


async def test_the_agents_traceparent_is_a_link_never_the_parent(
    serve_gateway: Any, example: Any, workspace: Workspace, mocks: Mocks
) -> None:
    """CG-2026-33 (issue 12): an incoming ``traceparent`` was ignored. Taking it as the parent
    would let an agent place its calls in any trace it names; it is kept as a span link instead
    (ids only), and the trace that goes upstream is the gateway's."""
    tok = workspace.token("sre-bot", ["sre-diagnostics"])
    headers = {**_bearer(tok), "traceparent": AGENT_TRACEPARENT, "tracestate": "evil=1"}
    assert (await example.get("/metrics/metrics/cpu?window=5m", headers=headers)).status == 200
    _, spans = _written(example)
    [server] = [s for s in map(json.loads, spans.splitlines()) if s["kind"] == "SpanKind.SERVER"]
    assert server["parent_id"] is None
    assert server["context"]["trace_id"] != "0x" + AGENT_TRACE
    [link] = server["links"]
    assert link["context"]["trace_id"] == "0x" + AGENT_TRACE
    assert "evil" not in spans.decode()
    [seen] = mocks.requests("metrics")
    sent = {k.lower(): v for k, v in seen["headers"].items()}
    assert AGENT_TRACE not in sent["traceparent"] and "tracestate" not in sent


async def test_trace_context_goes_upstream_and_recordings_treat_it_as_volatile(
    serve_gateway: Any, workspace: Workspace, mocks: Mocks, tmp_path: Path
) -> None:
    """CG-2026-34 (issue 12): no trace context went upstream. It now does (W3C ``traceparent`` of
    the gateway's upstream span), and recordings never store it: a recording made with tracing
    on holds no trace ids, and a replay with another traceparent still finds the call."""
    from gateway.transports.record import RecordTransport
    from gateway.transports.replay import ReplayTransport
    from mocks.demo import rewrite_policy_urls
    from tests.conftest import TEST_POLICY

    policy = tmp_path / "policy.yaml"
    policy.write_text(rewrite_policy_urls(TEST_POLICY.read_text(), mocks.urls))
    flags = {
        "policy": str(policy),
        "jwks": str(workspace.jwks),
        "upstream_key": str(workspace.upstream_key),
        "secrets_dir": str(workspace.secrets_dir),
        "audit": "-",
        "traces": "discard",
    }
    mocks.clear()
    gw = build_gateway(load_settings(flags, {}), workspace.environ())
    recorder = RecordTransport(gw.transport, tmp_path / "rec")
    gw = gw.with_transport(recorder, recorder)
    client = await serve_gateway(gw)
    tok = workspace.token("tester", ["tester"], run="run-1")
    headers = {**_bearer(tok), "traceparent": AGENT_TRACEPARENT}
    assert (await client.get("/echo/echo/hello", headers=headers)).status == 200
    [seen] = mocks.requests("echo")
    sent = {k.lower(): v for k, v in seen["headers"].items()}
    ours = sent["traceparent"].split("-")[1]
    assert len(ours) == 32 and ours != AGENT_TRACE
    await gw.transport.close()
    from gateway.recording.reader import load_recording

    recording = load_recording(tmp_path / "rec")
    entries = list(recording.entries())
    assert entries
    for entry in entries:
        names = {name.lower() for name, _ in entry.request_headers}
        assert not names & {"traceparent", "tracestate"}, names
        assert all(ours not in str(value) for _, value in entry.request_headers)
    dead = tmp_path / "dead.yaml"
    dead.write_text(
        rewrite_policy_urls(TEST_POLICY.read_text(), {n: "http://127.0.0.1:9" for n in mocks.urls})
    )
    replay = ReplayTransport(tmp_path / "rec")
    flags = {**flags, "policy": str(dead)}
    rgw = build_gateway(load_settings(flags, {}), workspace.environ()).with_transport(
        replay, replay
    )
    rclient = await serve_gateway(rgw)
    headers["traceparent"] = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    assert (await rclient.get("/echo/echo/hello", headers=headers)).status == 200


async def test_an_agent_cannot_blow_up_metric_cardinality(
    serve_gateway: Any, workspace: Workspace, mocks: Mocks, tmp_path: Path
) -> None:
    """CG-2026-35 (issue 12): metric label values must come from closed sets. An agent sending
    calls to hundreds of invented upstreams, paths, methods and agent ids adds no series:
    unknown upstreams and rules are counted as ``(other)``; agents, paths and methods are no
    labels."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from gateway.telemetry import Telemetry

    reader = InMemoryMetricReader()
    telemetry = Telemetry(None, metric_readers=[reader])
    flags = {
        "policy": str(workspace.policy),
        "jwks": str(workspace.jwks),
        "upstream_key": str(workspace.upstream_key),
        "secrets_dir": str(workspace.secrets_dir),
        "audit": "-",
    }
    gw = build_gateway(load_settings(flags, {}), workspace.environ())
    observers = (*gw.observers, telemetry)
    client = await serve_gateway(dataclasses.replace(gw, telemetry=telemetry, observers=observers))
    for i in range(150):
        tok = workspace.token(f"agent-{i}", ["sre-diagnostics"]) if i % 3 == 0 else f"junk{i}"
        await client.request(
            ("GET", "PURGE", "X-" + str(i))[i % 3], f"/u{i}/{i}?q{i}=1", headers=_bearer(tok)
        )
    data = reader.get_metrics_data()
    assert data is not None
    series = {
        (m.name, tuple(sorted(p.attributes.items())))
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
    }
    assert len(series) <= 12, sorted(series)
    values = {v for _, attrs in series for _, v in attrs}
    assert not any(v.startswith(("u", "/u", "agent-", "junk", "X-")) for v in values), values


# --- MCP approvals: one call, many waiters (CG-2026-36) -------------------------------------


async def test_one_agent_cannot_hold_connections_past_its_share_by_repeating_a_held_call(
    serve_gateway: Any,
    settings: Any,
    workspace: Workspace,
    policy_file: Path,
    tmp_path: Path,
    mocks: Mocks,
) -> None:
    """CG-2026-36 (issue 13): a held MCP ``tools/call`` sent again attaches to its pending
    approval without taking a slot of the agent's share of held calls (``approvals_per_agent``),
    so one agent sending the same call N times at once held N connections (each kept alive by
    progress notifications), up to the listener's cap, and other agents' calls were refused.
    Each call waiting for a decision now takes a slot of its agent's share, attached or not:
    past it the call is refused (``concurrency_limited``) at once."""
    from tests.test_approvals import ADMIN_TOKEN
    from tests.test_mcp_approvals import sse_messages, tool_calls_received
    from tests.test_mcp_keepalive import kept_policy

    admin_token = tmp_path / "admin.token"
    admin_token.write_text(ADMIN_TOKEN + "\n")
    admin_token.chmod(0o600)
    s = dataclasses.replace(
        settings,
        policy=kept_policy(policy_file, "approval_patience: 30s, approval_keepalive: 200ms"),
        admin_port=0,
        admin_token_file=admin_token,
        approvals_per_agent=2,
    )
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    tok = workspace.token("mcp-bot", ["mcp-agent"])
    headers = {
        "Authorization": f"Bearer {tok}",
        "Accept": "application/json, text/event-stream",
    }

    async def call(n: int) -> tuple[int, bytes]:
        message = {
            "jsonrpc": "2.0",
            "id": n,
            "method": "tools/call",
            "params": {
                "name": "get_order",
                "arguments": {"order_id": 1},
                "_meta": {"progressToken": n},
            },
        }
        resp = await client.post("/tools/mcp", headers=headers, json=message)
        return resp.status, await resp.read()

    calls = [asyncio.ensure_future(call(n)) for n in range(6)]
    await asyncio.sleep(1.0)
    answered = [c.result() for c in calls if c.done()]
    # Two wait (the share), on one approval; the other four are refused at once.
    assert len(answered) == 4, answered
    for status, body in answered:
        assert status == 200
        [answer] = sse_messages(body) if body.startswith(b"event:") else [json.loads(body)]
        assert answer["error"]["data"]["reason"] == "concurrency_limited", answer
    assert len(await gw.approvals.pending()) == 1
    [approval] = await gw.approvals.pending()
    assert await gw.approvals.decide(approval["id"], False, "alice") == "decided"
    for status, body in await asyncio.gather(*calls):
        assert status == 200
        *_, answer = sse_messages(body) if body.startswith(b"event:") else [json.loads(body)]
        assert answer["error"]["data"]["reason"] in ("concurrency_limited", "approval_denied")
    assert tool_calls_received(mocks) == []


# --- audit keys that change while the gateway runs (CG-2026-37) -----------------------------


def test_a_later_audit_signing_key_cannot_re_sign_lines_written_before_it(
    workspace: Workspace, mocks: Mocks, policy_file: Path, tmp_path: Path
) -> None:
    """CG-2026-37 (issue 15): ``audit verify`` accepted a checkpoint signed by any key of the
    audit JWKS, wherever it stood in the trail. With rotation with overlap (the JWKS keeps
    the old key beside the new), whoever held the new key (it lives beside the trail, in the
    sandbox) could edit lines written under the old key and re-sign the checkpoints after
    them with the new one: the trail verified, even against a JWKS copy kept outside. Now
    the change is recorded where it happens (a ``key`` line, vouched for by a checkpoint of
    the key before, written when capgate reads the new key file while it serves), and a
    checkpoint signed by another key than the one in force fails, at its line."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import threading
    import time
    import urllib.error
    import urllib.request

    from cryptography.hazmat.primitives.asymmetric import ed25519

    from gateway.audit_sign import CheckpointSigner
    from tests.conftest import ROOT
    from tests.e2e.test_serve import start_capgate
    from tests.test_audit_keys import put_signing_key, resign

    audit = tmp_path / "audit.jsonl"
    args = [*workspace.serve_args(0, audit, policy_file), "--audit-checkpoint-lines", "5"]
    proc, ready = start_capgate(args, workspace.environ(), tmp_path)
    tok = workspace.token("tester", ["tester"])
    stop = threading.Event()
    answered: list[int] = []

    def agent(k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            req = urllib.request.Request(
                f"{ready['url']}/echo/echo/k{k}-{n}", headers={"Authorization": f"Bearer {tok}"}
            )
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310 (loopback)
                    answered.append(resp.status)
            except (urllib.error.URLError, OSError, ValueError):
                return
            time.sleep(0.01)

    threads = [threading.Thread(target=agent, args=(k,)) for k in range(3)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        new_key = ed25519.Ed25519PrivateKey.generate()
        new_kid = put_signing_key(audit.with_name(audit.name + ".signing.pem"), new_key)
        deadline = time.monotonic() + 15
        while b'"type":"key"' not in audit.read_bytes():  # read at the next tick (1 s)
            assert time.monotonic() < deadline, "the new signing key was never read"
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert len(answered) > 10 and set(answered) == {200}
    trusted = tmp_path / "trusted.jwks.json"  # the operator's copy, both keys in it
    shutil.copy(audit.with_name(audit.name + ".jwks.json"), trusted)

    def verify() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway",
                "audit",
                "verify",
                str(audit),
                "--jwks",
                str(trusted),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
        )

    check = verify()
    assert check.returncode == 0, check.stdout + check.stderr
    assert new_kid in check.stdout
    raw = audit.read_bytes().splitlines()
    change = next(i for i, x in enumerate(raw) if b'"type":"key"' in x)
    edit = next(i for i in range(change) if b'"type":"decision"' in raw[i])
    raw[edit] = raw[edit].replace(b'"agent":"tester"', b'"agent":"a"', 1)  # edit, then hide
    forged = resign(raw, start=edit, signer=CheckpointSigner(new_key), edit=edit)
    audit.write_bytes(b"\n".join(forged) + b"\n")
    first = next(i for i in range(edit, len(forged)) if b'"type":"checkpoint"' in forged[i])
    check = verify()
    assert check.returncode == 1, check.stdout
    assert check.stdout.startswith(f"{audit}:{first + 1}: checkpoint signed by kid {new_kid}")
    assert "re-signed with another key" in check.stdout


# --- shares: one agent's waiting calls and everyone else's releases (CG-2026-38) -----------


async def test_one_agents_waiting_calls_do_not_slow_every_release() -> None:
    """CG-2026-38 (issue 15): every slot given back (an upstream call ended, a held call was
    decided, a check worker finished) looked at every waiter of the resource, all agents'
    together. An agent at its share with 1,000 calls waiting for an upstream (each waits up
    to the upstream's connect timeout) made each release of every other agent's call cost
    ~155 us of the event loop instead of ~2 us. Waiters now queue per agent, and a release
    looks at the head of each waiting agent's queue."""
    import time

    from gateway.shares import Shares

    async def release_cost(flood: int) -> float:
        shares = Shares("calls in flight to upstream 'up'", capacity=64, per_agent=16)
        for _ in range(16):
            assert shares.try_acquire("flood")
        waiting = [asyncio.ensure_future(shares.acquire("flood", 30)) for _ in range(flood)]
        await asyncio.sleep(0)
        started = time.process_time()
        for _ in range(2000):
            assert shares.try_acquire("polite")
            shares.release("polite")
        cost = time.process_time() - started
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert shares.snapshot()["waiting"] == 0
        return cost

    few, many = await release_cost(10), await release_cost(1000)
    assert many < few * 5 + 0.05, (few, many)  # was ~50x


# --- the upstream request: what the upstream reads is what was checked (CG-2026-39) --------


async def test_a_header_value_that_was_not_utf8_is_refused_not_rewritten(
    serve_gateway: Any, workspace: Workspace, tmp_path: Path
) -> None:
    """CG-2026-39 (found while replacing the upstream client, issue 15): a header value with
    bytes that are not UTF-8 (``X-Role: ad\\xffmin``) was checked as the text the listener
    decoded (``ad\\udcffmin``: it passed a rule's pattern), and aiohttp's client then wrote the
    value without those bytes: the upstream read ``admin``, a value the policy never saw. Such a
    value is now refused (400 ``http_invalid``) and nothing reaches the upstream."""
    heads: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    gw = _gateway_for(
        f"http://127.0.0.1:{port}", tmp_path, workspace,
        "      - {id: g, upstream: up, allow: 'GET /items',"
        " headers: {X-Role: {regex: '(?!admin$).{1,16}'}}}\n",
    )  # fmt: skip
    client = await serve_gateway(gw)
    token = workspace.token("a1", ["r"])
    async with server:

        async def raw(value: bytes) -> bytes:
            reader, writer = await asyncio.open_connection(client.host, client.port)
            writer.write(
                b"GET /up/items HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
                + token.encode()
                + b"\r\nX-Role: "
                + value
                + b"\r\nConnection: close\r\n\r\n"
            )
            await writer.drain()
            data = await reader.read()
            writer.close()
            return data

        assert (await raw(b"reader")).startswith(b"HTTP/1.1 200")
        refused = await raw(b"ad\xffmin")
        assert refused.startswith(b"HTTP/1.1 400") and b"http_invalid" in refused, refused
        held = await raw(b"admin")  # the pattern itself still refuses the plain value
        assert held.startswith(b"HTTP/1.1 4") and b"http_invalid" not in held, held
    assert len(heads) == 1 and b"X-Role: reader\r\n" in heads[0]


# --- SQL: the join limit counts what SQLite will join (CG-2026-40) -----------------------------


@pytest.mark.parametrize(
    "sql",
    [
        # a ',' after a join's condition adds an item: the count stopped at ON
        "SELECT o.id FROM orders o JOIN orders b ON 1, orders c, orders d, orders e LIMIT 5",
        # SQLite takes `window` as an alias: the count stopped at it
        "SELECT o.id FROM orders o window, orders b, orders c, orders d, orders e LIMIT 5",
        # Python upper-cases `ſelect` to SELECT; SQLite reads a name: the count stopped at it
        "SELECT o.id FROM orders o, orders ſelect, orders c, orders d, orders e LIMIT 5",
    ],
)
def test_the_sqlite_join_limit_counts_every_join_sqlite_makes(sql: str) -> None:
    """CG-2026-40 (found by a helper session rewriting the SQLite outline, issue 10): the
    SQLite check counts joins on the tokens (SQLite's authorizer does not report them), and a
    FROM list's count stopped at ON, at an alias SQLite allows to be called `window`, and at
    a name Python upper-cases to a keyword: a 5-way join passed the default limit of 3 joins
    with the example policy. The words that stop the count are now those SQLite reserves (a
    test asks SQLite), compared as ASCII, and a hypothesis test holds the count at least
    SQLite's own query plan's."""
    from gateway.errors import SqlTooComplex
    from gateway.policy.load import load_policy

    policy = load_policy("policies/example.yaml")
    (check,) = [c for c in policy.rules_by_id["query-orders"].checks if c.kind == "sql"]
    with pytest.raises(SqlTooComplex):
        check.policy.check(sql)  # type: ignore[attr-defined]
