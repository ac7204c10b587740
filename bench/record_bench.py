"""Record mode across many runs: calls per second as runs accumulate, and the time to stop.

    python -m bench.record_bench [--runs 1000] [--calls 5] [--window 200] [--json FILE]

Drives ``RecordTransport`` in-process (no HTTP: a stand-in live transport answers at once,
so the figures are the recorder's own cost per call) for ``--runs`` runs of ``--calls`` calls
each, every run left open, into a fresh recording directory. Prints calls/s for each window of
``--window`` runs, the ratio of the last window to the first (flat is ~1.0; the recorder once
went from 166 to 64 calls/s over 1,000 runs), and how long ``close()`` took with every run
still open (it once took over 20 s). The tests assert the structure (the work per call does
not grow with the runs, the manifest is written once at the end: see
``tests/recording/test_durability.py``); this gives the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from multidict import CIMultiDict

from gateway.policy.load import load_policy
from gateway.transport import UpstreamRequest
from gateway.transports.record import RecordTransport

POLICY = """
version: 1
upstreams:
  api: {url: "http://127.0.0.1:9"}
roles:
  reader:
    rules:
      - {id: items, upstream: api, allow: GET /items}
"""
BODY = b'{"items": [1, 2, 3], "next": null}'


class Answer:
    status = 200
    reason = "OK"

    def __init__(self) -> None:
        self.headers: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json"})

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield BODY

    async def read_all(self) -> bytes:
        return BODY

    async def close(self) -> None:
        return None


class Live:
    async def send(self, request: UpstreamRequest) -> Answer:
        return Answer()

    async def close(self) -> None:
        return None


async def measure(runs: int, calls: int, window: int, directory: Path) -> dict[str, Any]:
    policy = load_policy("bench.yaml", POLICY)
    upstream, rule = policy.upstreams["api"], policy.rules_by_id["items"]
    recorder = RecordTransport(Live(), directory)
    windows: list[float] = []
    started = time.perf_counter()
    for r in range(runs):
        for _ in range(calls):
            request = UpstreamRequest(
                upstream=upstream,
                method="GET",
                target="/items",
                headers=CIMultiDict(),
                body=None,
                agent="bench",
                run=f"run-{r}",
                rule=rule,
            )
            response = await recorder.send(request)
            await response.read_all()
            await response.close()
        if (r + 1) % window == 0:
            now = time.perf_counter()
            windows.append(window * calls / (now - started))
            print(
                f"runs {r + 1 - window + 1:>6}-{r + 1:<6} {windows[-1]:>9.0f} calls/s", flush=True
            )
            started = now
    open_runs = len(recorder.sessions)
    t = time.perf_counter()
    await recorder.close()
    close_s = time.perf_counter() - t
    ratio = windows[-1] / windows[0] if windows else 1.0
    print(f"last window / first window: {ratio:.2f}")
    print(f"close() with {open_runs} runs open: {close_s * 1000:.0f} ms")
    return {
        "runs": runs,
        "calls_per_run": calls,
        "window": window,
        "calls_per_s": [round(w) for w in windows],
        "last_to_first": round(ratio, 3),
        "close_ms": round(close_s * 1000, 1),
        "manifest_writes": recorder.writer.manifest_writes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=5, help="calls per run")
    parser.add_argument("--window", type=int, default=200, help="runs per reported window")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="capgate-record-bench-") as tmp:
        result = asyncio.run(measure(args.runs, args.calls, args.window, Path(tmp) / "rec"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
