"""OpenTelemetry: one trace per call with child spans for its phases, and the gateway's metrics.

Off unless asked for (``config.py``: ``traces``, ``traces_exporter``, ``metrics_exporter``,
``otlp_endpoint`` and the standard ``OTEL_*`` variables it reads). Spans go to stderr
(``console``), a JSON-lines file, or OTLP/HTTP; metrics go to OTLP/HTTP and/or the admin
listener's ``/metrics`` (Prometheus text, from the same instruments).

Traces
------
The server span starts when the call arrives (its ids must exist before the call goes
upstream) and is given its attributes when the call has ended, from the closed
``AuditRecord`` only, so a span can say nothing the audit line cannot:

================================  ===================================================
attribute                         value
================================  ===================================================
``capgate.request_id``            the request id the agent saw
``capgate.agent`` / ``.run``      from the verified token (absent when it was refused)
``capgate.upstream``              the upstream name
``capgate.rule``                  the rule that allowed or refused the call
``capgate.decision``              ``allow`` or ``deny``
``capgate.reason``                ``allowed`` or the stable reason code
``http.request.method``           the method
``url.path``                      the path (no query: it may carry data)
``http.response.status_code``     the status sent to the agent
================================  ===================================================

Child spans, built at the end from times the pipeline noted (no work while the call runs):
``capgate authenticate``, ``capgate match``, ``capgate checks`` (payload checks, limits and
quotas), each when it took at least ``PHASE_SPAN_MIN`` (1 ms) or refused the call;
``capgate approval`` (whenever the call was held) and ``capgate upstream`` (a CLIENT span
from sending to the answer's head, whenever the call was sent). The upstream span is the
one whose context goes upstream as ``traceparent`` (W3C Trace Context).

How spans are made: the ids are drawn when the call arrives (trace id, server span id) and
when it is sent (upstream span id), the way the SDK's ``RandomIdGenerator`` draws them; when
the call ends, each span is built whole as the SDK's own ``ReadableSpan`` and handed to the
SDK's span processor (batched, then exported by the SDK's exporters). Every call is sampled.
We do not go through ``Tracer.start_span``: per span it takes a context lookup, the sampler,
two locks and bounded containers that a span built once, complete, does not need; the bench
measured it at about ten times the cost (six spans per call made tracing cost ~80% of a
call's CPU; built whole, a few percent).

The agent's own ``traceparent`` is never the parent: the agent could otherwise place its
calls anywhere in someone else's trace. A well-formed one becomes a span *link* (trace and
span id only; the agent's ``tracestate`` is not copied); a malformed one is ignored, silently.
The agent's ``tracestate`` reaches the upstream only when a rule names it under ``headers``.

Metrics
-------
Instruments are created once. Per call: one dict increment for the call counter (reported
at collection time through an observable counter) and one or two histogram records, each a
bucket increment under a lock (``call_histograms.py``: handed to every reader as the SDK's
own histogram data when it collects; the SDK's instrument cost ~7 µs a record). Label
values come from closed sets only, so an agent cannot make new series: the decision, the
reason code, and the upstream and rule *as the policy names them* (any other value is
``(other)``); never an agent id, a path or a method.

==============================  =========  ==================================================
metric                          kind       labels
==============================  =========  ==================================================
``capgate.calls``               counter    decision, reason, upstream, rule
``capgate.call.duration``       histogram  decision, upstream (seconds, whole call)
``capgate.upstream.duration``   histogram  upstream (seconds, until the answer's head)
``capgate.approvals.pending``   gauge      (none): calls held for approval now
``capgate.state.errors``        counter    (none): calls the state store failed
``capgate.audit.errors``        counter    (none): audit lines that could not be written
==============================  =========  ==================================================
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from gateway import __version__
from gateway.call_histograms import CallHistogram, CallHistograms, usable
from gateway.telemetry_plan import DEFAULT_OTLP, PHASES, Plan, plan

__all__ = ["DEFAULT_OTLP", "PHASES", "Plan", "Telemetry", "plan"]

log = logging.getLogger("capgate")
if TYPE_CHECKING:
    from gateway.audit_record import AuditRecord
    from gateway.call import Call

# Span names hold only these methods; any other (agent-chosen) method is named "HTTP".
_SPAN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

TRACEPARENT_MAX = 512  # W3C: longer values are not a traceparent (ignored without a log line)
OTHER = "(other)"  # a label value outside the policy's closed set
NONE = "(none)"
MAX_SERIES = 2000  # call-counter series kept; beyond it, calls are counted as OTHER
# Seconds; from a cached token and no upstream (~0.2 ms) to the longest upstream deadline.
DURATION_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
EXPORT_TIMEOUT = 10.0  # seconds one OTLP export may take
# Seconds a check phase must take to get its own child span, unless it refused the call.
# On the common path (cached token, compiled rule) each phase takes tens of microseconds and
# a span of it costs about as much as the phase; the bench measured six spans per call at
# twice the encoding and export work of two. A held approval and the upstream exchange
# always have their span.
PHASE_SPAN_MIN = 0.001
CLOSE_WAIT = 2.0  # seconds the stop waits for the last export (a collector may be down)
SPAN_QUEUE = 16_384  # spans the batch processor holds (six a call) before it drops some
# Spans an OTLP request carries at most (the SDK's default is 512). Each request costs the
# exporting thread ~1 ms of CPU whatever its size (the HTTP client's per-request work: it
# scans the environment for proxy settings twice), ~2 us a span at 512; at 2048, a quarter.
# The processor still sends what it holds every 5 s, so a quiet gateway's spans wait no
# longer; ~2048 spans are ~350 KB of protobuf, far below a collector's request limit.
OTLP_BATCH = 2048
SCOPE = InstrumentationScope("capgate", __version__)
SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
_SERVER, _CLIENT = SpanKind.SERVER, SpanKind.CLIENT  # (an enum member read costs ~0.2 us)
_AGENT_LINK = {"capgate.link": "agent"}


class _Discard(SpanExporter):
    """Spans recorded and batched, then dropped (``--traces discard``: the cost of tracing
    without the cost of a destination)."""

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


# Span and trace ids: our own generator (seeded from the OS, like ``random``'s), so drawing
# ids never moves the process-wide ``random`` state that tests or libraries may seed.
_IDS = random.Random()  # noqa: S311 (ids need to be unique, not secret; the SDK does the same)


class CallTrace:
    """A call's trace while it runs: its ids, start time, the agent's link, stage ends."""

    __slots__ = ("trace_id", "span_id", "start_ns", "links", "upstream_id")

    def __init__(self, links: tuple[Link, ...]) -> None:
        self.trace_id = _IDS.getrandbits(128) or 1
        self.span_id = _IDS.getrandbits(64) or 1
        self.start_ns = time.time_ns()
        self.links = links
        self.upstream_id = 0  # the upstream span's id, once the call is sent


def traceparent(trace_id: int, span_id: int) -> str:
    """The W3C ``traceparent`` of a sampled span (what the SDK's propagator writes)."""
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def span_attributes(record: AuditRecord) -> dict[str, Any]:
    """The server span's attributes: the record's, under their OpenTelemetry names; a field
    without a value (no agent, no rule, no status) is left out."""
    # Member by member: a third of the cost of a loop over (field, name) pairs.
    attributes: dict[str, Any] = {"capgate.request_id": record["request_id"]}
    if (agent := record["agent"]) is not None:
        attributes["capgate.agent"] = agent
    if (run := record["run"]) is not None:
        attributes["capgate.run"] = run
    if (upstream := record["upstream"]) is not None:
        attributes["capgate.upstream"] = upstream
    if (rule := record["rule"]) is not None:
        attributes["capgate.rule"] = rule
    attributes["capgate.decision"] = record["decision"]
    attributes["capgate.reason"] = record["reason"]
    attributes["http.request.method"] = record["method"]
    attributes["url.path"] = record["path"]
    if (status := record["status"]) is not None:
        attributes["http.response.status_code"] = status
    return attributes


# W3C Trace Context, section 3.2: version-traceid-parentid-flags, lower-case hex; a later
# version may append "-..." fields. Optional spaces or tabs around it (header OWS).
_TRACEPARENT = re.compile(
    r"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*"
)
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def parse_traceparent(value: str) -> SpanContext | None:
    """A remote span context from a ``traceparent`` value, or None when it is not one: the
    rules of the SDK's ``TraceContextTextMapPropagator`` (version ``ff`` and all-zero ids
    invalid, version ``00`` has exactly four fields), without building a context per call.
    ``test_telemetry`` checks it against the propagator."""
    if len(value) > TRACEPARENT_MAX:
        return None
    m = _TRACEPARENT.fullmatch(value)
    if m is None:
        return None
    version, trace_id, span_id, flags, extra = m.groups()
    if version == "ff" or (version == "00" and extra) or trace_id == _ZERO_TRACE:
        return None
    if span_id == _ZERO_SPAN:
        return None
    return SpanContext(int(trace_id, 16), int(span_id, 16), True, TraceFlags(int(flags, 16)))


def agent_link(call: Call) -> tuple[Link, ...]:
    """The agent's W3C ``traceparent`` as a link (ids and flags only), or nothing when it is
    absent, repeated or malformed. Never an error and never a parent; the agent's
    ``tracestate`` is its own text and is neither parsed nor kept."""
    values = call.headers.getall("traceparent", ())
    if len(values) != 1:
        return ()
    agent = parse_traceparent(values[0])
    return () if agent is None else (Link(agent, _AGENT_LINK),)


class _OncePerMinute(logging.Filter):
    """Lets one "Queue full, dropping Span" line through per minute: when the collector is
    slow or gone, the SDK would log one line per dropped span."""

    def __init__(self) -> None:
        super().__init__()
        self.next = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Queue full"):
            return True
        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + 60.0
        return True


_DROP_LOG = "opentelemetry.sdk._shared_internal"
if not any(isinstance(f, _OncePerMinute) for f in logging.getLogger(_DROP_LOG).filters):
    logging.getLogger(_DROP_LOG).addFilter(_OncePerMinute())


# The call histograms: (name, unit, description).
HISTOGRAMS = (
    ("capgate.call.duration", "s", "Whole calls, from the request to the answer's end"),
    ("capgate.upstream.duration", "s", "Upstream exchanges, from sending to the answer's head"),
)
Recorder = Callable[[float, Hashable, Mapping[str, Any]], None]  # (value, series key, labels)


def _sdk_recorder(meter: Meter, name: str, unit: str, description: str) -> Recorder:
    """A recorder through the SDK's own histogram instrument (the key is not needed)."""
    histogram = meter.create_histogram(
        name,
        unit=unit,
        description=description,
        explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
    )

    def record(value: float, _key: Hashable, attributes: Mapping[str, Any]) -> None:
        histogram.record(value, attributes)

    return record


class CallMetrics:
    """The instruments, created once; ``measure`` is the per-call work."""

    def __init__(
        self,
        provider: MeterProvider,
        readers: Sequence[MetricReader] = (),
        resource: Resource | None = None,
    ) -> None:
        meter = provider.get_meter("capgate", __version__)
        self.calls: dict[tuple[str, str, str, str], int] = {}
        self.state_errors = 0
        self.pending: Callable[[], int] = lambda: 0
        self.audit_errors: Callable[[], int] = lambda: 0
        self._by_decision: dict[tuple[str, str], dict[str, str]] = {}
        self._by_upstream: dict[str, dict[str, str]] = {}
        meter.create_observable_counter(
            "capgate.calls",
            callbacks=[self._observe_calls],
            unit="{call}",
            description="Calls ended, by decision, reason, upstream and rule",
        )
        # The call histograms: aggregated by ``call_histograms`` (a tenth of the SDK's cost
        # a record) for readers that take cumulative explicit-bucket histograms, which is
        # every reader unless OTEL_EXPORTER_OTLP_METRICS_* asked otherwise; else the SDK's.
        self.histograms: CallHistograms | None = None
        self.duration: Recorder
        self.upstream: Recorder
        if readers and resource is not None and all(usable(r) for r in readers):
            own = CallHistograms(
                [
                    CallHistogram(name, unit, text, DURATION_BUCKETS)
                    for name, unit, text in HISTOGRAMS
                ],
                resource,
                SCOPE,
            )
            for reader in readers:
                own.attach(reader)
            self.histograms = own
            self.duration, self.upstream = (h.record for h in own.histograms)
        else:
            self.duration, self.upstream = (
                _sdk_recorder(meter, name, unit, text) for name, unit, text in HISTOGRAMS
            )
        meter.create_observable_gauge(
            "capgate.approvals.pending",
            callbacks=[lambda _: [Observation(self.pending())]],
            unit="{call}",
            description="Calls held for approval now",
        )
        meter.create_observable_counter(
            "capgate.state.errors",
            callbacks=[lambda _: [Observation(self.state_errors)]],
            unit="{call}",
            description="Calls during which the state store failed",
        )
        meter.create_observable_counter(
            "capgate.audit.errors",
            callbacks=[lambda _: [Observation(self.audit_errors())]],
            unit="{line}",
            description="Audit lines that could not be written",
        )

    def _observe_calls(self, _options: CallbackOptions) -> Iterable[Observation]:
        # Called from the exporter's thread or a scrape: a copy is one atomic C call.
        for (decision, reason, upstream, rule), count in self.calls.copy().items():
            yield Observation(
                count, {"decision": decision, "reason": reason, "upstream": upstream, "rule": rule}
            )

    def measure(self, call: Call, record: AuditRecord) -> None:
        policy = call.policy
        upstream = record["upstream"]
        rule = record["rule"]
        if upstream is None:
            upstream = NONE
        elif policy is None or upstream not in policy.upstreams:
            upstream = OTHER  # SECURITY: the agent names it (the path's first segment)
        if rule is None:
            rule = NONE
        elif policy is None or rule not in policy.rules_by_id:
            rule = OTHER
        decision = record["decision"]
        key = (decision, record["reason"], upstream, rule)
        calls = self.calls
        count = calls.get(key)
        if count is None and len(calls) >= MAX_SERIES:
            key = (decision, OTHER, OTHER, OTHER)
            count = calls.get(key)
        calls[key] = (count or 0) + 1
        attrs = self._by_decision.get((decision, upstream))
        if attrs is None:
            attrs = self._by_decision[(decision, upstream)] = {
                "decision": decision,
                "upstream": upstream,
            }
        self.duration(record["duration_ms"] / 1000, (decision, upstream), attrs)
        if call.upstream_ended:
            attrs = self._by_upstream.get(upstream)
            if attrs is None:
                attrs = self._by_upstream[upstream] = {"upstream": upstream}
            self.upstream(call.upstream_ended - call.upstream_started, upstream, attrs)
        if call.state_error is not None or record["reason"] == "state_unavailable":
            self.state_errors += 1


class Telemetry:
    """Spans and metrics for calls, or nothing at all with an empty ``Plan``.

    ``span_exporter`` and ``metric_readers`` are for tests (the SDK's in-memory ones): the
    exporter is given spans as each ends, the readers see the same instruments."""

    def __init__(
        self,
        settings: Plan | None = None,
        *,
        span_exporter: SpanExporter | None = None,
        metric_readers: Sequence[MetricReader] = (),
    ) -> None:
        p = settings or Plan()
        self.plan = p
        self._out: IO[str] | None = None
        self._spans: SpanProcessor | None = None
        self._meter_provider: MeterProvider | None = None
        self._network: list[Any] = []  # the OTLP exporters (their retries end at shutdown)
        self.metrics: CallMetrics | None = None
        self.prometheus_registry: Any = None
        self.phases: tuple[tuple[str, int, int], ...] = ()  # set by the pipeline
        self.phase_min = PHASE_SPAN_MIN  # shorter phases get no span (tests set 0)
        # Built here, not with Resource.create(), which would read OTEL_RESOURCE_ATTRIBUTES
        # from the process environment behind config.py's back.
        resource = Resource({"service.name": p.service_name, "service.version": __version__})
        self._resource = resource
        self._spans = self._span_processor(p, span_exporter)
        readers = list(metric_readers) + self._metric_readers(p)
        if readers:
            # No exemplars: the default filter looks up the current span on every record (we
            # keep none in the context); and OTEL_METRICS_EXEMPLAR_FILTER is not read.
            self._meter_provider = MeterProvider(
                metric_readers=readers,
                resource=resource,
                exemplar_filter=AlwaysOffExemplarFilter(),
                shutdown_on_exit=False,  # closed by ``close``, bounded; not again at exit
            )
            self.metrics = CallMetrics(self._meter_provider, readers, resource)

    def _span_processor(self, p: Plan, exporter: SpanExporter | None) -> SpanProcessor | None:
        if exporter is not None:
            return SimpleSpanProcessor(exporter)
        if p.spans is None:
            return None
        if p.spans == "otlp":
            from gateway.otlp_wire import SpanExporter as OTLPSpanExporter

            exporter = OTLPSpanExporter(
                endpoint=p.spans_endpoint, headers=dict(p.headers), timeout=EXPORT_TIMEOUT
            )
            self._network.append(exporter)
        elif p.spans == "discard":
            exporter = _Discard()
        else:
            out: IO[str] = sys.stderr
            if p.spans_file is not None:
                p.spans_file.parent.mkdir(parents=True, exist_ok=True)
                out = self._out = p.spans_file.open("a", encoding="utf-8")
            exporter = ConsoleSpanExporter(
                out=out, formatter=lambda span: span.to_json(indent=None) + "\n"
            )
        batch = OTLP_BATCH if p.spans == "otlp" else None  # None: the SDK's default
        return BatchSpanProcessor(exporter, max_queue_size=SPAN_QUEUE, max_export_batch_size=batch)

    def _metric_readers(self, p: Plan) -> list[MetricReader]:
        readers: list[MetricReader] = []
        if p.metrics_endpoint is not None:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )

            exporter = OTLPMetricExporter(
                endpoint=p.metrics_endpoint, headers=dict(p.headers), timeout=EXPORT_TIMEOUT
            )
            self._network.append(exporter)
            readers.append(
                PeriodicExportingMetricReader(
                    exporter, export_interval_millis=p.metrics_interval * 1000
                )
            )
        if p.prometheus:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry

            # A registry of our own: never the process-global one, which outlives a gateway.
            self.prometheus_registry = CollectorRegistry()
            readers.append(
                PrometheusMetricReader(registry=self.prometheus_registry, scope_info_enabled=False)
            )
        return readers

    @property
    def tracing(self) -> bool:
        return self._spans is not None

    @property
    def enabled(self) -> bool:
        return self._spans is not None or self.metrics is not None

    def watch(self, *, pending: Callable[[], int], audit_errors: Callable[[], int]) -> None:
        """Where the gauges read from (``app.py``, once the parts exist)."""
        if self.metrics is not None:
            self.metrics.pending = pending
            self.metrics.audit_errors = audit_errors

    def prometheus_text(self) -> bytes:
        """The metrics in Prometheus' text format (the admin listener's ``/metrics``)."""
        from prometheus_client import generate_latest

        assert self.prometheus_registry is not None
        return generate_latest(self.prometheus_registry)

    # -- per call ------------------------------------------------------------------------------

    def call_started(self, call: Call) -> None:
        """Draw the call's trace and span ids (they go upstream); link the agent's trace."""
        call.span = CallTrace(agent_link(call) if "traceparent" in call.headers else ())
        call.marks = [time.monotonic()]

    def upstream_started(self, call: Call) -> None:
        """Draw the upstream span's id and send its context upstream as ``traceparent``."""
        ct = call.span
        if ct is None or call.outbound_headers is None:
            return
        ct.upstream_id = _IDS.getrandbits(64) or 1
        # Replaces any traceparent a rule let through: the trace that goes upstream is ours.
        call.outbound_headers["traceparent"] = traceparent(ct.trace_id, ct.upstream_id)

    def call_ended(self, call: Call, records: Sequence[AuditRecord]) -> None:
        """Metrics and spans for the call that just ended, from its (first) record only."""
        record = records[0]
        if self.metrics is not None:
            self.metrics.measure(call, record)
        ct = call.span
        if ct is not None and self._spans is not None:
            self._end_spans(call, record, ct, self._spans)

    def _end_spans(
        self, call: Call, record: AuditRecord, ct: CallTrace, processor: SpanProcessor
    ) -> None:
        end_ns = time.time_ns()
        attributes = span_attributes(record)
        method = record["method"]
        name = method if method in _SPAN_METHODS else "HTTP"
        if call.policy is not None and record["upstream"] in call.policy.upstreams:
            name = f"{name} /{record['upstream']}"
        failed = record["decision"] == "deny" or (
            call.error is not None and record["reason"] != "client_closed"
        )
        status = Status(StatusCode.ERROR, record["reason"]) if failed else _UNSET
        trace_id, resource = ct.trace_id, self._resource
        server = SpanContext(trace_id, ct.span_id, False, SAMPLED)
        out = [
            ReadableSpan(
                name,
                server,
                None,
                resource,
                attributes,
                links=ct.links,
                kind=_SERVER,
                status=status,
                start_time=ct.start_ns,
                end_time=end_ns,
                instrumentation_scope=SCOPE,
            )
        ]
        marks = call.marks
        assert marks is not None  # set with the trace
        zero = ct.start_ns - int(marks[0] * 1e9)  # monotonic seconds -> epoch nanoseconds
        refused = call.error is not None and call.response is None
        # Each phase lies between the first mark and the last: when the checks took less in
        # all than one phase needs to be shown, and none refused the call, none is shown.
        if refused or marks[-1] - marks[0] >= self.phase_min:
            out.extend(self._phase_spans(call, marks, refused, server, zero))
        if ct.upstream_id:
            up_failed = call.response is None and call.error is not None
            ended = call.upstream_ended or time.monotonic()
            out.append(
                ReadableSpan(
                    "capgate upstream",
                    SpanContext(trace_id, ct.upstream_id, False, SAMPLED),
                    server,
                    resource,
                    {"capgate.upstream": record["upstream"] or ""},
                    kind=_CLIENT,
                    status=Status(StatusCode.ERROR, record["reason"]) if up_failed else _UNSET,
                    start_time=zero + int(call.upstream_started * 1e9),
                    end_time=zero + int(ended * 1e9),
                    instrumentation_scope=SCOPE,
                )
            )
        for span in out:
            processor.on_end(span)

    def _phase_spans(
        self, call: Call, marks: list[float], refused: bool, server: SpanContext, zero: int
    ) -> Iterator[ReadableSpan]:
        """The child spans of the check phases that refused the call or took long enough."""
        last = len(marks) - 1
        shortest = self.phase_min
        for phase, first, after in self.phases:
            if first >= last or (phase == "capgate approval" and not call.held):
                continue
            began, ended = marks[first], marks[min(after, last)]
            # A fast phase of a call that went on says nothing the gap before the upstream
            # span does not; the phase that refused a call, or a slow one, is shown.
            if ended - began < shortest and not (refused and after >= last):
                continue
            yield ReadableSpan(
                phase,
                SpanContext(server.trace_id, _IDS.getrandbits(64) or 1, False, SAMPLED),
                server,
                self._resource,
                start_time=zero + int(began * 1e9),
                end_time=zero + int(ended * 1e9),
                instrumentation_scope=SCOPE,
            )

    def flush(self) -> None:
        if self._spans is not None:
            self._spans.force_flush()
        if self._meter_provider is not None:
            self._meter_provider.force_flush()

    def close(self) -> None:
        """Export what is left and stop, waiting at most ``CLOSE_WAIT`` seconds: with the
        collector down the SDK would retry for its whole export timeout (15 s measured), and
        a stop must keep to its grace. What is not out by then is dropped (said once)."""
        spans, meters = self._spans, self._meter_provider
        self._spans = self._meter_provider = None
        if spans is not None or meters is not None:

            def shut_down() -> None:
                if spans is not None:
                    spans.shutdown()
                if meters is not None:
                    meters.shutdown()

            worker = threading.Thread(target=shut_down, name="capgate-telemetry-stop", daemon=True)
            worker.start()
            worker.join(CLOSE_WAIT)
            if worker.is_alive():
                log.warning(
                    "telemetry: spans and metrics not exported within %gs of the stop are "
                    "dropped (is the collector reachable?)",
                    CLOSE_WAIT,
                )
                # An export still retrying (the SDK backs off for up to its whole timeout)
                # ends at its next wait once its exporter is shut down: no thread outlives
                # the stop by more than one attempt.
                for exporter in self._network:
                    with contextlib.suppress(Exception):
                        exporter.shutdown()
                return  # the file, if any, is left to the exporting thread and the exit
        if self._out is not None:
            self._out.close()
            self._out = None
