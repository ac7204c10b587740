"""The least work the audit trail and tracing can do per call, counted in instructions.

    python -m bench.telemetry_floor [--calls 4000] [--gateway]

The telemetry targets ask that audit plus tracing cost at most 10% of throughput (every span
recorded, exported nowhere) and 20% with OTLP export, against the same gateway with audit and
telemetry off. This counts, under ``valgrind --tool=callgrind``, a loop that does only what
those features must do for every allowed call, with every value already at hand:

- audit: two lines (the decision, written before the call is forwarded, and the outcome),
  each a JSON object encoded by orjson, chained (the SHA-256 of the line before, as ``prev``)
  and written with one ``os.write`` to a file opened ``O_APPEND``;
- spans: the upstream span's id and ``traceparent`` drawn and formatted, the server span and
  the upstream span built as the SDK's ``ReadableSpan`` and handed to the SDK's
  ``BatchSpanProcessor`` (whose exporter drops them).

Nothing else: no record built from a call, no body digest, no timestamp formatted, no phase
span, no metric. Each loop runs at two lengths; the difference over the extra calls is the
figure per call (start-up cancels out). With ``--gateway`` the gateway's own instructions per
request are counted too (``bench.instructions``: ``otel-off``, ``otel-discard``,
``otel-otlp``), and the floor is set against them: the throughput the floor alone would cost
if time followed instructions.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("base", "audit", "spans", "both")


def child(mode: str, calls: int) -> None:
    """The loop itself (run under callgrind by ``count``)."""
    import orjson
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

    class Drop(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            return None

    # A queue that never fills: a dropped span would cost a log line, not the floor.
    processor = BatchSpanProcessor(Drop(), max_queue_size=1 << 20, max_export_batch_size=2048)
    resource, scope = Resource.create({}), InstrumentationScope("floor", "1")
    sampled = TraceFlags(TraceFlags.SAMPLED)
    server_kind, client_kind = SpanKind.SERVER, SpanKind.CLIENT
    ids = random.Random()  # noqa: S311 (span ids, as the gateway draws them)
    audit, spans = mode in ("audit", "both"), mode in ("spans", "both")
    with tempfile.TemporaryDirectory() as tmp:
        fd = os.open(Path(tmp) / "audit.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        prev = b',"prev":"' + b"0" * 64 + b'"}'
        for i in range(calls):
            request_id = f"r{i}"
            if audit:
                for line in (
                    {
                        "v": 2, "type": "decision", "time": "2026-12-06T11:37:58.820Z",
                        "request_id": request_id, "agent": "a", "jti": "j", "run": None,
                        "upstream": "u", "method": "GET", "path": "/p", "rule": "r",
                        "decision": "allow", "reason": "allowed", "status": None,
                        "duration_ms": 0.1,
                    },
                    {
                        "v": 2, "type": "outcome", "time": "2026-12-06T11:37:58.820Z",
                        "request_id": request_id, "agent": "a", "decision": "allow",
                        "reason": "allowed", "status": 200, "duration_ms": 0.3,
                    },
                ):  # fmt: skip
                    content = orjson.dumps(line)[:-1] + prev
                    os.write(fd, content + b"\n")
                    prev = b',"prev":"' + hashlib.sha256(content).hexdigest().encode() + b'"}'
            if spans:
                trace_id, span_id = ids.getrandbits(128), ids.getrandbits(64)
                upstream_id, started = ids.getrandbits(64), time.time_ns()
                _header = f"00-{trace_id:032x}-{upstream_id:016x}-01"
                server = SpanContext(trace_id, span_id, False, sampled)
                processor.on_end(
                    ReadableSpan(
                        "GET /u",
                        server,
                        None,
                        resource,
                        {"capgate.request_id": request_id, "capgate.agent": "a"},
                        kind=server_kind,
                        start_time=started,
                        end_time=time.time_ns(),
                        instrumentation_scope=scope,
                    )
                )
                processor.on_end(
                    ReadableSpan(
                        "capgate upstream",
                        SpanContext(trace_id, upstream_id, False, sampled),
                        server,
                        resource,
                        {"capgate.upstream": "u"},
                        kind=client_kind,
                        start_time=started,
                        end_time=time.time_ns(),
                        instrumentation_scope=scope,
                    )
                )
        os.close(fd)
    processor.shutdown()


def count(mode: str, calls: int) -> int:
    """Instructions of the whole child process (start-up included) for ``calls`` calls."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("bench.telemetry_floor: valgrind is not installed (apt: valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "floor.callgrind"
        subprocess.run(
            [
                valgrind,
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-m",
                "bench.telemetry_floor",
                "--child",
                mode,
                "--calls",
                str(calls),
            ],
            check=True,
            capture_output=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
        for line in out.read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise SystemExit("bench.telemetry_floor: callgrind wrote no total")


def per_call(calls: int) -> dict[str, float]:
    """Instructions per call of each mode, the loop's own (``base``) taken out."""
    raw = {m: (count(m, 3 * calls) - count(m, calls)) / (2 * calls) for m in MODES}
    return {m: raw[m] - raw["base"] for m in MODES if m != "base"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.telemetry_floor", description=__doc__)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--gateway", action="store_true", help="also count the gateway (otel-*)")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.calls)
        return 0
    floor = per_call(args.calls)
    print("the least work per call, instructions (callgrind):")
    for mode, label in (("audit", "audit: two chained lines"), ("spans", "spans: two, batched"),
                        ("both", "audit and spans")):  # fmt: skip
        print(f"  {label:<28}{floor[mode]:>10,.0f}")
    if not args.gateway:
        return 0
    from bench import instructions

    counts = instructions.gateway_counts(["otel-off", "otel-discard", "otel-otlp"], seconds=10)
    off = counts["otel-off"]
    print("the gateway, instructions per request (bench.instructions):")
    for name, value in counts.items():
        added = 100 * (value / off - 1)
        print(f"  {name:<28}{value:>10,.0f}  ({added:+.1f}% over otel-off)")
    share = floor["both"] / off
    print(
        f"floor of audit and spans over otel-off: {100 * share:+.1f}% instructions, so at best "
        f"{100 * (1 - 1 / (1 + share)):.1f}% of throughput if time followed instructions "
        "(target: at most 10%)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
