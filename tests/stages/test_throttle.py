"""throttle: every governed operation counts against its rule's and role's limits."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from gateway.call import Call
from gateway.errors import RateLimited
from gateway.policy.model import Policy
from gateway.stages.throttle import Throttle
from gateway.state.memory import MemoryStore
from gateway.testing import make_call, matching, run_stages
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
