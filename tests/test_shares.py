"""Per-agent shares of a shared resource (``gateway/shares.py``)."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.errors import ConcurrencyLimited
from gateway.shares import Shares


async def test_an_agent_holds_at_most_its_share_and_others_still_get_slots() -> None:
    shares = Shares("connections to up", capacity=4, per_agent=2)
    await shares.acquire("a", 0)
    await shares.acquire("a", 0)
    with pytest.raises(ConcurrencyLimited, match="agent 'a' already holds its share") as info:
        await shares.acquire("a", 0)
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "1"
    await shares.acquire("b", 0)
    await shares.acquire("b", 0)
    with pytest.raises(ConcurrencyLimited):
        await shares.acquire("c", 0)  # all four taken
    assert shares.snapshot()["agents_at_share"] == ["a", "b"]


async def test_a_waiter_gets_the_slot_its_agent_frees() -> None:
    shares = Shares("workers", capacity=2, per_agent=1)
    await shares.acquire("a", 0)
    waiting = asyncio.create_task(shares.acquire("a", 5))
    await asyncio.sleep(0)
    assert not waiting.done()
    shares.release("a")
    await asyncio.wait_for(waiting, 1)
    assert shares.held_by("a") == 1 and shares.in_use == 1


async def test_an_agent_at_its_share_never_holds_up_another_agent() -> None:
    shares = Shares("workers", capacity=3, per_agent=2)
    await shares.acquire("a", 0)
    await shares.acquire("a", 0)
    a_waits = [asyncio.create_task(shares.acquire("a", 5)) for _ in range(10)]
    await asyncio.sleep(0)
    await asyncio.wait_for(shares.acquire("b", 5), 1)  # free slot: b goes past a's queue
    assert shares.held_by("b") == 1
    with pytest.raises(ConcurrencyLimited, match="all 3 workers are in use"):
        await shares.acquire("c", 0)
    for task in a_waits:
        task.cancel()
    await asyncio.gather(*a_waits, return_exceptions=True)
    assert shares.held_by("a") == 2 and shares.snapshot()["waiting"] == 0


async def test_waiting_past_the_deadline_or_cancelled_leaves_nothing_taken() -> None:
    shares = Shares("approval slots", capacity=1, per_agent=1)
    await shares.acquire("a", 0)
    with pytest.raises(ConcurrencyLimited):
        await shares.acquire("b", 0.05)
    task = asyncio.create_task(shares.acquire("b", 5))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    shares.release("a")
    assert shares.in_use == 0 and shares.snapshot()["waiting"] == 0
    with pytest.raises(RuntimeError):
        shares.release("a")


async def test_random_interleavings_keep_the_invariants() -> None:
    """Capacity and shares are never exceeded; every slot comes back; nobody waits forever
    while a slot they could take is free."""
    rng = random.Random(7)
    shares = Shares("slots", capacity=5, per_agent=2)
    agents = ["a", "b", "c", "d"]
    peak: dict[str, int] = {}

    async def worker(agent: str) -> None:
        for _ in range(30):
            try:
                async with shares.slot(agent, rng.choice([0, 0.001, 0.05])):
                    assert shares.in_use <= shares.capacity
                    assert shares.held_by(agent) <= shares.per_agent
                    peak[agent] = max(peak.get(agent, 0), shares.held_by(agent))
                    await asyncio.sleep(rng.random() / 500)
            except ConcurrencyLimited:
                pass

    await asyncio.gather(*(worker(rng.choice(agents)) for _ in range(20)))
    assert shares.in_use == 0 and shares.snapshot()["waiting"] == 0
    assert max(peak.values()) == 2
    assert not shares._queues and not shares._live  # no agent's queue outlives its waiters


async def test_a_slot_granted_as_its_waiter_is_cancelled_comes_back() -> None:
    # The release hands the slot over (taken on the waiter's behalf) and the waiter is
    # cancelled before it runs: the slot must not leak.
    shares = Shares("slots", capacity=1, per_agent=1)
    await shares.acquire("a", 0)
    task = asyncio.create_task(shares.acquire("b", 5))
    await asyncio.sleep(0)
    shares.release("a")  # b's future is resolved, b has not run yet
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert shares.in_use == 0 and shares.held_by("b") == 0
    await shares.acquire("c", 0)


async def test_a_wait_that_times_out_names_whose_share_was_full(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shares = Shares("slots", capacity=4, per_agent=1)
    await shares.acquire("a", 0)
    waits = [asyncio.create_task(shares.acquire("a", 0.02)) for _ in range(5)]
    results = await asyncio.gather(*waits, return_exceptions=True)
    assert all(isinstance(r, ConcurrencyLimited) for r in results)
    assert "agent 'a' already holds its share" in str(results[0])
    assert shares.snapshot()["waiting"] == 0 and shares.in_use == 1
    assert "never retrieved" not in caplog.text


async def test_freed_slots_go_in_arrival_order_across_agents() -> None:
    """Waiters of several agents are served in the order they came, each agent within its
    share; one at its share is passed over, not waited for."""
    shares = Shares("slots", capacity=3, per_agent=2)
    for agent in ("a", "a", "b"):
        await shares.acquire(agent, 0)
    served: list[str] = []

    async def wait(agent: str) -> None:
        await shares.acquire(agent, 5)
        served.append(agent)

    order = ["c", "a", "b", "c", "d"]
    tasks = []
    for agent in order:
        tasks.append(asyncio.create_task(wait(agent)))
        await asyncio.sleep(0)  # each waits before the next arrives
    assert shares.snapshot()["waiting"] == 5
    shares.release("b")  # c came first
    await asyncio.sleep(0)
    assert served == ["c"]
    shares.release("a")  # a's waiter came next, and a is under its share again
    await asyncio.sleep(0)
    assert served == ["c", "a"]
    shares.release("c")  # b, then (after a release) c again, then d
    await asyncio.sleep(0)
    shares.release("a")
    await asyncio.sleep(0)
    shares.release("a")
    await asyncio.sleep(0)
    assert served == ["c", "a", "b", "c", "d"]
    assert shares.snapshot()["waiting"] == 0 and not shares._queues
    await asyncio.gather(*tasks)


async def test_waiters_that_expire_behind_a_full_share_do_not_pile_up() -> None:
    """An agent stays at its share while its later calls keep timing out behind one that
    still waits: the queue keeps the live waiters, not every one that ever expired."""
    shares = Shares("slots", capacity=4, per_agent=1)
    await shares.acquire("a", 0)
    patient = asyncio.create_task(shares.acquire("a", 5))
    await asyncio.sleep(0)
    for _ in range(300):
        with pytest.raises(ConcurrencyLimited):
            await shares.acquire("a", 0.0001)
        assert len(shares._queues["a"]) <= 2 * 1 + 32 + 1
    assert shares.snapshot()["waiting"] == 1
    shares.release("a")
    await asyncio.wait_for(patient, 1)
    assert shares.held_by("a") == 1 and not shares._queues


async def test_waits_expire_at_their_own_deadlines_with_one_timer() -> None:
    """Every waiter expires at its own deadline, whatever order the deadlines arrive in (a
    shorter wait after a longer one moves the one timer earlier); served waiters leave no
    timer behind, and the expiry heap stays bounded by the waiters still waiting."""
    shares = Shares("slots", capacity=8, per_agent=1)
    await shares.acquire("a", 0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    ended: dict[str, float] = {}

    async def wait(name: str, seconds: float) -> None:
        try:
            await shares.acquire("a", seconds)
        except ConcurrencyLimited:
            ended[name] = loop.time() - started

    tasks = [asyncio.create_task(wait(n, s)) for n, s in (("long", 0.4), ("short", 0.1))]
    await asyncio.gather(*tasks)
    assert 0.09 <= ended["short"] < 0.3 and 0.39 <= ended["long"] < 0.7, ended
    assert shares.snapshot()["waiting"] == 0 and shares._timer is None
    # Waiters served long before their deadlines: their entries go, the heap stays bounded.
    for _ in range(3000):
        task = asyncio.create_task(shares.acquire("a", 30))
        await asyncio.sleep(0)
        shares.release("a")
        await task
    assert len(shares._deadlines) <= 2 * shares.snapshot()["waiting"] + 1024 + 1
    assert shares.held_by("a") == 1
