"""The exception tree: one class per reason, statuses by family, the problem+json body."""

from __future__ import annotations

import json

import pytest

from gateway import errors as E
from gateway.errors import (
    ERROR_CLASSES,
    PROBLEM_CONTENT_TYPE,
    PROBLEM_TYPE_BASE,
    GatewayError,
    InternalError,
    Reason,
)

STATUS = {
    Reason.TOKEN_MISSING: 401,
    Reason.TOKEN_INVALID: 401,
    Reason.TOKEN_EXPIRED: 401,
    Reason.TOKEN_REVOKED: 401,
    Reason.NO_RULE: 403,
    Reason.AGENT_UNKNOWN: 403,
    Reason.ROLE_NOT_GRANTED: 403,
    Reason.SQL_DENIED: 403,
    Reason.SQL_TOO_COMPLEX: 403,
    Reason.TOOL_DENIED: 403,
    Reason.MCP_DENIED: 403,
    Reason.MCP_SESSION_UNKNOWN: 404,
    Reason.APPROVAL_DENIED: 403,
    Reason.TARGET_AMBIGUOUS: 400,
    Reason.HTTP_INVALID: 400,
    Reason.QUERY_INVALID: 400,
    Reason.BODY_INVALID: 400,
    Reason.UNSUPPORTED_MEDIA_TYPE: 415,
    Reason.PAYLOAD_TOO_LARGE: 413,
    Reason.RATE_LIMITED: 429,
    Reason.QUOTA_EXHAUSTED: 429,
    Reason.CONCURRENCY_LIMITED: 429,
    Reason.REQUEST_TIMEOUT: 408,
    Reason.GATEWAY_STOPPING: 503,
    Reason.APPROVAL_TIMEOUT: 408,
    Reason.APPROVAL_STALE: 409,
    Reason.APPROVAL_PENDING: 202,
    Reason.RUN_TAINTED: 403,
    Reason.UPSTREAM_UNAVAILABLE: 502,
    Reason.UPSTREAM_TIMEOUT: 504,
    Reason.STATE_UNAVAILABLE: 503,
    Reason.AGENT_PAUSED: 503,
    Reason.AUDIT_UNAVAILABLE: 503,
    Reason.INTERNAL_ERROR: 500,
    Reason.CLIENT_CLOSED: 499,
}
FAMILY = {
    401: E.TokenError,
    403: E.PolicyDenied,
    404: E.PolicyDenied,
    400: E.BadRequest,
    415: E.BadRequest,
    413: E.PayloadTooLarge,
    429: E.Throttled,
    408: (E.ApprovalTimeout, E.RequestTimeout),
    409: E.ApprovalStale,
    202: E.ApprovalPending,
    502: E.UpstreamError,
    504: E.UpstreamError,
    503: (E.StateUnavailable, E.GatewayStopping, E.AgentPaused, E.AuditUnavailable),
    500: E.InternalError,
    499: E.ClientClosed,
}


def test_framing_refusals_close_the_connection() -> None:
    assert E.FramingAmbiguous.close_connection and not E.TargetAmbiguous.close_connection


def test_every_reason_has_a_class_with_that_reason() -> None:
    assert set(ERROR_CLASSES) == set(Reason)
    for reason, cls in ERROR_CLASSES.items():
        assert issubclass(cls, GatewayError)
        assert cls.reason is reason
        assert cls("x").reason is reason
        assert cls.title and cls.__doc__ and cls.__doc__.startswith("Raised ")


def test_reason_values_are_the_public_codes() -> None:
    # A public contract: these strings are matched by agents and dashboards.
    assert {r.value for r in Reason} == {
        "token_missing",
        "token_invalid",
        "token_expired",
        "token_revoked",
        "target_ambiguous",
        "http_invalid",
        "no_rule",
        "agent_unknown",
        "role_not_granted",
        "query_invalid",
        "body_invalid",
        "unsupported_media_type",
        "sql_denied",
        "sql_too_complex",
        "tool_denied",
        "mcp_denied",
        "mcp_session_unknown",
        "approval_denied",
        "approval_timeout",
        "approval_stale",
        "approval_pending",
        "run_tainted",
        "rate_limited",
        "quota_exhausted",
        "concurrency_limited",
        "attempts_limited",
        "request_timeout",
        "gateway_stopping",
        "upstream_unavailable",
        "upstream_timeout",
        "replay_miss",
        "payload_too_large",
        "state_unavailable",
        "agent_paused",
        "audit_unavailable",
        "internal_error",
        "client_closed",
    }
    for r in Reason:
        assert r == r.value and str(r) == r.value


@pytest.mark.parametrize("reason", list(STATUS), ids=[r.value for r in STATUS])
def test_status_per_family(reason: Reason) -> None:
    cls = ERROR_CLASSES[reason]
    assert cls.status == STATUS[reason]
    assert issubclass(cls, FAMILY[cls.status])


def test_replay_miss_has_a_status_of_its_own() -> None:
    status = E.ReplayMiss.status
    assert status not in {s for r, s in STATUS.items()}
    assert status not in (200, 404, 500, 502, 503, 504)
    assert 400 <= status < 500


def test_statuses_cover_design_families() -> None:
    assert E.TokenError.status == 401 and E.PolicyDenied.status == 403
    assert E.BadRequest.status == 400 and E.PayloadTooLarge.status == 413
    assert E.Throttled.status == 429 and E.UpstreamError.status == 502
    assert E.UpstreamTimeout.status == 504 and E.StateUnavailable.status == 503
    assert E.InternalError.status == 500


def test_builtin_bases_so_callers_can_catch_them() -> None:
    assert issubclass(E.UpstreamTimeout, TimeoutError)
    assert issubclass(E.UpstreamUnavailable, ConnectionError)
    assert issubclass(E.UpstreamTimeout, E.UpstreamError)
    assert not issubclass(E.ConfigError, GatewayError)


def test_problem_body_has_the_required_members() -> None:
    err = E.NoRule("no rule allows GET /x")
    body = err.problem("req-1")
    assert body == {
        "type": PROBLEM_TYPE_BASE + "no_rule",
        "title": "Denied by policy",
        "status": 403,
        "detail": "no rule allows GET /x",
        "reason": "no_rule",
        "request_id": "req-1",
    }
    assert "rule" not in body and "errors" not in body


def test_problem_body_with_rule_and_errors() -> None:
    err = E.QueryInvalid("bad window", rule="read-cpu", errors=[{"param": "window"}])
    body = err.problem("req-2")
    assert body["rule"] == "read-cpu"
    assert body["errors"] == [{"param": "window"}]
    assert body["status"] == 400 and body["reason"] == "query_invalid"
    assert body["type"] == "https://capgate.dev/problems/query_invalid"


def test_empty_errors_list_is_left_out() -> None:
    assert "errors" not in E.BodyInvalid("x", errors=[]).problem("r")


@pytest.mark.parametrize("reason", list(Reason), ids=[r.value for r in Reason])
def test_problem_bytes_is_compact_json_of_the_body(reason: Reason) -> None:
    err = ERROR_CLASSES[reason]("some detail", rule="r-1")
    raw = err.problem_bytes("req-9")
    assert json.loads(raw) == err.problem("req-9")
    assert b", " not in raw and b": " not in raw
    assert json.loads(raw)["status"] == err.status
    assert json.loads(raw)["reason"] == reason.value


def test_problem_content_type() -> None:
    assert PROBLEM_CONTENT_TYPE == "application/problem+json"


def test_headers_are_kept_for_the_response() -> None:
    err = E.RateLimited("slow down", headers={"Retry-After": "7"})
    assert err.headers == {"Retry-After": "7"}
    assert E.NoRule("x").headers == {}


def test_internal_error_wrap_never_shows_the_wrapped_message() -> None:
    secret = "Bearer sk-live-123 and upstream body <html>"
    cause = RuntimeError(secret)
    err = InternalError.wrap(cause)
    assert isinstance(err, InternalError)
    assert err.__cause__ is cause
    assert secret not in err.detail and "sk-live" not in str(err)
    body = err.problem_bytes("req-3").decode()
    assert "sk-live" not in body and "RuntimeError" not in body
    assert json.loads(body)["reason"] == "internal_error"
    assert json.loads(body)["status"] == 500


def test_internal_error_wrap_of_a_gateway_error_is_still_internal() -> None:
    err = InternalError.wrap(E.TokenInvalid("the token tok.en.here is bad"))
    assert err.reason is Reason.INTERNAL_ERROR and "tok.en.here" not in err.detail


def test_detail_and_str_agree() -> None:
    err = E.TokenExpired("the capability token has expired")
    assert str(err) == err.detail == "the capability token has expired"
    assert err.rule is None and err.errors is None
