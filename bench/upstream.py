"""The benchmark's upstream: a tiny aiohttp app with one fixed JSON answer.

    python -m bench.upstream [--port 0] [--token SECRET]

``GET /metrics/cpu`` answers a fixed ~200-byte JSON body and looks at nothing else in the
request (not even the query). With ``--token`` it also requires
``Authorization: Bearer SECRET`` (401 otherwise), which proves that capgate injected the
credential. Every other path is 404. Listens on 127.0.0.1 only and prints one ready line:

    bench-upstream listening {"url": "http://127.0.0.1:PORT", "pid": N}
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import signal

from aiohttp import web

BODY = json.dumps(
    {
        "metric": "cpu",
        "window": "5m",
        "unit": "percent",
        "host": "bench-1",
        "samples": [12.5, 13.0, 11.75, 14.25, 12.0, 15.5, 13.25, 12.75, 11.5, 12.25],
        "mean": 12.875,
        "max": 15.5,
        "ok": True,
    },
    separators=(",", ":"),
).encode()


def create_app(token: str | None) -> web.Application:
    expected = f"Bearer {token}".encode() if token else None

    async def cpu(request: web.Request) -> web.Response:
        if expected is not None:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                return web.Response(
                    status=401, body=b'{"error":"unauthorized"}', content_type="application/json"
                )
        return web.Response(body=BODY, content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics/cpu", cpu)
    # The SQL scenario's database: the same fixed answer (the bench measures the gateway).
    app.router.add_post("/query", cpu)
    return app


async def serve(port: int, token: str | None) -> None:
    runner = web.AppRunner(create_app(token), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
    await site.start()
    server = site._server
    bound = server.sockets[0].getsockname()[1] if server and server.sockets else port
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {"url": f"http://127.0.0.1:{bound}", "pid": os.getpid()}
    print(f"bench-upstream listening {json.dumps(ready)}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.upstream")
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--token",
        default=os.environ.get("BENCH_UPSTREAM_TOKEN"),
        help="require 'Authorization: Bearer TOKEN' (default $BENCH_UPSTREAM_TOKEN)",
    )
    args = p.parse_args(argv)
    asyncio.run(serve(args.port, args.token or None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
