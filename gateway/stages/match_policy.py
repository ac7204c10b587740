"""match_policy: claims + target (+ MCP tool) to the one rule that allows the call."""

from __future__ import annotations

from typing import TYPE_CHECKING

MCP_SESSION_METHODS = ("GET", "DELETE")

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.call import Call


async def match_policy(call: Call, gw: Gateway) -> None:
    assert call.target is not None and call.claims is not None
    policy = gw.policy  # one policy for the whole call, even if a reload swaps it meanwhile
    call.policy = policy
    method = call.method
    upstream = policy.upstreams.get(call.target.upstream)
    if upstream is not None:
        call.upstream = upstream
        if upstream.kind == "mcp":
            # The rule for an MCP call depends on the tool named in its JSON-RPC body.
            await gw.mcp.inspect_request(call, upstream)
            if method in MCP_SESSION_METHODS:
                # Streamable HTTP: GET opens the server's event stream and DELETE ends the
                # session on an endpoint the roles may POST to; they carry no tool call.
                method = "POST"
    call.match = policy.match(
        call.claims.roles,
        call.claims.caps,
        call.target,
        method,
        call.headers,
        tool=call.tool,
    )
    if call.state_error is not None:
        if call.match.rule.on_state_error != "allow":
            raise call.state_error
        call.state_error_allowed = True
