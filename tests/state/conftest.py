"""Fixtures for the state tests: every behaviour runs on both backends.

``backend`` is parametrized over ``memory`` and ``redis``; ``store`` is one started store and
``store_pair`` two stores that share state (two Redis clients of one throwaway server, or the
one in-process store twice: the memory backend shares state only within a process).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from gateway.state import StateStore, open_store
from tests.redis_server import RedisCluster, RedisServer, redis_server_available

# Skipped only outside CI: in CI (CI=true) a missing redis-server fails these tests loudly.
needs_redis = pytest.mark.skipif(
    not redis_server_available() and os.environ.get("CI", "").lower() not in ("true", "1"),
    reason="needs a redis-server binary",
)

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("redis", id="redis", marks=[pytest.mark.redis, needs_redis]),
    pytest.param("cluster", id="cluster", marks=[pytest.mark.redis, needs_redis]),
]

# Quick reconnects, so fault tests stay short. Behaviour tests also get roomy socket timeouts:
# they check semantics (atomicity, expiry), and a loaded CI box can take longer than the
# production 0.25 s to open a burst of connections. Tests about timeouts pass PROD_TIMEOUTS.
FAST: dict[str, Any] = {
    "reconnect_min_s": 0.02,
    "reconnect_max_s": 0.2,
    "start_timeout_s": 3.0,
    "socket_timeout": 1.0,
    "connect_timeout": 1.0,
}
PROD_TIMEOUTS: dict[str, Any] = {"socket_timeout": 0.25, "connect_timeout": 0.25}

StoreFactory = Callable[..., Awaitable[StateStore]]


@pytest.fixture
async def make_store() -> AsyncIterator[StoreFactory]:
    """``await make_store(url, **opts)``: a started store, closed after the test."""
    opened: list[StateStore] = []

    async def make(url: str, **opts: Any) -> StateStore:
        if url.startswith("redis"):
            opts = {**FAST, **opts}
        store = open_store(url, **opts)
        await store.start()
        opened.append(store)
        return store

    yield make
    for store in reversed(opened):
        await store.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(backend: str, request: pytest.FixtureRequest) -> str:
    if backend == "memory":
        return "memory"
    if backend == "cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        return cluster.url
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


@pytest.fixture
async def store(store_url: str, make_store: StoreFactory) -> StateStore:
    return await make_store(store_url)


@pytest.fixture
async def store_pair(
    backend: str, store_url: str, make_store: StoreFactory
) -> tuple[StateStore, StateStore]:
    if backend == "memory":
        first = await make_store(store_url)
        return first, first
    # Two gateways' stores in a burst of concurrent operations each open connections at once
    # (per node, on a cluster): on a loaded CI box a connect took longer than FAST's 1 s and an
    # operation longer than its 2 s. These tests are about what is counted, not timeouts.
    roomy = {"connect_timeout": 5.0, "socket_timeout": 5.0, "op_timeout": 10.0}
    return await make_store(store_url, **roomy), await make_store(store_url, **roomy)
