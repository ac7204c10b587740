"""Quotas that throttle, then evict: at the rule's Nth refusal the run is stopped."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gateway.app import build_gateway
from gateway.config import Settings
from gateway.policy.load import load_policy
from gateway.policy_file import PolicyError
from mocks.demo import Workspace
from tests.conftest import Mocks
from tests.redis_server import RedisServer

RULE = "      - id: read-cpu\n"


def evicting(policy_file: Path, extra: str) -> Path:
    text = policy_file.read_text()
    assert RULE in text
    path = policy_file.with_name("evict.yaml")
    path.write_text(text.replace(RULE, RULE + extra, 1))
    return path


def auth(workspace: Workspace, run: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {workspace.token('sre-bot', ['sre-diagnostics'], run=run)}"}


@pytest.fixture(params=["memory", "redis"])
def state_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


async def test_the_run_is_stopped_at_the_nth_refusal(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    mocks: Mocks,
    state_url: str,
) -> None:
    policy = evicting(policy_file, "        quota: 2\n        evict_after: 2\n")
    gw = build_gateway(
        dataclasses.replace(settings, policy=policy, state=state_url), workspace.environ()
    )
    client = await serve_gateway(gw)
    seen: list[dict[str, Any]] = []
    with gw.events.subscribe(
        filters=__import__("gateway.events").events.Filters(type="operator"), who="t"
    ) as sub:
        run_a, run_b = (auth(workspace, run) for run in ("run-a", "run-b"))
        target = "/metrics/metrics/cpu?window=1m"
        statuses = []
        for _ in range(4):
            resp = await client.get(target, headers=run_a)
            body = await resp.json(content_type=None)
            statuses.append((resp.status, body.get("reason")))
        while not sub.queue.empty():
            seen.append(sub.queue.get_nowait())
    assert statuses == [
        (200, None),
        (200, None),
        (429, "quota_exhausted"),  # the first refusal: throttled
        (429, "quota_exhausted"),  # the second: throttled, and the run is stopped
    ]
    assert "was stopped" in body["detail"]
    resp = await client.get("/metrics/metrics/cpu?window=5m", headers=run_a)
    assert resp.status == 401 and (await resp.json(content_type=None))["reason"] == "token_revoked"
    assert (await client.get(target, headers=run_b)).status == 200  # another run goes on
    [event] = seen
    assert (event["action"], event["kind"], event["value"], event["by"]) == (
        "stop",
        "run",
        "run-a",
        "policy",
    )
    assert "read-cpu" in event["reason"]


def test_evict_after_needs_the_rules_own_limit(policy_file: Path) -> None:
    with pytest.raises(PolicyError) as err:
        load_policy(evicting(policy_file, "        evict_after: 3\n"))
    assert "evict_after needs the rule's own rate or quota" in str(err.value)
