"""OpenTelemetry traces: one span per call, with the decision, never a secret.

Off by default. ``--traces console`` writes spans to stderr; ``--traces FILE`` appends them
to FILE as JSON lines (one span per line). Each span is built when the call ends, from the
same fields as the audit line, so tracing adds nothing to a call's path until then:

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
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway import __version__

if TYPE_CHECKING:
    from gateway.audit_record import AuditRecord
    from gateway.call import Call

_ATTRIBUTES = (
    ("request_id", "capgate.request_id"),
    ("agent", "capgate.agent"),
    ("run", "capgate.run"),
    ("upstream", "capgate.upstream"),
    ("rule", "capgate.rule"),
    ("decision", "capgate.decision"),
    ("reason", "capgate.reason"),
    ("method", "http.request.method"),
    ("path", "url.path"),
    ("status", "http.response.status_code"),
)


class Telemetry:
    """Spans for calls, or nothing at all when ``target`` is None."""

    def __init__(self, target: str | None) -> None:
        self._provider: TracerProvider | None = None
        self._out: IO[str] | None = None
        self._tracer: Any = None
        if target is None:
            return
        if target == "console":
            out: IO[str] = sys.stderr
        else:
            path = Path(target)
            path.parent.mkdir(parents=True, exist_ok=True)
            out = self._out = path.open("a", encoding="utf-8")
        exporter = ConsoleSpanExporter(
            out=out, formatter=lambda span: span.to_json(indent=None) + "\n"
        )
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": "capgate", "service.version": __version__})
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("capgate", __version__)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def call_ended(self, call: Call, records: Sequence[AuditRecord]) -> None:
        """One span for the call that just ended, from its (first) audit record only."""
        audit = records[0]
        if self._tracer is None:
            return
        attributes = {
            name: value for key, name in _ATTRIBUTES if (value := audit.get(key)) is not None
        }
        span = self._tracer.start_span(
            f"capgate {call.method}",
            kind=SpanKind.SERVER,
            start_time=int(call.wall_started * 1e9),
            attributes=attributes,
        )
        if audit["decision"] == "deny" or (
            call.error is not None and audit["reason"] != "client_closed"
        ):
            span.set_status(Status(StatusCode.ERROR, audit["reason"]))
        span.end()

    def flush(self) -> None:
        if self._provider is not None:
            self._provider.force_flush()

    def close(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self._tracer = None
        if self._out is not None:
            self._out.close()
            self._out = None
