"""route: the upstream the target names, and the protocol it speaks, from the policy in force.

Nothing is read from the body and nothing is refused here, so an unauthenticated caller
learns nothing about the policy: an unknown upstream is refused by ``match_policy``, after
the token. Knowing the protocol this early lets a refused token be answered in the shape
the agent's client expects (a JSON-RPC error for MCP).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gateway.call import Call, CallProtocol
from gateway.policy.model import Policy


class PolicySource(Protocol):
    """Where the policy in force is read (a reload swaps it whole)."""

    @property
    def policy(self) -> Policy: ...


class Route:
    def __init__(self, source: PolicySource, protocols: Mapping[str, CallProtocol]) -> None:
        self.source = source
        self.protocols = protocols

    def __call__(self, call: Call) -> None:
        assert call.target is not None
        policy = self.source.policy  # one policy for the whole call, even across a reload
        call.policy = policy
        upstream = policy.upstreams.get(call.target.upstream)
        if upstream is not None:
            call.upstream = upstream
            call.protocol = self.protocols.get(upstream.kind)
