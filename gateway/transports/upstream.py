"""The live transport: a lean HTTP/1.1 client with a keep-alive pool per upstream origin.

What it sends is built here, byte for byte, from what the checks read:

- the request line (method and the checked target), ``Host`` from the upstream's URL, the
  headers the inject stage built, ``Content-Length`` (as aiohttp's client writes them, a test
  compares the bytes), and the checked body; never ``Transfer-Encoding``, never a header the
  agent could use to frame the request differently (``Host``, ``Content-Length``,
  ``Connection``, ``Expect`` and the other hop-by-hop names are dropped if present);
- a header name or value that is not plain text (a control character, a line break, or bytes
  that were not valid UTF-8 when the agent sent them) refuses the call: the upstream would not
  read the value the policy checked (aiohttp's writer silently dropped such bytes);
- no redirects are followed, no cookies kept, no proxy from the environment used, bodies
  never decompressed (``Accept-Encoding: identity`` is asked for by the inject stage);
- a call is sent once: a pooled connection that breaks is an error, never a resend.

What comes back is read by aiohttp's HTTP parser (llhttp, the parser aiohttp's own client
uses, with its settings), so the answer is read as before; interim (1xx) answers are skipped.

Timeouts: connecting (``timeouts.connect``) and the gap between two reads of the answer
(``timeouts.read``), kept by one timer per connection that re-arms itself only when it fires
(not one per call); the whole exchange's deadline is the pipeline's (``dispatch.py``).

A connection returns to its pool only when its answer was read to the end, the upstream did
not ask to close it and nothing else arrived on it; idle connections are closed after
``KEEPALIVE`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http import HttpResponseParser, RawResponseMessage
from aiohttp.streams import StreamReader
from multidict import CIMultiDict

from gateway.errors import HttpInvalid, UpstreamTimeout, UpstreamUnavailable
from gateway.http_headers import HOP_BY_HOP
from gateway.policy.model import Upstream
from gateway.transport import UpstreamRequest

CHUNK_SIZE = 64 * 1024
READ_BUFFER = 64 * 1024  # the response body buffer's high-water mark (aiohttp's default)
KEEPALIVE = 15.0  # seconds an idle pooled connection is kept (aiohttp's default)
MAX_IDLE_PER_ORIGIN = 256  # idle connections kept per origin; more are closed
# aiohttp's client parser limits (its defaults): a longer status line or header is refused.
MAX_LINE = 8190
MAX_FIELD = 8190
# Methods after which aiohttp's client sends ``Content-Length: 0`` when there is no body.
_NO_LENGTH_WITHOUT_BODY = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# Framing is the transport's: these never come from the headers it is given.
_FRAMING = HOP_BY_HOP | {"host", "content-length", "expect"}
# A control character other than tab, CR and LF (RFC 9110 5.5): never sent in a header; CR
# and LF are counted instead (each line the head has must end with the one pair it was given).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TOKENS: set[str] = set()  # methods and header names already checked to be tokens (bounded)
_NO_ANSWER = "the upstream connection closed before its answer"
_PAST_DEADLINE = "the call's deadline passed before the upstream answered"
INF = float("inf")


def _framed_oddly(message: RawResponseMessage) -> bool:
    """An answer whose transfer codings are anything but one plain ``chunked`` (repeated,
    stacked, capitalised): framing another reader could take otherwise. Such an answer is read as
    the parser frames it, but its connection carries no other call (RFC 9112 6.3: a message
    that might be an attempt at response splitting ends its connection)."""
    codings = message.headers.getall("Transfer-Encoding", ())
    return bool(codings) and (len(codings) != 1 or codings[0] != "chunked")


class _Connection(BaseProtocol):
    """One keep-alive connection to an origin, carrying one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: _Pool) -> None:
        super().__init__(loop)
        self.pool = pool
        self.parser: Any = self._new_parser(with_body=True)
        self._parser = self.parser  # (BaseProtocol pauses it with the transport)
        self.waiter: asyncio.Future[tuple[RawResponseMessage, StreamReader]] | None = None
        self.payload: StreamReader | None = None
        self.message: RawResponseMessage | None = None
        self.active = False  # an exchange is in progress
        self.reusable = True  # False once anything makes the connection unfit for another
        self.read_timeout = 30.0
        self.deadline = INF  # the call's deadline for the answer's head (loop time)
        self.last_read = 0.0  # loop time of the last bytes read (or of the request sent)
        self.timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0
        self.lost = False

    def _new_parser(self, *, with_body: bool) -> Any:
        return HttpResponseParser(
            self,
            self._loop,
            READ_BUFFER,
            timer=None,
            max_line_size=MAX_LINE,
            max_field_size=MAX_FIELD,
            payload_exception=aiohttp.ClientPayloadError,
            response_with_body=with_body,
            read_until_eof=True,
            auto_decompress=False,
        )

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # (sets TCP_NODELAY)

    def data_received(self, data: bytes) -> None:
        if data:
            self.last_read = self._loop.time()
        if not self.active:
            # Bytes nobody asked for (an idle connection, or after a complete answer): the
            # connection is no longer in step with the upstream.
            if data:
                self._discard()
            return
        try:
            messages, upgraded, tail = self.parser.feed_data(data)
        except Exception as exc:
            self._fail(UpstreamUnavailable(f"the upstream's answer is not valid HTTP: {exc}"))
            return
        for message, payload in messages:
            if 100 <= message.code < 200 and message.code != 101:
                continue  # interim answer (100 Continue, 103 Early Hints): the final one follows
            if self.message is not None or message.code == 101 or upgraded:
                # A second answer to one request, or a protocol switch nobody asked for.
                self._fail(UpstreamUnavailable("the upstream answered out of turn"))
                return
            self.message, self.payload = message, payload
            if message.should_close or _framed_oddly(message):
                self.reusable = False
            waiter, self.waiter = self.waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_result((message, payload))
        if tail:
            self.reusable = False

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self.lost = True
        self.reusable = False
        self.pool.forget(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.active:
            return
        try:
            self.parser.feed_eof()  # an answer delimited by the connection's end is complete
        except Exception:  # noqa: S110 (an incomplete answer: told below)
            pass
        self._fail(UpstreamUnavailable(_NO_ANSWER))

    def resume_reading(self, resume_parser: bool = True) -> None:
        # The body's reader calls this at every end of a body and after every read; only a
        # connection paused for an agent that reads slower than the upstream sends has
        # anything to resume (a parser holding bytes back, the socket's reading).
        if not self._reading_paused:
            return
        self.last_read = self._loop.time()  # a paused read was not the upstream's delay
        super().resume_reading(resume_parser)

    # --- one exchange -------------------------------------------------------------------------

    def send(
        self, data: bytes, read_timeout: float, deadline: float, with_body: bool
    ) -> asyncio.Future[Any]:
        """Write the request; the future is the answer's head and body stream."""
        assert self.transport is not None and not self.active
        if not with_body:  # (HEAD: a parser that knows no body follows the head)
            self.parser = self._parser = self._new_parser(with_body=False)
            self.reusable = False
        self.active = True
        self.message = self.payload = None
        waiter: asyncio.Future[Any] = self._loop.create_future()
        self.waiter = waiter
        now = self._loop.time()
        self.last_read = now
        self.read_timeout = read_timeout
        self.deadline = deadline
        first = min(now + read_timeout, deadline)
        timer = self.timer
        if timer is None or timer.when() > first:
            if timer is not None:
                timer.cancel()
            self.timer = self._loop.call_at(first, self._check_reading)
        self.transport.write(data)
        return waiter

    def _check_reading(self) -> None:
        """The read timer: lapses when idle, re-arms while bytes keep coming, else fails."""
        self.timer = None
        if not self.active or self.lost:
            return
        payload = self.payload
        if payload is not None and payload.is_eof():
            return  # the whole answer is here: nothing left to wait for
        now = self._loop.time()
        heading = self.waiter is not None  # the answer's head has not come yet
        if heading and now >= self.deadline:
            self._fail(UpstreamTimeout(_PAST_DEADLINE))
            return
        due = self.last_read + self.read_timeout
        if self._reading_paused or now < due:
            when = now + self.read_timeout if self._reading_paused else due
            if heading:
                when = min(when, self.deadline)
            self.timer = self._loop.call_at(when, self._check_reading)
            return
        self._fail(UpstreamTimeout("the upstream stopped sending its answer in time"))

    def finish(self) -> None:
        """The exchange is over: back to the pool if fit for another one, else closed."""
        payload = self.payload
        complete = (payload is not None and payload.is_eof() and payload.exception() is None) or (
            self.message is not None and payload is None
        )
        self.active = False
        self.waiter = None
        self.payload = self.message = None
        if complete and self.reusable and not self.lost and self.transport is not None:
            self.pool.keep(self)
        else:
            self._discard()

    def _fail(self, error: Exception) -> None:
        """The exchange cannot go on: tell whoever waits, drop the connection."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        payload = self.payload
        if payload is not None and not payload.is_eof():
            payload.set_exception(error)
        self._discard()

    def _discard(self) -> None:
        self.reusable = False
        self.pool.forget(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()


class _Pool:
    """The idle keep-alive connections to one origin (scheme, host, port)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()  # every connection not yet closed
        self._sweeper: asyncio.TimerHandle | None = None

    async def take(self, connect_timeout: float) -> _Connection:
        idle = self.idle
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be timed out
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                return conn
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(connect_timeout):
            _, conn = await loop.create_connection(
                lambda: _Connection(loop, self),
                self.host,
                self.port,
                ssl=self.tls,
                server_hostname=self.host if self.tls is not None else None,
            )
        self.open.add(conn)
        return conn

    def keep(self, conn: _Connection) -> None:
        if len(self.idle) >= MAX_IDLE_PER_ORIGIN:
            conn._discard()
            return
        conn.idle_since = conn._loop.time()
        self.idle.append(conn)
        if self._sweeper is None:
            self._sweeper = conn._loop.call_later(KEEPALIVE, self._sweep)

    def forget(self, conn: _Connection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)
        if conn.lost or conn.transport is None or conn.transport.is_closing():
            self.open.discard(conn)

    def _sweep(self) -> None:
        """Close connections idle for ``KEEPALIVE`` seconds; again while any stay idle."""
        self._sweeper = None
        if not self.idle:
            return
        loop = self.idle[0]._loop
        cutoff = loop.time() - KEEPALIVE
        for conn in [c for c in self.idle if c.idle_since <= cutoff]:
            conn._discard()
        if self.idle:
            oldest = min(c.idle_since for c in self.idle)
            self._sweeper = loop.call_at(oldest + KEEPALIVE, self._sweep)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self.open):
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()
        self.open.clear()


class LiveResponse:
    """The upstream's answer: its head, and its body read from the connection."""

    __slots__ = ("_conn", "_payload", "status", "reason", "headers", "_done")

    def __init__(
        self, conn: _Connection, message: RawResponseMessage, payload: StreamReader
    ) -> None:
        self._conn = conn
        self._payload = payload
        self.status = message.code
        self.reason = message.reason or ""
        self.headers: CIMultiDict[str] = CIMultiDict(message.headers)
        self._done = False

    @property
    def complete(self) -> bool:
        """Whether the whole body is already here (reading it will not wait)."""
        return self._payload.is_eof()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._payload.iter_chunked(CHUNK_SIZE):
                yield chunk
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable("the upstream connection broke during the response") from exc

    async def read_all(self) -> bytes:
        payload = self._payload
        try:
            if payload.is_eof():  # all here: taken from the buffer, no coroutine per chunk
                return payload.read_nowait(-1)
            return await payload.read()
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable("the upstream connection broke during the response") from exc

    async def close(self) -> None:
        if not self._done:
            self._done = True
            self._conn.finish()  # (pooled again only when read to its end)

    def __del__(self) -> None:
        # A path that dropped the answer without closing it must not leave its connection
        # open and idle forever: it cannot go back to the pool (its answer was not read).
        if not self._done:
            self._done = True
            with contextlib.suppress(Exception):  # (at exit, the loop may be closed)
                self._conn._discard()


class LiveTransport:
    """Sends each call on a pooled connection to its upstream's origin, and keeps the call's
    deadline (``UpstreamRequest.deadline``) until the answer's head with the connection's
    read timer.

    The pool itself is not the bound: each upstream's ``limits.concurrency`` (and each
    agent's share of it) is, counted by the pipeline around every exchange. A pool limit
    here would be one queue shared by every upstream and agent: the starvation the shares
    prevent. So connections are bounded by the sum of the upstreams' concurrency."""

    keeps_deadline = True

    def __init__(self, *, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls  # the context for https upstreams (default: the system's trust store)
        self._pools: dict[tuple[str, str, int], _Pool] = {}
        self._routes: dict[Upstream, tuple[_Pool, bytes, str]] = {}

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            context = ssl.create_default_context()
            context.set_alpn_protocols(["http/1.1"])
            self._tls = context
        return self._tls

    def _route(self, up: Upstream) -> tuple[_Pool, bytes, str]:
        """An upstream's pool, the ``Host`` line and its base path, computed once."""
        route = self._routes.get(up)
        if route is None:
            url = up.url
            if url.scheme not in ("http", "https") or not url.host or url.port is None:
                raise UpstreamUnavailable(f"upstream {up.name!r} has no http(s) origin")
            key = (url.scheme, url.host, url.port)
            pool = self._pools.get(key)
            if pool is None:
                tls = self._tls_context() if url.scheme == "https" else None
                pool = self._pools[key] = _Pool(url.host, url.port, tls)
            host = url.host_port_subcomponent or url.host
            route = (pool, f"Host: {host}\r\n".encode("ascii"), up.base_path)
            if len(self._routes) > 1024:  # policy reloads bring new Upstream objects
                self._routes.clear()
            self._routes[up] = route
        return route

    async def send(self, request: UpstreamRequest) -> LiveResponse:
        up = request.upstream
        pool, host_line, base = self._route(up)
        body = request.body
        if body is not None and not isinstance(body, bytes):
            body = b"".join([chunk async for chunk in body])
        data = _request_bytes(request.method, base + request.target, host_line, request, body)
        deadline = INF if request.deadline is None else request.deadline
        connect = min(up.connect_timeout, deadline - asyncio.get_running_loop().time())
        if connect <= 0:
            raise _past_deadline(up)
        try:
            conn = await pool.take(connect)
        except TimeoutError as exc:
            if connect < up.connect_timeout:
                raise _past_deadline(up) from exc
            raise UpstreamTimeout(f"upstream {up.name!r} did not answer in time") from exc
        except OSError as exc:
            raise UpstreamUnavailable(f"upstream {up.name!r} cannot be reached") from exc
        waiter = conn.send(data, up.read_timeout, deadline, with_body=request.method != "HEAD")
        try:
            message, payload = await waiter
        except UpstreamTimeout as exc:
            if exc.args and exc.args[0] == _PAST_DEADLINE:
                raise _past_deadline(up) from exc
            raise UpstreamTimeout(f"upstream {up.name!r} did not answer in time") from exc
        except UpstreamUnavailable as exc:
            raise UpstreamUnavailable(f"upstream {up.name!r} failed to answer: {exc}") from exc
        except BaseException:
            conn._discard()  # cancelled (the agent left, a revocation): not reused
            raise
        return LiveResponse(conn, message, payload)

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._routes.clear()
        await asyncio.sleep(0)


def _past_deadline(up: Upstream) -> UpstreamTimeout:
    return UpstreamTimeout(
        f"upstream {up.name!r} did not answer within the call's deadline ({up.total_timeout:g} s)"
    )


def _check_token(text: str, what: str) -> None:
    if not _TOKEN.fullmatch(text):
        raise HttpInvalid(f"{what} {text[:40]!r} is not an HTTP token")
    if len(_TOKENS) < 4096:
        _TOKENS.add(text)


def _request_bytes(
    method: str, target: str, host_line: bytes, request: UpstreamRequest, body: bytes | None
) -> bytes:
    """The request's bytes: its head (checked to be plain text) and its body."""
    if " " in target:
        raise HttpInvalid("the request target holds a space")
    if method not in _TOKENS:
        _check_token(method, "method")
    lines = [method, " ", target, " HTTP/1.1\r\n"]
    count = 1  # lines, each ending with CR LF
    for name, value in request.headers.items():
        if name not in _TOKENS:
            _check_token(name, "header name")
        if name.lower() in _FRAMING:
            continue
        lines += (name, ": ", value, "\r\n")
        count += 1
    if body is not None:
        lines.append(f"Content-Length: {len(body)}\r\n")
        count += 1
    elif method not in _NO_LENGTH_WITHOUT_BODY:
        lines.append("Content-Length: 0\r\n")
        count += 1
    text = "".join(lines)
    if _CONTROL.search(text) or text.count("\r") != count or text.count("\n") != count:
        raise HttpInvalid("a header holds a control character or a line break")
    try:
        head = text.encode("utf-8")
    except UnicodeEncodeError:
        raise HttpInvalid(
            "a header value is not valid UTF-8: the upstream would not read the value checked"
        ) from None
    # ``Host`` second, as aiohttp's client writes it: after the request line.
    cut = head.index(b"\r\n") + 2
    if body:
        return b"".join((head[:cut], host_line, head[cut:], b"\r\n", body))
    return b"".join((head[:cut], host_line, head[cut:], b"\r\n"))
