"""Fallback load generator for when ``wrk`` is not installed (asyncio + raw sockets).

    python -m bench.loadgen --url http://127.0.0.1:PORT/path -c 32 -d 5 [-H 'Name: value']...
                            [--method POST] [--body-file FILE]
                            [--auth-file FILE] [--body-prefix-file F --body-suffix-file F
                                                --seq-start N]

N workers, each with one keep-alive HTTP/1.1 connection, send requests back to back for the
duration and record each request's latency. Prints one JSON object: requests, seconds,
rps, p50_ms, p99_ms, non2xx, errors, seq_next. Being Python on one core, it saturates well
before wrk does, so its req/s at high connection counts is a floor for the server, not a
ceiling.

``--auth-file``: one ``Authorization`` value per line; the requests take them in turn
(round-robin over all workers), so consecutive requests carry different tokens.
``--body-prefix-file``/``--body-suffix-file``: every request's body is
``prefix + str(n) + suffix`` with ``n`` counting up from ``--seq-start``, so no two requests
carry the same body; ``seq_next`` in the output is the first ``n`` not used.
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


class Requests:
    """Builds each request's bytes: a fixed one, or one that varies per request (the
    ``Authorization`` header taken in turn from a list, a body with a counter in it)."""

    def __init__(
        self,
        head: list[str],
        auths: list[str],
        body: bytes | None = None,
        body_seq: tuple[bytes, bytes, int] | None = None,
    ) -> None:
        self.head = head  # request line and headers, without Authorization or Content-Length
        self.auths = auths
        self.body = body
        self.prefix, self.suffix, self.seq = body_seq if body_seq else (b"", b"", 0)
        self.sequenced = body_seq is not None
        self.turn = 0
        self._heads = [self._head(a) for a in auths] or [self._head(None)]
        fixed = len(self._heads) == 1 and not self.sequenced
        self._fixed = self._heads[0] + self._tail(body) if fixed else None

    def _head(self, auth: str | None) -> bytes:
        lines = [*self.head, *([f"Authorization: {auth}"] if auth is not None else [])]
        return ("\r\n".join(lines) + "\r\n").encode()

    @staticmethod
    def _tail(body: bytes | None) -> bytes:
        if body is None:
            return b"\r\n"
        return f"Content-Length: {len(body)}\r\n\r\n".encode() + body

    def next(self) -> bytes:
        if self._fixed is not None:
            return self._fixed
        head = self._heads[self.turn % len(self._heads)]
        self.turn += 1
        if not self.sequenced:
            return head + self._tail(self.body)
        body = self.prefix + str(self.seq).encode() + self.suffix
        self.seq += 1
        return head + self._tail(body)


async def _worker(
    host: str,
    port: int,
    requests: Requests,
    deadline: float,
    latencies: list[float],
    counts: dict[str, int],
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline:
            request = requests.next()
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
    auths: list[str] | None = None,
    body_seq: tuple[bytes, bytes, int] | None = None,
) -> dict[str, float]:
    u = URL(url)
    if u.host not in ("127.0.0.1", "localhost"):
        raise SystemExit("bench.loadgen only targets 127.0.0.1")
    target = u.raw_path_qs or "/"
    lines = [f"{method} {target} HTTP/1.1", f"Host: {u.host}:{u.port}", "Connection: keep-alive"]
    lines += headers
    requests = Requests(lines, auths or [], body, body_seq)
    latencies: list[float] = []
    counts = {"non2xx": 0, "errors": 0}
    started = time.perf_counter()
    deadline = started + duration
    await asyncio.gather(
        *(
            _worker(u.host or "127.0.0.1", u.port or 80, requests, deadline, latencies, counts)
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
        "seq_next": requests.seq,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen")
    p.add_argument("--url", required=True)
    p.add_argument("-c", "--connections", type=int, default=1)
    p.add_argument("-d", "--duration", type=float, default=5.0)
    p.add_argument("-H", "--header", action="append", default=[])
    p.add_argument("--method", default="GET")
    p.add_argument("--body-file", type=Path)
    p.add_argument("--auth-file", type=Path, help="Authorization values, one a line, in turn")
    p.add_argument("--body-prefix-file", type=Path, help="body before the counter")
    p.add_argument("--body-suffix-file", type=Path, help="body after the counter")
    p.add_argument("--seq-start", type=int, default=1, help="the counter's first value")
    args = p.parse_args(argv)
    body = args.body_file.read_bytes() if args.body_file else None
    auths = args.auth_file.read_text().splitlines() if args.auth_file else []
    body_seq = None
    if args.body_prefix_file or args.body_suffix_file:
        if body is not None or not (args.body_prefix_file and args.body_suffix_file):
            p.error("--body-prefix-file and --body-suffix-file go together, without --body-file")
        prefix, suffix = args.body_prefix_file.read_bytes(), args.body_suffix_file.read_bytes()
        body_seq = (prefix, suffix, args.seq_start)
    result = asyncio.run(
        run(
            args.url,
            args.connections,
            args.duration,
            args.header,
            args.method,
            body,
            [a for a in auths if a],
            body_seq,
        )
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
