"""validate: each governed operation's payload goes through its rule's checks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.call import Call
from gateway.errors import BodyInvalid, SqlDenied, ToolDenied
from gateway.payload import BodyPayload, ToolCallPayload
from gateway.policy.model import Policy
from gateway.stages.validate import Validate
from gateway.testing import make_call, matching, run_stages
from tests.stages.test_match_policy import rpc, tool


async def validated(policy: Policy, call: Call) -> Call:
    await run_stages(call, *matching(policy), Validate())
    return call


def post(target: str, payload: Any, roles: list[str], **headers: str) -> Call:
    return make_call(
        "POST", target, body=json.dumps(payload).encode(), roles=roles, headers=headers
    )


async def test_body_schema(policy: Policy) -> None:
    ok = await validated(
        policy, post("/svc/restart", {"service": "web"}, ["ops"], **{"X-Env": "prod"})
    )
    [op] = ok.operations
    assert isinstance(op.payload, BodyPayload) and not op.payload.rewritten
    with pytest.raises(BodyInvalid) as info:
        await validated(
            policy, post("/svc/restart", {"service": "db"}, ["ops"], **{"X-Env": "prod"})
        )
    assert info.value.rule == "restart" and info.value.errors


async def test_sql_rewrite_is_what_will_be_forwarded(policy: Policy) -> None:
    call = await validated(policy, post("/db/query", {"sql": "SELECT id FROM orders"}, ["analyst"]))
    assert json.loads(call.body or b"") == {"sql": "SELECT id FROM orders LIMIT 10"}
    assert call.findings.sql_kinds == {"select"} and call.findings.sql_tables == {"orders"}
    with pytest.raises(SqlDenied):
        await validated(policy, post("/db/query", {"sql": "DELETE FROM orders"}, ["analyst"]))


async def test_every_message_of_a_batch_is_checked_under_its_own_rule(policy: Policy) -> None:
    # The second message breaks get_order's argument schema; the first alone would pass.
    with pytest.raises(ToolDenied, match="order_id"):
        await validated(
            policy,
            post(
                "/tools/mcp",
                [tool(1, "get_order", order_id=1), tool(2, "get_order", order_id="x")],
                ["support"],
            ),
        )
    # run_sql's SQL is checked even behind an allowed get_order.
    with pytest.raises(SqlDenied):
        await validated(
            policy,
            post(
                "/tools/mcp",
                [tool(1, "get_order", order_id=1), tool(2, "run_sql", sql="UPDATE orders SET x=1")],
                ["support"],
            ),
        )


async def test_rewritten_tool_arguments_are_folded_into_the_forwarded_batch(
    policy: Policy,
) -> None:
    sent = [
        rpc(1, "ping"),
        tool(2, "run_sql", sql="SELECT id FROM orders"),
        tool(3, "get_order", order_id=4),
    ]
    call = await validated(policy, post("/tools/mcp", sent, ["support"]))
    forwarded = json.loads(call.body or b"")
    assert forwarded[0] == sent[0] and forwarded[2] == sent[2]
    assert forwarded[1]["params"]["arguments"] == {"sql": "SELECT id FROM orders LIMIT 5"}
    assert isinstance(call.operations[1].payload, ToolCallPayload)


async def test_a_tools_call_without_arguments_is_forwarded_with_empty_ones(
    policy: Policy,
) -> None:
    call = await validated(
        policy, post("/tools/mcp", rpc(1, "tools/call", name="refund"), ["support"])
    )
    # Checked as {} (what a server reads for absent arguments); forwarded as sent.
    assert call.operations[0].payload is not None
    assert json.loads(call.body or b"") == rpc(1, "tools/call", name="refund")
