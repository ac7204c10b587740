"""The one exception tree of capgate, and its rendering as RFC 9457 problem+json.

Every way a call can end other than success is a ``GatewayError``. A stage ends a call by
raising one; ``stages/respond.py`` renders it. Each class has a fixed HTTP ``status``, a
stable ``reason`` (a public contract: values are added, never renamed) and a ``title``;
instances carry a ``detail`` sentence, the ``rule`` id when one applies, and optional
structured ``errors`` (a list of dicts, e.g. the failing JSON pointer or SQL position).

    GatewayError
    ├── TokenError (401)            token_missing, token_invalid, token_expired, token_revoked
    ├── PolicyDenied (403)          no_rule, sql_denied, tool_denied, mcp_denied,
    │   │                           approval_denied
    │   └── McpSessionUnknown (404) mcp_session_unknown
    ├── BadRequest (400)            target_ambiguous, query_invalid, body_invalid
    │   └── UnsupportedMediaType (415) unsupported_media_type
    ├── PayloadTooLarge (413)       payload_too_large
    ├── Throttled (429)             rate_limited, quota_exhausted, concurrency_limited,
    │                               attempts_limited
    ├── ApprovalTimeout (408)       approval_timeout
    ├── ApprovalStale (409)         approval_stale
    ├── ApprovalPending (202)       approval_pending (held past the MCP client's patience)
    ├── UpstreamError (502)         upstream_unavailable
    │   └── UpstreamTimeout (504)   upstream_timeout (also a TimeoutError)
    ├── ReplayMiss (421)            replay_miss
    ├── StateUnavailable (503)      state_unavailable
    ├── AgentPaused (503)           agent_paused (Retry-After)
    ├── AuditUnavailable (503)      audit_unavailable
    ├── ClientClosed (499)          client_closed (the agent hung up; not an error)
    └── InternalError (500)         internal_error

Nothing in a problem body may contain a credential, a token or an upstream body: ``detail``
is written by us, never copied from a foreign exception.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any, ClassVar

PROBLEM_CONTENT_TYPE = "application/problem+json"
PROBLEM_TYPE_BASE = "https://capgate.dev/problems/"


class Reason(StrEnum):
    """Stable reason codes. Added, never renamed: agents and dashboards match on them."""

    TOKEN_MISSING = "token_missing"  # noqa: S105 (a reason code)
    TOKEN_INVALID = "token_invalid"  # noqa: S105 (a reason code)
    TOKEN_EXPIRED = "token_expired"  # noqa: S105 (a reason code)
    TOKEN_REVOKED = "token_revoked"  # noqa: S105 (a reason code)
    TARGET_AMBIGUOUS = "target_ambiguous"
    HTTP_INVALID = "http_invalid"
    NO_RULE = "no_rule"
    AGENT_UNKNOWN = "agent_unknown"
    ROLE_NOT_GRANTED = "role_not_granted"
    QUERY_INVALID = "query_invalid"
    BODY_INVALID = "body_invalid"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    SQL_DENIED = "sql_denied"
    SQL_TOO_COMPLEX = "sql_too_complex"
    TOOL_DENIED = "tool_denied"
    MCP_DENIED = "mcp_denied"
    MCP_SESSION_UNKNOWN = "mcp_session_unknown"
    APPROVAL_DENIED = "approval_denied"
    APPROVAL_TIMEOUT = "approval_timeout"
    APPROVAL_STALE = "approval_stale"
    APPROVAL_PENDING = "approval_pending"
    RUN_TAINTED = "run_tainted"
    RATE_LIMITED = "rate_limited"
    QUOTA_EXHAUSTED = "quota_exhausted"
    CONCURRENCY_LIMITED = "concurrency_limited"
    ATTEMPTS_LIMITED = "attempts_limited"
    REQUEST_TIMEOUT = "request_timeout"
    GATEWAY_STOPPING = "gateway_stopping"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    REPLAY_MISS = "replay_miss"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    STATE_UNAVAILABLE = "state_unavailable"
    AGENT_PAUSED = "agent_paused"
    AUDIT_UNAVAILABLE = "audit_unavailable"
    INTERNAL_ERROR = "internal_error"
    CLIENT_CLOSED = "client_closed"


class GatewayError(Exception):
    """Raised when a call is ended by the gateway instead of being answered by an upstream."""

    status: ClassVar[int] = 500
    reason: ClassVar[Reason] = Reason.INTERNAL_ERROR
    title: ClassVar[str] = "Gateway error"
    # The agent's connection is closed after the answer (its framing cannot be trusted).
    close_connection: ClassVar[bool] = False

    def __init__(
        self,
        detail: str,
        *,
        rule: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.rule = rule
        self.errors = errors
        self.headers = headers or {}

    def problem(self, request_id: str) -> dict[str, Any]:
        """The RFC 9457 body for this error."""
        body: dict[str, Any] = {
            "type": PROBLEM_TYPE_BASE + self.reason.value,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "reason": self.reason.value,
            "request_id": request_id,
        }
        if self.rule is not None:
            body["rule"] = self.rule
        if self.errors:
            body["errors"] = self.errors
        return body

    def problem_bytes(self, request_id: str) -> bytes:
        return json.dumps(self.problem(request_id), separators=(",", ":")).encode()


# --- 401: the token -------------------------------------------------------------------------


class TokenError(GatewayError):
    """Raised when the capability token cannot be accepted."""

    status = 401
    reason = Reason.TOKEN_INVALID
    title = "Capability token rejected"


class TokenMissing(TokenError):
    """Raised when a call carries no ``Authorization: Bearer`` token."""

    reason = Reason.TOKEN_MISSING
    title = "Capability token missing"


class TokenInvalid(TokenError):
    """Raised when a token is malformed, badly signed, or breaks a claim rule."""

    reason = Reason.TOKEN_INVALID


class TokenExpired(TokenError):
    """Raised when a token's ``exp`` is in the past (beyond the configured leeway)."""

    reason = Reason.TOKEN_EXPIRED
    title = "Capability token expired"


class TokenRevoked(TokenError):
    """Raised when the token, its agent or its run has been revoked."""

    reason = Reason.TOKEN_REVOKED
    title = "Capability token revoked"


# --- 403: the policy ------------------------------------------------------------------------


class PolicyDenied(GatewayError):
    """Raised when the policy does not allow the call."""

    status = 403
    reason = Reason.NO_RULE
    title = "Denied by policy"


class NoRule(PolicyDenied):
    """Raised when no rule of the token's roles (narrowed by ``caps``) matches the call."""

    reason = Reason.NO_RULE


class AgentUnknown(PolicyDenied):
    """Raised when the token names an agent the policy does not declare (a valid signature
    is not enough to call)."""

    reason = Reason.AGENT_UNKNOWN
    title = "Agent not declared"


class RoleNotGranted(PolicyDenied):
    """Raised when the token carries a role the policy does not let its agent hold."""

    reason = Reason.ROLE_NOT_GRANTED
    title = "Role not granted to this agent"


class SqlDenied(PolicyDenied):
    """Raised when SQL in the call cannot be parsed or breaks the rule's SQL policy."""

    reason = Reason.SQL_DENIED
    title = "SQL denied by policy"


class SqlTooComplex(SqlDenied):
    """Raised when SQL in the call is past the bounds on what one check may cost (length,
    tokens, nodes, joins, nesting) or the check ran past its wall-clock backstop."""

    reason = Reason.SQL_TOO_COMPLEX
    title = "SQL too complex to check"


class ToolDenied(PolicyDenied):
    """Raised when an MCP ``tools/call`` names a tool or arguments the rule does not allow."""

    reason = Reason.TOOL_DENIED
    title = "Tool call denied by policy"


class McpDenied(PolicyDenied):
    """Raised when an MCP message other than a tool call (a method, prompt, resource, or an
    answer to the server) is not allowed by the policy, or breaks the protocol's rules."""

    reason = Reason.MCP_DENIED
    title = "MCP message denied by policy"


class McpSessionUnknown(McpDenied):
    """Raised when an MCP request names a session this gateway did not see opened (a client
    must then start a new session: RFC-wise a 404, as MCP servers answer)."""

    status = 404
    reason = Reason.MCP_SESSION_UNKNOWN
    title = "MCP session unknown"


class ApprovalDenied(PolicyDenied):
    """Raised when a person declined a call that the rule held for approval."""

    reason = Reason.APPROVAL_DENIED
    title = "Approval denied"
    operator: str | None = None  # who declined it (for the audit line, never the agent)


class RunTainted(PolicyDenied):
    """Raised for a sensitive call (``when_tainted: deny``) of a run that has read untrusted
    content: the detail names what tainted it and when."""

    reason = Reason.RUN_TAINTED
    title = "Run tainted by untrusted content"


# --- 400: malformed input -------------------------------------------------------------------


class BadRequest(GatewayError):
    """Raised when the call itself is malformed."""

    status = 400
    reason = Reason.BODY_INVALID
    title = "Bad request"


class TargetAmbiguous(BadRequest):
    """Raised when the request target is not in its one canonical form (never normalised)."""

    reason = Reason.TARGET_AMBIGUOUS
    title = "Ambiguous request target"


class FramingAmbiguous(TargetAmbiguous):
    """Raised when a request's framing could be read two ways (HTTP/1.0 with
    ``Transfer-Encoding``, RFC 9112 6.1): answered, then the connection is closed."""

    title = "Ambiguous request framing"
    close_connection = True


class HttpInvalid(BadRequest):
    """Raised (answered by the listener) when the request is not valid HTTP/1.1: the HTTP
    parser refused its request line, a header or its framing. The connection is closed."""

    reason = Reason.HTTP_INVALID
    title = "Invalid HTTP request"
    close_connection = True


class QueryInvalid(BadRequest):
    """Raised when a query parameter is unknown, repeated, missing or out of its constraint."""

    reason = Reason.QUERY_INVALID
    title = "Query not allowed"


class BodyInvalid(BadRequest):
    """Raised when a body is not valid JSON or fails the rule's JSON Schema."""

    reason = Reason.BODY_INVALID
    title = "Body not allowed"


class UnsupportedMediaType(BadRequest):
    """Raised when a body the gateway checks is sent in a character set or content coding
    the upstream could read differently (anything but UTF-8, identity)."""

    status = 415
    reason = Reason.UNSUPPORTED_MEDIA_TYPE
    title = "Unsupported media type"


# --- other statuses -------------------------------------------------------------------------


class PayloadTooLarge(GatewayError):
    """Raised when a request or response body exceeds its configured size limit."""

    status = 413
    reason = Reason.PAYLOAD_TOO_LARGE
    title = "Payload too large"


class Throttled(GatewayError):
    """Raised when a rate limit or quota refuses the call; carries ``Retry-After``."""

    status = 429
    reason = Reason.RATE_LIMITED
    title = "Rate limited"


class RateLimited(Throttled):
    """Raised when the rule's or role's rate for this agent is used up for now."""

    reason = Reason.RATE_LIMITED


class AttemptsLimited(Throttled):
    """Raised when the agent's attempts at a rule (allowed or not, counted before the payload
    is checked) are used up for now."""

    reason = Reason.ATTEMPTS_LIMITED
    title = "Too many attempts"


class QuotaExhausted(Throttled):
    """Raised when the run's quota of calls (in total or for the rule) is spent."""

    reason = Reason.QUOTA_EXHAUSTED
    title = "Quota exhausted"


class ConcurrencyLimited(Throttled):
    """Raised when the agent already holds its share of a shared resource (connections to an
    upstream, calls held for approval, workers for checks), or every slot is taken."""

    reason = Reason.CONCURRENCY_LIMITED
    title = "Too many calls in flight"

    def __init__(self, detail: str, **kw: Any) -> None:
        kw.setdefault("headers", {"Retry-After": "1"})
        super().__init__(detail, **kw)


class RequestTimeout(GatewayError):
    """Raised when the agent does not send its whole request (its body) in time."""

    status = 408
    reason = Reason.REQUEST_TIMEOUT
    title = "Request not received in time"
    close_connection = True


class GatewayStopping(GatewayError):
    """Raised (and audited) for a call still in flight when the gateway's shutdown grace
    ended: it was cut, whatever the upstream did."""

    status = 503
    reason = Reason.GATEWAY_STOPPING
    title = "Gateway stopping"
    close_connection = True


class ApprovalTimeout(GatewayError):
    """Raised when nobody decided on a held call before the approval deadline."""

    status = 408
    reason = Reason.APPROVAL_TIMEOUT
    title = "Approval timed out"


class ApprovalStale(GatewayError):
    """Raised when a held call was approved under a policy that is no longer in force: the
    approval was for the call as that policy judged it, so it is not forwarded."""

    status = 409
    reason = Reason.APPROVAL_STALE
    title = "Approval given under another policy"


class ApprovalPending(GatewayError):
    """Raised when a held MCP ``tools/call`` is still undecided at the upstream's
    ``approval_patience``: the call was not forwarded, its approval stays pending, and the
    same call sent again (same arguments) attaches to it."""

    status = 202
    reason = Reason.APPROVAL_PENDING
    title = "Awaiting approval"

    def __init__(self, detail: str, *, approval: str = "", **kw: Any) -> None:
        super().__init__(detail, **kw)
        self.approval = approval


class UpstreamError(GatewayError):
    """Raised when the upstream cannot be reached or answers in a way we cannot pass on."""

    status = 502
    reason = Reason.UPSTREAM_UNAVAILABLE
    title = "Upstream unavailable"


class UpstreamUnavailable(UpstreamError, ConnectionError):
    """Raised when the connection to the upstream fails or breaks."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """Raised when the upstream does not connect or answer within its timeouts."""

    status = 504
    reason = Reason.UPSTREAM_TIMEOUT
    title = "Upstream timed out"


class ReplayMiss(GatewayError):
    """Raised in replay mode when no recording matches the call (nothing is sent upstream)."""

    # A distinct status, so a replay miss is never mistaken for an upstream's own answer.
    status = 421
    reason = Reason.REPLAY_MISS
    title = "No recording matches this call"


class StateUnavailable(GatewayError):
    """Raised when the shared state store is needed but unreachable or too slow (fail closed)."""

    status = 503
    reason = Reason.STATE_UNAVAILABLE
    title = "State store unavailable"


class AgentPaused(GatewayError):
    """Raised when an operator paused the call's agent or run and the call was held past the
    pause hold, or the agent already has its share of calls held; carries ``Retry-After``."""

    status = 503
    reason = Reason.AGENT_PAUSED
    title = "Agent paused"


class AuditUnavailable(GatewayError):
    """Raised when the audit trail cannot be written (disk full, permission, file gone): an
    allowed call is not forwarded without its line (fail closed)."""

    status = 503
    reason = Reason.AUDIT_UNAVAILABLE
    title = "Audit trail unavailable"

    def __init__(self, detail: str, **kwargs: Any) -> None:
        super().__init__(detail, **kwargs)
        self.headers.setdefault("Retry-After", "1")


class ClientClosed(GatewayError):
    """Raised when the agent closes its connection before its call is answered (nothing
    more is sent; the status is nginx's 499, never seen by the agent)."""

    status = 499
    reason = Reason.CLIENT_CLOSED
    title = "The agent closed the connection"


class InternalError(GatewayError):
    """Raised when a bug or an unexpected condition ends the call; the call is denied."""

    status = 500
    reason = Reason.INTERNAL_ERROR
    title = "Internal error"

    @classmethod
    def wrap(cls, exc: BaseException) -> InternalError:
        # The foreign message is never shown: it may carry a secret or an upstream body.
        err = cls("the gateway failed while handling this call; it was not forwarded")
        err.__cause__ = exc
        return err


class ConfigError(Exception):
    """Raised when a setting has a value we cannot use; the message names the key and value."""


ERROR_CLASSES: dict[Reason, type[GatewayError]] = {
    Reason.TOKEN_MISSING: TokenMissing,
    Reason.TOKEN_INVALID: TokenInvalid,
    Reason.TOKEN_EXPIRED: TokenExpired,
    Reason.TOKEN_REVOKED: TokenRevoked,
    Reason.TARGET_AMBIGUOUS: TargetAmbiguous,
    Reason.HTTP_INVALID: HttpInvalid,
    Reason.NO_RULE: NoRule,
    Reason.AGENT_UNKNOWN: AgentUnknown,
    Reason.ROLE_NOT_GRANTED: RoleNotGranted,
    Reason.QUERY_INVALID: QueryInvalid,
    Reason.BODY_INVALID: BodyInvalid,
    Reason.UNSUPPORTED_MEDIA_TYPE: UnsupportedMediaType,
    Reason.SQL_DENIED: SqlDenied,
    Reason.SQL_TOO_COMPLEX: SqlTooComplex,
    Reason.TOOL_DENIED: ToolDenied,
    Reason.MCP_DENIED: McpDenied,
    Reason.MCP_SESSION_UNKNOWN: McpSessionUnknown,
    Reason.APPROVAL_DENIED: ApprovalDenied,
    Reason.APPROVAL_TIMEOUT: ApprovalTimeout,
    Reason.APPROVAL_STALE: ApprovalStale,
    Reason.APPROVAL_PENDING: ApprovalPending,
    Reason.RUN_TAINTED: RunTainted,
    Reason.RATE_LIMITED: RateLimited,
    Reason.QUOTA_EXHAUSTED: QuotaExhausted,
    Reason.CONCURRENCY_LIMITED: ConcurrencyLimited,
    Reason.ATTEMPTS_LIMITED: AttemptsLimited,
    Reason.REQUEST_TIMEOUT: RequestTimeout,
    Reason.GATEWAY_STOPPING: GatewayStopping,
    Reason.UPSTREAM_UNAVAILABLE: UpstreamUnavailable,
    Reason.UPSTREAM_TIMEOUT: UpstreamTimeout,
    Reason.REPLAY_MISS: ReplayMiss,
    Reason.PAYLOAD_TOO_LARGE: PayloadTooLarge,
    Reason.STATE_UNAVAILABLE: StateUnavailable,
    Reason.AGENT_PAUSED: AgentPaused,
    Reason.AUDIT_UNAVAILABLE: AuditUnavailable,
    Reason.INTERNAL_ERROR: InternalError,
    Reason.CLIENT_CLOSED: ClientClosed,
}
"""The class raised for each reason; ``test_errors.py`` checks every reason has one."""
