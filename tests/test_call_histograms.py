"""The call histograms aggregated by ``gateway/call_histograms.py`` against the SDK's own
``Histogram`` instrument fed the same values: the readers' data, the OTLP request the SDK's
encoder writes from it and the Prometheus text must say the same thing. And the failure
paths: a collector down, slow or answering 500 never blocks a record, and the series are
bounded."""

from __future__ import annotations

import http.server
import math
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from multidict import CIMultiDict
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway import __version__
from gateway.audit_record import AuditRecord, BodyMac
from gateway.call_histograms import CARDINALITY_LIMIT, OVERFLOW, CallHistogram, CallHistograms
from gateway.stages.audit import audit_records
from gateway.telemetry import DURATION_BUCKETS, SCOPE, CallMetrics, Plan, Telemetry
from gateway.testing import make_call

RESOURCE = Resource({"service.name": "capgate-test"})
# Values on every bucket bound, between them, beyond the last; and ones the SDK drops.
EDGES = [0.0, *DURATION_BUCKETS, *(b * 1.5 for b in DURATION_BUCKETS), 1e6]
DROPPED = [-1.0, -0.0001, math.inf, -math.inf, math.nan]


def values(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return EDGES + DROPPED + [rng.expovariate(1 / 0.02) for _ in range(n)]


def sdk_pair() -> tuple[Any, Any]:
    """The SDK's histogram instrument as ``CallMetrics`` made it, and its reader."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE)
    meter = provider.get_meter("capgate", __version__)
    histogram = meter.create_histogram(
        "capgate.call.duration",
        unit="s",
        description="Whole calls",
        explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
    )
    return histogram, reader


def own_pair() -> tuple[CallHistogram, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE)
    provider.get_meter("capgate", __version__)
    own = CallHistogram("capgate.call.duration", "s", "Whole calls", DURATION_BUCKETS)
    CallHistograms([own], RESOURCE, SCOPE).attach(reader)
    return own, reader


def normalised(data: MetricsData | None) -> list[dict[str, Any]]:
    """The data's histogram points without their times, sorted; sums rounded (the SDK adds
    per-collection partial sums, we add the values in turn: the last bits may differ)."""
    assert data is not None
    out = []
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    if not hasattr(p, "bucket_counts"):
                        continue
                    assert p.start_time_unix_nano <= p.time_unix_nano
                    out.append(
                        {
                            "resource": dict(rm.resource.attributes),
                            "scope": (sm.scope.name, sm.scope.version, sm.schema_url),
                            "metric": (m.name, m.unit, m.description),
                            "temporality": m.data.aggregation_temporality,
                            "attributes": dict(p.attributes),
                            "count": p.count,
                            "sum": float(f"{p.sum:.12g}"),
                            "buckets": tuple(p.bucket_counts),
                            "bounds": tuple(p.explicit_bounds),
                            "min": p.min,
                            "max": p.max,
                            "exemplars": list(p.exemplars),
                        }
                    )
    return sorted(out, key=lambda d: (d["metric"], sorted(d["attributes"].items())))


def labels(i: int) -> dict[str, str]:
    return {"decision": ("allow", "deny")[i % 2], "upstream": f"up-{i % 3}"}


def test_the_readers_get_what_the_sdks_histogram_gives() -> None:
    sdk, sdk_reader = sdk_pair()
    own, own_reader = own_pair()
    for collection in range(3):  # cumulative across collections, as the SDK's
        for i, v in enumerate(values(300, seed=collection)):
            attrs = labels(i)
            with _quiet():
                sdk.record(v, attrs)
            own.record(v, (attrs["decision"], attrs["upstream"]), attrs)
        sdk_data, own_data = sdk_reader.get_metrics_data(), own_reader.get_metrics_data()
        assert normalised(own_data) == normalised(sdk_data)
        assert len(normalised(own_data)) == 6


def test_the_otlp_request_decodes_to_the_sdks() -> None:
    sdk, sdk_reader = sdk_pair()
    own, own_reader = own_pair()
    for i, v in enumerate(values(200, seed=7)):
        with _quiet():
            sdk.record(v, labels(i))
        own.record(v, tuple(labels(i).values()), labels(i))
    sdk_req = encode_metrics(sdk_reader.get_metrics_data())
    own_req = encode_metrics(own_reader.get_metrics_data())
    for req in (sdk_req, own_req):
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.histogram.data_points:
                        p.start_time_unix_nano = p.time_unix_nano = 0
                        p.sum = float(f"{p.sum:.12g}")
                    m.histogram.data_points.sort(key=lambda p: p.SerializeToString())
    assert own_req == sdk_req


def prometheus(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(f"{s.value:.12g}")
    return out


def test_the_prometheus_text_is_the_sdks() -> None:
    texts = []
    for ours in (False, True):
        registry = CollectorRegistry()
        reader = PrometheusMetricReader(registry=registry, scope_info_enabled=False)
        provider = MeterProvider(metric_readers=[reader], resource=RESOURCE)
        meter = provider.get_meter("capgate", __version__)
        if ours:
            own = CallHistogram("capgate.call.duration", "s", "Whole calls", DURATION_BUCKETS)
            CallHistograms([own], RESOURCE, SCOPE).attach(reader)
            for i, v in enumerate(values(200, seed=3)):
                own.record(v, tuple(labels(i).values()), labels(i))
        else:
            sdk = meter.create_histogram(
                "capgate.call.duration",
                unit="s",
                description="Whole calls",
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
            )
            for i, v in enumerate(values(200, seed=3)):
                with _quiet():
                    sdk.record(v, labels(i))
        texts.append(generate_latest(registry))
    assert b"capgate_call_duration_seconds_bucket" in texts[1]
    assert prometheus(texts[1]) == prometheus(texts[0])


def metrics_records() -> Iterator[tuple[Any, AuditRecord]]:
    """Calls and records of several decisions, reasons and durations (no policy: the
    upstream and rule labels are the closed set's (other) and (none))."""
    rng = random.Random(11)
    for i in range(120):
        call = make_call("GET", f"/metrics/x/{i}", headers={})
        call.outbound_headers = CIMultiDict()
        [record] = audit_records(call, BodyMac(None))
        record = dict(record)  # type: ignore[assignment]
        record["decision"] = ("allow", "deny")[i % 2]
        record["reason"] = ("allowed", "token_missing", "rule_missing")[i % 3]
        record["upstream"] = (None, "metrics")[i % 2]
        record["duration_ms"] = rng.expovariate(1 / 20)
        if i % 4:
            call.upstream_started = 100.0
            call.upstream_ended = 100.0 + rng.expovariate(1 / 0.01)
        yield call, record


def test_call_metrics_export_what_the_sdk_instruments_did() -> None:
    """The whole ``CallMetrics``: with our histograms, and with the SDK's (the fallback)."""
    readers = [InMemoryMetricReader(), InMemoryMetricReader()]
    ours = CallMetrics(
        MeterProvider(metric_readers=[readers[0]], resource=RESOURCE), [readers[0]], RESOURCE
    )
    sdks = CallMetrics(MeterProvider(metric_readers=[readers[1]], resource=RESOURCE))
    assert ours.histograms is not None and sdks.histograms is None
    for call, record in metrics_records():
        ours.measure(call, record)
        sdks.measure(call, record)
    got = [normalised(r.get_metrics_data()) for r in readers]
    assert {p["metric"][0] for p in got[0]} == {
        "capgate.call.duration",
        "capgate.upstream.duration",
    }
    assert got[0] == got[1]
    names = [
        [m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
        for data in (r.get_metrics_data() for r in readers)
    ]
    assert sorted(names[0]) == sorted(names[1])


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta"),
        (
            "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION",
            "base2_exponential_bucket_histogram",
        ),
    ],
)
def test_a_reader_asking_for_delta_or_exponential_gets_the_sdks_histograms(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)  # read by the SDK's exporter itself
    telemetry = Telemetry(Plan(metrics_endpoint="http://127.0.0.1:9/v1/metrics"))
    assert telemetry.metrics is not None and telemetry.metrics.histograms is None
    call, record = next(metrics_records())
    telemetry.metrics.measure(call, record)  # through the SDK's instrument
    telemetry.close()
    monkeypatch.delenv(variable)
    telemetry = Telemetry(Plan(metrics_endpoint="http://127.0.0.1:9/v1/metrics", prometheus=True))
    assert telemetry.metrics is not None and telemetry.metrics.histograms is not None
    telemetry.close()


def test_series_are_bounded() -> None:
    own = CallHistogram("h", "s", "", DURATION_BUCKETS)
    for i in range(CARDINALITY_LIMIT + 500):
        own.record(0.001, i, {"n": str(i)})
    metric = own.metric(time.time_ns())
    assert metric is not None
    points = metric.data.data_points
    assert len(points) == CARDINALITY_LIMIT + 1
    [overflow] = [p for p in points if dict(p.attributes) == dict(OVERFLOW)]
    assert overflow.count == 500


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP endpoint that answers 500, or (``slow``) takes its time."""

    slow = 0.0

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(self.slow)
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.mark.parametrize("collector", ["down", "500", "slow"])
def test_a_failing_collector_never_blocks_a_call_nor_grows_memory(collector: str) -> None:
    server = None
    if collector == "down":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    else:
        handler = type("H", (_Collector,), {"slow": 2.0 if collector == "slow" else 0.0})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
    telemetry = Telemetry(
        Plan(
            spans="otlp",
            spans_endpoint=url + "/v1/traces",
            metrics_endpoint=url + "/v1/metrics",
            metrics_interval=0.05,  # exports keep failing while the calls go on
        )
    )
    try:
        assert telemetry.metrics is not None and telemetry.metrics.histograms is not None
        slowest = 0.0
        for n, (call, record) in enumerate(metrics_records()):
            if n % 10 == 0:
                time.sleep(0.02)  # let the exporters try
            telemetry.call_started(call)
            started = time.monotonic()
            telemetry.call_ended(call, [record])
            slowest = max(slowest, time.monotonic() - started)
        assert slowest < 0.5  # no call waits for an export (the slow one takes 2 s)
        series = sum(len(h._series) for h in telemetry.metrics.histograms.histograms)
        assert series <= 6  # (decision, upstream) and upstream pairs: no growth per call
    finally:
        telemetry.close()
        if server is not None:
            server.shutdown()
            server.server_close()


class _quiet:
    """The SDK logs a warning for each value it drops (negative, infinite)."""

    def __enter__(self) -> None:
        import logging

        self._logger = logging.getLogger("opentelemetry.sdk.metrics._internal.instrument")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)
