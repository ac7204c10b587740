"""The checked-in example recording: it replays, it is clean, and it is current."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.app import build_gateway
from gateway.config import load_settings
from gateway.recording.lint import lint
from gateway.recording.placeholders import PlaceholderCredentials
from gateway.recording.reader import load_recording
from gateway.transports.replay import ReplayTransport
from mocks.demo import prepare_workspace
from mocks.make_example import make_example
from tests.recording.conftest import bearer, read_all_bytes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "recordings" / "example"


async def test_the_example_replays_with_no_upstream_and_no_real_credentials(
    tmp_path: Path, serve_gateway: Any
) -> None:
    ws = prepare_workspace(tmp_path / "ws")  # the example policy, mocks' fixed ports: unused
    report = tmp_path / "replay-report.json"
    settings = load_settings(
        {
            "policy": str(ws.policy),
            "jwks": str(ws.jwks),
            "upstream_key": str(ws.upstream_key),
            "audit": "-",
            "mode": "replay",
            "recordings": str(EXAMPLE),
            "replay_report": str(report),
        },
        {},
    )
    # No real secret exists here: the replay mode's placeholders stand in for every one.
    gw = build_gateway(settings, {})
    assert isinstance(gw.credentials, PlaceholderCredentials)
    assert isinstance(gw.transport, ReplayTransport)
    client = await serve_gateway(gw)
    tok = ws.token("sre-bot", ["sre-diagnostics"], run="ci-job-7")
    recorded = {e.seq: e for e in load_recording(EXAMPLE).runs["example"].entries}

    resp = await client.get("/metrics/metrics/cpu?window=5m", headers=bearer(tok))
    assert resp.status == 200
    assert await resp.read() == recorded[1].response.body.read()  # type: ignore[union-attr]
    resp = await client.get("/logs/logs/application?level=error&limit=5", headers=bearer(tok))
    assert await resp.read() == recorded[2].response.body.read()  # type: ignore[union-attr]
    resp = await client.post(
        "/services/services/restart", json={"service": "web"}, headers=bearer(tok)
    )
    assert await resp.json() == {"restarted": "web", "by": "sre-bot"}
    resp = await client.delete("/services/services/web", headers=bearer(tok))
    assert resp.status == 403
    await gw.transport.close()
    data = json.loads(report.read_text())
    assert data["ok"] and data["counts"]["misses"] == 0 and data["unused"] == []
    assert data["unexpected_denials"] == []


def test_the_example_is_clean() -> None:
    assert lint(EXAMPLE) == []


def test_the_example_is_current(tmp_path: Path) -> None:
    """Regenerating gives the same bytes; if not, run: python -m mocks.make_example"""
    fresh = make_example(tmp_path / "example")
    assert read_all_bytes(fresh) == read_all_bytes(EXAMPLE), (
        "recordings/example is out of date: python -m mocks.make_example"
    )
