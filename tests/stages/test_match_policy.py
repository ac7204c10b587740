"""match_policy: every operation of a call is matched to the rule that allows it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.call import Call
from gateway.errors import McpDenied, NoRule, QueryInvalid, StateUnavailable, ToolDenied
from gateway.policy.model import Policy
from gateway.protocols import PROTOCOLS
from gateway.protocols.mcp import McpRequest
from gateway.testing import make_call, matching, run_stages


def rpc(msg_id: int | None, method: str, **params: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if msg_id is not None:
        msg["id"] = msg_id
    if params:
        msg["params"] = params
    return msg


def tool(msg_id: int, name: str, **arguments: Any) -> dict[str, Any]:
    return rpc(msg_id, "tools/call", name=name, arguments=arguments)


async def matched(policy: Policy, call: Call) -> Call:
    return await run_stages(call, *matching(policy))


def mcp_call(roles: list[str], payload: Any) -> Call:
    return make_call("POST", "/tools/mcp", body=json.dumps(payload).encode(), roles=roles)


async def test_plain_request_is_one_operation(policy: Policy) -> None:
    call = await matched(policy, make_call("GET", "/svc/status?verbose=1", roles=["ops"]))
    [op] = call.operations
    assert (op.kind, op.method, op.tool) == ("request", "GET", None)
    assert call.match is not None and call.match.rule.id == "status"
    assert call.protocol is PROTOCOLS["http"] and call.upstream is not None


async def test_unknown_upstream_and_no_rule(policy: Policy) -> None:
    with pytest.raises(NoRule, match="no upstream named 'nope'"):
        await matched(policy, make_call("GET", "/nope/x", roles=["ops"]))
    with pytest.raises(NoRule):
        await matched(policy, make_call("DELETE", "/svc/status", roles=["ops"]))
    with pytest.raises(QueryInvalid):
        await matched(policy, make_call("GET", "/svc/status?verbose=2", roles=["ops"]))


async def test_each_message_of_a_batch_is_matched_to_its_own_rule(policy: Policy) -> None:
    call = await matched(
        policy,
        mcp_call(
            ["support"],
            [rpc(1, "ping"), tool(2, "get_order", order_id=1), tool(3, "run_sql", sql="x")],
        ),
    )
    assert [(op.kind, op.tool) for op in call.operations] == [
        ("protocol", None),
        ("tool", "get_order"),
        ("tool", "run_sql"),
    ]
    rules = [op.match.rule.id for op in call.operations if op.match is not None]
    assert rules[1:] == ["get-order", "run-sql"]
    # The call is attributed to its first governed operation, not to the ping.
    assert call.match is not None and call.match.rule.id == "get-order"
    assert isinstance(call.inspection, McpRequest) and call.inspection.batch


async def test_a_tool_no_rule_allows_refuses_the_batch(policy: Policy) -> None:
    with pytest.raises(ToolDenied, match="delete_order"):
        await matched(
            policy,
            mcp_call(["support"], [tool(1, "get_order", order_id=1), tool(2, "delete_order")]),
        )


async def test_methods_the_policy_does_not_name_are_refused(policy: Policy) -> None:
    with pytest.raises(McpDenied, match="the resource 'file:///x'"):
        await matched(policy, mcp_call(["support"], rpc(1, "resources/read", uri="file:///x")))


async def test_session_get_is_a_protocol_operation(policy: Policy) -> None:
    call = await matched(policy, make_call("GET", "/tools/mcp", roles=["support"]))
    [op] = call.operations
    assert (op.kind, op.method) == ("protocol", "POST")


async def test_state_error_is_raised_unless_every_rule_allows_it(policy: Policy) -> None:
    call = make_call("GET", "/svc/status", roles=["ops"])
    call.state_error = StateUnavailable("store down")
    with pytest.raises(StateUnavailable):
        await matched(policy, call)
