"""Redis Cluster: a three-master cluster on loopback (``redis+cluster://``).

Every behaviour test of the stores also runs on it (``backend`` ``cluster`` in conftest);
these are what only a cluster can show: each script's keys share a slot, so all of the
store's keys live on one node, and two gateways decide an approval exactly once.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.rates import parse_rate
from gateway.state.redis import cluster_prefix
from tests.redis_server import RedisCluster
from tests.state.conftest import StoreFactory, needs_redis
from tests.state.test_store import eventually

pytestmark = [pytest.mark.redis, needs_redis]


def test_the_prefix_gets_one_hash_tag() -> None:
    assert cluster_prefix("capgate:") == "{capgate}:"
    assert cluster_prefix("fleet-7:") == "{fleet-7}:"
    assert cluster_prefix("{team}:capgate:") == "{team}:capgate:"  # the operator's own tag
    assert cluster_prefix("") == "{capgate}:"


async def test_every_key_of_the_store_lives_in_one_slot(
    redis_cluster: RedisCluster, make_store: StoreFactory
) -> None:
    store = await make_store(redis_cluster.url)
    other = await make_store(redis_cluster.url)
    await store.revoke("agent", "a1", by="ops", reason="r")
    await store.revoke("jti", "j1", until=time.time() + 60)
    assert (await store.take("rate:a1", parse_rate("10/second"))).allowed
    assert (await store.consume_quotas([("q1", 5), ("q2", 5)], ttl_s=60)).allowed
    await store.pause("run", "r1", until=None, by="ops", reason="")
    await store.taint("run:r1", {"cause": "web"}, ttl_s=60)
    board = store.approval_board()
    await board.publish("ap-1", {"body_sha256": "x"}, time.time() + 60)
    await eventually(lambda: other.is_revoked("j", "a1", None) == "agent", within=2.0)
    per_node = redis_cluster.keys_by_node()
    assert sum(per_node.values()) >= 8, per_node
    assert sorted(per_node.values())[:-1] == [0, 0], f"keys on more than one node: {per_node}"


async def test_two_gateways_decide_an_approval_exactly_once(
    redis_cluster: RedisCluster, make_store: StoreFactory
) -> None:
    first, second = await make_store(redis_cluster.url), await make_store(redis_cluster.url)
    await first.approval_board().publish("ap-9", {"body_sha256": "d"}, time.time() + 60)
    claims = await asyncio.gather(
        *(
            board.claim("ap-9", {"approved": verdict, "by": who}, "d")
            for board, verdict, who in (
                (first.approval_board(), True, "alice"),
                (second.approval_board(), False, "bob"),
            )
            for _ in range(5)
        )
    )
    assert sorted(claims).count("decided") == 1
    decided = await second.approval_board().decisions(["ap-9"])
    assert decided["ap-9"]["by"] in ("alice", "bob")
