"""Record against the real mocks through the gateway, then replay with no upstream at all."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import ConfigError
from gateway.recording.lint import lint
from gateway.recording.reader import load_recording
from gateway.transports.modes import build_transport
from gateway.transports.record import RecordTransport
from gateway.transports.replay import ReplayOrRecordTransport, ReplayTransport, ShadowTransport
from gateway.transports.upstream import LiveTransport
from mocks.demo import Workspace
from tests.conftest import Mocks
from tests.recording.conftest import (
    GatewayFactory,
    Recorded,
    ReplayFactory,
    bearer,
    read_all_bytes,
    records,
)

PROBLEM = "application/problem+json"

# The calls of one agent run: (method, path, json body). One token with both roles.
SCENARIO: list[tuple[str, str, Any]] = [
    ("GET", "/metrics/metrics/cpu?window=5m", None),
    ("GET", "/logs/logs/application?limit=3", None),
    ("POST", "/services/services/restart", {"service": "worker"}),
    ("GET", "/echo/echo/abc-1?x=1", None),
    ("GET", "/echo/echo/abc-1?x=1", None),  # the same call again: answered in order
    ("GET", "/echo/echo/reflect", None),  # the echo reflects the injected X-Api-Key
    ("GET", "/echo/sse?events=3&delay=0.01", None),
    ("GET", "/logs/logs/stream?chunks=3&delay=0.01", None),
    ("DELETE", "/services/services/web", None),  # denied: no rule
    ("GET", "/down/x", None),  # the upstream is down: recorded as an error
]
ROLES = ["sre-diagnostics", "tester"]


async def run_scenario(client: Any, tok: str) -> list[tuple[int, str, bytes]]:
    out = []
    for method, path, body in SCENARIO:
        if path.startswith("/echo/sse"):
            path = "/echo/echo/sse?events=3&delay=0.01"
        resp = await client.request(method, path, json=body, headers=bearer(tok))
        out.append((resp.status, resp.headers.get("Content-Type", ""), await resp.read()))
    return out


def secrets_of_workspace(workspace: Workspace, mocks: Mocks, tokens: list[str]) -> list[str]:
    upstream_jwts = [
        {k.lower(): v for k, v in r["headers"].items()}["authorization"].split(" ", 1)[1]
        for r in mocks.requests("services")
    ]
    assert upstream_jwts, "the services mock saw no agent-JWT"
    echo_keys = [p.read_text().strip() for p in workspace.secrets_dir.glob("echo-*.key")]
    return [
        workspace.metrics_token,
        *workspace.db_tokens.values(),
        *echo_keys,
        *tokens,
        *upstream_jwts,
    ]


async def test_record_then_replay_with_no_upstream(
    recorded: Recorded,
    token: Any,
    workspace: Workspace,
    mocks: Mocks,
    replay_gateway: ReplayFactory,
) -> None:
    tok = token("sre-bot", ROLES, run="r1")
    live = await run_scenario(recorded.client, tok)
    assert [s for s, _, _ in live] == [200, 200, 200, 200, 200, 200, 200, 200, 403, 502]
    directory = await recorded.finish()

    # No secret of the workspace appears anywhere in the recording, in any form.
    secrets = secrets_of_workspace(workspace, mocks, [tok])
    files = read_all_bytes(directory)
    assert "manifest.json" in files and "runs/r1.jsonl" in files
    for name, data in files.items():
        for secret in secrets:
            assert secret.encode() not in data, f"a secret is in {name}"
    assert lint(directory, known=secrets) == []

    recs = records(directory, "r1")
    assert [r["kind"] for r in recs].count("denial") == 1
    metrics = recs[0]
    assert metrics["roles"] == ROLES and metrics["decision"]["rule"] == "read-cpu"
    assert ["Authorization", {"secret": "metrics:bearer"}] in metrics["request"]["headers"]
    reflect = next(r for r in recs if r["target"] == "/echo/reflect")
    assert "[secret:echo:header]" in reflect["response"]["body"]["text"]
    assert ["X-Api-Key", {"secret": "echo:header"}] in reflect["request"]["headers"]
    sse = next(r for r in recs if r["target"].startswith("/echo/sse"))
    assert len(sse["response"]["chunks"]) == 3
    down = recs[-1]
    assert down["error"]["reason"] == "upstream_unavailable" and down["response"] is None

    # Replay: a new token of the same run, every upstream on a dead port, the replay
    # transport (which has no client): the agent gets what it got, byte for byte.
    client, gw = await replay_gateway(directory)
    replayed = await run_scenario(client, token("sre-bot", ROLES, run="r1"))
    # (The echo mock reflects the injected key: the recording holds [secret:echo:header], and
    # replay puts this gateway's key back for the respond stage to mask, as it did live.)
    for (method, path, _), got, want in zip(SCENARIO, replayed, live, strict=True):
        assert got[:2] == want[:2], (method, path)
        if want[1] != PROBLEM:  # problem bodies carry each call's own request id
            assert got[2] == want[2], (method, path)
    transport = gw.transport
    assert isinstance(transport, ReplayTransport)
    report = transport.report().as_dict()
    assert report["counts"]["misses"] == 0 and report["unused"] == []
    assert report["unexpected_denials"] == []


async def test_a_changed_request_misses_with_a_diff(
    recorded: Recorded, token: Any, replay_gateway: ReplayFactory
) -> None:
    tok = token("sre-bot", ["sre-diagnostics"])
    assert (
        await recorded.client.get("/metrics/metrics/cpu?window=5m", headers=bearer(tok))
    ).status == 200
    resp = await recorded.client.post(
        "/services/services/restart", json={"service": "web"}, headers=bearer(tok)
    )
    assert resp.status == 200
    client, _ = await replay_gateway(await recorded.finish())
    resp = await client.get("/metrics/metrics/cpu?window=1m", headers=bearer(tok))
    assert resp.status == 421
    body = await resp.json(content_type=PROBLEM)
    assert body["reason"] == "replay_miss" and body["rule"] == "read-cpu"
    assert "query.window: '1m' != '5m'" in body["detail"]
    assert body["errors"][0]["differences"] == [
        {"field": "query.window", "call": "1m", "recorded": "5m"}
    ]
    resp = await client.post(
        "/services/services/restart", json={"service": "worker"}, headers=bearer(tok)
    )
    body = await resp.json(content_type=PROBLEM)
    assert resp.status == 421 and "body./service: '\"worker\"' != '\"web\"'" in body["detail"]
    # Key order and whitespace of a JSON body do not matter.
    resp = await client.post(
        "/services/services/restart",
        data=b'{ "service" :\n"web" }',
        headers={**bearer(tok), "Content-Type": "application/json"},
    )
    assert resp.status == 200 and await resp.json() == {"restarted": "web", "by": "sre-bot"}


async def test_parallel_runs_and_repeat_last(
    recorded: Recorded, token: Any, replay_gateway: ReplayFactory
) -> None:
    tok = token("tester", run="p")
    bodies = [
        await (await recorded.client.get("/echo/echo/n", headers=bearer(tok))).read()
        for _ in range(2)
    ]
    assert bodies[0] != bodies[1]  # each echo carries its own request id
    directory = await recorded.finish()

    client, _ = await replay_gateway(directory)

    async def run(name: str) -> list[bytes]:
        t = token("tester", run=name)
        out = []
        for _ in range(2):
            out.append(await (await client.get("/echo/echo/n", headers=bearer(t))).read())
        return out

    assert await asyncio.gather(*(run(f"job-{i}") for i in range(4))) == [bodies] * 4
    resp = await client.get("/echo/echo/n", headers=bearer(token("tester", run="job-0")))
    assert resp.status == 421
    assert "were already used" in (await resp.json(content_type=PROBLEM))["detail"]

    client, _ = await replay_gateway(directory, repeat_last={"echo-get"})
    t = token("tester", run="again")
    got = [await (await client.get("/echo/echo/n", headers=bearer(t))).read() for _ in range(4)]
    assert got == [bodies[0], bodies[1], bodies[1], bodies[1]]


async def test_sse_chunk_order_is_reproduced(recorded: Recorded, token: Any, gateway: Any) -> None:
    tok = token("tester", run="sse")
    await (
        await recorded.client.get("/echo/echo/sse?events=4&delay=0.01", headers=bearer(tok))
    ).read()
    directory = await recorded.finish()
    from multidict import CIMultiDict

    from gateway.transport import UpstreamRequest

    replay = ReplayTransport(directory)
    req = UpstreamRequest(
        upstream=gateway.policy.upstreams["echo"],
        method="GET",
        target="/echo/sse?events=4&delay=0.01",
        headers=CIMultiDict(),
        body=None,
        run="sse",
        rule=gateway.policy.rules_by_id["echo-get"],
    )
    resp = await replay.send(req)
    chunks = [c async for c in resp.iter_chunks()]
    assert [json.loads(c.decode().split("data: ")[1])["n"] for c in chunks] == [1, 2, 3, 4]
    assert resp.headers["Content-Type"] == "text/event-stream"


async def test_shadow_reports_differences_without_failing(
    recorded: Recorded,
    token: Any,
    live_gateway: GatewayFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tok = token("tester", run="s")
    await recorded.client.get("/echo/echo/a", headers=bearer(tok))
    await recorded.client.get(
        "/metrics/metrics/cpu?window=5m",
        headers=bearer(token("sre-bot", ["sre-diagnostics"], run="s")),
    )
    directory = await recorded.finish()
    report_path = tmp_path / "shadow-report.json"
    client, gw = await live_gateway(
        lambda live: ShadowTransport(directory, live, report_path=report_path)
    )
    with caplog.at_level(logging.WARNING, logger="capgate.recording"):
        resp = await client.get("/echo/echo/a", headers=bearer(tok))
        assert resp.status == 200  # the live answer, whatever the comparison says
        resp = await client.get(
            "/metrics/metrics/cpu?window=5m",
            headers=bearer(token("sre-bot", ["sre-diagnostics"], run="s")),
        )
        assert resp.status == 200
        resp = await client.get("/echo/echo/b", headers=bearer(tok))
        assert resp.status == 200
    await gw.transport.close()
    report = json.loads(report_path.read_text())
    assert report["mode"] == "shadow"
    diffs = {d["call"]: d["differences"] for d in report["differences"]}
    # The echo answer differs (its request id); the metrics answer is the same; /b is new.
    assert any("body: JSON fields differ: /headers" in d for d in diffs["GET echo /echo/a"])
    assert "GET metrics /metrics/cpu?window=5m" not in diffs
    assert diffs["GET echo /echo/b"][0].startswith("no recording")
    assert "shadow: GET echo /echo/a differs" in caplog.text


async def test_replay_or_record(
    recorded: Recorded, token: Any, live_gateway: GatewayFactory
) -> None:
    tok = token("tester", run="ror")
    await recorded.client.get("/echo/echo/a", headers=bearer(tok))
    directory = await recorded.finish()
    with pytest.raises(ConfigError, match="refused when CI=true"):
        build_transport("replay-or-record", directory, LiveTransport(), ci=True, sample=None)
    client, gw = await live_gateway(
        lambda live: build_transport("replay-or-record", directory, live, ci=False, sample=None)
    )
    assert (await client.get("/echo/echo/a", headers=bearer(tok))).status == 200  # replayed
    assert (await client.get("/echo/echo/new", headers=bearer(tok))).status == 200  # recorded
    transport = gw.transport
    assert isinstance(transport, ReplayOrRecordTransport)
    report = transport.replay.report().as_dict()
    assert report["counts"]["misses"] == 0 and report["recorded"] == [
        {"run": "ror", "call": "GET echo /echo/new"}
    ]
    await transport.close()
    assert [e.target for e in load_recording(directory).runs["ror"].entries] == [
        "/echo/a",
        "/echo/new",
    ]


def test_build_transport_errors(tmp_path: Path) -> None:
    live = LiveTransport()
    assert build_transport("live", None, live, ci=True, sample=None) == (live, None)
    with pytest.raises(ConfigError, match="mode has value 'fast'"):
        build_transport("fast", tmp_path, live, ci=False, sample=None)
    with pytest.raises(ConfigError, match="needs a recordings directory"):
        build_transport("replay", None, live, ci=False, sample=None)
    with pytest.raises(ConfigError, match="recordings: .*no such recording directory"):
        build_transport("replay", tmp_path / "missing", live, ci=False, sample=None)
    with pytest.raises(ConfigError, match="sample has value 2"):
        build_transport("record", tmp_path, live, ci=False, sample=2)
    made = build_transport("record", tmp_path / "new", live, ci=False, sample=0.5)
    assert isinstance(made.transport, RecordTransport) and made.denials is made.transport


async def test_a_response_refused_for_its_size_is_refused_again(
    recorded: Recorded, token: Any, replay_gateway: ReplayFactory
) -> None:
    tok = token("tester")
    resp = await recorded.client.get("/logs/logs/big?size=70000", headers=bearer(tok))
    assert resp.status == 502
    [rec] = records(await recorded.finish())
    assert rec["response"]["body"] is None and rec["response"]["complete"] is False
    client, _ = await replay_gateway(recorded.directory)
    resp = await client.get("/logs/logs/big?size=70000", headers=bearer(tok))
    assert resp.status == 502
    assert (await resp.json(content_type=PROBLEM))["reason"] == "payload_too_large"


async def test_refusals_before_the_policy_are_recorded_and_reproduced(
    recorded: Recorded, token: Any, replay_gateway: ReplayFactory
) -> None:
    from yarl import URL

    async def refusals(client: Any) -> list[int]:
        ambiguous = URL("/echo/echo/a%3Bb", encoded=True)
        return [
            (await client.get("/metrics/metrics/cpu?window=5m")).status,
            (await client.get(ambiguous, headers=bearer(token("tester")))).status,
        ]

    assert await refusals(recorded.client) == [401, 400]
    directory = await recorded.finish()
    missing, ambiguous = load_recording(directory).runs["default"].entries
    assert (missing.kind, missing.agent, missing.decision.reason) == (
        "denial",
        None,
        "token_missing",
    )
    assert (ambiguous.upstream, ambiguous.target, ambiguous.decision.reason) == (
        None,
        "/echo/echo/a%3Bb",
        "target_ambiguous",
    )
    assert ambiguous.agent is None  # refused before the token was even read
    client, gw = await replay_gateway(directory)
    assert await refusals(client) == [401, 400]
    report = gw.transport.report().as_dict()  # type: ignore[attr-defined]
    assert report["unexpected_denials"] == [] and report["unused"] == []
