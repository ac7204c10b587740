"""What the settings ask of OpenTelemetry, resolved once (``plan``), without the SDK.

The SDK (``gateway/telemetry.py``) is imported only when the plan turns something on: a
gateway with telemetry off (the default) never loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import Settings

DEFAULT_OTLP = "http://localhost:4318"  # the OTLP/HTTP default (used with an exporter, no URL)

# Phases shown as child spans: (span name, first stage, stage after the last), by the
# pipeline's stage names; ``Pipeline`` turns them into indices of its marks.
PHASES = (
    ("capgate authenticate", "authenticate", "match_policy"),  # the pause wait included
    ("capgate match", "match_policy", "validate"),
    ("capgate checks", "validate", "taint_gate"),
    ("capgate approval", "taint_gate", "inject"),
)


@dataclass(frozen=True)
class Plan:
    """What ``Settings`` ask of telemetry, resolved once (``plan``)."""

    spans: str | None = None  # console | file | otlp | discard | None (off)
    spans_file: Path | None = None
    spans_endpoint: str | None = None
    metrics_endpoint: str | None = None  # OTLP metrics, when set
    prometheus: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    service_name: str = "capgate"
    metrics_interval: float = 60.0

    @property
    def metrics(self) -> bool:
        return self.metrics_endpoint is not None or self.prometheus

    @property
    def enabled(self) -> bool:
        """Whether anything is exported (spans, metrics): otherwise no SDK is loaded."""
        return self.spans is not None or self.metrics


def _signal(base: str, path: str) -> str:
    return base.rstrip("/") + path


def plan(settings: Settings) -> Plan:
    """Which exporters to build, from the settings (flags, file, ``CAPGATE_*``, ``OTEL_*``).

    ``traces`` wins over ``traces_exporter``; an http(s) ``traces`` value is an OTLP base
    endpoint like ``otlp_endpoint``. Setting an endpoint turns OTLP export on for the
    signals whose exporter is not set."""
    traces = settings.traces
    base = settings.otlp_endpoint
    spans: str | None = None
    spans_file: Path | None = None
    if traces is not None and traces.startswith(("http://", "https://")):
        spans, base = "otlp", base or traces
        spans_endpoint: str | None = _signal(traces, "/v1/traces")
    else:
        spans_endpoint = settings.otlp_traces_endpoint
        if traces in ("console", "discard"):
            spans = traces
        elif traces is not None:
            spans, spans_file = "file", Path(traces)
        elif settings.traces_exporter in ("otlp", "console"):
            spans = settings.traces_exporter
        elif settings.traces_exporter is None and (base or spans_endpoint):
            spans = "otlp"
        if spans == "otlp" and spans_endpoint is None:
            spans_endpoint = _signal(base or DEFAULT_OTLP, "/v1/traces")
    exporters = settings.metrics_exporter
    if exporters is None:
        exporters = ("otlp",) if (base or settings.otlp_metrics_endpoint) else ()
    metrics_endpoint = None
    if "otlp" in exporters:
        metrics_endpoint = settings.otlp_metrics_endpoint or _signal(
            base or DEFAULT_OTLP, "/v1/metrics"
        )
    return Plan(
        spans=spans,
        spans_file=spans_file,
        spans_endpoint=spans_endpoint if spans == "otlp" else None,
        metrics_endpoint=metrics_endpoint,
        prometheus="prometheus" in exporters,
        headers=settings.otlp_headers.pairs,
        service_name=settings.service_name,
        metrics_interval=settings.metrics_interval,
    )
