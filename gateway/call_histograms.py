"""The call histograms, aggregated here instead of by the SDK's ``Histogram`` instrument.

The SDK's ``Histogram.record`` builds a ``Measurement``, cleans and hashes the attributes
and looks up an aggregation per metric reader, per call: ~7 µs a record, so nearly all of
the 16 µs that metrics cost a call in ``bench.telemetry_bench`` (2 µs with this module);
in the running gateway under load (py-spy) it was ~8% of the event loop's busy samples.
Our two histograms have fixed explicit buckets and attribute sets from a closed set, so a
record is a dict lookup, a ``bisect``, a count, a sum, min and max under a lock (~1 µs).

What the readers receive does not change: at each collection (an OTLP export, a
Prometheus scrape) each histogram becomes the SDK's own ``Metric`` of ``Histogram`` data
points, added to what the SDK collected for the other instruments, so the SDK's OTLP
encoder and Prometheus reader write it as they would their own. ``test_call_histograms``
compares it with what the SDK's instrument gives for the same records.

The SDK's aggregation is followed: bucket ``i`` counts values in ``(bounds[i-1],
bounds[i]]`` (``bisect_left``); a value that is negative, infinite or NaN is ignored;
min and max are kept; a series starts when its first value is recorded; beyond
``CARDINALITY_LIMIT`` series, values go to one series with the attribute
``otel.metric.overflow``. Only cumulative temporality is aggregated here: when a reader
asks for delta histograms or another aggregation (``OTEL_EXPORTER_OTLP_METRICS_*``, which
the SDK's exporter reads), ``usable`` says no and the SDK's instruments are used instead.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

from opentelemetry.sdk.metrics import Histogram as SDKHistogram
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.view import DefaultAggregation, ExplicitBucketHistogramAggregation
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

CARDINALITY_LIMIT = 2000  # series per histogram, as the SDK's default
OVERFLOW: Mapping[str, Any] = {"otel.metric.overflow": True}
_OVERFLOW_KEY = ("otel.metric.overflow",)

Collect = Callable[..., MetricsData | None]


class _Series:
    __slots__ = ("attributes", "counts", "sum", "min", "max", "start_ns")

    def __init__(self, attributes: Mapping[str, Any], buckets: int) -> None:
        self.attributes = dict(attributes)
        self.counts = [0] * buckets
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.start_ns = time.time_ns()


class CallHistogram:
    """One histogram with explicit buckets, aggregated cumulatively per attribute set."""

    def __init__(self, name: str, unit: str, description: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self.bounds = tuple(bounds)
        self._series: dict[Hashable, _Series] = {}
        self._lock = threading.Lock()

    def record(self, value: float, key: Hashable, attributes: Mapping[str, Any]) -> None:
        """Count ``value`` in the series ``key`` (whose attributes are ``attributes``)."""
        if not 0 <= value < math.inf:  # negative, infinite or NaN: the SDK drops it too
            return
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._new_series(key, attributes)
            series.counts[bisect_left(self.bounds, value)] += 1
            series.sum += value
            if value < series.min:
                series.min = value
            if value > series.max:
                series.max = value

    def _new_series(self, key: Hashable, attributes: Mapping[str, Any]) -> _Series:
        if len(self._series) >= CARDINALITY_LIMIT:
            key, attributes = _OVERFLOW_KEY, OVERFLOW
            series = self._series.get(key)
            if series is not None:
                return series
        series = self._series[key] = _Series(attributes, len(self.bounds) + 1)
        return series

    def metric(self, now_ns: int) -> Metric | None:
        """The SDK's cumulative ``Metric`` of every series so far (None before the first)."""
        with self._lock:
            taken = [
                (s.attributes, s.start_ns, tuple(s.counts), s.sum, s.min, s.max)
                for s in self._series.values()
            ]
        if not taken:
            return None
        points = [
            HistogramDataPoint(
                attributes=dict(attributes),
                start_time_unix_nano=start_ns,
                time_unix_nano=now_ns,
                count=sum(counts),
                sum=total,
                bucket_counts=counts,
                explicit_bounds=self.bounds,
                min=low,
                max=high,
                exemplars=[],
            )
            for attributes, start_ns, counts, total, low, high in taken
        ]
        return Metric(
            name=self.name,
            description=self.description,
            unit=self.unit,
            data=Histogram(
                data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE
            ),
        )


def _for_histograms(mapping: Mapping[type, Any]) -> list[Any]:
    """A reader's setting for the SDK's histogram instruments (keyed by their classes)."""
    return [v for k, v in mapping.items() if isinstance(k, type) and issubclass(k, SDKHistogram)]


def _explicit_buckets(aggregation: Any) -> bool:
    """The default aggregation, or explicit buckets taking the instrument's advisory
    boundaries and recording min and max (what the OTLP exporter asks for by default)."""
    if isinstance(aggregation, DefaultAggregation):
        return True
    return (
        isinstance(aggregation, ExplicitBucketHistogramAggregation)
        and getattr(aggregation, "_boundaries", ()) is None
        and getattr(aggregation, "_record_min_max", False) is True
    )


def usable(reader: MetricReader) -> bool:
    """Whether ``reader`` takes histograms as aggregated here (cumulative, the default
    aggregation: explicit buckets) and can be given them at collection."""
    temporality = _for_histograms(getattr(reader, "_instrument_class_temporality", {}))
    aggregation = _for_histograms(getattr(reader, "_instrument_class_aggregation", {}))
    return (
        bool(temporality and aggregation)
        and all(t is AggregationTemporality.CUMULATIVE for t in temporality)
        and all(_explicit_buckets(a) for a in aggregation)
        and callable(getattr(reader, "_collect", None))
    )


class CallHistograms:
    """The histograms, added to what each reader collects from the SDK."""

    def __init__(
        self,
        histograms: Sequence[CallHistogram],
        resource: Resource,
        scope: InstrumentationScope,
    ) -> None:
        self.histograms = tuple(histograms)
        self._resource = resource
        self._scope = scope

    def attach(self, reader: MetricReader) -> None:
        """Wrap the collection the ``MeterProvider`` gave ``reader`` so that its result
        carries the histograms (the reader must be registered and ``usable``)."""
        inner = cast(Collect, reader._collect)  # set by the MeterProvider

        def collect(r: MetricReader, *args: Any, **kwargs: Any) -> MetricsData | None:
            return self.add_to(inner(r, *args, **kwargs))

        reader._collect = cast(Any, collect)

    def add_to(self, data: MetricsData | None) -> MetricsData | None:
        """``data`` with the histograms in our scope (made when the SDK had nothing)."""
        now = time.time_ns()
        metrics = [m for m in (h.metric(now) for h in self.histograms) if m is not None]
        if not metrics:
            return data
        if data is None:
            data = MetricsData(resource_metrics=[])
        out: list[ResourceMetrics] = []
        placed = False
        for rm in data.resource_metrics:
            scopes = list(rm.scope_metrics)
            if not placed and rm.resource == self._resource:
                for i, sm in enumerate(scopes):
                    if sm.scope == self._scope:
                        scopes[i] = ScopeMetrics(sm.scope, [*sm.metrics, *metrics], sm.schema_url)
                        placed = True
                        break
                else:
                    scopes.append(self._scope_metrics(metrics))
                    placed = True
            out.append(ResourceMetrics(rm.resource, scopes, rm.schema_url))
        if not placed:
            out.append(
                ResourceMetrics(
                    self._resource, [self._scope_metrics(metrics)], self._resource.schema_url
                )
            )
        return MetricsData(resource_metrics=out)

    def _scope_metrics(self, metrics: list[Metric]) -> ScopeMetrics:
        return ScopeMetrics(self._scope, metrics, self._scope.schema_url or "")
