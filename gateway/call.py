"""``Call``: the record of one agent request that the stages read and annotate in order."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.errors import GatewayError, PayloadTooLarge

if TYPE_CHECKING:
    from aiohttp import web

    from gateway.audit_record import BodyDigest
    from gateway.credentials import Injection
    from gateway.policy.model import Match, Policy, Upstream
    from gateway.target import Target
    from gateway.tokens import Claims
    from gateway.transports.base import UpstreamResponse


@dataclass(eq=False)
class Call:
    """Everything known about one call; each stage fills in its part."""

    method: str
    raw_target: str
    headers: CIMultiDictProxy[str] | CIMultiDict[str]
    request_id: str
    request: web.BaseRequest | None = None  # None when built by tests or `policy explain`
    started: float = field(default_factory=time.monotonic)
    wall_started: float = field(default_factory=time.time)
    body: bytes | None = None  # set once read (payload checks need it whole)

    # filled in by the stages, in order
    target: Target | None = None
    claims: Claims | None = None
    policy: Policy | None = None  # the policy in force when the call arrived
    upstream: Upstream | None = None
    match: Match | None = None
    tool: str | None = None  # MCP tool name, when the call is a tools/call
    facts: dict[str, Any] = field(default_factory=dict)  # what checks found (sql kinds, ...)
    outbound_headers: CIMultiDict[str] | None = None
    injection: Injection | None = None
    response: UpstreamResponse | None = None
    status: int | None = None  # the status sent to the agent
    response_bytes: int = 0
    error: GatewayError | None = None
    revoked: GatewayError | None = None  # set when a revocation cancels the call in flight
    state_error: GatewayError | None = None  # the state store could not answer (fail closed)
    streaming: bool = False  # the response's head was sent to the agent
    approval: str | None = None  # the approval that let the call go on
    state_error_allowed: bool = False  # the rule let the call on while state was unreachable
    request_digest: BodyDigest | None = None  # a streamed body's size and keyed digest
    response_digest: BodyDigest | None = None  # the response body's size and keyed digest

    @property
    def rule_id(self) -> str | None:
        if self.match is not None:
            return self.match.rule.id
        return self.error.rule if self.error is not None else None

    async def read_body(self, limit: int) -> bytes:
        """The whole request body, refusing more than ``limit`` bytes (read at most once)."""
        if self.body is not None:
            if len(self.body) > limit:
                raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
            return self.body
        if self.request is None:
            self.body = b""
            return self.body
        declared = self.request.content_length
        if declared is not None and declared > limit:
            raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in self.request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
            chunks.append(chunk)
        self.body = b"".join(chunks)
        return self.body
