"""inject: an allow-list of headers, the protocol's own, and the credential, added last."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.call import Call
from gateway.credentials import CredentialStore
from gateway.policy.model import Policy
from gateway.protocols import PROTOCOLS
from gateway.protocols.mcp import Mcp
from gateway.stages.inject import Inject
from gateway.testing import make_call, matching, run_stages


async def injected(policy: Policy, call: Call) -> Call:
    store = CredentialStore(environ={"SVC_TOKEN": "svc-secret-0123456789"}, base_dir=Path("."))
    await run_stages(call, *matching(policy), Inject(store))
    return call


async def test_only_allowed_headers_and_the_credential_go_upstream(policy: Policy) -> None:
    call = make_call(
        "POST",
        "/svc/restart",
        body=b'{"service":"web"}',
        roles=["ops"],
        headers=[
            ("X-Env", "prod"),
            ("Authorization", "Bearer agent-token"),
            ("Cookie", "c=1"),
            ("X-Forwarded-For", "1.2.3.4"),
            ("X-Unlisted", "1"),
            ("Mcp-Session-Id", "s1"),
            ("Accept", "application/json"),
        ],
    )
    out = (await injected(policy, call)).outbound_headers
    assert out is not None
    assert out["Authorization"] == "Bearer svc-secret-0123456789"
    assert out["X-Env"] == "prod" and out["Accept"] == "application/json"
    for name in ("Cookie", "X-Forwarded-For", "X-Unlisted", "Mcp-Session-Id"):
        assert name not in out  # MCP headers go to MCP upstreams only
    assert out["X-Request-Id"] == call.request_id


async def test_mcp_upstreams_get_the_session_headers(policy: Policy) -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode()
    mcp = PROTOCOLS["mcp"]
    assert isinstance(mcp, Mcp)
    mcp.bind_session("s1", "test-agent")  # as the server's answer to initialize would
    call = make_call(
        "POST",
        "/tools/mcp",
        body=body,
        roles=["support"],
        headers=[
            ("Mcp-Session-Id", "s1"),
            ("Mcp-Protocol-Version", "x"),
            ("Mcp-Param-Region", "eu"),
        ],
    )
    out = (await injected(policy, call)).outbound_headers
    assert out is not None and out["Mcp-Session-Id"] == "s1" and out["Mcp-Protocol-Version"] == "x"
    assert "Mcp-Param-Region" not in out  # not compared with the body: not forwarded
