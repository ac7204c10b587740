"""What telemetry adds to one call, in-process: microseconds of CPU per call for each part.

    python -m bench.telemetry_bench [--calls 5000] [--rounds 7]

Each configuration runs the per-call telemetry work on ended calls made by
``gateway.testing.make_call`` (the server span's start, the upstream span and its
``traceparent``, the spans built at the end and handed to the SDK's batch processor with an
exporter that drops them; the metrics' counter and histograms), with no other stage, so the
figure is the telemetry's own. The OTLP configuration exports to a local receiver
(``mocks/otlp_receiver.py``, another process); the CPU time is the whole process's, so the
exporting threads' encoding and posting count, and each round ends with a flush. Rounds
alternate the configurations and the minimum of each is reported (the least disturbed by
other work on the machine). Compare with the CPU per request of a whole call
(``bench.run``, column "srv CPU us/req").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable

from multidict import CIMultiDict

from gateway.audit_record import BodyMac
from gateway.pipeline import CHECK_STAGES
from gateway.stages.audit import audit_records
from gateway.telemetry import PHASES, Plan, Telemetry
from gateway.testing import make_call

STAGES = CHECK_STAGES
AGENT_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def per_call_us(telemetry: Telemetry | None, calls: int, traceparent: bool = False) -> float:
    """CPU microseconds per call of ``telemetry``'s per-call work (process time)."""
    headers = {"Authorization": "Bearer x"}
    if traceparent:
        headers["traceparent"] = AGENT_TRACEPARENT
    batch = [
        make_call("GET", "/metrics/metrics/cpu?window=5m", headers=headers) for _ in range(calls)
    ]
    for call in batch:
        call.outbound_headers = CIMultiDict()
    records = audit_records(batch[0], BodyMac(None))
    clock = time.monotonic
    started = time.process_time()
    for call in batch:
        if telemetry is not None and telemetry.tracing:
            telemetry.call_started(call)
            marks = call.marks
            assert marks is not None
            for _ in STAGES:
                marks.append(clock())
            telemetry.upstream_started(call)
        call.upstream_started = clock()
        call.upstream_ended = clock()
        if telemetry is not None:
            telemetry.call_ended(call, records)
    if telemetry is not None:
        telemetry.flush()  # what is still batched is exported (and its CPU counted) here
    return (time.process_time() - started) / calls * 1e6


def _phases() -> tuple[tuple[str, int, int], ...]:
    return tuple((span, STAGES.index(a), STAGES.index(b)) for span, a, b in PHASES)


CONFIGS: dict[str, tuple[Callable[[], Telemetry | None], bool, bool]] = {
    # name: (telemetry factory, child spans, agent traceparent)
    "nothing": (lambda: None, False, False),
    "server span only": (lambda: Telemetry(Plan(spans="discard")), False, False),
    "server + all child spans": (lambda: Telemetry(Plan(spans="discard")), True, False),
    "... + agent traceparent": (lambda: Telemetry(Plan(spans="discard")), True, True),
    "metrics only": (lambda: Telemetry(Plan(prometheus=True)), False, False),
    "spans + metrics": (lambda: Telemetry(Plan(spans="discard", prometheus=True)), True, False),
    # Both exported by OTLP/HTTP to the receiver (a metrics interval longer than the run:
    # the flush ending each round exports them once).
    "OTLP spans + metrics": (lambda: Telemetry(_otlp_plan()), False, False),
}
RECEIVER: list[str] = []  # the receiver's URL, once started


def _otlp_plan() -> Plan:
    url = RECEIVER[0]
    return Plan(
        spans="otlp",
        spans_endpoint=url + "/v1/traces",
        metrics_endpoint=url + "/v1/metrics",
        metrics_interval=3600.0,
    )


def _start_receiver() -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mocks.otlp_receiver", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # otlp-receiver listening {"ready": true, "url": ...}
    RECEIVER[:] = [json.loads(line.split(" ", 2)[2])["url"]]
    return proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.telemetry_bench")
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    receiver = _start_receiver()
    try:
        best = _rounds(args.calls, args.rounds)
    finally:
        with receiver:  # closes its stdout once it has ended
            receiver.terminate()
    print(f"telemetry per call, CPU us (min of {args.rounds} rounds of {args.calls} calls):")
    for name, us in best.items():
        print(f"  {name:<26} {us:8.1f}")
    return 0


def _rounds(calls: int, rounds: int) -> dict[str, float]:
    best: dict[str, float] = {}
    for round_no in range(rounds):
        names = list(CONFIGS) if round_no % 2 == 0 else list(CONFIGS)[::-1]
        for name in names:
            make, children, tp = CONFIGS[name]
            telemetry = make()
            if telemetry is not None and children:
                telemetry.phases = _phases()
                telemetry.phase_min = 0.0  # every phase a span: the dearest case
            us = per_call_us(telemetry, calls, traceparent=tp)
            if telemetry is not None:
                telemetry.close()
            best[name] = min(best.get(name, us), us)
    return best


if __name__ == "__main__":
    raise SystemExit(main())
