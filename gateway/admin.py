"""The admin API, on its own listener (never the agents' port), for named operators.

    GET  /openapi.json               this API, described (no credentials needed)
    GET  /whoami                     the operator the credentials name         viewer
    GET  /health                     the gateway's health report               viewer
    GET  /calls                      recent calls, newest first (filters)      viewer
    GET  /calls/inflight             calls being held or forwarded now         viewer
    GET  /stats                      decisions since start, by reason          viewer
    GET  /metrics                    the gateway's metrics, Prometheus text    viewer
                                     (with ``metrics_exporter: prometheus``; else 404)
    GET  /events                     server-sent events, live (filters)        viewer
    GET  /approvals                  calls held for approval                   viewer
    GET  /taint?run=R | ?jti=J       whether a run (or token) read untrusted content   viewer
    POST /approvals/{id}/approve     let the held call go on                   approver
    POST /approvals/{id}/deny        end it with approval_denied               approver
    POST /approvals/{id}/check       is the masked value at this path X? (yes/no) approver
    GET  /pauses                     agents and runs paused now                viewer
    GET  /stops                      agents and runs stopped (revoked), by whom  viewer
    POST /agents/{agent}/pause       hold an agent's new calls (resume, or ``until``)  admin
    POST /agents/{agent}/resume      let them go on                            admin
    POST /agents/{agent}/stop        revoke the agent, cut its calls in flight admin
    POST /runs/{run}/pause|resume|stop  the same for one run               admin
    GET  /operators                  operator names and roles                  admin
    GET  /console/...                the web console (``gateway/admin_console.py``)

Every request but ``/openapi.json`` and the console's page and login carries
``Authorization: Bearer <operator token>`` (or a console session cookie, with its CSRF
token on a state-changing request: ``gateway/admin_console.py``); the operator it names
(``gateway/operators.py``) must hold the route's role. The operator's name is recorded with
what they do (an approval's audit line says who approved it). Filters are exact matches:
``agent``, ``run``, ``decision`` (allow|deny), ``type`` (call|approval|operator|taint);
``/calls`` also takes ``limit`` (1-1000, default 100). Answers are JSON; refusals are
problem+json with a stable ``reason``: ``operator_unauthenticated`` (401),
``operator_forbidden`` (403), ``cross_site_refused`` and ``csrf_token_invalid`` (403, a
console session used from another site or without its CSRF token), ``approval_not_found``
(404), ``approval_mismatch`` (409: the decision named another body digest than the held
call's), ``admin_request_invalid`` (400), ``concurrency_limited`` (429, too many event
streams).

What the API shows is built from the closed audit record: no body, query value, header
value, SQL text or tool argument; agent-chosen names (paths) are data to be escaped by
whoever displays them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.admin_console import (
    Refused,
    console_file,
    console_login,
    console_logout,
    console_page,
    console_redirect,
    console_session,
    identify,
    install_console,
    still_allowed,
)
from gateway.approval_checks import CHECKS_PER_APPROVAL, MAX_VALUE
from gateway.approvals import Approvals
from gateway.errors import ConcurrencyLimited, ConfigError, StateUnavailable
from gateway.events import EventHub, Filters, Subscription, sse
from gateway.operators import Operator, OperatorBook
from gateway.secret_files import check_secret_file
from gateway.state.base import PauseKind, StateStore

HEARTBEAT_S = 15.0
MAX_LIMIT = 1000
log = logging.getLogger("capgate")
MAX_FILTER = 256
MAX_REASON = 500


class Console(Protocol):
    """What the admin API reads and acts on (the gateway, ``app.Gateway``)."""

    approvals: Approvals
    events: EventHub

    def inflight_calls(self) -> list[dict[str, Any]]: ...

    def health_report(self) -> Awaitable[tuple[int, dict[str, Any]]]: ...

    def taint_report(self, key: str) -> Awaitable[dict[str, Any]]: ...

    def pause(
        self, kind: PauseKind, value: str, *, until: float | None, by: str, reason: str
    ) -> Awaitable[None]: ...

    def resume(self, kind: PauseKind, value: str, *, by: str) -> Awaitable[bool]: ...

    def stop(self, kind: PauseKind, value: str, *, by: str, reason: str) -> Awaitable[int]: ...

    @property
    def state(self) -> StateStore: ...


CONSOLE: web.AppKey[Console] = web.AppKey("console")
OPERATORS: web.AppKey[OperatorBook] = web.AppKey("operators")
METRICS: web.AppKey[Callable[[], bytes] | None] = web.AppKey("metrics")
# prometheus_client's CONTENT_TYPE_LATEST (text format 0.0.4), written here so the admin API
# imports nothing of it when metrics are off.
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
ROUTE_ROLES: web.AppKey[dict[tuple[str, str], str]] = web.AppKey("route_roles")
OPERATOR: web.RequestKey[Operator] = web.RequestKey("operator", Operator)


def read_admin_token(path: Path) -> bytes:
    """The legacy single admin token, from a file readable by its owner only."""
    try:
        check_secret_file(path)
        token = path.read_text("utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read admin token file {str(path)!r}: {exc.strerror}") from exc
    if len(token) < 16:
        raise ConfigError(f"admin token in {str(path)!r} is shorter than 16 characters")
    return token.encode()


def problem(status: int, reason: str, detail: str) -> web.Response:
    body = {
        "type": f"https://capgate.dev/problems/{reason}",
        "title": reason.replace("_", " ").capitalize(),
        "status": status,
        "reason": reason,
        "detail": detail,
    }
    headers = {"Cache-Control": "no-store"}
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="capgate-admin"'
    return web.Response(
        status=status,
        body=json.dumps(body),
        content_type="application/problem+json",
        headers=headers,
    )


def _route_role(request: web.Request) -> str | None:
    resource = request.match_info.route.resource
    if resource is None:  # no such route: the router answers 404/405
        return None
    return request.app[ROUTE_ROLES].get((request.method, resource.canonical))


@web.middleware
async def _authorized(request: web.Request, handler: Handler) -> web.StreamResponse:
    role = _route_role(request)
    if role is None:  # /openapi.json, and unknown paths (answered 404/405 by the router)
        return await handler(request)
    operator = identify(request, request.app[OPERATORS])  # Refused: a cross-site request
    if operator is None:
        return problem(401, "operator_unauthenticated", "a valid operator bearer token is required")
    if not operator.may(role):
        return problem(
            403,
            "operator_forbidden",
            f"operator {operator.name!r} is a {operator.role}; this needs the {role} role",
        )
    request[OPERATOR] = operator
    return await handler(request)


def _operator(request: web.Request) -> Operator:
    return request[OPERATOR]


def _filters(request: web.Request) -> Filters:
    for key, value in request.query.items():
        if len(value) > MAX_FILTER:
            raise _invalid(f"filter {key!r} is longer than {MAX_FILTER} characters")
    decision = request.query.get("decision")
    if decision not in (None, "", "allow", "deny"):
        raise _invalid(f"decision must be allow or deny, not {decision!r}")
    kind = request.query.get("type")
    if kind not in (None, "", "call", "approval", "operator", "taint"):
        raise _invalid(f"type must be call, approval, operator or taint, not {kind!r}")
    return Filters.of(request.query)


class _Invalid(Exception):
    pass


def _invalid(detail: str) -> _Invalid:
    return _Invalid(detail)


# --- handlers -------------------------------------------------------------------------------


async def _whoami(request: web.Request) -> web.Response:
    op = _operator(request)
    return web.json_response({"name": op.name, "role": op.role})


async def _health(request: web.Request) -> web.Response:
    status, body = await request.app[CONSOLE].health_report()
    return web.json_response(body, status=status)


async def _calls(request: web.Request) -> web.Response:
    limit_text = request.query.get("limit", "100")
    if not re.fullmatch(r"[0-9]{1,4}", limit_text) or not 1 <= int(limit_text) <= MAX_LIMIT:
        raise _invalid(f"limit must be a whole number from 1 to {MAX_LIMIT}")
    calls = request.app[CONSOLE].events.calls(_filters(request), int(limit_text))
    return web.json_response({"calls": calls})


async def _inflight(request: web.Request) -> web.Response:
    return web.json_response({"calls": request.app[CONSOLE].inflight_calls()})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[CONSOLE].events.stats())


async def _events(request: web.Request) -> web.StreamResponse:
    hub = request.app[CONSOLE].events
    filters = _filters(request)
    try:
        with hub.subscribe(filters, _operator(request).name) as sub:
            return await _stream(request, sub)
    except ConcurrencyLimited as exc:
        return problem(429, "concurrency_limited", exc.detail)


async def _stream(request: web.Request, sub: Subscription) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    await response.write(b": capgate events\n\n")
    book = request.app[OPERATORS]
    while True:
        try:
            event = await asyncio.wait_for(sub.queue.get(), HEARTBEAT_S)
        except TimeoutError:
            if not still_allowed(request, book):  # logged out, expired or removed
                return response
            await response.write(b": keepalive\n\n")
            continue
        if not still_allowed(request, book):
            return response
        await response.write(sse(event))
        if event["type"] == "lagged":
            return response


async def _taint(request: web.Request) -> web.Response:
    run, jti = request.query.get("run"), request.query.get("jti")
    if (run is None) == (jti is None) or not (run or jti) or len(run or jti or "") > MAX_FILTER:
        raise _invalid("give one of run or jti")
    key = run if run is not None else f"jti:{jti}"
    return web.json_response(await request.app[CONSOLE].taint_report(key))


async def _approvals(request: web.Request) -> web.Response:
    return web.json_response({"pending": await request.app[CONSOLE].approvals.pending()})


async def _decide(request: web.Request) -> web.Response:
    approval_id = request.match_info["id"]
    approve = request.match_info["verb"] == "approve"
    note, digest = await _decision_body(request)
    by = _operator(request).name
    outcome = await request.app[CONSOLE].approvals.decide(
        approval_id, approve, by=by, reason=note, body_sha256=digest
    )
    if outcome == "not_found":
        return problem(404, "approval_not_found", f"no pending approval {approval_id!r}")
    if outcome == "mismatch":
        return problem(
            409,
            "approval_mismatch",
            f"approval {approval_id!r} holds a call with another body than the one decided "
            "on; nothing was decided",
        )
    return web.json_response(
        {"id": approval_id, "decision": "approved" if approve else "denied", "by": by}
    )


async def _json_body(request: web.Request, allowed: frozenset[str]) -> dict[str, Any]:
    """The optional JSON object of a state-changing request, with only ``allowed`` keys."""
    if not request.can_read_body:
        return {}
    if request.content_type != "application/json":
        raise _invalid("a request body must be application/json")
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise _invalid("the request body is not JSON") from None
    if not isinstance(body, dict) or set(body) - allowed:
        raise _invalid(f"expected a JSON object with only {sorted(allowed)}")
    reason = body.get("reason", "")
    if not isinstance(reason, str) or len(reason) > MAX_REASON:
        raise _invalid(f"reason must be a string of at most {MAX_REASON} characters")
    return body


_CHECK_KEYS = frozenset({"path", "value"})


async def _check(request: web.Request) -> web.Response:
    """Whether the masked value at a path of a held call's body is the value offered
    (``gateway/approval_checks.py``): yes or no, never the value; a few per approval."""
    approval_id = request.match_info["id"]
    body = await _json_body(request, _CHECK_KEYS)
    path, value = body.get("path"), body.get("value")
    if not isinstance(path, str) or not 0 < len(path) <= MAX_FILTER:
        raise _invalid("path must be one of the approval's 'checkable' paths")
    if not isinstance(value, str) or len(value) > MAX_VALUE:
        raise _invalid(f"value must be a string of at most {MAX_VALUE} characters")
    console = request.app[CONSOLE]
    by = _operator(request).name
    try:
        allowed = await console.state.consume_quota(
            f"approval-check:{approval_id}",
            CHECKS_PER_APPROVAL,
            ttl_s=console.approvals.timeout + 60,
        )
    except StateUnavailable as exc:
        return problem(503, "state_unavailable", exc.detail)
    if not allowed.allowed:
        return problem(
            429,
            "approval_check_limited",
            f"approval {approval_id!r} has had its {CHECKS_PER_APPROVAL} checks",
        )
    outcome = await console.approvals.check(approval_id, path, value)
    if outcome == "not_found":
        return problem(404, "approval_not_found", f"no pending approval {approval_id!r}")
    if outcome == "not_checkable":
        raise _invalid(f"approval {approval_id!r} has no masked value at {path!r}")
    answer = {
        "id": approval_id,
        "path": path,
        "equal": outcome == "equal",
        "checks_left": allowed.remaining,
        "by": by,
    }
    console.events.publish({"type": "operator", "action": "check", **answer})
    log.info("operator %s checked %s of approval %s: %s", by, path, approval_id, outcome)
    return web.json_response(answer)


_DECISION_KEYS = frozenset({"reason", "body_sha256"})
_SHA256 = re.compile(r"[0-9a-f]{64}")


async def _decision_body(request: web.Request) -> tuple[str, str | None]:
    """``{"reason": "...", "body_sha256": "<the digest the approver saw>"}``, both optional."""
    body = await _json_body(request, _DECISION_KEYS)
    digest = body.get("body_sha256")
    if digest is not None and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
        raise _invalid("body_sha256 must be 64 lower-case hex digits")
    return str(body.get("reason", "")), digest


_ACT_KEYS = frozenset({"reason", "for_s"})
MAX_HOLD_S = 7 * 24 * 3600


async def _act(request: web.Request) -> web.Response:
    """Pause, resume or stop an agent or a run, as the operator the credentials name."""
    kind: PauseKind = "agent" if request.path.startswith("/agents/") else "run"
    value = request.match_info["name"]
    verb = request.match_info["verb"]
    body = await _json_body(request, _ACT_KEYS)
    reason = str(body.get("reason", ""))
    by = _operator(request).name
    console = request.app[CONSOLE]
    answer: dict[str, Any] = {"kind": kind, "value": value, "action": verb, "by": by}
    try:
        if verb == "pause":
            until = _until(body.get("for_s"))
            await console.pause(kind, value, until=until, by=by, reason=reason)
            answer["until"] = until
        elif verb == "resume":
            answer["was_paused"] = await console.resume(kind, value, by=by)
        else:
            answer["calls_cut"] = await console.stop(kind, value, by=by, reason=reason)
    except ValueError as exc:
        raise _invalid(str(exc)) from None
    except StateUnavailable as exc:
        return problem(503, "state_unavailable", exc.detail)
    console.events.publish({"type": "operator", **answer, "reason": reason})
    return web.json_response(answer)


def _until(for_s: object) -> float | None:
    if for_s is None:
        return None
    if isinstance(for_s, bool) or not isinstance(for_s, int | float) or not 0 < for_s <= MAX_HOLD_S:
        raise _invalid(f"for_s must be a number of seconds from 1 to {MAX_HOLD_S}")
    return time.time() + float(for_s)


async def _pauses(request: web.Request) -> web.Response:
    try:
        return web.json_response({"pauses": request.app[CONSOLE].state.pauses()})
    except StateUnavailable as exc:
        return problem(503, "state_unavailable", exc.detail)


async def _stops(request: web.Request) -> web.Response:
    try:
        found = request.app[CONSOLE].state.revocations()
    except StateUnavailable as exc:
        return problem(503, "state_unavailable", exc.detail)
    stops = [r for r in found if r.get("kind") in ("agent", "run")]
    return web.json_response({"stops": stops})


async def _operators(request: web.Request) -> web.Response:
    return web.json_response({"operators": request.app[OPERATORS].names()})


async def _openapi(request: web.Request) -> web.Response:
    from gateway.admin_openapi import openapi_document

    return web.json_response(openapi_document())


@web.middleware
async def _problems(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bad input is a problem+json, never a traceback; router 404/405 too."""
    try:
        return await handler(request)
    except _Invalid as exc:
        return problem(400, "admin_request_invalid", str(exc))
    except Refused as exc:
        return problem(exc.status, exc.reason, exc.detail)
    except StateUnavailable as exc:  # (any endpoint: the store gone or too slow, fail closed)
        return problem(503, "state_unavailable", exc.detail)
    except web.HTTPRequestEntityTooLarge:
        return problem(413, "admin_request_invalid", "the request body is too large")
    except web.HTTPNotFound:
        return problem(404, "admin_not_found", f"no admin endpoint {request.path!r}")
    except web.HTTPMethodNotAllowed as exc:
        return problem(
            405,
            "admin_method_not_allowed",
            f"{request.method} is not allowed: {exc.allowed_methods}",
        )


async def _metrics(request: web.Request) -> web.Response:
    render = request.app[METRICS]
    if render is None:
        return problem(404, "admin_not_found", "metrics are off (metrics_exporter: prometheus)")
    return web.Response(body=render(), headers={"Content-Type": PROMETHEUS_TEXT})


Route = tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]], str | None]
ROUTES: tuple[Route, ...] = (
    ("GET", "/openapi.json", _openapi, None),
    ("GET", "/console", console_redirect, None),
    ("GET", "/console/", console_page, None),
    ("POST", "/console/login", console_login, None),
    ("GET", "/console/session", console_session, "viewer"),
    ("POST", "/console/logout", console_logout, "viewer"),
    ("GET", "/console/{file}", console_file, None),  # after the fixed paths it must not hide
    ("GET", "/whoami", _whoami, "viewer"),
    ("GET", "/health", _health, "viewer"),
    ("GET", "/calls", _calls, "viewer"),
    ("GET", "/calls/inflight", _inflight, "viewer"),
    ("GET", "/stats", _stats, "viewer"),
    ("GET", "/metrics", _metrics, "viewer"),
    ("GET", "/events", _events, "viewer"),
    ("GET", "/approvals", _approvals, "viewer"),
    ("GET", "/taint", _taint, "viewer"),
    ("POST", "/approvals/{id:[0-9a-f]{16}}/{verb:approve|deny}", _decide, "approver"),
    ("POST", "/approvals/{id:[0-9a-f]{16}}/check", _check, "approver"),
    ("GET", "/pauses", _pauses, "viewer"),
    ("GET", "/stops", _stops, "viewer"),
    ("POST", "/agents/{name}/{verb:pause|resume|stop}", _act, "admin"),
    ("POST", "/runs/{name}/{verb:pause|resume|stop}", _act, "admin"),
    ("GET", "/operators", _operators, "admin"),
)


def create_admin_app(
    console: Console, operators: OperatorBook, *, metrics: Callable[[], bytes] | None = None
) -> web.Application:
    """The admin API; ``metrics`` renders ``/metrics`` (Prometheus text), when metrics are on."""
    app = web.Application(middlewares=[_problems, _authorized], client_max_size=64 * 1024)
    app[CONSOLE] = console
    app[OPERATORS] = operators
    app[METRICS] = metrics
    install_console(app, operators)
    roles: dict[tuple[str, str], str] = {}
    for method, path, handler, role in ROUTES:
        resource = app.router.add_resource(path)
        resource.add_route(method, handler)
        if role is not None:
            roles[(method, resource.canonical)] = role
    app[ROUTE_ROLES] = roles
    return app
