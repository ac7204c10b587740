"""OTLP/protobuf bytes of finished spans, written directly: the export's hot loop.

The SDK's encoder (``opentelemetry.exporter.otlp.proto.common``) builds a protobuf object
per span, attribute and value in Python; the bench measured it at ~85 µs a span on a busy
2-core machine, most of what OTLP export cost a call. Our spans have a fixed, small shape
and their attribute pairs repeat (decision, reason, rule, upstream, method, path), so each
``key=value`` pair and each span name is encoded once and kept (bounded), the fields of fixed
shape (ids, times, flags) are a constant tag and the value's bytes, and a span is a few byte
strings joined (~12 µs a span here, less than half of what encoding every field as it came
cost). ``test_otlp_wire`` checks the bytes decode to exactly what the SDK's encoder gives.

Wire format (protobuf): a field is ``varint(number << 3 | wire type)`` then a varint, eight
little-endian bytes (fixed64), four (fixed32), or a varint length and the bytes.
``opentelemetry/proto/trace/v1/trace.proto`` names the fields used below.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import DEFAULT_TRACE_STATE, SpanKind, StatusCode

MAX_CACHED = 4096  # encoded key=value pairs kept
MAX_NAMES = 256  # encoded span names kept
_HAS_IS_REMOTE = 0x100  # SpanFlags: the is_remote bit below is meaningful
_IS_REMOTE = 0x200
_NO_STATE = DEFAULT_TRACE_STATE  # the empty TraceState every SpanContext has by default
_SPAN_FIELD = 2 << 3 | 2  # ScopeSpans.spans (each span's tag, then its length)
_SMALL = [bytes((n,)) for n in range(0x80)]  # the varints of one byte
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _fixed64(number: int, value: int) -> bytes:
    return _varint(number << 3 | 1) + _U64.pack(value)


def _fixed32(number: int, value: int) -> bytes:
    return _varint(number << 3 | 5) + _U32.pack(value)


# The span's fields whose tag and length never change, written once (trace.proto's numbers).
_TRACE_ID = _varint(1 << 3 | 2) + _varint(16)  # then 16 bytes
_SPAN_ID = _varint(2 << 3 | 2) + _varint(8)  # then 8 bytes
_PARENT_ID = _varint(4 << 3 | 2) + _varint(8)  # then 8 bytes
_START = _varint(7 << 3 | 1)  # then 8 bytes, little-endian
_END = _varint(8 << 3 | 1)
_UNSET_STATUS = _field(15, b"")  # an unset status is an empty message (as the SDK writes it)
_FLAGS = {
    remote: _fixed32(16, _HAS_IS_REMOTE | (_IS_REMOTE if remote else 0)) for remote in (False, True)
}


def _any_value(value: Any) -> bytes:
    """AnyValue: string 1, bool 2, int 3, double 4, array 5."""
    if isinstance(value, bool):
        return _varint(2 << 3) + _varint(int(value))
    if isinstance(value, int):
        return _varint(3 << 3) + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int64, two's complement
    if isinstance(value, float):
        return _varint(4 << 3 | 1) + struct.pack("<d", value)
    if isinstance(value, str):
        return _field(1, value.encode("utf-8"))
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        return _field(5, b"".join(_field(1, _any_value(v)) for v in value))
    return _field(1, str(value).encode("utf-8"))


class Encoder:
    """Spans to an ``ExportTraceServiceRequest``, with a bounded cache of attribute pairs."""

    def __init__(self) -> None:
        # Per field number (span 9, link 4, resource 1): a str value's pair is cached under
        # the (key, value) tuple ``items()`` yields, others under (key, type, value): 1,
        # 1.0 and True are equal as dict keys but not on the wire.
        self._pairs: dict[int, dict[tuple[Any, ...], bytes]] = {}
        self._cached = 0
        self._names: dict[tuple[str, SpanKind], bytes] = {}  # (name, kind): fields 5 and 6

    def _attributes(self, number: int, attributes: Mapping[str, Any] | None) -> bytes:
        if not attributes:
            return b""
        out = []
        pairs = self._pairs.get(number)
        if pairs is None:
            pairs = self._pairs[number] = {}
        for item in attributes.items():
            value = item[1]
            if type(value) is str:
                cache_key: tuple[Any, ...] | None = item
            elif isinstance(value, (list, tuple)):
                cache_key = None  # unhashable or rare: encoded each time
            else:
                cache_key = (item[0], type(value), value)
            encoded = pairs.get(cache_key) if cache_key is not None else None
            if encoded is None:
                encoded = _field(number, _field(1, item[0].encode()) + _field(2, _any_value(value)))
                if cache_key is not None and self._cached < MAX_CACHED:
                    pairs[cache_key] = encoded
                    self._cached += 1
            out.append(encoded)
        return b"".join(out)

    def _name(self, name: str, kind: SpanKind) -> bytes:
        encoded = self._names.get((name, kind))
        if encoded is None:
            # SPAN_KIND_* is the API's value + 1.
            encoded = _field(5, name.encode("utf-8")) + _varint(6 << 3) + _varint(kind.value + 1)
            if len(self._names) < MAX_NAMES:
                self._names[(name, kind)] = encoded
        return encoded

    def span(self, span: ReadableSpan) -> bytes:
        ctx = span.context
        assert ctx is not None
        parts = [
            _TRACE_ID,
            ctx.trace_id.to_bytes(16, "big"),
            _SPAN_ID,
            ctx.span_id.to_bytes(8, "big"),
        ]
        state = ctx.trace_state
        if state is not _NO_STATE and state:  # (an empty TraceState's len() is a Python call)
            parts.append(_field(3, state.to_header().encode()))
        parent = span.parent
        if parent is not None:
            parts += (_PARENT_ID, parent.span_id.to_bytes(8, "big"))
        parts += (
            self._name(span.name, span.kind),
            _START,
            _U64.pack(span.start_time or 0),
            _END,
            _U64.pack(span.end_time or 0),
            self._attributes(9, span.attributes),
        )
        for link in span.links:
            lc = link.context
            body = _field(1, lc.trace_id.to_bytes(16, "big")) + _field(
                2, lc.span_id.to_bytes(8, "big")
            )
            state = lc.trace_state
            if state is not _NO_STATE and state:
                body += _field(3, state.to_header().encode())
            body += self._attributes(4, link.attributes)
            link_flags = _HAS_IS_REMOTE | (_IS_REMOTE if lc.is_remote else 0)
            body += _fixed32(6, link_flags)
            parts.append(_field(13, body))
        status = span.status
        if status.status_code is StatusCode.UNSET:
            parts.append(_UNSET_STATUS)
        else:
            body = b""
            if status.description:
                body += _field(2, status.description.encode("utf-8"))
            body += _varint(3 << 3) + _varint(status.status_code.value)
            parts.append(_field(15, body))
        parts.append(_FLAGS[parent is not None and parent.is_remote])
        return b"".join(parts)

    def request(self, spans: Sequence[ReadableSpan]) -> bytes:
        """ResourceSpans per resource, ScopeSpans per scope, in the order first seen."""
        groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
        last: tuple[Any, Any] | None = None
        encoded: list[bytes] = []
        span_tag = _SMALL[_SPAN_FIELD]
        for span in spans:
            resource, scope = span.resource, span.instrumentation_scope
            if last is None or resource is not last[0] or scope is not last[1]:
                # A new pair (ours never changes within a batch): its list is looked up once.
                scopes = groups.setdefault(id(resource), (resource, {}))[1]
                encoded = scopes.setdefault(id(scope), (scope, []))[1]
                last = (resource, scope)
            body = self.span(span)
            encoded += (span_tag, _varint(len(body)), body)
        out = []
        for resource, scopes in groups.values():
            body = _field(1, self._attributes(1, resource.attributes))
            for scope, fields in scopes.values():
                scope_body = b""
                if scope is not None:
                    scope_body = _field(1, scope.name.encode()) + (
                        _field(2, scope.version.encode()) if scope.version else b""
                    )
                    if scope.schema_url:
                        schema = _field(3, scope.schema_url.encode())
                    else:
                        schema = b""
                else:
                    schema = b""
                body += _field(2, _field(1, scope_body) + b"".join(fields) + schema)
            if resource.schema_url:
                body += _field(3, resource.schema_url.encode())
            out.append(_field(1, body))
        return b"".join(out)


class SpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP span exporter (its client, retries, headers, timeout), with the
    request bytes written by ``Encoder``. Falls back to the SDK's own export if this SDK
    version's exporter is not shaped as expected."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._encoder = Encoder()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        client = getattr(self, "_client", None)
        if client is None or getattr(self, "_shutdown", True):
            return super().export(spans)
        result = client.export(self._encoder.request(spans))
        return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE
