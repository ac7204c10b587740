"""OpenTelemetry spans: one per call, with the decision and no secret."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from gateway.app import build_gateway
from gateway.config import Settings
from gateway.telemetry import Telemetry
from mocks.demo import Workspace


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
    spans = [json.loads(line) for line in traces.read_text().splitlines()]
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
    assert not telemetry.enabled
    telemetry.flush()
    telemetry.close()
