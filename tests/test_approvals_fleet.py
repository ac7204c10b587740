"""Approvals in a fleet: two gateways on one Redis. A call held by one gateway is listed and
decided through the other's admin API; concurrent decisions on both, exactly one counts."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gateway.admin import create_admin_app
from gateway.app import build_gateway
from gateway.config import Settings
from gateway.operators import add_operator
from mocks.demo import Workspace
from tests.conftest import Mocks
from tests.redis_server import RedisServer
from tests.state.conftest import needs_redis
from tests.test_approvals import held_policy, restart

pytestmark = [pytest.mark.redis, needs_redis]


@pytest.fixture
async def fleet(
    redis_server: RedisServer,  # first: it outlives the gateways, which close before it
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    mocks: Mocks,
    tmp_path: Path,
) -> Any:
    operators = tmp_path / "operators.yaml"
    token = add_operator(operators, "alice", "approver")
    mocks.clear()
    members = []
    for i in range(2):
        s = dataclasses.replace(
            settings,
            policy=held_policy(policy_file),
            admin_port=0,
            operators_file=operators,
            approval_timeout=10.0,
            state=redis_server.url,
            audit=tmp_path / f"audit-{i}.jsonl",
        )
        gw = build_gateway(s, workspace.environ())
        client = await serve_gateway(gw)
        assert gw.operators is not None
        admin = await aiohttp_client(create_admin_app(gw, gw.operators))
        members.append((gw, client, admin))
    return members, {"Authorization": f"Bearer {token}"}


async def listed(admin: Any, auth: dict[str, str]) -> list[dict[str, Any]]:
    for _ in range(200):
        resp = await admin.get("/approvals", headers=auth)
        pending = (await resp.json())["pending"]
        if pending:
            return pending  # type: ignore[no-any-return]
        await asyncio.sleep(0.02)
    raise AssertionError("nothing became pending")


async def test_a_call_held_by_one_gateway_is_approved_through_another(
    fleet: Any, workspace: Workspace, mocks: Mocks
) -> None:
    (holder, client, _), (_, _, other_admin) = fleet[0]
    auth = fleet[1]
    call = asyncio.ensure_future(restart(client, workspace))
    [pending] = await listed(other_admin, auth)  # seen from the gateway that does not hold it
    assert (pending["agent"], pending["target"]) == ("sre-bot", "/services/services/restart")
    resp = await other_admin.post(f"/approvals/{pending['id']}/approve", headers=auth)
    assert resp.status == 200
    answer = await asyncio.wait_for(call, 5)
    assert answer.status == 200
    assert len(mocks.requests("services")) == 1
    resp = await other_admin.get("/approvals", headers=auth)
    assert (await resp.json())["pending"] == []  # taken off the board
    assert holder.approvals.held_here() == 0


async def test_concurrent_decisions_on_two_gateways_exactly_one_counts(
    fleet: Any, workspace: Workspace, mocks: Mocks
) -> None:
    (_, client, admin_a), (_, _, admin_b) = fleet[0]
    auth = fleet[1]
    call = asyncio.ensure_future(restart(client, workspace))
    [pending] = await listed(admin_b, auth)
    attempts = [(admin, verb) for admin, verb in ((admin_a, "approve"), (admin_b, "deny")) * 6]
    answers = await asyncio.gather(
        *(a.post(f"/approvals/{pending['id']}/{verb}", headers=auth) for a, verb in attempts)
    )
    statuses = [r.status for r in answers]
    # On a loaded machine a claim can outlast the store's op timeout (0.5 s) while Redis still
    # runs it: that decision's operator gets 503 state_unavailable (not known to be recorded;
    # a retry gets 404 if it was). Never two decisions: at most one 200, the rest 404 or 503.
    assert statuses.count(200) <= 1 and set(statuses) <= {200, 404, 503}, statuses
    assert statuses.count(200) == 1 or 503 in statuses, statuses
    answer = await asyncio.wait_for(call, 5)
    assert answer.status in (200, 403)
    if 200 in statuses:
        won = attempts[statuses.index(200)][1]
        assert answer.status == (200 if won == "approve" else 403)
    assert len(mocks.requests("services")) == (1 if answer.status == 200 else 0)


async def test_with_redis_down_a_held_call_is_refused_not_left_waiting(
    fleet: Any, workspace: Workspace, mocks: Mocks, redis_server: RedisServer
) -> None:
    (_, client, _), _ = fleet[0]
    redis_server.kill()
    answer = await asyncio.wait_for(restart(client, workspace), 10)
    body = await answer.json(content_type="application/problem+json")
    assert answer.status == 503 and body["reason"] == "state_unavailable"
    assert mocks.requests("services") == []


async def test_a_decision_the_store_cannot_record_is_a_503_problem_not_a_traceback(
    fleet: Any, workspace: Workspace, mocks: Mocks, redis_server: RedisServer
) -> None:
    """An approval decided while Redis is gone cannot be claimed: the operator gets a 503
    ``state_unavailable`` problem+json (retry), never a plain 500, and nothing is forwarded."""
    (_, client, _), (_, _, other_admin) = fleet[0]
    auth = fleet[1]
    call = asyncio.ensure_future(restart(client, workspace))
    [pending] = await listed(other_admin, auth)
    redis_server.kill()
    resp = await other_admin.post(f"/approvals/{pending['id']}/approve", headers=auth)
    assert resp.status == 503, await resp.text()
    assert resp.content_type == "application/problem+json"
    assert (await resp.json(content_type=None))["reason"] == "state_unavailable"
    await asyncio.wait_for(call, 15)
    assert mocks.requests("services") == []
