"""A chaos upstream: a real HTTP server on loopback that misbehaves on request.

Fault tests point the gateway at it; the chaos mode of a load run reuses the same faults. It
is written on asyncio streams, not aiohttp's server, so that it can do what a well-behaved
server never would: trickle bytes, reset a connection mid-answer, answer garbage.

The path chooses the fault, query parameters tune it::

    GET /ok                          200 with a small JSON body
    GET /slow?delay=S                wait S seconds, then answer
    GET /trickle?every=S&bytes=N     a declared N-byte body, one byte every S seconds
                     (&chunked=1: chunked, a chunk per byte: the answer streams)
    GET /trickle-head?every=S        the status line and headers, one byte every S seconds
    GET /hang                        read the request, never answer (until the peer leaves)
    GET /reset                       read the request, then reset the connection (RST)
    GET /reset-mid?bytes=N           send the head and N body bytes, then reset
    GET /close                       read the request, close without a byte
    GET /huge?mib=N                  a chunked body of N MiB (default: endless);
                                     &declared=1: with its Content-Length instead
    GET /garbage                     bytes that are not HTTP
    GET /status?code=C               an empty answer with status C
    GET /echo                        the request's head and body, as JSON

``down_url()`` gives a URL on which nothing listens. ``ChaosUpstream.stats`` counts requests
by fault and the connections open now, so a test can tell that the gateway let go.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024 * 1024


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    def number(self, name: str, default: float) -> float:
        try:
            return float(self.query.get(name, default))
        except ValueError:
            return default


Writer = asyncio.StreamWriter
Fault = Callable[[Request, Writer], Awaitable[None]]


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _json(status: int, payload: object) -> bytes:
    body = json.dumps(payload).encode()
    head = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    return _head(status, head) + body


def reset(writer: Writer) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), not a polite FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _ok(req: Request, w: Writer) -> None:
    w.write(_json(200, {"ok": True, "path": req.path}))


async def _slow(req: Request, w: Writer) -> None:
    await asyncio.sleep(req.number("delay", 5.0))
    w.write(_json(200, {"ok": True, "slow": True}))


async def _trickle(req: Request, w: Writer) -> None:
    size, every = int(req.number("bytes", 60)), req.number("every", 1.0)
    chunked = req.query.get("chunked") == "1"
    framing = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(size)}
    w.write(_head(200, {"Content-Type": "text/plain", **framing}))
    for _ in range(size):
        await w.drain()
        await asyncio.sleep(every)
        w.write(b"1\r\nx\r\n" if chunked else b"x")
    if chunked:
        w.write(b"0\r\n\r\n")


async def _trickle_head(req: Request, w: Writer) -> None:
    every = req.number("every", 1.0)
    for byte in _json(200, {"ok": True}):
        w.write(bytes([byte]))
        await w.drain()
        await asyncio.sleep(every)


async def _hang(req: Request, w: Writer) -> None:
    await asyncio.sleep(3600)


async def _reset(req: Request, w: Writer) -> None:
    reset(w)


async def _reset_mid(req: Request, w: Writer) -> None:
    sent = int(req.number("bytes", 100))
    w.write(_head(200, {"Content-Type": "text/plain", "Content-Length": str(sent * 10)}))
    w.write(b"y" * sent)
    await w.drain()
    await asyncio.sleep(0.05)
    reset(w)


async def _close(req: Request, w: Writer) -> None:
    w.close()


async def _huge(req: Request, w: Writer) -> None:
    mib = req.number("mib", -1)
    block = b"z" * 65536
    if req.query.get("declared") == "1":  # the size said up front (mib, default 1024)
        size = int((mib if mib > 0 else 1024) * 1024 * 1024)
        w.write(
            _head(200, {"Content-Type": "application/octet-stream", "Content-Length": str(size)})
        )
        for _ in range(size // len(block)):
            w.write(block)
            await w.drain()
        return
    w.write(
        _head(200, {"Content-Type": "application/octet-stream", "Transfer-Encoding": "chunked"})
    )
    sent = 0
    while mib < 0 or sent < mib * 16:
        w.write(b"10000\r\n" + block + b"\r\n")
        await w.drain()
        sent += 1
    w.write(b"0\r\n\r\n")


async def _garbage(req: Request, w: Writer) -> None:
    w.write(b"\x00\xffNOT HTTP AT ALL\r\n\r\n")


async def _status(req: Request, w: Writer) -> None:
    w.write(_head(int(req.number("code", 500)), {"Content-Length": "0"}))


async def _echo(req: Request, w: Writer) -> None:
    w.write(
        _json(
            200,
            {
                "method": req.method,
                "path": req.path,
                "headers": req.headers,
                "body": req.body.decode("latin-1"),
            },
        )
    )


FAULTS: dict[str, Fault] = {
    "ok": _ok,
    "slow": _slow,
    "trickle": _trickle,
    "trickle-head": _trickle_head,
    "hang": _hang,
    "reset": _reset,
    "reset-mid": _reset_mid,
    "close": _close,
    "huge": _huge,
    "garbage": _garbage,
    "status": _status,
    "echo": _echo,
}


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One HTTP/1.1 request (Content-Length bodies only), or None at a clean end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip()] = value.strip()
    length = int(headers.get("Content-Length", "0") or 0)
    body = await reader.readexactly(min(length, MAX_BODY)) if length else b""
    parts = urlsplit(target)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return Request(method, parts.path, query, headers, body)


@dataclass
class ChaosUpstream:
    """The chaos server; ``async with ChaosUpstream() as up:`` starts it on a free port."""

    host: str = "127.0.0.1"
    port: int = 0
    stats: Counter[str] = field(default_factory=Counter)
    open_connections: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> ChaosUpstream:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> ChaosUpstream:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: Writer) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.open_connections += 1
        try:
            while True:
                req = await read_request(reader)
                if req is None:
                    return
                name = req.path.strip("/").split("/")[-1] or "ok"
                fault = FAULTS.get(name)
                self.stats[name if fault else "unknown"] += 1
                if fault is None:
                    writer.write(_json(404, {"error": f"no fault {name!r}"}))
                    await writer.drain()
                    continue
                if not await _until_peer_leaves(fault(req, writer), reader):
                    self.stats["peer left"] += 1
                    return
                if writer.transport.is_closing():
                    return
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.open_connections -= 1
            self._tasks.discard(task)
            if not writer.transport.is_closing():
                writer.close()


async def _until_peer_leaves(work: Awaitable[None], reader: asyncio.StreamReader) -> bool:
    """Run ``work``; False (and ``work`` cancelled) if the peer closed the connection first,
    so a slow or hanging fault lets go as soon as the gateway does."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            if reader.at_eof():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await task
                return False
            await asyncio.wait([task], timeout=0.02)
        task.result()
        return True
    finally:
        if not task.done():
            task.cancel()


def down_url() -> str:
    """A loopback URL on which nothing listens (a port bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9199)
    args = parser.parse_args(argv)

    async def run() -> None:
        async with ChaosUpstream(args.host, args.port) as up:
            print(f"chaos upstream listening on {up.url}", flush=True)
            await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
