"""A local OTLP/HTTP receiver: decodes what an exporter sends, keeps it, answers like a collector.

    python -m mocks.otlp_receiver [--host 127.0.0.1] [--port 0] [--keep N]

Prints one line when listening: ``otlp-receiver listening {"ready": true, "url": "http://..."}``.

* ``POST /v1/traces``   ``ExportTraceServiceRequest`` (protobuf, optionally gzip), answered
  with an empty ``ExportTraceServiceResponse``
* ``POST /v1/metrics``  ``ExportMetricsServiceRequest``, the same way
* ``GET /_otlp/spans``   the spans received: name, ids (hex), parent, kind, attributes, links,
  resource attributes (the last ``--keep`` of them)
* ``GET /_otlp/metrics`` each metric's name, kind and data points (attributes and value)
* ``GET /_otlp/stats``   request, span and metric-point counts, and the bytes received
* ``DELETE /_otlp``      forget everything

A body that does not decode is answered 400, as a collector does; the tests then see no data.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import signal
from collections import deque
from typing import Any

from aiohttp import web
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

PROTOBUF = "application/x-protobuf"


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


class Received:
    """What the receiver has decoded so far."""

    def __init__(self, keep: int) -> None:
        self.spans: deque[dict[str, Any]] = deque(maxlen=keep)
        self.metrics: deque[dict[str, Any]] = deque(maxlen=keep)
        self.stats = {"requests": 0, "spans": 0, "points": 0, "bytes": 0, "bad": 0}

    def clear(self) -> None:
        self.spans.clear()
        self.metrics.clear()
        for key in self.stats:
            self.stats[key] = 0

    def add_traces(self, req: ExportTraceServiceRequest) -> None:
        for rs in req.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.stats["spans"] += 1
                    self.spans.append(
                        {
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(),
                            "kind": int(s.kind),
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "status": int(s.status.code),
                            "attributes": _attributes(s.attributes),
                            "links": [
                                {
                                    "trace_id": link.trace_id.hex(),
                                    "span_id": link.span_id.hex(),
                                    "trace_state": link.trace_state,
                                    "attributes": _attributes(link.attributes),
                                }
                                for link in s.links
                            ],
                            "resource": resource,
                            "scope": ss.scope.name,
                        }
                    )

    def add_metrics(self, req: ExportMetricsServiceRequest) -> None:
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data") or ""
                    points = []
                    for p in getattr(m, kind).data_points if kind else ():
                        point: dict[str, Any] = {"attributes": _attributes(p.attributes)}
                        if kind == "histogram":
                            point["count"] = p.count
                            point["sum"] = p.sum
                        else:
                            point["value"] = (
                                p.as_int if p.WhichOneof("value") == "as_int" else (p.as_double)
                            )
                        points.append(point)
                    self.stats["points"] += len(points)
                    self.metrics.append({"name": m.name, "kind": kind, "points": points})


RECEIVED: web.AppKey[Received] = web.AppKey("received")


async def _body(request: web.Request) -> bytes:
    data = await request.read()
    request.app[RECEIVED].stats["bytes"] += len(data)
    if request.headers.get("Content-Encoding", "").lower() == "gzip":
        data = gzip.decompress(data)
    return data


async def _traces(request: web.Request) -> web.Response:
    got = request.app[RECEIVED]
    got.stats["requests"] += 1
    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(await _body(request))
    except (DecodeError, OSError):
        got.stats["bad"] += 1
        return web.Response(status=400, text="not an ExportTraceServiceRequest")
    got.add_traces(req)
    body = ExportTraceServiceResponse().SerializeToString()
    return web.Response(body=body, content_type=PROTOBUF)


async def _metrics(request: web.Request) -> web.Response:
    got = request.app[RECEIVED]
    got.stats["requests"] += 1
    req = ExportMetricsServiceRequest()
    try:
        req.ParseFromString(await _body(request))
    except (DecodeError, OSError):
        got.stats["bad"] += 1
        return web.Response(status=400, text="not an ExportMetricsServiceRequest")
    got.add_metrics(req)
    body = ExportMetricsServiceResponse().SerializeToString()
    return web.Response(body=body, content_type=PROTOBUF)


async def _list_spans(request: web.Request) -> web.Response:
    return web.json_response(list(request.app[RECEIVED].spans))


async def _list_metrics(request: web.Request) -> web.Response:
    return web.json_response(list(request.app[RECEIVED].metrics))


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[RECEIVED].stats)


async def _clear(request: web.Request) -> web.Response:
    request.app[RECEIVED].clear()
    return web.json_response({"cleared": True})


def create_app(keep: int = 100_000) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[RECEIVED] = Received(keep)
    app.router.add_post("/v1/traces", _traces)
    app.router.add_post("/v1/metrics", _metrics)
    app.router.add_get("/_otlp/spans", _list_spans)
    app.router.add_get("/_otlp/metrics", _list_metrics)
    app.router.add_get("/_otlp/stats", _stats)
    app.router.add_delete("/_otlp", _clear)
    return app


async def _serve(host: str, port: int, keep: int) -> None:
    runner = web.AppRunner(create_app(keep), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    real = runner.addresses[0][1]
    ready = {"ready": True, "url": f"http://{host}:{real}"}
    print(f"otlp-receiver listening {json.dumps(ready)}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mocks.otlp_receiver")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--keep", type=int, default=1000, help="spans and metrics kept for GET")
    args = p.parse_args(argv)
    asyncio.run(_serve(args.host, args.port, args.keep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
