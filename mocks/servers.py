"""aiohttp app factories for the mock upstreams capgate proxies to.

Every app records each request it receives (method, raw path with query, headers, body as text)
and exposes two control endpoints that are never credential-checked and never recorded:

* ``GET /_mock/requests``    - JSON list of the recorded requests, oldest first
* ``DELETE /_mock/requests`` - forget them

Credentials are checked by a middleware that runs *after* recording, so a rejected request is
still visible in the log. Every 401 has the body ``{"error": "unauthorized"}``; why it was
refused is in the ``X-Mock-Auth-Error`` response header.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import hmac
import json
import math
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final
from urllib.parse import quote

import jwt
from aiohttp import web

from mocks.data import CUSTOMERS, ORDERS
from mocks.tokens import PRIVATE_JWK_MEMBERS

__all__ = [
    "CONTROL_PREFIX",
    "DB_SCHEMA",
    "LOG_LINES",
    "MAX_REQUEST_BODY",
    "REQUEST_LOG",
    "MockDatabase",
    "QueryResult",
    "RequestLog",
    "db_app",
    "echo_app",
    "headers_as_dict",
    "logs_app",
    "metrics_app",
    "services_app",
]

CONTROL_PREFIX: Final = "/_mock/"
MAX_REQUEST_BODY: Final = 32 * 1024 * 1024
"""Request bodies up to this size are accepted (aiohttp's own default is 1 MiB)."""

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --------------------------------------------------------------------------- request recording


class RequestLog:
    """The requests one mock app has received, in arrival order."""

    def __init__(self) -> None:
        self._entries: list[dict[str, Any]] = []

    def append(self, entry: dict[str, Any]) -> None:
        self._entries.append(entry)

    def snapshot(self) -> list[dict[str, Any]]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


REQUEST_LOG: Final = web.AppKey("mock_request_log", RequestLog)
_PRINCIPAL: Final = web.RequestKey("mock_principal", dict)


def headers_as_dict(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Headers as a dict: names keep their first-seen spelling, repeated values join with ", "."""
    result: dict[str, str] = {}
    spelling: dict[str, str] = {}
    for name, value in pairs:
        key = spelling.setdefault(name.lower(), name)
        result[key] = f"{result[key]}, {value}" if key in result else value
    return result


@web.middleware
async def _record_requests(request: web.Request, handler: _Handler) -> web.StreamResponse:
    if request.path.startswith(CONTROL_PREFIX):
        return await handler(request)
    entry: dict[str, Any] = {
        "method": request.method,
        "path": request.raw_path,
        "headers": headers_as_dict(request.headers.items()),
        "body": "",
        "received_at": time.time(),
    }
    request.app[REQUEST_LOG].append(entry)
    try:
        entry["body"] = (await request.read()).decode("utf-8", errors="replace")
    except web.HTTPRequestEntityTooLarge:
        entry["body"] = None
        entry["error"] = "request body too large"
        raise
    return await handler(request)


async def _list_requests(request: web.Request) -> web.Response:
    return web.json_response(request.app[REQUEST_LOG].snapshot())


async def _clear_requests(request: web.Request) -> web.Response:
    request.app[REQUEST_LOG].clear()
    return web.json_response({"cleared": True})


def _new_app(*, auth: _BearerVerifier | None = None) -> web.Application:
    middlewares: list[Callable[..., Awaitable[web.StreamResponse]]] = [_record_requests]
    if auth is not None:
        middlewares.append(_bearer_auth(auth))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_REQUEST_BODY)
    app[REQUEST_LOG] = RequestLog()
    app.router.add_get(CONTROL_PREFIX + "requests", _list_requests)
    app.router.add_delete(CONTROL_PREFIX + "requests", _clear_requests)
    return app


# --------------------------------------------------------------------------- credentials


class _Unauthorized(Exception):
    """The request's credentials were missing or wrong; the message says which."""


_BearerVerifier = Callable[[str], dict[str, Any]]
"""Takes the exact ``Authorization`` header value; returns the principal or raises."""


def _unauthorized(reason: str) -> web.Response:
    return web.json_response(
        {"error": "unauthorized"},
        status=401,
        headers={"WWW-Authenticate": 'Bearer realm="mock"', "X-Mock-Auth-Error": reason},
    )


def _bearer_auth(verify: _BearerVerifier) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def bearer_auth(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.path.startswith(CONTROL_PREFIX):
            return await handler(request)
        values = request.headers.getall("Authorization", [])
        if not values:
            return _unauthorized("missing Authorization header")
        if len(values) > 1:
            return _unauthorized("more than one Authorization header")
        try:
            request[_PRINCIPAL] = verify(values[0])
        except _Unauthorized as exc:
            return _unauthorized(str(exc))
        return await handler(request)

    return bearer_auth


def _bearer_token(header_value: str) -> str:
    scheme, _, token = header_value.partition(" ")
    if scheme != "Bearer" or not token:
        raise _Unauthorized("expected 'Authorization: Bearer <token>'")
    return token


def _matches_any(candidate: str, secrets: Iterable[str]) -> bool:
    # Compare against every secret, so timing does not tell which one (or none) matched.
    found = False
    for secret in secrets:
        found |= hmac.compare_digest(candidate.encode(), secret.encode())
    return found


def _static_bearer(tokens: Collection[str]) -> _BearerVerifier:
    expected = [f"Bearer {token}" for token in tokens]

    def verify(header_value: str) -> dict[str, Any]:
        _bearer_token(header_value)
        if not _matches_any(header_value, expected):
            raise _Unauthorized("unknown bearer token")
        return {}

    return verify


# --------------------------------------------------------------------------- helpers


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


def _bad_param(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _bad_param(f"{name} must be an integer") from None
    if not lo <= value <= hi:
        raise _bad_param(f"{name} must be between {lo} and {hi}")
    return value


def _float_param(request: web.Request, name: str, default: float, lo: float, hi: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not lo <= value <= hi:  # also rejects NaN
        raise _bad_param(f"{name} must be a number between {lo} and {hi}")
    return value


# --------------------------------------------------------------------------- metrics

_METRIC_WINDOWS: Final = {"1m": (6, 10), "5m": (10, 30), "15m": (15, 60)}
"""window -> (number of samples, seconds between samples)"""


def _cpu_values(window: str) -> list[float]:
    samples, _ = _METRIC_WINDOWS[window]
    phase = {"1m": 0.0, "5m": 1.0, "15m": 2.0}[window]
    return [
        round(42.0 + 23.5 * math.sin(0.9 * i + phase) + 3.25 * (i % 3), 2) for i in range(samples)
    ]


async def _metrics_cpu(request: web.Request) -> web.Response:
    window = request.query.get("window", "5m")
    if window not in _METRIC_WINDOWS:
        return _bad_request(f"window must be one of {', '.join(_METRIC_WINDOWS)}")
    _, interval = _METRIC_WINDOWS[window]
    return web.json_response(
        {
            "metric": "cpu",
            "window": window,
            "host": "web-1",
            "unit": "percent",
            "interval_seconds": interval,
            "values": _cpu_values(window),
        }
    )


def metrics_app(token: str) -> web.Application:
    """``GET /metrics/cpu?window=1m|5m|15m``; needs exactly ``Authorization: Bearer <token>``."""
    if not token:
        raise ValueError("metrics token must not be empty")
    app = _new_app(auth=_static_bearer([token]))
    app.router.add_get("/metrics/cpu", _metrics_cpu)
    return app


# --------------------------------------------------------------------------- logs

_LOG_LEVELS: Final = ("INFO", "DEBUG", "INFO", "WARN", "INFO", "ERROR", "DEBUG")
_LOG_MESSAGES: Final = (
    "GET /api/orders 200",
    "cache miss for customer profile",
    "POST /api/checkout 201",
    "slow query on orders (812 ms)",
    "worker heartbeat",
    "upstream payment provider timed out",
    "feature flag evaluated: new-checkout=off",
    "GET /api/customers/7 200",
    "retrying job send-receipts (attempt 2)",
)
_LOG_START: Final = datetime(2024, 6, 1, 12, 0, 0)
_LEVEL_NAMES: Final = {
    "debug": "DEBUG",
    "info": "INFO",
    "warn": "WARN",
    "warning": "WARN",
    "error": "ERROR",
}


def _log_line(i: int) -> dict[str, Any]:
    return {
        "ts": (_LOG_START + timedelta(seconds=17 * i)).isoformat() + "Z",
        "level": _LOG_LEVELS[i % len(_LOG_LEVELS)],
        "service": "application",
        "message": _LOG_MESSAGES[i % len(_LOG_MESSAGES)],
        "request_id": f"req-{i:05d}",
    }


LOG_LINES: Final[tuple[dict[str, Any], ...]] = tuple(_log_line(i) for i in range(200))


async def _logs_application(request: web.Request) -> web.Response:
    raw_level = request.query.get("level")
    level: str | None = None
    if raw_level is not None:
        level = _LEVEL_NAMES.get(raw_level.lower())
        if level is None:
            return _bad_request("level must be one of debug, info, warn, error")
    limit = _int_param(request, "limit", default=50, lo=0, hi=1000)
    lines = [line for line in LOG_LINES if level is None or line["level"] == level][:limit]
    return web.json_response(
        {"source": "application", "level": level, "count": len(lines), "lines": lines}
    )


async def _logs_stream(request: web.Request) -> web.StreamResponse:
    chunks = _int_param(request, "chunks", default=5, lo=1, hi=1000)
    delay = _float_param(request, "delay", default=0.05, lo=0.0, hi=10.0)
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    for seq in range(chunks):
        if seq:
            await asyncio.sleep(delay)
        line = {"seq": seq, **LOG_LINES[seq % len(LOG_LINES)]}
        await response.write(json.dumps(line).encode() + b"\n")
    await response.write_eof()
    return response


_BIG_PATTERN: Final = b"capgate mock log filler 0123456789 abcdefghijklmnopqrstuvwxyz.\n"
_BIG_CHUNK: Final = _BIG_PATTERN * 1024  # 64 KiB


async def _logs_big(request: web.Request) -> web.StreamResponse:
    """Exactly `size` bytes; with ``chunked=1`` they come without a Content-Length."""
    size = _int_param(request, "size", default=1024, lo=0, hi=512 * 1024 * 1024)
    chunked = request.query.get("chunked", "").lower() in {"1", "true", "yes"}
    response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
    if chunked:
        response.enable_chunked_encoding()
    else:
        response.content_length = size
    await response.prepare(request)
    remaining = size
    while remaining > 0:
        piece = _BIG_CHUNK[: min(remaining, len(_BIG_CHUNK))]
        await response.write(piece)
        remaining -= len(piece)
    await response.write_eof()
    return response


def logs_app() -> web.Application:
    """Unauthenticated log reader.

    * ``GET /logs/application?level=debug|info|warn|error&limit=N`` (limit 0..1000, default 50)
    * ``GET /logs/stream?chunks=5&delay=0.05`` - NDJSON, one line per chunk, chunked encoding
    * ``GET /logs/big?size=N[&chunked=1]`` - exactly N bytes of text
    """
    app = _new_app()
    app.router.add_get("/logs/application", _logs_application)
    app.router.add_get("/logs/stream", _logs_stream)
    app.router.add_get("/logs/big", _logs_big)
    return app


# --------------------------------------------------------------------------- services

SERVICES: Final = ("web", "worker")

# Signature algorithm pinned by key type: a token is only checked with its key's algorithm.
_ALGORITHM_BY_KEY_TYPE: Final = {("OKP", "Ed25519"): "EdDSA", ("EC", "P-256"): "ES256"}
_REQUIRED_CLAIMS: Final = ["exp", "iat", "sub", "aud", "iss"]


def _load_jwks(jwks: Mapping[str, Any]) -> dict[str, jwt.PyJWK]:
    """Public keys by `kid`. Keys that are not Ed25519 or P-256 are ignored."""
    raw_keys = jwks.get("keys")
    if not isinstance(raw_keys, list):
        raise ValueError("JWKS must be an object with a 'keys' list")
    keys: dict[str, jwt.PyJWK] = {}
    for raw in raw_keys:
        if not isinstance(raw, Mapping):
            raise ValueError("every JWKS entry must be an object")
        kid = raw.get("kid")
        if not isinstance(kid, str) or not kid:
            raise ValueError("every JWKS entry needs a non-empty 'kid'")
        algorithm = _ALGORITHM_BY_KEY_TYPE.get((raw.get("kty"), raw.get("crv")))
        if algorithm is None:
            continue
        declared = raw.get("alg")
        if declared is not None and declared != algorithm:
            raise ValueError(f"JWKS key {kid!r}: alg {declared!r} does not fit its key type")
        public = {k: v for k, v in raw.items() if k not in PRIVATE_JWK_MEMBERS}
        keys[kid] = jwt.PyJWK(public, algorithm=algorithm)
    if not keys:
        raise ValueError("JWKS has no Ed25519 or P-256 key")
    return keys


def _jwt_bearer(jwks: Mapping[str, Any], audience: str, issuer: str) -> _BearerVerifier:
    keys = _load_jwks(jwks)

    def verify(header_value: str) -> dict[str, Any]:
        token = _bearer_token(header_value)
        try:
            kid = jwt.get_unverified_header(token).get("kid")
        except jwt.PyJWTError as exc:
            raise _Unauthorized(f"malformed token: {exc}") from None
        key = keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise _Unauthorized(f"no key for kid {kid!r}")
        try:
            return jwt.decode(
                token,
                key,
                algorithms=[key.algorithm_name],
                audience=audience,
                issuer=issuer,
                options={"require": _REQUIRED_CLAIMS},
            )
        except jwt.PyJWTError as exc:
            raise _Unauthorized(f"invalid token: {exc}") from None

    return verify


async def _services_restart(request: web.Request) -> web.Response:
    try:
        payload = await request.json()
    except json.JSONDecodeError:
        return _bad_request("body must be JSON")
    service = payload.get("service") if isinstance(payload, dict) else None
    if service not in SERVICES:
        return _bad_request(f"service must be one of {', '.join(SERVICES)}")
    return web.json_response({"restarted": service, "by": request[_PRINCIPAL]["sub"]})


def services_app(
    jwks: Mapping[str, Any], audience: str = "services", issuer: str = "capgate"
) -> web.Application:
    """``POST /services/restart`` with ``{"service": "web"|"worker"}``.

    Needs ``Authorization: Bearer <JWT>``: the key is chosen by the token's ``kid`` from `jwks`
    (Ed25519 keys verify EdDSA only, P-256 keys ES256 only), and ``exp``, ``iat``, ``sub``,
    ``aud`` (== `audience`) and ``iss`` (== `issuer`) are required.
    """
    app = _new_app(auth=_jwt_bearer(jwks, audience, issuer))
    app.router.add_post("/services/restart", _services_restart)
    return app


# --------------------------------------------------------------------------- echo


async def _echo_payload(request: web.Request) -> dict[str, Any]:
    path, _, query = request.raw_path.partition("?")
    return {
        "method": request.method,
        "path": path,
        "query": query,
        "headers": headers_as_dict(request.headers.items()),
        "body": (await request.read()).decode("utf-8", errors="replace"),
    }


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(await _echo_payload(request))


async def _echo_slow(request: web.Request) -> web.Response:
    delay = _float_param(request, "delay", default=1.0, lo=0.0, hi=300.0)
    await asyncio.sleep(delay)
    return web.json_response(await _echo_payload(request))


async def _echo_status(request: web.Request) -> web.Response:
    try:
        status = int(request.match_info["code"])
    except ValueError:
        status = 0
    if not 200 <= status <= 599:
        return _bad_request("status code must be between 200 and 599")
    if status in (204, 304):
        return web.Response(status=status)
    return web.json_response(await _echo_payload(request), status=status)


async def _echo_reflect(request: web.Request) -> web.Response:
    """A hostile upstream: puts the ``X-Api-Key`` it received in its reason phrase, in a
    header name and in a header value; the body is the usual echo plus the key base64-,
    URL-safe-base64- and percent-encoded inside longer text. ``?gzip=1`` compresses the body
    (whatever the client asked for)."""
    key = request.headers.get("X-Api-Key", "none")
    payload = await _echo_payload(request)
    raw = key.encode()
    payload["encoded"] = {
        "b64": base64.b64encode(b"user=agent;key=" + raw + b";end").decode(),
        "b64url": base64.urlsafe_b64encode(b"k:" + raw).decode(),
        "pct": "https://x.example/?k=" + quote(key, safe=""),
    }
    headers = {f"X-Seen-{key}": "1", "X-Seen": key}
    if request.query.get("gzip"):
        body = gzip.compress(json.dumps(payload).encode())
        headers.update({"Content-Encoding": "gzip", "Content-Type": "application/json"})
        return web.Response(body=body, reason=f"OK {key}", headers=headers)
    return web.json_response(payload, reason=f"OK {key}", headers=headers)


async def _echo_sse(request: web.Request) -> web.StreamResponse:
    count = _int_param(request, "events", default=3, lo=1, hi=1000)
    delay = _float_param(request, "delay", default=0.05, lo=0.0, hi=10.0)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    response.enable_chunked_encoding()
    await response.prepare(request)
    for n in range(1, count + 1):
        if n > 1:
            await asyncio.sleep(delay)
        data = json.dumps({"n": n, "of": count})
        await response.write(f"id: {n}\nevent: tick\ndata: {data}\n\n".encode())
    await response.write_eof()
    return response


def echo_app() -> web.Application:
    """Answers any method on any path with what it received, as JSON.

    Body: ``{"method", "path" (raw, without query), "query" (raw), "headers", "body"}``.
    Special paths: ``GET /echo/slow?delay=S`` sleeps first, ``GET /echo/sse?events=3`` streams
    server-sent events, ``/echo/status/{code}`` echoes with that HTTP status, and
    ``GET /echo/reflect`` also reflects the ``X-Api-Key`` in its reason phrase and headers.
    """
    app = _new_app()
    app.router.add_get("/echo/slow", _echo_slow)
    app.router.add_get("/echo/sse", _echo_sse)
    app.router.add_route("*", "/echo/status/{code}", _echo_status)
    app.router.add_get("/echo/reflect", _echo_reflect)
    app.router.add_route("*", "/{tail:.*}", _echo)
    return app


# --------------------------------------------------------------------------- database

DB_SCHEMA: Final[dict[str, list[str]]] = {
    "customers": ["id", "name", "email", "ssn", "country"],
    "orders": ["id", "customer_id", "total_cents", "status", "created_at"],
}

_DDL: Final = """
DROP TABLE IF EXISTS orders;
DROP TABLE IF EXISTS customers;
CREATE TABLE customers (
    id INTEGER PRIMARY KEY,
    name TEXT,
    email TEXT,
    ssn TEXT,
    country TEXT
);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    customer_id INTEGER REFERENCES customers(id),
    total_cents INTEGER,
    status TEXT,
    created_at TEXT
);
"""

QUERY_TIME_LIMIT: Final = 5.0
"""Seconds a single statement may run before SQLite is told to abandon it."""


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]
    rowcount: int

    def as_dict(self) -> dict[str, Any]:
        return {"columns": self.columns, "rows": self.rows, "rowcount": self.rowcount}


def _json_value(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else value


class MockDatabase:
    """A seeded SQLite database; one statement at a time, from any thread.

    The tables are dropped and re-seeded on open, so a file database always starts from the
    same data as an in-memory one.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path or ":memory:"
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._deadline = math.inf
        self._conn.set_progress_handler(self._over_time, 1000)
        self.queries_executed = 0
        self._seed()

    def _over_time(self) -> int:
        return 1 if time.monotonic() > self._deadline else 0

    def _seed(self) -> None:
        with self._lock:
            self._conn.executescript(_DDL)
            self._conn.execute("BEGIN")
            self._conn.executemany(
                "INSERT INTO customers (id, name, email, ssn, country) VALUES (?, ?, ?, ?, ?)",
                [(c.id, c.name, c.email, c.ssn, c.country) for c in CUSTOMERS],
            )
            self._conn.executemany(
                "INSERT INTO orders (id, customer_id, total_cents, status, created_at) "
                "VALUES (?, ?, ?, ?, ?)",
                [(o.id, o.customer_id, o.total_cents, o.status, o.created_at) for o in ORDERS],
            )
            self._conn.execute("COMMIT")

    def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> QueryResult:
        """Run one statement. Counts as executed even if SQLite rejects it.

        Raises:
            sqlite3.Error: the statement is invalid, failed, or ran past `QUERY_TIME_LIMIT`.
        """
        with self._lock:
            self.queries_executed += 1
            self._deadline = time.monotonic() + QUERY_TIME_LIMIT
            try:
                cursor = self._conn.execute(sql, params)
                try:
                    if cursor.description is None:
                        return QueryResult(columns=[], rows=[], rowcount=max(cursor.rowcount, 0))
                    columns = [d[0] for d in cursor.description]
                    rows = [[_json_value(v) for v in row] for row in cursor.fetchall()]
                    return QueryResult(columns=columns, rows=rows, rowcount=len(rows))
                finally:
                    cursor.close()
            finally:
                self._deadline = math.inf
                if self._conn.in_transaction:
                    # A statement that left a transaction open (e.g. BEGIN) must not leak into
                    # the next request.
                    self._conn.rollback()

    def close(self) -> None:
        with self._lock:
            self._conn.close()


MOCK_DATABASE: Final = web.AppKey("mock_database", MockDatabase)


async def _db_query(request: web.Request) -> web.Response:
    try:
        payload = await request.json()
    except json.JSONDecodeError:
        return _bad_request("body must be JSON")
    if not isinstance(payload, dict) or not isinstance(payload.get("sql"), str):
        return _bad_request('body must be {"sql": string, "params": list (optional)}')
    params = payload.get("params", [])
    if params is None:
        params = []
    if not isinstance(params, list | dict):
        return _bad_request("params must be a list (or an object for named parameters)")
    database = request.app[MOCK_DATABASE]
    try:
        result = await asyncio.to_thread(database.execute, payload["sql"], params)
    except (sqlite3.Error, ValueError, OverflowError) as exc:
        return _bad_request(str(exc))
    return web.json_response(result.as_dict())


async def _db_stats(request: web.Request) -> web.Response:
    return web.json_response({"queries_executed": request.app[MOCK_DATABASE].queries_executed})


async def _db_reset_stats(request: web.Request) -> web.Response:
    request.app[MOCK_DATABASE].queries_executed = 0
    return web.json_response({"queries_executed": 0})


def db_app(db_path: str | None = None, tokens: Collection[str] | None = None) -> web.Application:
    """``POST /query`` with ``{"sql": str, "params": list}`` against a seeded SQLite database.

    Answers ``{"columns", "rows", "rowcount"}``; SQL errors are 400 ``{"error": message}``.
    With `tokens`, needs ``Authorization: Bearer <one of tokens>``. ``GET /_mock/stats`` gives
    ``{"queries_executed": n}`` (every statement handed to SQLite, failed ones included) and
    ``DELETE /_mock/stats`` resets it. The database is closed with the app.
    """
    if tokens is not None and not tokens:
        raise ValueError("tokens must not be empty; pass None for an unauthenticated database")
    app = _new_app(auth=_static_bearer(list(tokens)) if tokens is not None else None)
    database = MockDatabase(db_path)
    app[MOCK_DATABASE] = database

    async def close_database(_: web.Application) -> None:
        await asyncio.to_thread(database.close)

    app.on_cleanup.append(close_database)
    app.router.add_post("/query", _db_query)
    app.router.add_get(CONTROL_PREFIX + "stats", _db_stats)
    app.router.add_delete(CONTROL_PREFIX + "stats", _db_reset_stats)
    return app


# ------------------------------------------------------------------ a batch-accepting MCP server

MCP_BATCH_TOOL_CALLS: web.AppKey[dict[str, int]] = web.AppKey("mcp_batch_tool_calls")
_BATCH_TOOLS = ("get_order", "search_orders", "run_sql")


def _batch_answer(app: web.Application, msg: Any) -> dict[str, Any] | None:
    if not isinstance(msg, dict):
        return {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "invalid"}}
    method, msg_id, params = msg.get("method"), msg.get("id"), msg.get("params") or {}
    if "id" not in msg:
        return None  # a notification
    if method == "initialize":
        result: dict[str, Any] = {
            "protocolVersion": "2025-03-26",
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "mock-batch-mcp", "version": "1"},
        }
    elif method == "ping":
        result = {}
    elif method == "tools/list":
        result = {"tools": [{"name": n, "inputSchema": {"type": "object"}} for n in _BATCH_TOOLS]}
    elif method == "tools/call" and params.get("name") in _BATCH_TOOLS:
        calls = app[MCP_BATCH_TOOL_CALLS]
        calls[params["name"]] = calls.get(params["name"], 0) + 1
        text = json.dumps({"tool": params["name"], "arguments": params.get("arguments", {})})
        result = {"content": [{"type": "text", "text": text}], "isError": False}
    else:
        return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": -32601, "message": "no method"}}
    return {"jsonrpc": "2.0", "id": msg_id, "result": result}


async def _mcp_batch(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return _bad_request("not JSON")
    messages = body if isinstance(body, list) else [body]
    answers = [a for a in (_batch_answer(request.app, m) for m in messages) if a is not None]
    headers = {"Mcp-Session-Id": "batch-session-1"}
    if not answers:
        return web.Response(status=202, headers=headers)
    payload = answers if isinstance(body, list) else answers[0]
    return web.json_response(payload, headers=headers)


async def _mcp_batch_stats(request: web.Request) -> web.Response:
    return web.json_response({"tool_calls": request.app[MCP_BATCH_TOOL_CALLS]})


def mcp_batch_app() -> web.Application:
    """An MCP server over plain HTTP (JSON answers, no streams) that takes JSON-RPC batches,
    as older MCP versions allowed: ``POST /mcp``. Its tools (``get_order``, ``search_orders``,
    ``run_sql``) echo their arguments; ``GET /_mock/stats`` counts the calls of each."""
    app = _new_app()
    app[MCP_BATCH_TOOL_CALLS] = {}
    app.router.add_post("/mcp", _mcp_batch)
    app.router.add_get(CONTROL_PREFIX + "stats", _mcp_batch_stats)
    return app
