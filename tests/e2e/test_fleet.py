"""Two real ``capgate serve`` processes sharing one throwaway Redis: limits, revocation,
faults (Redis killed, restarted, paused) and a bounded soak."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gateway.audit_trail import call_records
from mocks.demo import Workspace, rewrite_policy_urls
from tests.conftest import ROOT, TEST_POLICY, Mocks
from tests.e2e.test_serve import Served, start_capgate
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.close()


class Fleet:
    def __init__(self, gateways: list[Served]) -> None:
        self.gateways = gateways

    def __getitem__(self, i: int) -> Served:
        return self.gateways[i]


@pytest.fixture
def fleet(
    workspace: Workspace, mocks: Mocks, redis: RedisServer, tmp_path: Path
) -> Iterator[Fleet]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(rewrite_policy_urls(TEST_POLICY.read_text(), mocks.urls))
    gateways: list[Served] = []
    try:
        for i in range(2):
            audit = tmp_path / f"audit-{i}.jsonl"
            args = [*workspace.serve_args(0, audit, policy), "--state", redis.url]
            args += ["--shutdown-grace", "5s"]
            proc, ready = start_capgate(args, workspace.environ(), tmp_path)
            gateways.append(Served(proc, ready, audit))
        yield Fleet(gateways)
    finally:
        for g in gateways:
            if g.proc.poll() is None:
                g.proc.send_signal(signal.SIGTERM)
        for g in gateways:
            try:
                g.proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                g.proc.kill()
                g.proc.communicate()


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    raise AssertionError("condition not reached in time")


def test_rate_limit_holds_across_two_gateways(fleet: Fleet, workspace: Workspace) -> None:
    tok = workspace.token("tester", ["tester"])
    results = [fleet[i % 2].call(f"/echo-plain/rated/{i}", tok) for i in range(12)]
    statuses = Counter(status for status, _ in results)
    assert statuses == {200: 5, 429: 7}
    limited = [body for status, body in results if status == 429]
    assert all(b["reason"] == "rate_limited" and b["rule"] == "echo-rated" for b in limited)
    assert {fleet[0].ready["url"], fleet[1].ready["url"]} and len(fleet.gateways) == 2


def test_revocation_reaches_the_other_gateway_within_a_second(
    fleet: Fleet, workspace: Workspace, redis: RedisServer
) -> None:
    tok = workspace.token("tester", ["tester"])
    assert fleet[1].call("/echo/echo/x", tok)[0] == 200  # its verdict is now cached there
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "revoke", "--agent", "tester", "--state", redis.url],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    revoked_at = time.monotonic()

    def denied() -> bool:
        status, body = fleet[1].call("/echo/echo/x", tok)
        return status == 401 and body["reason"] == "token_revoked"

    wait_for(denied, timeout=1.0)
    assert time.monotonic() - revoked_at < 1.0
    assert fleet[0].call("/echo/echo/x", tok)[1]["reason"] == "token_revoked"
    assert time.monotonic() - started < 10


def test_redis_killed_then_restarted(
    fleet: Fleet, workspace: Workspace, redis: RedisServer
) -> None:
    tok = workspace.token("tester", ["tester"])
    assert fleet[0].call("/echo/echo/x", tok)[0] == 200
    redis.kill()
    wait_for(lambda: fleet[0].call("/echo/echo/x", tok)[0] == 503, timeout=5)
    status, body = fleet[0].call("/echo/echo/x", tok)
    assert status == 503 and body["reason"] == "state_unavailable"
    status, body = fleet[1].call("/echo-plain/rated/1", tok)
    assert status == 503 and body["reason"] == "state_unavailable"
    # A rule that explicitly allows calls when the store is down still works.
    assert fleet[0].call("/echo-plain/lenient/1", tok)[0] == 200
    status, health = fleet[0].call("/_capgate/health")
    assert status == 503 and health["status"] == "degraded"
    assert health["state"]["reachable"] is False
    assert fleet[0].proc.poll() is None and fleet[1].proc.poll() is None  # both still up
    redis.restart()
    wait_for(lambda: fleet[0].call("/echo/echo/x", tok)[0] == 200, timeout=10)
    wait_for(lambda: fleet[1].call("/echo-plain/rated/2", tok)[0] == 200, timeout=10)


def test_paused_redis_does_not_hang_calls(
    fleet: Fleet, workspace: Workspace, redis: RedisServer
) -> None:
    tok = workspace.token("tester", ["tester"])
    assert fleet[0].call("/echo-plain/rated/1", tok)[0] == 200
    redis.pause(3000)
    started = time.monotonic()
    status, body = fleet[0].call("/echo-plain/rated/2", tok, timeout=10)
    elapsed = time.monotonic() - started
    assert status == 503 and body["reason"] == "state_unavailable"
    assert elapsed < 1.5, elapsed


def test_soak_two_gateways_audit_and_counters_match(fleet: Fleet, workspace: Workspace) -> None:
    agents = [f"soak-{i}" for i in range(6)]
    tokens = {a: workspace.token(a, ["tester"]) for a in agents}
    calls_per_agent = 20

    def agent_run(agent: str) -> list[tuple[int, str]]:
        out = []
        for i in range(calls_per_agent):
            gw = fleet[i % 2]
            path = f"/echo-plain/rated/{i}" if i % 2 == 0 else f"/echo-plain/x/{i}"
            status, body = gw.call(path, tokens[agent])
            out.append(
                (status, body.get("reason", "allowed") if isinstance(body, dict) else "allowed")
            )
        return out

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(agents)) as pool:
        results = dict(zip(agents, pool.map(agent_run, agents), strict=True))
    assert time.monotonic() - started < 60
    for agent, outcomes in results.items():
        rated = outcomes[0::2]
        plain = outcomes[1::2]
        # Exactly the rate (5/minute) of the rated calls were admitted across both gateways.
        assert sum(1 for s, _ in rated if s == 200) == 5, agent
        assert all(r == "rate_limited" for s, r in rated if s != 200)
        assert all(s == 200 for s, _ in plain), agent
    for g in fleet.gateways:
        g.proc.send_signal(signal.SIGTERM)
        assert g.proc.wait(timeout=15) == 0
    lines = call_records(
        json.loads(x) for g in fleet.gateways for x in g.audit.read_text().splitlines()
    )
    assert len(lines) == len(agents) * calls_per_agent
    assert len({x["request_id"] for x in lines}) == len(lines)
    per_agent = Counter((x["agent"], x["status"]) for x in lines)
    for agent in agents:
        assert per_agent[(agent, 200)] == calls_per_agent // 2 + 5
        assert per_agent[(agent, 429)] == calls_per_agent // 2 - 5
