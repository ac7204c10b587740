"""The agents' listener: connections bounded in number and in time, floods summarised.

aiohttp's low-level server parses and answers; this module decides how long and how many:

- **a cap on connections** (``max_connections``), kept below the process's file-descriptor
  limit with room for the upstream connections and files (``fd_budget``): a connection over
  the cap gets a 503 problem+json and is closed at once, so a flood of idle connections can
  neither exhaust descriptors nor block the calls of connections already open;
- **a head timeout** (``head_timeout``): once the first byte of a request arrives, its whole
  head (request line and headers) must follow within that time, so a header trickled a byte
  every few seconds cannot hold a connection;
- **an idle timeout** (``idle_timeout``, aiohttp's keep-alive timeout): a connection that
  sends no complete request within that time of opening, or of its previous answer, is
  closed;
- **summaries, not tracebacks**: connections refused at the cap, heads that timed out and
  requests the HTTP parser refused are counted and logged once per interval as one line,
  whatever their number (a flood of bad requests used to write a traceback each).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gateway.errors import (
    PROBLEM_CONTENT_TYPE,
    PROBLEM_TYPE_BASE,
    GatewayError,
    HttpInvalid,
    InternalError,
)

log = logging.getLogger("capgate.listener")

FD_RESERVE = 64  # descriptors kept for files, the state store, the admin listener, logs
SUMMARY_EVERY = 10.0


def fd_budget(upstream_connections: int) -> int:
    """How many agent connections the process's descriptor limit leaves room for, after the
    upstream connections and a reserve; raises the soft limit to the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return int(soft) - FD_RESERVE - upstream_connections


@dataclass
class ConnectionGuard:
    """Limits and counters shared by every connection of one listener."""

    max_connections: int = 1024
    head_timeout: float = 10.0
    idle_timeout: float = 60.0
    open: int = 0
    busy: int = 0  # requests being handled now
    counts: Counter[str] = field(default_factory=Counter)  # since the last summary
    totals: Counter[str] = field(default_factory=Counter)  # since start (health)
    # Told of each refusal by reason code and peer address: the audit trail's summary lines.
    refused: Callable[[str, str | None], None] | None = None
    _last_summary: float = 0.0

    def note(self, what: str, reason: str | None = None, source: str | None = None) -> None:
        self.counts[what] += 1
        self.totals[what] += 1
        if reason is not None and self.refused is not None:
            self.refused(reason, source)

    def summarise(self, now: float) -> str | None:
        """One line for what happened since the last summary (None if nothing did); logged
        at WARNING by the caller."""
        if now - self._last_summary < SUMMARY_EVERY or not self.counts:
            return None
        self._last_summary = now
        parts = ", ".join(f"{n} {what}" for what, n in sorted(self.counts.items()))
        self.counts.clear()
        return f"agents' listener: {parts} (open connections: {self.open})"


_AT_CAPACITY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
    + PROBLEM_CONTENT_TYPE.encode()
    + b"\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_AT_CAPACITY_BODY = (
    b'{"type":"' + PROBLEM_TYPE_BASE.encode() + b'concurrency_limited","title":"Too many '
    b'connections","status":503,"detail":"the gateway has as many agent connections open as '
    b'it takes; retry shortly","reason":"concurrency_limited"}'
)


class AtCapacity(asyncio.Protocol):
    """A connection over the cap: one 503 and closed, nothing read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_AT_CAPACITY % (len(_AT_CAPACITY_BODY), _AT_CAPACITY_BODY))
        transport.close()


class AgentConnection(RequestHandler):
    """aiohttp's request handler for one connection, with the head timeout and counted
    (not logged) errors."""

    def __init__(self, manager: AgentServer, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, keepalive_timeout=guard.idle_timeout, **kwargs)
        self.guard = guard
        self.in_request = False
        # When the head now arriving began (loop time; None: no head in progress), and the
        # one timer that checks it. The timer is not cancelled when a head completes: when it
        # fires it lapses, or re-arms for the head in progress then, so a keep-alive
        # connection makes a timer per head_timeout, not one per request.
        self._head_since: float | None = None
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.guard.open += 1
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.open -= 1
        self._head_since = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.in_request and self._head_since is None:
            loop = asyncio.get_running_loop()
            self._head_since = now = loop.time()
            if self._head_timer is None:
                self._head_timer = loop.call_at(now + self.guard.head_timeout, self._head_check)
        super().data_received(data)

    def request_started(self) -> None:
        """The head arrived whole (the handler runs): no more head deadline for it."""
        self.in_request = True
        self.guard.busy += 1
        self._head_since = None

    def request_ended(self) -> None:
        self.in_request = False
        self.guard.busy -= 1

    def _head_check(self) -> None:
        self._head_timer = None
        since = self._head_since
        if since is None or self.in_request:
            return  # no head in progress: the next one arms a timer
        loop = asyncio.get_running_loop()
        deadline = since + self.guard.head_timeout
        if loop.time() < deadline:  # a later head than the one this timer was armed for
            self._head_timer = loop.call_at(deadline, self._head_check)
            return
        self.guard.note(
            "request heads not complete in time", "request_timeout", _peer(self.transport)
        )
        self.force_close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (or a handler that failed outside
        the pipeline): problem+json with a reason, the connection closed, no traceback."""
        self.guard.note(
            "requests refused by the HTTP parser or cut by the peer",
            "http_invalid" if 400 <= status < 500 else "internal_error",
            _peer(self.transport),
        )
        if request.writer.output_size > 0:
            raise ConnectionError("the response was already started")
        error: GatewayError = (
            HttpInvalid(f"the request is not valid HTTP/1.1 ({_first_line(message)})")
            if 400 <= status < 500
            else InternalError("the request could not be handled")
        )
        response = web.Response(
            status=error.status,
            body=error.problem_bytes(os.urandom(8).hex()),
            content_type=PROBLEM_CONTENT_TYPE,
        )
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # The parser refusing a request (bad HTTP) or a peer leaving mid-request: counted and
        # summarised, never a traceback each. A bug in the pipeline is logged there.
        self.guard.note("requests refused by the HTTP parser or cut by the peer")


class AgentServer(web.Server):
    """aiohttp's low-level server with the guard: connections over the cap are refused."""

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        guard: ConnectionGuard,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        self.guard = guard

    def __call__(self) -> Any:  # RequestHandler, or AtCapacity over the cap
        if self.guard.open >= self.guard.max_connections:
            self.guard.note("connections refused at the cap", "concurrency_limited", None)
            return AtCapacity()
        return AgentConnection(self, self.guard, loop=self._loop, **self._kwargs)


def _peer(transport: asyncio.BaseTransport | None) -> str | None:
    """The peer's address (no port), for the audit's summary of refusals."""
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


def _first_line(message: str | None) -> str:
    """aiohttp's message, first line only, printable, bounded (it may quote the request)."""
    line = (message or "malformed").splitlines()[0] if message else "malformed"
    return "".join(c if c.isprintable() else "?" for c in line)[:120].rstrip(": ")


def tracked(
    handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """``handler``, telling its connection when a request starts and ends (head timeout)."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        conn = request.protocol
        if isinstance(conn, AgentConnection):
            conn.request_started()
            try:
                return await handler(request)
            finally:
                conn.request_ended()
        return await handler(request)

    return handle
