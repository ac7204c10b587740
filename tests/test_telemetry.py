"""OpenTelemetry: spans (with the SDK's in-memory exporter), metrics (in-memory reader), the
Prometheus endpoint, and OTLP/HTTP to a real local receiver (mocks/otlp_receiver.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.admin import create_admin_app
from gateway.app import Gateway, build_gateway
from gateway.config import Settings, load_settings
from gateway.telemetry import OTHER, Plan, Telemetry, parse_traceparent, plan, traceparent
from mocks import otlp_receiver
from mocks.demo import Workspace
from tests.conftest import Mocks
from tests.helpers_core import FUZZ

AGENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
AGENT_SPAN = "b7ad6b7169203331"
AGENT_TRACEPARENT = f"00-{AGENT_TRACE}-{AGENT_SPAN}-01"
ADMIN_TOKEN = "admin-token-0123456789abcdef"


def with_telemetry(gw: Gateway, telemetry: Telemetry) -> Gateway:
    """The same gateway with ``telemetry`` (the pipeline is rebuilt around it)."""
    observers = tuple(o for o in gw.observers if not isinstance(o, Telemetry)) + (telemetry,)
    return dataclasses.replace(gw, telemetry=telemetry, observers=observers)


@pytest.fixture
def memory() -> tuple[Telemetry, InMemorySpanExporter, InMemoryMetricReader]:
    """In-memory span exporter and metric reader; every phase gets its span, however short."""
    spans = InMemorySpanExporter()
    reader = InMemoryMetricReader()
    telemetry = Telemetry(Plan(), span_exporter=spans, metric_readers=[reader])
    telemetry.phase_min = 0.0
    return telemetry, spans, reader


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    out: dict[str, list[Any]] = {}
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


async def test_one_span_per_call_without_secrets(
    serve_gateway: Any, settings: Settings, workspace: Workspace, tmp_path: Path
) -> None:
    traces = tmp_path / "spans.jsonl"
    gw = build_gateway(dataclasses.replace(settings, traces=str(traces)), workspace.environ())
    client = await serve_gateway(gw)
    tok = workspace.token("sre-bot", ["sre-diagnostics"], run="run-7")
    auth = {"Authorization": f"Bearer {tok}"}
    assert (await client.get("/metrics/metrics/cpu?window=5m", headers=auth)).status == 200
    assert (await client.delete("/services/services/web", headers=auth)).status == 403
    assert (await client.get("/metrics/metrics/cpu?window=5m")).status == 401
    gw.telemetry.flush()
    every = [json.loads(line) for line in traces.read_text().splitlines()]
    spans = [s for s in every if s["kind"] == "SpanKind.SERVER"]
    assert len(spans) == 3
    allowed, denied, anonymous = (s["attributes"] for s in spans)
    assert allowed["capgate.decision"] == "allow" and allowed["capgate.rule"] == "read-cpu"
    assert allowed["capgate.agent"] == "sre-bot" and allowed["capgate.run"] == "run-7"
    assert allowed["http.response.status_code"] == 200
    assert allowed["url.path"] == "/metrics/metrics/cpu"  # no query
    assert denied["capgate.reason"] == "no_rule" and denied["http.response.status_code"] == 403
    assert spans[1]["status"]["status_code"] == "ERROR"
    assert anonymous["capgate.reason"] == "token_missing" and "capgate.agent" not in anonymous
    raw = traces.read_text()
    for secret in (tok, workspace.metrics_token):
        assert secret not in raw


def test_disabled_by_default() -> None:
    telemetry = Telemetry(None)
    assert not telemetry.enabled and not telemetry.tracing
    telemetry.flush()
    telemetry.close()


async def test_child_spans_link_and_traceparent_upstream(
    serve_gateway: Any, gateway: Gateway, workspace: Workspace, mocks: Mocks, memory: Any
) -> None:
    telemetry, exporter, _ = memory
    client = await serve_gateway(with_telemetry(gateway, telemetry))
    tok = workspace.token("tester", ["tester"])
    headers = {
        "Authorization": f"Bearer {tok}",
        "traceparent": AGENT_TRACEPARENT,
        "tracestate": "agent=secretish",
    }
    assert (await client.get("/echo/echo/hello", headers=headers)).status == 200
    spans = exporter.get_finished_spans()
    [server] = [s for s in spans if s.kind == SpanKind.SERVER]
    children = {s.name: s for s in spans if s.parent is not None}
    assert set(children) == {
        "capgate authenticate",
        "capgate match",
        "capgate checks",
        "capgate upstream",
    }
    ctx = server.get_span_context()
    for child in children.values():
        assert child.parent is not None and child.parent.span_id == ctx.span_id
        assert child.context.trace_id == ctx.trace_id
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time
    assert server.name == "GET /echo"
    # The agent's trace is a link, never the parent; its tracestate is not copied.
    assert server.parent is None and ctx.trace_id != int(AGENT_TRACE, 16)
    [link] = server.links
    assert (link.context.trace_id, link.context.span_id) == (
        int(AGENT_TRACE, 16),
        int(AGENT_SPAN, 16),
    )
    assert len(link.context.trace_state) == 0
    # Upstream: our trace, the upstream span as parent; the agent's tracestate not passed.
    [seen] = mocks.requests("echo")
    sent = {k.lower(): v for k, v in seen["headers"].items()}
    upstream = children["capgate upstream"]
    assert upstream.kind == SpanKind.CLIENT
    flags = int(upstream.context.trace_flags)
    assert flags & 1  # sampled (the SDK also sets 0x02: its trace ids are random)
    assert sent["traceparent"] == (
        f"00-{ctx.trace_id:032x}-{upstream.context.span_id:016x}-{flags:02x}"
    )
    assert "tracestate" not in sent


async def test_tracestate_passes_only_when_a_rule_names_it(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    mocks: Mocks,
    policy_file: Path,
    memory: Any,
) -> None:
    text = policy_file.read_text()
    anchor = '          X-Trace: {regex: "[a-z0-9]{1,16}"}\n'
    assert anchor in text
    named = policy_file.with_name("tracestate.yaml")
    named.write_text(
        text.replace(anchor, anchor + '          tracestate: {regex: "[a-z=]{1,32}"}\n')
    )
    mocks.clear()
    gw = build_gateway(dataclasses.replace(settings, policy=named), workspace.environ())
    client = await serve_gateway(with_telemetry(gw, memory[0]))
    headers = {
        "Authorization": f"Bearer {workspace.token('tester', ['tester'])}",
        "traceparent": AGENT_TRACEPARENT,
        "tracestate": "agent=ok",
    }
    assert (await client.get("/echo/echo/hello", headers=headers)).status == 200
    [seen] = mocks.requests("echo")
    sent = {k.lower(): v for k, v in seen["headers"].items()}
    assert sent["tracestate"] == "agent=ok"
    assert AGENT_TRACE not in sent["traceparent"]  # the traceparent is always ours


@pytest.mark.parametrize(
    "value",
    [
        "garbage",
        "00-" + "0" * 32 + "-" + AGENT_SPAN + "-01",  # all-zero trace id
        "00-" + AGENT_TRACE + "-" + "0" * 16 + "-01",  # all-zero span id
        "ff-" + AGENT_TRACE + "-" + AGENT_SPAN + "-01",  # forbidden version
        "00-" + AGENT_TRACE.upper() + "-" + AGENT_SPAN + "-01",  # upper case
        "00-" + AGENT_TRACE + "-" + AGENT_SPAN + "-01-extra",  # v00 with more fields
        "01-" + AGENT_TRACE + "-" + AGENT_SPAN + "-01-" + "x" * 600,  # too long
        "\u00e9" * 60,
    ],
)
async def test_a_malformed_traceparent_is_ignored(
    serve_gateway: Any, gateway: Gateway, workspace: Workspace, memory: Any, value: str
) -> None:
    telemetry, exporter, _ = memory
    client = await serve_gateway(with_telemetry(gateway, telemetry))
    headers = {"Authorization": f"Bearer {workspace.token('tester', ['tester'])}"}
    headers["traceparent"] = value
    assert (await client.get("/echo/echo/hello", headers=headers)).status == 200
    [server] = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert server.parent is None and server.links == ()


async def test_the_approval_wait_is_a_child_span(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    tmp_path: Path,
    memory: Any,
) -> None:
    text = policy_file.read_text()
    anchor = "      - id: restart-service\n"
    held = policy_file.with_name("held.yaml")
    held.write_text(text.replace(anchor, anchor + "        approval: required\n"))
    token_file = tmp_path / "admin.token"
    token_file.write_text(ADMIN_TOKEN)
    os.chmod(token_file, 0o600)
    s = dataclasses.replace(settings, policy=held, admin_port=0, admin_token_file=token_file)
    telemetry, exporter, reader = memory
    gw = with_telemetry(build_gateway(s, workspace.environ()), telemetry)
    client = await serve_gateway(gw)
    assert gw.operators is not None
    admin = await aiohttp_client(create_admin_app(gw, gw.operators))
    tok = workspace.token("sre-bot", ["sre-diagnostics"])
    call = asyncio.ensure_future(
        client.post(
            "/services/services/restart",
            json={"service": "web"},
            headers={"Authorization": f"Bearer {tok}"},
        )
    )
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for _ in range(100):
        pending = (await (await admin.get("/approvals", headers=auth)).json())["pending"]
        if pending:
            break
        await asyncio.sleep(0.02)
    [gauge] = points(reader)["capgate.approvals.pending"]
    assert gauge.value == 1
    await asyncio.sleep(0.05)
    assert (await admin.post(f"/approvals/{pending[0]['id']}/approve", headers=auth)).status == 200
    assert (await call).status == 200
    names = [sp.name for sp in exporter.get_finished_spans()]
    assert "capgate approval" in names and "capgate upstream" in names
    [approval] = [sp for sp in exporter.get_finished_spans() if sp.name == "capgate approval"]
    assert approval.end_time is not None and approval.start_time is not None
    assert approval.end_time - approval.start_time >= 40_000_000  # it waited >= 40 ms
    assert points(reader)["capgate.approvals.pending"][0].value == 0


async def test_metrics_by_decision_reason_upstream_and_rule(
    serve_gateway: Any, gateway: Gateway, workspace: Workspace, memory: Any
) -> None:
    telemetry, _, reader = memory
    client = await serve_gateway(with_telemetry(gateway, telemetry))
    tok = workspace.token("sre-bot", ["sre-diagnostics"])
    auth = {"Authorization": f"Bearer {tok}"}
    for _ in range(3):
        assert (await client.get("/metrics/metrics/cpu?window=5m", headers=auth)).status == 200
    assert (await client.get("/metrics/metrics/cpu?window=2h", headers=auth)).status == 400
    assert (await client.get("/metrics/metrics/cpu?window=5m")).status == 401
    got = points(reader)
    calls = {
        (
            p.attributes["decision"],
            p.attributes["reason"],
            p.attributes["upstream"],
            p.attributes["rule"],
        ): p.value
        for p in got["capgate.calls"]
    }
    assert calls[("allow", "allowed", "metrics", "read-cpu")] == 3
    assert calls[("deny", "query_invalid", "metrics", "read-cpu")] == 1
    assert calls[("deny", "token_missing", "metrics", "(none)")] == 1
    durations = {
        (p.attributes["decision"], p.attributes["upstream"]): p
        for p in got["capgate.call.duration"]
    }
    assert durations[("allow", "metrics")].count == 3
    [up] = got["capgate.upstream.duration"]
    assert up.attributes == {"upstream": "metrics"} and up.count == 3 and up.sum > 0
    assert got["capgate.state.errors"][0].value == 0
    assert got["capgate.audit.errors"][0].value == 0


async def test_metric_labels_stay_in_the_policys_closed_set(
    serve_gateway: Any, gateway: Gateway, workspace: Workspace, memory: Any
) -> None:
    """An agent choosing upstream names, paths, methods and agent ids cannot add series."""
    telemetry, _, reader = memory
    client = await serve_gateway(with_telemetry(gateway, telemetry))
    for i in range(60):
        tok = workspace.token("tester", ["tester"]) if i % 2 else "not-a-token"
        auth = {"Authorization": f"Bearer {tok}"}
        await client.request("GET" if i % 3 else "PROPFIND", f"/up-{i}/p/{i}", headers=auth)
        await client.get(f"/echo-plain/zz{i}/{i}", headers=auth)
    got = points(reader)
    labels = {tuple(sorted(p.attributes.items())) for p in got["capgate.calls"]}
    assert len(labels) <= 6, labels
    for point in got["capgate.calls"]:
        assert point.attributes["upstream"] in {OTHER, "(none)", "echo-plain"}
        assert point.attributes["rule"] in {OTHER, "(none)", "plain-anything"}
    histogram_labels = {tuple(sorted(p.attributes.items())) for p in got["capgate.call.duration"]}
    assert len(histogram_labels) <= 4


async def test_prometheus_endpoint_serves_the_metrics(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "admin.token"
    token_file.write_text(ADMIN_TOKEN)
    os.chmod(token_file, 0o600)
    s = dataclasses.replace(
        settings, admin_port=0, admin_token_file=token_file, metrics_exporter=("prometheus",)
    )
    gw = build_gateway(s, workspace.environ())
    assert gw.telemetry.enabled and not gw.telemetry.tracing
    client = await serve_gateway(gw)
    tok = workspace.token("sre-bot", ["sre-diagnostics"])
    auth = {"Authorization": f"Bearer {tok}"}
    assert (await client.get("/metrics/metrics/cpu?window=5m", headers=auth)).status == 200
    assert gw.operators is not None
    admin = await aiohttp_client(
        create_admin_app(gw, gw.operators, metrics=gw.telemetry.prometheus_text)
    )
    assert (await admin.get("/metrics")).status == 401  # the admin token, like the rest
    resp = await admin.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    assert (
        'capgate_calls_total{decision="allow",reason="allowed",rule="read-cpu",upstream="metrics"'
    ) in text
    assert "capgate_call_duration_seconds_bucket" in text
    assert "capgate_upstream_duration_seconds_count" in text
    assert "capgate_approvals_pending" in text
    assert "sre-bot" not in text and tok not in text


async def test_otlp_reaches_a_local_receiver(
    serve_gateway: Any, settings: Settings, workspace: Workspace
) -> None:
    app = otlp_receiver.create_app()
    receiver = TestServer(app, host="127.0.0.1")
    await receiver.start_server()
    try:
        endpoint = str(receiver.make_url("")).rstrip("/")
        s = load_settings(
            {
                "policy": str(settings.policy),
                "jwks": str(settings.jwks),
                "upstream_key": str(settings.upstream_key),
                "secrets_dir": str(settings.secrets_dir),
                "audit": "-",
            },
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "OTEL_SERVICE_NAME": "capgate-test",
                "OTEL_EXPORTER_OTLP_HEADERS": "x-team=sre%20one",
            },
        )
        assert plan(s).spans == "otlp" and plan(s).metrics_endpoint == endpoint + "/v1/metrics"
        gw = build_gateway(s, workspace.environ())
        gw.telemetry.phase_min = 0.0  # every phase a span, to see them arrive
        client = await serve_gateway(gw)
        tok = workspace.token("sre-bot", ["sre-diagnostics"])
        headers = {"Authorization": f"Bearer {tok}", "traceparent": AGENT_TRACEPARENT}
        assert (await client.get("/metrics/metrics/cpu?window=5m", headers=headers)).status == 200
        assert (await client.get("/nowhere/x", headers=headers)).status == 403
        # The exporters post from their own threads, with a blocking client: flush there.
        await asyncio.get_running_loop().run_in_executor(None, gw.telemetry.flush)
        got = app[otlp_receiver.RECEIVED]
        assert got.stats["bad"] == 0
        servers = [sp for sp in got.spans if sp["kind"] == 2]  # SPAN_KIND_SERVER
        assert len(servers) == 2
        allowed = servers[0]
        assert allowed["resource"]["service.name"] == "capgate-test"
        assert allowed["attributes"]["capgate.rule"] == "read-cpu"
        assert allowed["links"][0]["trace_id"] == AGENT_TRACE
        assert allowed["links"][0]["trace_state"] == ""
        kids = {sp["name"] for sp in got.spans if sp["parent_span_id"] == allowed["span_id"]}
        assert {"capgate authenticate", "capgate upstream"} <= kids
        assert servers[1]["attributes"]["capgate.reason"] == "no_rule"
        names = {m["name"] for m in got.metrics}
        assert {"capgate.calls", "capgate.call.duration", "capgate.upstream.duration"} <= names
        calls = [p for m in got.metrics if m["name"] == "capgate.calls" for p in m["points"]]
        assert {
            (p["attributes"]["reason"], p["attributes"]["upstream"], p["value"]) for p in calls
        } >= {("allowed", "metrics", 1), ("no_rule", OTHER, 1)}
        # Before the receiver goes (its last export has somewhere to go), off the loop (the
        # receiver answering that export runs on it).
        await asyncio.get_running_loop().run_in_executor(None, gw.telemetry.close)
    finally:
        await receiver.close()


def test_otel_variables_choose_the_exporters() -> None:
    base = {"policy": "p", "jwks": "j"}
    assert plan(load_settings(base, {})) == Plan()
    p = plan(load_settings(base, {"OTEL_TRACES_EXPORTER": "otlp"}))
    assert p.spans_endpoint == "http://localhost:4318/v1/traces" and p.metrics_endpoint is None
    p = plan(
        load_settings(
            base,
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://tempo:4318/custom",
                "OTEL_METRICS_EXPORTER": "none",
            },
        )
    )
    assert p.spans_endpoint == "http://tempo:4318/custom" and p.metrics_endpoint is None
    p = plan(load_settings({**base, "traces": "https://otel.example:4318"}, {}))
    assert p.spans_endpoint == "https://otel.example:4318/v1/traces"
    p = plan(
        load_settings(
            base, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
        )
    )
    assert p.spans is None and not p.metrics


_HEX = "0123456789abcdefABCDEF"


@st.composite
def traceparents(draw: st.DrawFn) -> str:
    """Mostly near-valid values: the fields' lengths, alphabet, versions and extras vary."""

    def hexes(n: int) -> str:
        size = draw(st.sampled_from([n, n, n, n - 1, n + 1]))
        alphabet = st.sampled_from(_HEX if draw(st.booleans()) else "0123456789abcdef")
        return "".join(draw(st.lists(alphabet, min_size=size, max_size=size)))

    version = draw(st.sampled_from(["00", "01", "ff", "fe", "0g", "0"]))
    trace_id = draw(st.sampled_from(["0" * 32, hexes(32)]))
    span_id = draw(st.sampled_from(["0" * 16, hexes(16)]))
    flags = draw(st.sampled_from(["00", "01", "03", "ff", "1", "zz"]))
    extra = draw(st.sampled_from(["", "", "-", "-x", "-01-extra", " ", "\t", " x"]))
    lead = draw(st.sampled_from(["", "", " ", "\t", "x"]))
    sep = draw(st.sampled_from(["-", "-", "-", "_"]))
    return lead + sep.join([version, trace_id, span_id, flags]) + extra


@given(st.one_of(traceparents(), st.text(max_size=80).filter(lambda t: "\n" not in t)))
@FUZZ
def test_traceparent_parsing_agrees_with_the_sdk_propagator(value: str) -> None:
    """Our parser (no Context built per call) accepts exactly what the SDK's W3C propagator
    accepts, with the same ids and flags."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    sdk = trace.get_current_span(
        TraceContextTextMapPropagator().extract({"traceparent": value})
    ).get_span_context()
    ours = parse_traceparent(value)
    if not sdk.is_valid:
        assert ours is None, value
    else:
        assert ours is not None, value
        assert (ours.trace_id, ours.span_id, ours.trace_flags) == (
            sdk.trace_id,
            sdk.span_id,
            sdk.trace_flags,
        )


def test_the_traceparent_we_send_is_the_propagators() -> None:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = SpanContext(0x1234, 0x42, False, TraceFlags(TraceFlags.SAMPLED))
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(
        carrier, trace.set_span_in_context(NonRecordingSpan(ctx))
    )
    assert carrier == {"traceparent": traceparent(0x1234, 0x42)}


async def test_state_and_audit_errors_are_counted(
    serve_gateway: Any, gateway: Gateway, workspace: Workspace, memory: Any
) -> None:
    from gateway.errors import StateUnavailable

    telemetry, _, reader = memory
    gw = with_telemetry(gateway, telemetry)

    def store_down(*args: Any) -> None:
        raise StateUnavailable("the state store is down (test)")

    def trail_broken(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    gw.state.is_revoked = store_down  # type: ignore[method-assign]
    gw.audit.call_ended = trail_broken  # type: ignore[method-assign]
    client = await serve_gateway(gw)
    auth = {"Authorization": f"Bearer {workspace.token('tester', ['tester'])}"}
    assert (await client.get("/echo-plain/rated/1", headers=auth)).status == 503
    assert (await client.get("/echo-plain/lenient/1", headers=auth)).status == 200
    got = points(reader)
    assert got["capgate.state.errors"][0].value == 2
    assert got["capgate.audit.errors"][0].value == 2
    calls = {(p.attributes["reason"], p.attributes["rule"]) for p in got["capgate.calls"]}
    assert calls == {("state_unavailable", "echo-rated"), ("allowed", "echo-open-on-state-error")}


def test_closing_with_the_collector_down_keeps_to_a_bound(caplog: pytest.LogCaptureFixture) -> None:
    """The SDK retries an export for its whole timeout (15 s measured with a refused port);
    the stop waits at most CLOSE_WAIT for it, then drops the rest and says so once."""
    import socket
    import time

    from multidict import CIMultiDict

    from gateway.audit_record import BodyMac
    from gateway.stages.audit import audit_records
    from gateway.telemetry import CLOSE_WAIT
    from gateway.testing import make_call

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    telemetry = Telemetry(
        Plan(spans="otlp", spans_endpoint=dead + "/v1/traces", metrics_endpoint=dead + "/v1/m")
    )
    call = make_call("GET", "/metrics/metrics/cpu", headers={})
    call.outbound_headers = CIMultiDict()
    telemetry.call_started(call)
    telemetry.call_ended(call, audit_records(call, BodyMac(None)))
    started = time.monotonic()
    telemetry.close()
    assert time.monotonic() - started < CLOSE_WAIT + 1.0
    # The export still retrying behind the stop ends too (its exporter was shut down): no
    # thread keeps retrying for the SDK's whole timeout into what runs next.
    while any(t.name == "capgate-telemetry-stop" for t in threading.enumerate()):
        assert time.monotonic() - started < CLOSE_WAIT + 4.0, "the export is still retrying"
        time.sleep(0.05)


async def test_fast_phases_get_no_span_but_a_refusing_one_does(
    serve_gateway: Any, gateway: Gateway, workspace: Workspace
) -> None:
    """The common path stays lean: phases under PHASE_SPAN_MIN are not spans of their own,
    unless the phase refused the call; the upstream span is always there."""
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(Plan(), span_exporter=exporter)
    client = await serve_gateway(with_telemetry(gateway, telemetry))
    auth = {"Authorization": f"Bearer {workspace.token('tester', ['tester'])}"}
    assert (await client.get("/echo/echo/hello", headers=auth)).status == 200
    names = [s.name for s in exporter.get_finished_spans()]
    assert "capgate upstream" in names and "GET /echo" in names
    assert len(names) < 6  # a cached token and a compiled rule take well under 1 ms each
    exporter.clear()
    assert (
        await client.get("/echo/echo/hello", headers={"Authorization": "Bearer x"})
    ).status == 401
    names = [s.name for s in exporter.get_finished_spans()]
    assert "capgate authenticate" in names and "capgate upstream" not in names


def test_a_slow_phase_among_fast_ones_gets_its_span() -> None:
    """Phase spans are looked for only when the checks took at least ``phase_min`` in all (or
    one refused the call): a slow phase is still found; quick checks give none."""
    from multidict import CIMultiDict

    from gateway.audit_record import BodyMac
    from gateway.stages.audit import audit_records
    from gateway.testing import make_call

    exporter = InMemorySpanExporter()
    telemetry = Telemetry(Plan(), span_exporter=exporter)
    telemetry.phase_min = 0.001
    telemetry.phases = (("capgate authenticate", 0, 1), ("capgate match", 1, 2))
    for steps, shown in (
        ([0.0001, 0.0001], []),  # 0.2 ms in all
        ([0.0002, 0.003], ["capgate match"]),
        ([0.002, 0.0001], ["capgate authenticate"]),
    ):
        call = make_call("GET", "/metrics/metrics/cpu", headers={})
        call.outbound_headers = CIMultiDict()
        telemetry.call_started(call)
        assert call.marks is not None
        for step in steps:
            call.marks.append(call.marks[-1] + step)
        telemetry.call_ended(call, audit_records(call, BodyMac(None)))
        names = [s.name for s in exporter.get_finished_spans()]
        assert [n for n in names if n.startswith("capgate ")] == shown
        exporter.clear()
