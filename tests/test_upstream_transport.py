"""The live transport's HTTP/1.1 client (gateway/transports/upstream.py), against real sockets.

The oracle for what is sent is aiohttp's own client, configured as the transport was before it
had its own: for any request both must put the same bytes on the wire. What comes back is read
by aiohttp's parser; these tests cover what the transport itself decides: interim answers,
answers out of turn, reuse of a connection, timeouts, cancellation and refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict
from yarl import URL

from gateway.errors import HttpInvalid, UpstreamTimeout, UpstreamUnavailable
from gateway.policy.model import Upstream
from gateway.transport import UpstreamRequest
from gateway.transports import upstream as live
from gateway.transports.upstream import LiveTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A loopback TCP server running ``handler`` per connection; remembers every connection's
    peer port and the bytes each request head had."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.peers: list[int] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.peers.append(writer.get_extra_info("peername")[1])
            try:
                await self.handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@contextlib.asynccontextmanager
async def served(handler: Handler) -> AsyncIterator[tuple[RawServer, LiveTransport]]:
    """A raw server running ``handler`` and a transport to it, both closed after."""
    async with RawServer(handler) as srv:
        transport = LiveTransport()
        try:
            yield srv, transport
        finally:
            await transport.close()


def replying(data: bytes, linger: float = 0.0) -> Handler:
    """A handler that reads one request head, writes ``data``, then keeps the connection
    open for ``linger`` seconds."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(linger)

    return handler


def first_then_own(first: Handler) -> Handler:
    """``first`` on the server's first connection; on every later one, each request answered
    ``own``: a call that lands on a new connection gets its own answer."""
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        if connections == 1:
            await first(reader, writer)
            return
        while True:
            await read_head(reader)
            writer.write(answer(b"own"))
            await writer.drain()

    return handler


def upstream(url: str, **kw: Any) -> Upstream:
    return Upstream(name="up", url=URL(url), **kw)


def request(up: Upstream, method: str = "GET", target: str = "/x", **kw: Any) -> UpstreamRequest:
    headers = kw.pop("headers", CIMultiDict({"Accept": "*/*"}))
    return UpstreamRequest(up, method, target, headers, kw.pop("body", None), **kw)


async def exchange(transport: LiveTransport, req: UpstreamRequest) -> tuple[int, bytes]:
    resp = await transport.send(req)
    try:
        return resp.status, await resp.read_all()
    finally:
        await resp.close()


async def read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def answer(body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


# --- what is sent -----------------------------------------------------------------------------


async def _sent_by_both(
    method: str,
    headers: CIMultiDict[str],
    body: bytes | None,
    oracle: bool = True,
    target: str = "/p?q=1",
) -> tuple[bytes, bytes | None]:
    """The bytes the transport and aiohttp's client (``oracle``) each send for one request, to
    the same server (the server answers and closes)."""
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_head(reader)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        seen.append(head + (await reader.readexactly(length) if length else b""))
        writer.write(answer(extra=b"Connection: close\r\n"))
        await writer.drain()

    async with served(handler) as (srv, transport):
        req = request(upstream(srv.url + "/base"), method, target, headers=headers, body=body)
        await exchange(transport, req)
        if not oracle:
            return seen[0], None
        async with (
            aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                trust_env=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            ) as session,
            session.request(
                method, URL(srv.url + "/base" + target, encoded=True), headers=headers, data=body
            ) as resp,
        ):
            await resp.read()
    mine, theirs = seen
    return mine, theirs


TOKEN_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"
header_names = st.text(TOKEN_CHARS, min_size=1, max_size=12).map(lambda n: "X-" + n)
# Any text a header may carry: printable ASCII, tab, and any non-ASCII character (UTF-8).
header_values = st.text(
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\x7f")
    | st.sampled_from(["\t", " "]),
    max_size=24,
).map(str.strip)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
    headers=st.lists(st.tuples(header_names, header_values), max_size=5),
    body=st.none() | st.binary(max_size=64),
    target=st.lists(
        st.sampled_from([*"abcXYZ019-._~!$&'()*+,;=:@/?", "%2F", "%25", "%C3%A9"]), max_size=16
    ).map(lambda parts: "/" + "".join(parts)),
)
def test_a_request_is_sent_as_aiohttps_client_sent_it(
    method: str, headers: list[tuple[str, str]], body: bytes | None, target: str
) -> None:
    """Differential: for any method, target (path and query as the target stage forwards
    them: percent-encoded), headers (any text, repeated names included) and body, the
    transport's bytes are the bytes aiohttp's client put on the wire. (One exception, not
    compared: aiohttp's URL type drops an empty query's '?'; the transport sends the target as
    the checks read it.)"""
    assume(not target.endswith("?"))
    mine, theirs = asyncio.run(_sent_by_both(method, CIMultiDict(headers), body, target=target))
    assert mine == theirs


async def test_framing_headers_given_to_the_transport_are_never_sent() -> None:
    headers = CIMultiDict(
        [
            ("Host", "evil.example"),
            ("Content-Length", "999"),
            ("Transfer-Encoding", "chunked"),
            ("Connection", "keep-alive, X-Keep"),
            ("Expect", "100-continue"),
            ("X-Ok", "1"),
        ]
    )
    sent, _ = await _sent_by_both("POST", headers, b"body", oracle=False)
    head, _, body = sent.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /base/p?q=1 HTTP/1.1"
    assert lines[1].startswith(b"Host: 127.0.0.1:")
    assert lines[2:] == [b"X-Ok: 1", b"Content-Length: 4"]
    assert body == b"body"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("X-A", "a\r\nX-Injected: 1"),
        ("X-A", "a\nb"),
        ("X-A", "a\rb"),
        ("X-A", "a\x00b"),
        ("X-A", "a\x7fb"),
        ("X-A", "ad\udcffmin"),  # bytes that were not UTF-8 when the agent sent them
        ("Bad Name", "v"),
        ("X-A:", "v"),
        ("", "v"),
    ],
)
async def test_a_header_the_upstream_would_read_differently_is_refused_unsent(
    name: str, value: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)

    async with served(handler) as (srv, transport):
        req = request(upstream(srv.url), headers=CIMultiDict([(name, value)]))
        with pytest.raises(HttpInvalid):
            await transport.send(req)
    assert srv.peers == []  # refused before any connection was made


@pytest.mark.parametrize(("method", "target"), [("GET", "/a b"), ("GET /x", "/"), ("G\r\nX", "/")])
async def test_a_request_line_that_could_be_read_two_ways_is_refused(
    method: str, target: str
) -> None:
    transport = LiveTransport()
    with pytest.raises(HttpInvalid):
        await transport.send(request(upstream("http://127.0.0.1:9"), method, target))


# --- what comes back --------------------------------------------------------------------------


async def test_sequential_calls_share_one_kept_alive_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_head(reader)
            writer.write(answer(b"hello"))
            await writer.drain()

    async with served(handler) as (srv, transport):
        for _ in range(5):
            assert await exchange(transport, request(upstream(srv.url))) == (200, b"hello")
    assert len(srv.peers) == 1


@pytest.mark.parametrize(
    "reply",
    [
        answer(extra=b"Connection: close\r\n"),  # the upstream asks to close it
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",  # HTTP/1.0 without keep-alive
        b"HTTP/1.1 200 OK\r\n\r\nok",  # delimited by the connection's end
    ],
)
async def test_a_connection_the_answer_ends_is_not_reused(reply: bytes) -> None:
    handler = replying(reply)

    async with served(handler) as (srv, transport):
        for _ in range(2):
            assert await exchange(transport, request(upstream(srv.url))) == (200, b"ok")
    assert len(srv.peers) == 2


async def test_an_answer_not_read_to_its_end_does_not_return_its_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_head(reader)
            writer.write(answer(b"x" * 200_000))
            await writer.drain()

    async with served(handler) as (srv, transport):
        resp = await transport.send(request(upstream(srv.url)))
        await resp.close()  # the body was never read
        assert await exchange(transport, request(upstream(srv.url))) == (200, b"x" * 200_000)
    assert len(srv.peers) == 2


async def test_interim_answers_are_skipped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>\r\n\r\n")
        writer.write(answer(b"final"))
        await writer.drain()

    async with served(handler) as (srv, transport):
        assert await exchange(transport, request(upstream(srv.url))) == (200, b"final")


@pytest.mark.parametrize(
    ("first_reply", "first_answer"),
    [
        (answer(b"first") + answer(b"SMUGGLED"), (200, b"first")),  # two answers to one request
        (b"HTTP/1.1 204 No Content\r\n\r\n" + answer(b"SMUGGLED"), (204, b"")),  # after a 204
    ],
)
async def test_an_answer_out_of_turn_never_reaches_the_next_call(
    first_reply: bytes, first_answer: tuple[int, bytes]
) -> None:
    """A desynchronised upstream (a second answer to one request, bytes after an answer that
    has no body) must not hand its extra answer to another call: the call gets its own
    answer, the connection is dropped, and the next call gets its own answer on a new one."""

    async def desynchronised(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_head(reader)
            writer.write(first_reply)
            await writer.drain()

    async with served(first_then_own(desynchronised)) as (srv, transport):
        assert await exchange(transport, request(upstream(srv.url))) == first_answer
        await asyncio.sleep(0.05)
        assert await exchange(transport, request(upstream(srv.url))) == (200, b"own")
    assert len(srv.peers) == 2


@pytest.mark.parametrize(
    "first",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 45\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 45\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 9\r\n\r\n"
        b"0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 45\r\nContent-Length: 45\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\nContent-Length: 9\r\n\r\n",
    ],
)
async def test_an_answer_framed_two_ways_never_shares_its_connection(first: bytes) -> None:
    """An answer whose framing another reader could take otherwise (Content-Length beside
    Transfer-Encoding, repeated or stacked codings) is refused or read as llhttp frames it,
    but its connection never carries the next call: whatever the upstream sends after it on
    that connection never becomes another call's answer."""

    async def framed_oddly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(first)
        await writer.drain()
        await read_head(reader)  # the next call, were the connection reused
        writer.write(answer(b"the rest of the first answer"))
        await writer.drain()

    async with served(first_then_own(framed_oddly)) as (srv, transport):
        with contextlib.suppress(UpstreamUnavailable):
            await exchange(transport, request(upstream(srv.url)))
        assert await exchange(transport, request(upstream(srv.url))) == (200, b"own")
    assert len(srv.peers) == 2


async def test_bytes_on_an_idle_connection_retire_it() -> None:
    async def unasked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(answer(b"one"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(answer(b"UNASKED"))  # while the connection sits in the pool
        await writer.drain()
        await read_head(reader)  # (never comes: the client retired this connection)

    async with served(first_then_own(unasked)) as (srv, transport):
        assert await exchange(transport, request(upstream(srv.url))) == (200, b"one")
        await asyncio.sleep(0.2)
        assert await exchange(transport, request(upstream(srv.url))) == (200, b"own")
    assert len(srv.peers) == 2


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n",
    ],
)
async def test_an_answer_that_is_not_http_is_an_upstream_error(reply: bytes) -> None:
    handler = replying(reply, linger=0.5)

    async with served(handler) as (srv, transport):
        with pytest.raises(UpstreamUnavailable):
            await exchange(transport, request(upstream(srv.url)))


async def test_a_body_cut_short_is_an_error_not_a_short_answer() -> None:
    handler = replying(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")

    async with served(handler) as (srv, transport):
        resp = await transport.send(request(upstream(srv.url)))
        with pytest.raises(UpstreamUnavailable):
            await resp.read_all()
        await resp.close()


async def test_a_closed_connection_before_the_answer_is_unavailable_and_not_resent() -> None:
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await read_head(reader))
        writer.transport.abort()

    async with served(handler) as (srv, transport):
        with pytest.raises(UpstreamUnavailable):
            await exchange(transport, request(upstream(srv.url), "DELETE"))
    assert len(heads) == 1


async def test_head_answers_have_no_body() -> None:
    handler = replying(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", linger=1)

    async with served(handler) as (srv, transport):
        resp = await transport.send(request(upstream(srv.url), "HEAD"))
        assert resp.status == 200 and resp.headers["Content-Length"] == "100"
        assert await asyncio.wait_for(resp.read_all(), 0.5) == b""
        await resp.close()


async def test_a_refused_connection_is_unavailable() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    transport = LiveTransport()
    with pytest.raises(UpstreamUnavailable):
        await transport.send(request(upstream(f"http://127.0.0.1:{port}")))


# --- time -------------------------------------------------------------------------------------


async def test_an_upstream_that_stops_sending_times_out_at_the_read_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        await asyncio.sleep(5)

    async with RawServer(handler) as srv:
        transport = LiveTransport()
        loop = asyncio.get_running_loop()
        try:
            t0 = loop.time()
            with pytest.raises(UpstreamTimeout):
                await transport.send(request(upstream(srv.url, read_timeout=0.3)))
            assert 0.25 <= loop.time() - t0 < 1.5
        finally:
            await transport.close()


async def test_a_body_that_stops_mid_way_times_out_at_the_read_timeout() -> None:
    handler = replying(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", linger=5)

    async with served(handler) as (srv, transport):
        resp = await transport.send(request(upstream(srv.url, read_timeout=0.3)))
        with pytest.raises(UpstreamTimeout):
            await resp.read_all()
        await resp.close()


async def test_a_trickling_answer_is_not_cut_by_the_read_timeout() -> None:
    """The read timeout is the gap between reads, not the whole answer's time (that is the
    call's deadline): one timer per connection re-arms while bytes keep coming."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n")
        for byte in b"abcdef":
            await asyncio.sleep(0.1)
            writer.write(bytes([byte]))
            await writer.drain()

    async with served(handler) as (srv, transport):
        got = await exchange(transport, request(upstream(srv.url, read_timeout=0.25)))
        assert got == (200, b"abcdef")


async def test_a_call_cancelled_while_waiting_drops_its_connection() -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        await reader.read()  # until the client closes
        closed.set()

    async with served(handler) as (srv, transport):
        task = asyncio.ensure_future(transport.send(request(upstream(srv.url))))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 2)


async def test_idle_connections_are_closed_after_the_keepalive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(live, "KEEPALIVE", 0.2)
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(answer())
        await writer.drain()
        await reader.read()
        closed.set()

    async with served(handler) as (srv, transport):
        assert await exchange(transport, request(upstream(srv.url))) == (200, b"ok")
        await asyncio.wait_for(closed.wait(), 2)


# --- TLS --------------------------------------------------------------------------------------


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture
async def tls_upstream(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"tls {request.path}")

    app = web.Application()
    app.router.add_get("/{tail:.*}", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"https://localhost:{port}", cert
    await runner.cleanup()


async def test_https_upstreams_are_verified(tls_upstream: tuple[str, Path]) -> None:
    url, cert = tls_upstream
    trusting = ssl.create_default_context(cafile=str(cert))
    transport = LiveTransport(tls=trusting)
    try:
        assert await exchange(transport, request(upstream(url), target="/a")) == (200, b"tls /a")
    finally:
        await transport.close()
    # The system's trust store does not know this certificate: refused, not sent.
    transport = LiveTransport()
    try:
        with pytest.raises(UpstreamUnavailable):
            await exchange(transport, request(upstream(url)))
    finally:
        await transport.close()


async def test_an_answer_dropped_unclosed_does_not_keep_its_connection() -> None:
    """A path that drops the answer without closing it (a bug, or a cancellation at the wrong
    instant) must not leave a connection open that nothing will ever read or pool."""
    import gc

    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(answer(b"x" * 100_000))
        await writer.drain()
        await reader.read()
        closed.set()

    async with served(handler) as (srv, transport):
        resp = await transport.send(request(upstream(srv.url)))
        assert resp.status == 200
        del resp
        gc.collect()
        await asyncio.wait_for(closed.wait(), 2)


async def test_a_slow_reader_pauses_the_upstream_without_timing_it_out() -> None:
    """An answer larger than the read buffer, read slower than the upstream sends it: the
    connection stops reading (flow control) and resumes, the body arrives whole, and the time
    the agent took is not counted as the upstream's silence."""
    body = bytes(range(256)) * 2048  # 512 KiB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_head(reader)
            writer.write(answer(body))
            await writer.drain()

    async with served(handler) as (srv, transport):
        up = upstream(srv.url, read_timeout=0.1)
        resp = await transport.send(request(up))
        got = bytearray()
        async for chunk in resp.iter_chunks():
            got += chunk
            await asyncio.sleep(0.15)  # each pause longer than the read timeout
        await resp.close()
        assert bytes(got) == body
        assert await exchange(transport, request(up)) == (200, body)  # reused, in step
    assert len(srv.peers) == 1


async def test_the_calls_deadline_is_kept_until_the_answers_head() -> None:
    """The live transport keeps the call's deadline itself (no timer of the call's own): an
    upstream that keeps trickling its head under the read timeout is cut at the deadline."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)

    assert LiveTransport.keeps_deadline
    async with served(handler) as (srv, transport):
        loop = asyncio.get_running_loop()
        up = upstream(srv.url, read_timeout=0.3, total_timeout=0.5)
        t0 = loop.time()
        with pytest.raises(UpstreamTimeout, match="deadline"):
            await transport.send(request(up, deadline=t0 + 0.5))
        assert 0.45 <= loop.time() - t0 < 1.5
        # A deadline already past: refused before anything is sent.
        with pytest.raises(UpstreamTimeout, match="deadline"):
            await transport.send(request(up, deadline=loop.time() - 1))
    assert len(srv.peers) == 1


@pytest.mark.parametrize(
    ("reply", "body"),
    [
        # chunked, with a chunk extension and trailers
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n",
            b"abcde",
        ),
        # 204 and 304 have no body, whatever their headers say
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n", b""),
        (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n", b""),
    ],
)
async def test_answers_are_framed_as_http_frames_them(reply: bytes, body: bytes) -> None:
    async with served(replying(reply, linger=0.3)) as (srv, transport):
        resp = await transport.send(request(upstream(srv.url)))
        assert await asyncio.wait_for(resp.read_all(), 1) == body
        await resp.close()


async def test_a_head_longer_than_the_parsers_limit_is_an_upstream_error() -> None:
    reply = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 20_000 + b"\r\nContent-Length: 0\r\n\r\n"
    async with served(replying(reply, linger=0.3)) as (srv, transport):
        with pytest.raises(UpstreamUnavailable):
            await exchange(transport, request(upstream(srv.url)))
