"""Chaos on demand (``serve --faults FILE``): faults chosen from the seed, the run, the
canonical call and its occurrence, the same in any arrival order; each kind ends the call as
a real fault would; every injected fault is marked in the audit and in the answer."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict
from yarl import URL

from gateway.app import build_gateway
from gateway.audit_trail import call_records
from gateway.chaos import FAULT_HEADER, ChaosTransport, FaultPlan, load_faults
from gateway.config import load_settings
from gateway.errors import ConfigError, UpstreamTimeout, UpstreamUnavailable
from gateway.policy.model import Upstream
from gateway.transport import UpstreamRequest
from mocks.chaos import ChaosUpstream
from mocks.demo import Workspace
from tests.helpers_core import REPO

UP = Upstream(name="up", url=URL("http://127.0.0.1:9"), read_timeout=0.2, total_timeout=1.0)


def req(target: str, run: str = "run-1", body: bytes | None = None) -> UpstreamRequest:
    method = "POST" if body else "GET"
    return UpstreamRequest(UP, method, target, CIMultiDict(), body, agent="a", run=run)


def plan(tmp_path: Path, text: str) -> FaultPlan:
    path = tmp_path / "faults.yaml"
    path.write_text(text)
    return load_faults(path)


def test_the_same_seed_gives_the_same_faults_in_any_order(tmp_path: Path) -> None:
    text = "seed: 7\nfaults:\n  - {upstream: up, probability: 0.5, error: 503}\n"
    calls = [(f"/items/{i % 40}", f"run-{i % 3}") for i in range(240)]

    def outcomes(order: list[int]) -> dict[tuple[str, str, int], bool]:
        p = plan(tmp_path, text)
        seen: dict[tuple[str, str], int] = {}
        out = {}
        for i in order:
            target, run = calls[i]
            n = seen[(target, run)] = seen.get((target, run), 0) + 1
            out[(target, run, n)] = p.choose(req(target, run)) is not None
        return out

    forward = outcomes(list(range(len(calls))))
    shuffled = list(range(len(calls)))
    random.Random(3).shuffle(shuffled)
    assert outcomes(shuffled) == forward  # arrival order does not matter
    assert 70 < sum(forward.values()) < 170  # about half of 240
    other = plan(tmp_path, text.replace("seed: 7", "seed: 8"))
    assert [other.choose(req(t, r)) is not None for t, r in calls] != [
        forward[k] for k in sorted(forward, key=list(forward).index)
    ]


def test_json_bodies_are_one_call_whatever_their_key_order(tmp_path: Path) -> None:
    p = plan(tmp_path, "seed: 1\nfaults:\n  - {probability: 0.5, reset: true}\n")
    q = plan(tmp_path, "seed: 1\nfaults:\n  - {probability: 0.5, reset: true}\n")
    for i in range(50):
        a = json.dumps({"a": i, "b": 2}).encode()
        b = json.dumps({"b": 2, "a": i}).encode()
        assert (p.choose(req("/x", body=a)) is None) == (q.choose(req("/x", body=b)) is None)


def test_a_bad_fault_file_says_where(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        plan(
            tmp_path,
            "seed: 1\nfaults:\n"
            "  - {upstream: up, latency: soon}\n"
            "  - {upstream: up, error: 200}\n"
            "  - {upstream: up, probability: 2, reset: true}\n"
            "  - {upstream: up, reset: true, timeout: true}\n"
            "  - {upstream: up, latency: 1s, colour: red}\n",
        )
    lines = str(info.value).splitlines()
    assert lines[0] == "fault file has errors:"
    assert [line.split(": ", 1)[0].rsplit(":", 2)[-2:] for line in lines[1:]] == [
        ["3", "29"],
        ["4", "27"],
        ["5", "33"],
        ["6", "5"],
        ["7", "33"],
    ]


class Inner:
    def __init__(self) -> None:
        self.sent = 0

    async def send(self, request: UpstreamRequest) -> Any:
        self.sent += 1
        return type("R", (), {"status": 200, "reason": "OK", "headers": CIMultiDict()})()

    async def close(self) -> None:
        pass


async def test_each_kind_of_fault(tmp_path: Path) -> None:
    async def one(kind: str) -> tuple[Inner, UpstreamRequest, Any]:
        inner = Inner()
        transport = ChaosTransport(
            inner, plan(tmp_path, f"faults:\n  - {{upstream: up, {kind}}}\n")
        )
        r = req("/x")
        try:
            return inner, r, await transport.send(r)
        except (UpstreamUnavailable, UpstreamTimeout) as exc:
            return inner, r, exc

    inner, r, resp = await one("error: 503")
    assert (inner.sent, resp.status, resp.headers[FAULT_HEADER]) == (0, 503, "error 503")
    assert json.loads(await resp.read_all())["error"] == "injected by capgate chaos"
    assert r.fault == "error 503"
    inner, r, exc = await one("reset: true")
    assert isinstance(exc, UpstreamUnavailable) and "fault injected" in exc.detail
    loop = asyncio.get_running_loop()
    started = loop.time()
    inner, r, exc = await one("timeout: true")
    assert isinstance(exc, UpstreamTimeout) and loop.time() - started >= 0.2
    started = loop.time()
    inner, r, resp = await one("latency: 150ms")
    assert loop.time() - started >= 0.15 and inner.sent == 1
    assert resp.status == 200 and resp.headers[FAULT_HEADER] == "latency 0.15s"


def test_the_fault_file_key_is_not_a_typo(tmp_path: Path) -> None:
    # "up: 0" above is an unknown key: only upstream, rule, probability and one kind count
    with pytest.raises(ConfigError, match="unknown key 'up'"):
        plan(tmp_path, "faults:\n  - {up: 0, reset: true}\n")


def test_the_ready_made_scenarios_load() -> None:
    for name in ("upstream-down.yaml", "slow-upstream.yaml"):
        p = load_faults(REPO / "faults" / name)
        assert p.faults


@pytest.fixture
async def chaos() -> AsyncIterator[ChaosUpstream]:
    async with ChaosUpstream() as up:
        yield up


async def test_serve_with_faults_marks_the_audit(
    chaos: ChaosUpstream, serve_gateway: Any, workspace: Workspace, tmp_path: Path
) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\n"
        f'upstreams:\n  up: {{url: "{chaos.url}", timeouts: {{read: 0.3s, total: 2s}}}}\n'
        "agents:\n  agent-a: [r]\n"
        "roles:\n  r:\n    rules:\n"
        "      - {id: ok, upstream: up, allow: GET /ok}\n"
        "      - {id: echo, upstream: up, allow: GET /echo}\n"
    )
    faults = tmp_path / "faults.yaml"
    faults.write_text(
        "seed: 1\nfaults:\n  - {rule: ok, error: 503}\n  - {rule: echo, latency: 50ms}\n"
    )
    audit = tmp_path / "audit.jsonl"
    flags = {"policy": str(policy), "jwks": str(workspace.jwks), "audit": str(audit)}
    settings = load_settings({**flags, "faults": str(faults)}, {})
    gw = build_gateway(settings, workspace.environ())
    client = await serve_gateway(gw)
    auth = {"Authorization": f"Bearer {workspace.token('agent-a', ['r'], run='run-9')}"}
    resp = await client.get("/up/ok", headers=auth)
    assert resp.status == 503 and resp.headers[FAULT_HEADER] == "error 503"
    resp = await client.get("/up/echo", headers=auth)
    assert resp.status == 200 and resp.headers[FAULT_HEADER] == "latency 0.05s"
    gw.audit.flush()
    records = call_records(json.loads(x) for x in audit.read_text().splitlines())
    assert [(r["rule"], r["status"], r.get("fault")) for r in records] == [
        ("ok", 503, "error 503"),
        ("echo", 200, "latency 0.05s"),
    ]
    assert chaos.stats["ok"] == 0  # the error was the gateway's: the upstream never saw it


async def test_faults_are_marked_in_the_recording(tmp_path: Path) -> None:
    from gateway.recording.reader import load_recording
    from gateway.transports.record import RecordTransport
    from tests.recording.helpers import drain, mini_policy, request

    policy = mini_policy()
    faults = plan(tmp_path, "faults:\n  - {upstream: api, error: 503}\n")
    recorder = RecordTransport(ChaosTransport(Inner(), faults), tmp_path / "rec")
    resp = await recorder.send(request(policy, None, "GET", "/x", run="r1"))
    assert b"injected by capgate chaos" in await drain(resp)
    await recorder.close()
    [entry] = list(load_recording(tmp_path / "rec").entries())
    assert entry.response is not None and entry.response.status == 503
    assert (FAULT_HEADER, "error 503") in [(k, v) for k, v in entry.response.headers]
