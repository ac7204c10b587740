"""``CheckWorkers``: heavy checks in threads, a share per agent, slots held until the thread
really ends; which SQL payloads count as costly."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.check_workers import CheckWorkers
from gateway.checks.sql import SqlPolicy
from gateway.checks.sql.adapter import SqlBodyCheck
from gateway.checks.sql.limits import OFFLOAD_MIN_CHARS
from gateway.errors import ConcurrencyLimited, SqlDenied
from gateway.payload import BodyPayload, Findings


async def test_runs_off_the_loop_and_returns_or_raises() -> None:
    workers = CheckWorkers(capacity=2, per_agent=1, wait=0.1)
    try:
        assert await workers.run("a", threading.get_ident) != threading.get_ident()

        def deny() -> None:
            raise SqlDenied("no")

        with pytest.raises(SqlDenied):
            await workers.run("a", deny)
        assert workers.shares.in_use == 0
    finally:
        workers.close()


async def test_an_agent_over_its_share_waits_then_is_refused() -> None:
    workers = CheckWorkers(capacity=2, per_agent=1, wait=0.05)
    gate = threading.Event()
    try:
        first = asyncio.create_task(workers.run("a", gate.wait))
        await asyncio.sleep(0.01)
        with pytest.raises(ConcurrencyLimited) as info:
            await workers.run("a", lambda: None)  # a's second: over its share
        assert info.value.headers["Retry-After"] == "1"
        assert await workers.run("b", lambda: 7) == 7  # b has its own share
        gate.set()
        assert await first is True
    finally:
        gate.set()
        workers.close()


async def test_a_cancelled_call_keeps_its_slot_until_the_thread_ends() -> None:
    workers = CheckWorkers(capacity=1, per_agent=1, wait=0.01)
    gate = threading.Event()
    try:
        call = asyncio.create_task(workers.run("a", gate.wait))
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert workers.shares.in_use == 1  # the thread is still at work
        gate.set()
        for _ in range(100):
            if workers.shares.in_use == 0:
                break
            await asyncio.sleep(0.01)
        assert workers.shares.in_use == 0
    finally:
        gate.set()
        workers.close()


def test_costly_is_long_and_unseen() -> None:
    policy = SqlPolicy.create("postgres", tables=["orders"], server_version=15)
    check = SqlBodyCheck(policy, "q", field=("sql",))
    small = "SELECT id FROM orders"
    long = "SELECT id FROM orders WHERE " + " OR ".join(["id = 1"] * (OFFLOAD_MIN_CHARS // 6))

    def payload(sql: object) -> BodyPayload:
        import json

        return BodyPayload(json.dumps({"sql": sql}).encode(), "application/json", Findings())

    assert not check.costly(payload(small))
    assert check.costly(payload(long))
    check.check(payload(long))  # now its verdict is cached
    assert not check.costly(payload(long))
    assert not check.costly(payload(42))  # not a string: refused inline at once
    assert not check.costly(BodyPayload(b"{", "application/json", Findings()))
