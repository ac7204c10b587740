"""match_policy: claims + target + what the call asks for, to the rules that allow it.

The upstream's protocol says what the call asks for (``inspect``): one operation for a plain
HTTP request, one per JSON-RPC message for MCP. Each operation must be allowed by a rule of
the token's roles; the call is attributed to the first operation that does something
(``governed``), or to its first operation.
"""

from __future__ import annotations

from gateway.call import Call
from gateway.errors import NoRule


class MatchPolicy:
    async def __call__(self, call: Call) -> None:
        assert call.target is not None and call.claims is not None
        policy = call.policy  # set by route: one policy for the whole call
        assert policy is not None
        upstream = call.upstream
        if upstream is None:
            raise NoRule(f"there is no upstream named {call.target.upstream!r}")
        protocol = call.protocol
        if protocol is None:  # the loader accepts only known kinds: a bug, so deny
            raise NoRule(f"upstream {upstream.name!r} has no protocol {upstream.kind!r}")
        call.operations = await protocol.inspect(call)
        claims = call.claims
        primary = None
        for op in call.operations:
            op.match = policy.match(
                claims.roles, claims.caps, call.target, op.method, call.headers, op.subject
            )
            if primary is None and op.governed:
                primary = op
        call.match = (primary or call.operations[0]).match
        if call.state_error is not None:
            if any(
                op.match is not None and op.match.rule.on_state_error != "allow"
                for op in call.operations
            ):
                raise call.state_error
            call.state_error_allowed = True
