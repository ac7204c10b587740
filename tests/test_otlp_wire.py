"""Our OTLP span bytes decode to exactly what the SDK's own encoder produces."""

from __future__ import annotations

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from gateway.otlp_wire import Encoder
from gateway.telemetry import SCOPE


def spans() -> list[ReadableSpan]:
    resource = Resource({"service.name": "capgate", "service.version": "0.1.0", "n": 3})
    sampled = TraceFlags(TraceFlags.SAMPLED)
    server = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, False, sampled)
    agent = SpanContext(0x1234, 0x5678, True, sampled)
    attrs = {
        "capgate.request_id": "0123456789abcdef",
        "capgate.agent": "bench-bot",
        "capgate.decision": "deny",
        "http.response.status_code": 403,
        "neg": -5,
        "ok": True,
        "ratio": 0.25,
        "list": ["a", "b"],
        "unicode": "\u00e9t\u00e9",
    }
    out = []
    for i in range(3):  # repeated pairs come from the cache the second time
        out.append(
            ReadableSpan(
                "GET /metrics",
                server,
                None,
                resource,
                attrs,
                links=(Link(agent, {"capgate.link": "agent"}),),
                kind=SpanKind.SERVER,
                status=Status(StatusCode.ERROR, "no_rule"),
                start_time=1_764_620_000_000_000_000 + i,
                end_time=1_764_620_000_000_500_000 + i,
                instrumentation_scope=SCOPE,
            )
        )
        out.append(
            ReadableSpan(
                "capgate upstream",
                SpanContext(server.trace_id, 0x42 + i, False, sampled),
                server,
                resource,
                {"capgate.upstream": "metrics"},
                kind=SpanKind.CLIENT,
                start_time=1,
                end_time=2,
                instrumentation_scope=SCOPE,
            )
        )
        out.append(  # a remote parent, an OK status, a name that is not ASCII
            ReadableSpan(
                "capgate v\u00e9rifie",
                SpanContext(server.trace_id, 0xFFFFFFFFFFFFFFF0 + i, False, sampled),
                agent,
                resource,
                kind=SpanKind.INTERNAL,
                status=Status(StatusCode.OK),
                start_time=5,
                end_time=6,
                instrumentation_scope=SCOPE,
            )
        )
        out.append(
            ReadableSpan(
                "capgate checks",
                SpanContext(server.trace_id, 0x99 + i, False, sampled),
                server,
                resource,
                start_time=3,
                end_time=4,
                instrumentation_scope=SCOPE,
            )
        )
    for flag in (1, True, 1.0):  # equal as dict keys, not on the wire
        out.append(  # pairs also seen on a link and the resource: each field's own tag
            ReadableSpan(
                "capgate match",
                SpanContext(server.trace_id, 0x77, False, sampled),
                server,
                resource,
                {"capgate.link": "agent", "n": 3, "flag": flag},
                start_time=7,
                end_time=8,
                instrumentation_scope=SCOPE,
            )
        )
    return out


def test_our_bytes_decode_to_the_sdks_request() -> None:
    batch = spans()
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(Encoder().request(batch))
    assert MessageToDict(ours) == MessageToDict(encode_spans(batch))
    assert ours == encode_spans(batch)


def test_spans_of_several_resources_and_scopes_interleaved() -> None:
    """Grouped per resource, then per scope, in the order first seen (as the SDK does)."""
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    batch = spans()
    other_resource = Resource({"service.name": "other"})
    other_scope = InstrumentationScope("other", "2", "https://schema.example/1")
    mixed = []
    for i, span in enumerate(batch):
        resource = other_resource if i % 3 == 1 else span.resource
        scope = other_scope if i % 2 else span.instrumentation_scope
        mixed.append(
            ReadableSpan(
                span.name,
                span.context,
                span.parent,
                resource,
                span.attributes,
                links=span.links,
                kind=span.kind,
                status=span.status,
                start_time=span.start_time,
                end_time=span.end_time,
                instrumentation_scope=scope,
            )
        )
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(Encoder().request(mixed))
    assert ours == encode_spans(mixed)
