"""The ceiling: a bare aiohttp pass-through proxy with no checks at all.

    python -m bench.bare_proxy --upstream http://127.0.0.1:PORT [--port 0]

One pooled ``aiohttp.ClientSession`` for the process. Every request's method, raw path and
query, headers (minus hop-by-hop ones and ``Host``) and body are forwarded to the upstream as
they are, and the response is streamed back chunk by chunk. No redirects, no cookies, no
decompression: the same client settings capgate's live transport uses, and nothing else, so
the difference between this and capgate is the cost of capgate's checks and bookkeeping.

Listens on 127.0.0.1 only and prints one ready line:

    bench-bare-proxy listening {"url": "http://127.0.0.1:PORT", "pid": N}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
REQUEST_DROP = HOP_BY_HOP | {"host"}
CHUNK_SIZE = 64 * 1024

SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session")


def _dropped(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], base: frozenset[str]
) -> frozenset[str]:
    """``base`` plus the header names listed in ``Connection`` (hop-by-hop by declaration)."""
    named = {n.strip().lower() for v in headers.getall("Connection", ()) for n in v.split(",")}
    named.discard("")
    return base | named if named else base


def create_app(upstream: str) -> web.Application:
    origin = upstream.rstrip("/")

    async def forward(request: web.Request) -> web.StreamResponse:
        drop = _dropped(request.headers, REQUEST_DROP)
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in drop)
        data = request.content if request.body_exists else None
        url = URL(origin + request.raw_path, encoded=True)
        async with request.app[SESSION].request(
            request.method, url, headers=headers, data=data, allow_redirects=False
        ) as resp:
            out = web.StreamResponse(status=resp.status, reason=resp.reason)
            back = _dropped(resp.headers, HOP_BY_HOP)
            for k, v in resp.headers.items():
                if k.lower() not in back:
                    out.headers.add(k, v)
            await out.prepare(request)
            async for chunk in resp.content.iter_chunked(CHUNK_SIZE):
                await out.write(chunk)
            await out.write_eof()
            return out

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, limit_per_host=64),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=30),
        )
        yield
        await app[SESSION].close()

    app = web.Application(client_max_size=1024**3)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def serve(upstream: str, port: int) -> None:
    runner = web.AppRunner(create_app(upstream), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
    await site.start()
    server = site._server
    bound = server.sockets[0].getsockname()[1] if server and server.sockets else port
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {"url": f"http://127.0.0.1:{bound}", "pid": os.getpid(), "upstream": upstream}
    print(f"bench-bare-proxy listening {json.dumps(ready)}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bare_proxy")
    p.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:9101")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    url = URL(args.upstream)
    if url.host not in ("127.0.0.1", "localhost", "::1"):
        p.error("the bench proxy only forwards to a loopback upstream")
    asyncio.run(serve(args.upstream, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
