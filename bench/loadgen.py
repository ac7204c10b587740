"""Fallback load generator for when ``wrk`` is not installed (asyncio + raw sockets).

    python -m bench.loadgen --url http://127.0.0.1:PORT/path -c 32 -d 5 [-H 'Name: value']...

N workers, each with one keep-alive HTTP/1.1 connection, send GETs back to back for the
duration and record each request's latency. Prints one JSON object: requests, seconds,
rps, p50_ms, p99_ms, non2xx, errors. Being Python on one core, it saturates well before wrk
does, so its req/s at high connection counts is a floor for the server, not a ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from yarl import URL


def percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, round(pct / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length: int | None = None
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip())
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await reader.readexactly(length)
    return status


async def _worker(
    host: str,
    port: int,
    request: bytes,
    deadline: float,
    latencies: list[float],
    counts: dict[str, int],
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            writer.write(request)
            try:
                status = await _read_response(reader)
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                counts["errors"] += 1
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                continue
            latencies.append(time.perf_counter() - t0)
            if not 200 <= status < 400:
                counts["non2xx"] += 1
    finally:
        writer.close()


async def run(
    url: str,
    connections: int,
    duration: float,
    headers: list[str],
    method: str = "GET",
    body: bytes | None = None,
) -> dict[str, float]:
    u = URL(url)
    if u.host not in ("127.0.0.1", "localhost"):
        raise SystemExit("bench.loadgen only targets 127.0.0.1")
    target = u.raw_path_qs or "/"
    lines = [f"{method} {target} HTTP/1.1", f"Host: {u.host}:{u.port}", "Connection: keep-alive"]
    lines += headers
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")
    latencies: list[float] = []
    counts = {"non2xx": 0, "errors": 0}
    started = time.perf_counter()
    deadline = started + duration
    await asyncio.gather(
        *(
            _worker(u.host or "127.0.0.1", u.port or 80, request, deadline, latencies, counts)
            for _ in range(connections)
        )
    )
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "requests": len(latencies),
        "seconds": elapsed,
        "rps": len(latencies) / elapsed if elapsed > 0 else 0.0,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "non2xx": counts["non2xx"],
        "errors": counts["errors"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen")
    p.add_argument("--url", required=True)
    p.add_argument("-c", "--connections", type=int, default=1)
    p.add_argument("-d", "--duration", type=float, default=5.0)
    p.add_argument("-H", "--header", action="append", default=[])
    p.add_argument("--method", default="GET")
    p.add_argument("--body-file", type=Path)
    args = p.parse_args(argv)
    body = args.body_file.read_bytes() if args.body_file else None
    result = asyncio.run(
        run(args.url, args.connections, args.duration, args.header, args.method, body)
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
