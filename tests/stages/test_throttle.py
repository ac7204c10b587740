"""throttle: every governed operation counts against its rule's and role's limits."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from gateway.call import Call
from gateway.errors import QuotaExhausted, RateLimited
from gateway.policy.model import Policy
from gateway.stages.throttle import Throttle
from gateway.state.memory import MemoryStore
from gateway.testing import make_call, matching, policy_from_text, run_stages
from tests.stages.test_match_policy import rpc, tool


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    s = MemoryStore()
    await s.start()
    yield s
    await s.close()


async def throttled(policy: Policy, store: MemoryStore, call: Call) -> Call:
    await run_stages(call, *matching(policy), Throttle(store))
    return call


def batch(*messages: object, agent: str = "a1") -> Call:
    body = json.dumps(list(messages)).encode()
    return make_call("POST", "/tools/mcp", body=body, roles=["support"], agent=agent)


async def test_a_batch_spends_one_unit_per_tool_call(policy: Policy, store: MemoryStore) -> None:
    # get-order allows 2/hour: a batch of three calls to it is refused at the third.
    with pytest.raises(RateLimited) as info:
        await throttled(
            policy,
            store,
            batch(*(tool(i, "get_order", order_id=i) for i in (1, 2, 3))),
        )
    assert info.value.rule == "get-order"
    # The two admitted units were spent: a later single call finds the rate used up too.
    with pytest.raises(RateLimited):
        await throttled(policy, store, batch(tool(9, "get_order", order_id=9)))
    # Another agent has its own limiter.
    await throttled(policy, store, batch(tool(1, "get_order", order_id=1), agent="a2"))


async def test_protocol_messages_do_not_count(policy: Policy, store: MemoryStore) -> None:
    for _ in range(5):
        await throttled(policy, store, batch(rpc(1, "ping"), rpc(2, "tools/list")))
    await throttled(policy, store, batch(tool(1, "get_order", order_id=1)))
    await throttled(policy, store, batch(tool(2, "get_order", order_id=2)))


RATE_ONLY = """
version: 1
agents: {"*": [r]}
upstreams:
  svc: {url: "http://127.0.0.1:9"}
roles:
  r:
    rules:
      - {id: limited, upstream: svc, allow: GET /a, rate: 3/hour}
      - {id: evicting, upstream: svc, allow: GET /b, rate: 1/hour, evict_after: 2}
      - {id: quota, upstream: svc, allow: GET /c, rate: 100/hour, quota: 1}
"""


async def test_a_rate_alone_is_counted_without_waiting_and_refused_the_same(
    store: MemoryStore,
) -> None:
    policy = policy_from_text(RATE_ONLY)
    stage = Throttle(store)
    for _ in range(3):
        call = make_call("GET", "/svc/a", roles=["r"], run="run-1")
        await run_stages(call, *matching(policy))
        assert stage(call) is None  # counted at once: no coroutine
    call = make_call("GET", "/svc/a", roles=["r"], run="run-1")
    await run_stages(call, *matching(policy))
    with pytest.raises(RateLimited, match="rate of 3/hour for rule 'limited'"):
        stage(call)


async def test_a_refusal_that_counts_towards_eviction_still_stops_the_run(
    store: MemoryStore,
) -> None:
    policy = policy_from_text(RATE_ONLY)
    stage = Throttle(store)
    refusals = 0
    for _ in range(3):
        call = make_call("GET", "/svc/b", roles=["r"], run="run-9")
        await run_stages(call, *matching(policy))
        try:
            pending = stage(call)
            if pending is not None:
                await pending
        except RateLimited as exc:
            refusals += 1
            last = exc
    assert refusals == 2 and "the run run-9 was stopped" in last.detail
    assert store.is_revoked("jti-x", "test-agent", "run-9") == "run"


async def test_a_quota_of_the_run_is_awaited_and_counted(store: MemoryStore) -> None:
    policy = policy_from_text(RATE_ONLY)
    stage = Throttle(store)
    call = make_call("GET", "/svc/c", roles=["r"], run="run-2")
    await run_stages(call, *matching(policy))
    pending = stage(call)
    assert pending is not None
    await pending
    again = make_call("GET", "/svc/c", roles=["r"], run="run-2")
    await run_stages(again, *matching(policy))
    with pytest.raises(QuotaExhausted):
        await run_stages(again, stage)
