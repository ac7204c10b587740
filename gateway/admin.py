"""The admin API, on its own listener (never the agents' port), with its own bearer token.

    GET  /approvals                 pending approvals of this gateway
    POST /approvals/{id}/approve    let the held call go on
    POST /approvals/{id}/deny       end it with approval_denied
    GET  /metrics                   the gateway's metrics in Prometheus' text format
                                    (with ``metrics_exporter: prometheus``)

Requests carry ``Authorization: Bearer <admin token>`` (``--admin-token-file``, a 0600 file).
Answers are JSON; refusals are problem+json like the gateway's.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.approvals import Approvals
from gateway.errors import ConfigError
from gateway.secret_files import check_secret_file

ADMIN_APPROVALS: web.AppKey[Approvals] = web.AppKey("approvals")
ADMIN_TOKEN: web.AppKey[bytes] = web.AppKey("admin_token")
ADMIN_METRICS: web.AppKey[Callable[[], bytes]] = web.AppKey("metrics")
# prometheus_client's CONTENT_TYPE_LATEST (text format 0.0.4), written here so the admin API
# imports nothing of it when metrics are off.
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def read_admin_token(path: Path) -> bytes:
    """The admin token from a file readable by its owner only."""
    try:
        check_secret_file(path)
        token = path.read_text("utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read admin token file {str(path)!r}: {exc.strerror}") from exc
    if len(token) < 16:
        raise ConfigError(f"admin token in {str(path)!r} is shorter than 16 characters")
    return token.encode()


def _problem(status: int, reason: str, detail: str) -> web.Response:
    body = {"type": "about:blank", "status": status, "reason": reason, "detail": detail}
    return web.Response(
        status=status, body=json.dumps(body), content_type="application/problem+json"
    )


@web.middleware
async def _authorized(request: web.Request, handler: Handler) -> web.StreamResponse:
    expected = b"Bearer " + request.app[ADMIN_TOKEN]
    got = request.headers.get("Authorization", "").encode()
    if not hmac.compare_digest(got, expected):
        return _problem(401, "admin_token_invalid", "a valid admin bearer token is required")
    return await handler(request)


async def _list(request: web.Request) -> web.Response:
    return web.json_response({"pending": request.app[ADMIN_APPROVALS].pending()})


async def _decide(request: web.Request) -> web.Response:
    approval_id = request.match_info["id"]
    approve = request.match_info["verb"] == "approve"
    if not request.app[ADMIN_APPROVALS].decide(approval_id, approve, by="admin-api"):
        return _problem(404, "approval_not_found", f"no pending approval {approval_id!r}")
    return web.json_response({"id": approval_id, "decision": "approved" if approve else "denied"})


async def _metrics(request: web.Request) -> web.Response:
    # Scrapes are rare (seconds apart) and the text is small: rendered on the loop.
    body = request.app[ADMIN_METRICS]()
    return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TEXT})


def create_admin_app(
    approvals: Approvals, token: bytes, *, metrics: Callable[[], bytes] | None = None
) -> web.Application:
    """The admin API; ``metrics`` renders ``/metrics`` (behind the same token: the admin
    port is on the agent's loopback too)."""
    app = web.Application(middlewares=[_authorized], client_max_size=64 * 1024)
    app[ADMIN_APPROVALS] = approvals
    app[ADMIN_TOKEN] = token
    app.router.add_get("/approvals", _list)
    app.router.add_post("/approvals/{id:[0-9a-f]{16}}/{verb:approve|deny}", _decide)
    if metrics is not None:
        app[ADMIN_METRICS] = metrics
        app.router.add_get("/metrics", _metrics)
    return app
