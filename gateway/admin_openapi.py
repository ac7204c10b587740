"""The admin API's OpenAPI 3.1 document, served at ``GET /openapi.json``.

``tests/test_admin.py`` holds the server to it: every route is described, every answer the
tests receive validates against the schema given for its status.
"""

from __future__ import annotations

from typing import Any

from gateway import __version__
from gateway.approval_checks import CHECKS_PER_APPROVAL, MAX_VALUE

_STR_OR_NULL: dict[str, Any] = {"type": ["string", "null"]}

PROBLEM: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "reason", "detail"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "reason": {"type": "string"},
        "detail": {"type": "string"},
    },
}

CALL: dict[str, Any] = {
    "type": "object",
    "description": "An audit record of one ended call (see docs/audit.md), with its type and "
    "sequence number in the event stream. Never holds a body, query value, header value, SQL "
    "text or tool argument; path and names are agent-chosen text.",
    "required": ["type", "seq", "request_id", "agent", "method", "path", "decision", "reason"],
    "properties": {
        "type": {"const": "call"},
        "seq": {"type": "integer"},
        "time": {"type": "string"},
        "request_id": {"type": "string"},
        "agent": _STR_OR_NULL,
        "run": _STR_OR_NULL,
        "upstream": _STR_OR_NULL,
        "method": {"type": "string"},
        "path": {"type": "string"},
        "rule": _STR_OR_NULL,
        "decision": {"enum": ["allow", "deny"]},
        "reason": {"type": "string"},
        "status": {"type": ["integer", "null"]},
        "duration_ms": {"type": "number"},
        "approval": {"type": "string"},
        "operator": {"type": "string"},
    },
}

INFLIGHT: dict[str, Any] = {
    "type": "object",
    "required": ["request_id", "agent", "run", "method", "path", "rule", "seconds", "state"],
    "properties": {
        "request_id": {"type": "string"},
        "agent": _STR_OR_NULL,
        "run": _STR_OR_NULL,
        "upstream": _STR_OR_NULL,
        "method": {"type": "string"},
        "path": {"type": "string"},
        "rule": _STR_OR_NULL,
        "seconds": {"type": "number"},
        "state": {"enum": ["held for approval", "forwarded"]},
    },
}

PENDING: dict[str, Any] = {
    "type": "object",
    "description": "A held call, as it will be forwarded: the target and body with "
    "secret-looking values masked, the body's SHA-256 (of the unmasked bytes), the policy "
    "that judged it and why it waits.",
    "required": [
        "id",
        "agent",
        "run",
        "rule",
        "why",
        "method",
        "target",
        "tools",
        "body",
        "body_size",
        "body_truncated",
        "body_sha256",
        "checkable",
        "policy",
        "expires_at",
        "expires_in_s",
    ],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
        "agent": {"type": "string"},
        "run": _STR_OR_NULL,
        "rule": {"type": "string"},
        "why": {"type": "string"},
        "method": {"type": "string"},
        "target": {"type": "string"},
        "tools": {"type": "array", "items": {"type": "string"}},
        "body": _STR_OR_NULL,
        "body_size": {"type": ["integer", "null"]},
        "body_truncated": {"type": "boolean"},
        "body_sha256": {"type": ["string", "null"], "pattern": "^[0-9a-f]{64}$"},
        "checkable": {
            "type": "array",
            "description": "paths of the masked values an approver may check "
            "(POST /approvals/{id}/check)",
            "items": {"type": "string"},
        },
        "policy": {"type": "string"},
        "created": {"type": "number"},
        "expires_at": {"type": "number"},
        "expires_in_s": {"type": "integer"},
    },
}

DECIDED: dict[str, Any] = {
    "type": "object",
    "required": ["id", "decision", "by"],
    "properties": {
        "id": {"type": "string"},
        "decision": {"enum": ["approved", "denied"]},
        "by": {"type": "string"},
    },
}

CHECKED: dict[str, Any] = {
    "type": "object",
    "required": ["id", "path", "equal", "checks_left", "by"],
    "properties": {
        "id": {"type": "string"},
        "path": {"type": "string"},
        "equal": {"type": "boolean"},
        "checks_left": {"type": "integer"},
        "by": {"type": "string"},
    },
}

STATS: dict[str, Any] = {
    "type": "object",
    "description": "Decisions since the gateway started (an MCP call counts once per JSON-RPC "
    "message, as it is audited).",
    "required": ["since", "total", "by_decision", "by_reason"],
    "properties": {
        "since": {"type": "string"},
        "total": {"type": "integer"},
        "by_decision": {
            "type": "object",
            "required": ["allow", "deny"],
            "properties": {"allow": {"type": "integer"}, "deny": {"type": "integer"}},
        },
        "by_reason": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["decision", "reason", "count"],
                "properties": {
                    "decision": {"enum": ["allow", "deny"]},
                    "reason": {"type": "string"},
                    "count": {"type": "integer"},
                },
            },
        },
    },
}

TAINT: dict[str, Any] = {
    "type": "object",
    "required": ["key", "tainted", "cause"],
    "properties": {
        "key": {"type": "string"},
        "tainted": {"type": "boolean"},
        "cause": {
            "type": ["object", "null"],
            "properties": {"source": {"type": "string"}, "time": {"type": "string"}},
        },
    },
}

SESSION: dict[str, Any] = {
    "type": "object",
    "required": ["name", "role", "csrf", "expires_in_s"],
    "properties": {
        "name": {"type": "string"},
        "role": {"enum": ["viewer", "approver", "admin"]},
        "csrf": {
            "type": ["string", "null"],
            "description": "send as X-CSRF-Token on every state-changing request made with "
            "the session cookie (null when authenticated by a Bearer header)",
        },
        "expires_in_s": {"type": ["integer", "null"]},
    },
}

ACTED: dict[str, Any] = {
    "type": "object",
    "required": ["kind", "value", "action", "by"],
    "properties": {
        "kind": {"enum": ["agent", "run"]},
        "value": {"type": "string"},
        "action": {"enum": ["pause", "resume", "stop"]},
        "by": {"type": "string"},
        "until": {"type": ["number", "null"]},
        "was_paused": {"type": "boolean"},
        "calls_cut": {"type": "integer"},
    },
}

HEALTH: dict[str, Any] = {
    "type": "object",
    "required": ["status", "version", "policy", "state"],
    "properties": {"status": {"enum": ["ok", "degraded"]}},
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _problem(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {
            "application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}
        },
    }


def _list(key: str, item: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": [key],
        "properties": {key: {"type": "array", "items": item}},
    }


_FILTERS = [
    {"name": "agent", "in": "query", "schema": {"type": "string", "maxLength": 256}},
    {"name": "run", "in": "query", "schema": {"type": "string", "maxLength": 256}},
    {"name": "decision", "in": "query", "schema": {"enum": ["allow", "deny"]}},
    {"name": "type", "in": "query", "schema": {"enum": ["call", "approval", "operator", "taint"]}},
]


def _op(summary: str, role: str | None, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": responses, **extra}
    if role is None:
        op["security"] = []
    else:
        op["x-capgate-role"] = role
        responses.setdefault("401", _problem("operator_unauthenticated"))
        responses.setdefault("403", _problem("operator_forbidden"))
    return op


def _page(summary: str) -> dict[str, Any]:
    return {
        "get": _op(
            summary,
            None,
            {
                "200": {
                    "description": "a static file of the console (it holds no data)",
                    "content": {
                        kind: {"schema": {"type": "string"}}
                        for kind in ("text/html", "text/css", "text/javascript")
                    },
                },
                "404": _problem("admin_not_found"),
            },
        )
    }


def _act(whom: str) -> dict[str, Any]:
    """Pause, resume or stop an agent or a run."""
    return {
        "post": _op(
            f"Pause, resume or stop {whom}",
            "admin",
            {
                "200": _json(ACTED, "done"),
                "400": _problem("admin_request_invalid"),
                "503": _problem("state_unavailable: the store could not record it"),
            },
            parameters=[
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
                {
                    "name": "verb",
                    "in": "path",
                    "required": True,
                    "schema": {"enum": ["pause", "resume", "stop"]},
                },
            ],
            requestBody={
                "required": False,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "reason": {"type": "string", "maxLength": 500},
                                "for_s": {"type": "number", "minimum": 1},
                            },
                        }
                    }
                },
            },
        )
    }


def _console_paths() -> dict[str, Any]:
    return {
        "/console": {
            "get": _op("Redirects to /console/", None, {"308": {"description": "to /console/"}})
        },
        "/console/": _page("The web console's page"),
        "/console/login": {
            "post": _op(
                "Exchange an operator token for a console session: an HttpOnly, "
                "SameSite=Strict cookie, and a CSRF token in the answer",
                None,
                {
                    "200": _json(SESSION, "logged in"),
                    "400": _problem("admin_request_invalid"),
                    "401": _problem("operator_unauthenticated: not an operator token"),
                    "403": _problem("cross_site_refused"),
                },
                requestBody={
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["token"],
                                "additionalProperties": False,
                                "properties": {"token": {"type": "string"}},
                            }
                        }
                    },
                },
            )
        },
        "/console/session": {
            "get": _op(
                "The session's operator and CSRF token",
                "viewer",
                {"200": _json(SESSION, "the session")},
            )
        },
        "/console/logout": {
            "post": _op(
                "End the console session (and clear its cookie)",
                "viewer",
                {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["ended"],
                            "properties": {"ended": {"type": "boolean"}},
                        },
                        "ended",
                    )
                },
            )
        },
        "/console/{file}": _page("The console's stylesheet and script (console.css, console.js)"),
    }


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "capgate admin API", "version": __version__},
        "components": {
            "securitySchemes": {
                "operator": {"type": "http", "scheme": "bearer"},
                # The console's session (POST /console/login); a state-changing request made
                # with it also carries X-CSRF-Token.
                "console": {"type": "apiKey", "in": "cookie", "name": "capgate_session"},
            },
            "schemas": {"Problem": PROBLEM, "Call": CALL, "InFlight": INFLIGHT, "Pending": PENDING},
        },
        "security": [{"operator": []}, {"console": []}],
        "paths": {
            "/openapi.json": {
                "get": _op(
                    "This document", None, {"200": _json({"type": "object"}, "the document")}
                )
            },
            "/whoami": {
                "get": _op(
                    "The operator the credentials name",
                    "viewer",
                    {
                        "200": _json(
                            {"type": "object", "required": ["name", "role"]}, "the operator"
                        )
                    },
                )
            },
            "/health": {
                "get": _op(
                    "The gateway's health report",
                    "viewer",
                    {"200": _json(HEALTH, "healthy"), "503": _json(HEALTH, "degraded")},
                )
            },
            "/calls": {
                "get": _op(
                    "Recent calls, newest first",
                    "viewer",
                    {
                        "200": _json(
                            _list("calls", {"$ref": "#/components/schemas/Call"}), "calls"
                        ),
                        "400": _problem("admin_request_invalid"),
                    },
                    parameters=[
                        *_FILTERS,
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                        },
                    ],
                )
            },
            "/metrics": {
                "get": _op(
                    "The gateway's metrics in Prometheus' text format (with "
                    "metrics_exporter: prometheus)",
                    "viewer",
                    {
                        "200": {
                            "description": "Prometheus text format 0.0.4",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        "404": _problem("admin_not_found: metrics are off"),
                    },
                )
            },
            "/stats": {
                "get": _op(
                    "Decisions since start: in all, by decision, by decision and reason",
                    "viewer",
                    {"200": _json(STATS, "counts")},
                )
            },
            "/calls/inflight": {
                "get": _op(
                    "Calls held for approval or being forwarded now",
                    "viewer",
                    {
                        "200": _json(
                            _list("calls", {"$ref": "#/components/schemas/InFlight"}), "calls"
                        )
                    },
                )
            },
            "/events": {
                "get": _op(
                    "Every decision as it is made (server-sent events: call, approval, operator, "
                    "lagged)",
                    "viewer",
                    {
                        "200": {
                            "description": "the stream",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
                        },
                        "400": _problem("admin_request_invalid"),
                        "429": _problem("concurrency_limited: too many streams open"),
                    },
                    parameters=_FILTERS,
                )
            },
            "/approvals": {
                "get": _op(
                    "Calls held for approval",
                    "viewer",
                    {
                        "200": _json(
                            _list("pending", {"$ref": "#/components/schemas/Pending"}), "pending"
                        )
                    },
                )
            },
            "/taint": {
                "get": _op(
                    "Whether a run (or a token without a run) read untrusted content, and what",
                    "viewer",
                    {
                        "200": _json(TAINT, "the run's taint"),
                        "400": _problem("admin_request_invalid"),
                    },
                    parameters=[
                        {"name": "run", "in": "query", "schema": {"type": "string"}},
                        {"name": "jti", "in": "query", "schema": {"type": "string"}},
                    ],
                )
            },
            "/approvals/{id}/{verb}": {
                "post": _op(
                    "Approve or deny a held call",
                    "approver",
                    {
                        "200": _json(DECIDED, "decided"),
                        "400": _problem("admin_request_invalid"),
                        "404": _problem("approval_not_found"),
                        "409": _problem("approval_mismatch"),
                    },
                    parameters=[
                        {
                            "name": "id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
                        },
                        {
                            "name": "verb",
                            "in": "path",
                            "required": True,
                            "schema": {"enum": ["approve", "deny"]},
                        },
                    ],
                    requestBody={
                        "required": False,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "reason": {"type": "string", "maxLength": 500},
                                        "body_sha256": {
                                            "type": "string",
                                            "pattern": "^[0-9a-f]{64}$",
                                        },
                                    },
                                }
                            }
                        },
                    },
                )
            },
            "/approvals/{id}/check": {
                "post": _op(
                    "Check a masked value of a held call: is the value at this path X? "
                    f"Answers yes or no, never the value; {CHECKS_PER_APPROVAL} checks per "
                    "approval (the fleet shares the count), each published as an operator event",
                    "approver",
                    {
                        "200": _json(CHECKED, "checked"),
                        "400": _problem("admin_request_invalid"),
                        "404": _problem("approval_not_found"),
                        "429": _problem("approval_check_limited"),
                        "503": _problem("state_unavailable"),
                    },
                    parameters=[
                        {
                            "name": "id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
                        }
                    ],
                    requestBody={
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["path", "value"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "path": {"type": "string", "maxLength": 256},
                                        "value": {"type": "string", "maxLength": MAX_VALUE},
                                    },
                                }
                            }
                        },
                    },
                )
            },
            "/agents/{name}/{verb}": _act("an agent (pause: hold its new calls; stop: revoke it)"),
            "/runs/{name}/{verb}": _act("a run"),
            "/pauses": {
                "get": _op(
                    "Agents and runs paused now",
                    "viewer",
                    {
                        "200": _json(_list("pauses", {"type": "object"}), "pauses"),
                        "503": _problem("state_unavailable"),
                    },
                )
            },
            "/stops": {
                "get": _op(
                    "Agents and runs stopped, with who and why",
                    "viewer",
                    {
                        "200": _json(_list("stops", {"type": "object"}), "stops"),
                        "503": _problem("state_unavailable"),
                    },
                )
            },
            **_console_paths(),
            "/operators": {
                "get": _op(
                    "Operator names and roles",
                    "admin",
                    {
                        "200": _json(
                            _list("operators", {"type": "object", "required": ["name", "role"]}),
                            "operators",
                        )
                    },
                )
            },
        },
    }
