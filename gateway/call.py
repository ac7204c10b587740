"""``Call``: the typed record of one agent request, filled in by the stages in order.

Every slot has one writer (the stage named beside it) and a type. Nothing here is written to
the audit as it is: the audit stage builds a closed ``AuditRecord`` from a few of these
slots (ids, names, decisions, digests), so a slot holding a body, SQL text or tool arguments
can never leak through it.

An ``Operation`` is one thing the call asks the upstream to do, matched to one rule: a plain
HTTP request is one operation; an MCP POST is one per JSON-RPC message. Every operation is
matched, checked, limited and counted on its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import HttpVersion11
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.errors import GatewayError, PayloadTooLarge, RequestTimeout
from gateway.payload import Findings

if TYPE_CHECKING:
    from aiohttp import web

    from gateway.audit_record import AuditRecord, BodyDigest
    from gateway.credentials import Injection
    from gateway.held_stream import HeldStream
    from gateway.payload import Payload
    from gateway.policy.model import Match, Policy, Subject, Upstream
    from gateway.target import Target
    from gateway.tokens import Claims
    from gateway.transport import UpstreamResponse


BODY_READ_TIMEOUT = 30.0
"""Seconds an agent has to send a whole request body, however it trickles."""


@dataclass(slots=True)
class Operation:
    """One thing a call asks for: matched to one rule, then checked and counted under it.

    ``kind`` is "request" (a whole HTTP request), or for an MCP message what it acts on:
    "tool", "prompt", "resource", "method" (a JSON-RPC method a rule names), or "protocol"
    (the handshake, a listing, ping, a notification, a completion)."""

    kind: str
    method: str  # the HTTP method rules are matched with
    subject: Subject | None = None  # what a rule must name to allow it (MCP)
    rpc: str | None = None  # the JSON-RPC method (MCP), for the audit
    payload: Payload | None = None  # what the rule's checks read; None: the call's body
    match: Match | None = None  # set by match_policy

    @property
    def tool(self) -> str | None:
        subject = self.subject
        return subject[1] if subject is not None and subject[0] == "tool" else None

    @property
    def governed(self) -> bool:
        """Whether the matched rule's checks, limits and quotas apply to this operation.

        A protocol message is allowed by a rule (any on the endpoint, or the one naming
        what it refers to) but does nothing under it: it is not checked or counted."""
        return self.kind != "protocol"


@dataclass(eq=False, slots=True)
class Call:
    """Everything known about one call; each stage fills in its part."""

    method: str
    raw_target: str
    headers: CIMultiDictProxy[str] | CIMultiDict[str]
    request_id: str
    request: web.BaseRequest | None = None  # None when built by tests or `policy explain`
    started: float = field(default_factory=time.monotonic)
    wall_started: float = field(default_factory=time.time)
    body: bytes | None = None  # the body as read (and, once checked, as it will be forwarded)

    # filled in by the stages, in order
    target: Target | None = None  # receive
    claims: Claims | None = None  # authenticate
    state_error: GatewayError | None = None  # authenticate: the store could not vouch
    policy: Policy | None = None  # match_policy: the policy in force when the call arrived
    upstream: Upstream | None = None  # match_policy
    protocol: CallProtocol | None = None  # match_policy: chosen by the upstream's kind
    inspection: object | None = None  # match_policy: the protocol's own parse of the request
    operations: list[Operation] = field(default_factory=list)  # match_policy
    match: Match | None = None  # match_policy: the rule the call is attributed to
    findings: Findings = field(default_factory=Findings)  # validate
    content_type: str | None = None  # validate / protocol: Content-Type of the checked body
    state_error_allowed: bool = False  # match_policy / throttle: on_state_error: allow
    approval: str | None = None  # approve: the approval that let the call go on
    operator: str | None = (
        None  # the operator whose action decided it (approved, declined, stopped)
    )
    taint: str | None = None  # taint_gate: why this sensitive call of a tainted run is held
    # taint_mark: what to record this untrusted call's answer as, before the agent gets it
    taint_read: str | None = None
    outbound_headers: CIMultiDict[str] | None = None  # inject
    injection: Injection | None = None  # inject
    audit_decided: bool = False  # audit: the decision line was written before forwarding
    # audit: the decision's records (HTTP calls), completed at the end instead of rebuilt
    decided_records: list[AuditRecord] | None = None
    request_digest: BodyDigest | None = None  # audit: the forwarded body's keyed digest
    audit_key: str | None = None  # audit: the audit key of the decision line (its digests)
    dispatched: bool = False  # dispatch: the call was handed to the transport
    deadline: float | None = None  # dispatch: loop time by which the upstream exchange ends
    response: UpstreamResponse | None = None  # dispatch
    status: int | None = None  # respond: the status sent to the agent
    response_bytes: int = 0  # respond
    response_digest: BodyDigest | None = None  # respond
    fault: str | None = None  # dispatch: a fault injected by --faults (chaos.py), described
    streaming: bool = False  # respond: the response's head was sent to the agent
    body_invited: bool = False  # read_body / dispatch: "100 Continue" considered
    error: GatewayError | None = None  # any stage: why the call was refused or cut
    revoked: GatewayError | None = None  # why the gateway cancelled the call in flight
    held: bool = False  # approve: the call waited for a person's decision
    # approve: the event stream a held MCP call is kept alive and answered on (held_stream.py)
    held_stream: HeldStream | None = None
    upstream_started: float = 0.0  # dispatch: monotonic time the exchange began
    upstream_ended: float = 0.0  # dispatch: ... and its answer's head arrived (or it failed)
    # telemetry (only when tracing): the call's trace (ids, start), stage end times
    span: Any = None
    marks: list[float] | None = None

    @property
    def rule_id(self) -> str | None:
        if self.match is not None:
            return self.match.rule.id
        return self.error.rule if self.error is not None else None

    @property
    def tools(self) -> list[str]:
        """The MCP tools the call asks to run, in order."""
        return [op.tool for op in self.operations if op.tool is not None]

    async def invite_body(self) -> None:
        """Answer ``Expect: 100-continue`` when the body is first needed, so a client that
        waits for it sends its body only for a call that has passed the checks before."""
        request = self.request
        if request is None or self.body_invited:
            return
        self.body_invited = True
        if (
            request.version == HttpVersion11
            and request.headers.get("Expect", "").lower() == "100-continue"
        ):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the interim answer is not the response's size

    async def read_body(self, limit: int) -> bytes:
        """The whole request body, refusing more than ``limit`` bytes (read at most once)."""
        if self.body is not None:
            if len(self.body) > limit:
                raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
            return self.body
        if self.request is None:
            self.body = b""
            return self.body
        await self.invite_body()
        declared = self.request.content_length
        if declared is not None and declared > limit:
            raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
        content = self.request.content
        if content.is_eof():
            # The whole body is here already (a small body comes with the head): no timer,
            # no wait. A stream that failed raises its error, as reading it would.
            body = content.read_nowait(-1)
            if len(body) > limit:
                raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
            self.body = body
            return body
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(BODY_READ_TIMEOUT):
                async for chunk in content.iter_any():
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {BODY_READ_TIMEOUT:g} s"
            ) from None
        self.body = b"".join(chunks)
        return self.body


class DecisionLog(Protocol):
    """Told of an allowed call before it is forwarded (the audit trail): its decision line
    is written first, or the call is refused (``AuditUnavailable``)."""

    def call_decided(self, call: Call, records: Sequence[AuditRecord]) -> Awaitable[None] | None:
        """Write the decision; an awaitable when the call must wait for it to be durable."""


class CallObserver(Protocol):
    """Told of every call once it has ended (answered or refused): the audit trail, the
    trace exporter, the recorder of denials, the live event stream."""

    def call_ended(self, call: Call, records: Sequence[AuditRecord]) -> None:
        """Told once per call, with one record per operation (one for most calls; one per
        JSON-RPC message for MCP). A failure is logged by the pipeline."""


Rewriter = Callable[[AsyncIterator[bytes], int], AsyncIterator[bytes]]
"""Rewrites a response body, chunk by chunk, holding at most the given number of bytes."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refusal in a protocol's own shape; ``respond`` turns it into the HTTP answer."""

    status: int
    content_type: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


class CallProtocol(Protocol):
    """The hooks through which a protocol (``gateway/protocols/``) shapes a call.

    =====================  ===============  ==============================================
    hook                   called by        does
    =====================  ===============  ==============================================
    ``inspect``            match_policy     reads the request as far as needed and says
                                            what it asks for: one ``Operation`` per thing
                                            to match
    ``finish``             validate         folds payloads the checks rewrote into the
                                            bytes that will be forwarded
    ``forwarded_headers``  inject           extra request headers the protocol needs (lower
    ``..._prefixes``                        case names, and name prefixes)
    ``rewrite_response``   respond          rewrites an answer on its way back (or None)
    ``refusal``            respond          the shape of a refusal the agent's client
                                            expects (or None for problem+json)
    =====================  ===============  ==============================================
    """

    kind: str
    forwarded_headers: frozenset[str]
    forwarded_header_prefixes: tuple[str, ...]

    async def inspect(self, call: Call) -> list[Operation]:
        """What the call asks for; raise a ``GatewayError`` when it cannot be read."""

    def finish(self, call: Call) -> None:
        """After every check passed: make ``call.body`` say what the checked payloads say."""

    def rewrite_response(self, call: Call, response: UpstreamResponse) -> Rewriter | None:
        """How to rewrite the answer's body (its length changes), or None to pass it as is."""

    def refusal(self, call: Call, err: GatewayError) -> Refusal | None:
        """The refusal in this protocol's shape, or None for problem+json."""
