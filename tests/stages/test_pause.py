"""pause: a call of a paused agent or run waits until resumed, within the hold and its share."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest

from gateway.call import Call
from gateway.errors import AgentPaused, StateUnavailable, TokenExpired, TokenRevoked
from gateway.inflight import InFlight
from gateway.stages.pause import RETRY_AFTER_S, Pause
from gateway.state.base import PauseEntry
from gateway.state.memory import MemoryStore
from gateway.testing import make_call


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    s = MemoryStore()
    await s.start()
    yield s
    await s.close()


def stage(store: MemoryStore, hold: float = 5.0, **kw: int) -> Pause:
    pause = Pause(store, InFlight(), hold=hold, **kw)
    store.on_pause(pause.changed)
    return pause


def call_of(agent: str = "a1", run: str | None = None, ttl: float = 3600) -> Call:
    call = make_call("GET", "/x", roles=["ops"], agent=agent, run=run)
    assert call.claims is not None
    call.claims = dataclasses.replace(call.claims, expires_at=time.time() + ttl)
    return call


async def started(pause: Pause, call: Call) -> asyncio.Task[None]:
    """The stage's wait, running; returns once the call is held."""
    pending = pause(call)
    assert pending is not None, "the call should have been held"

    async def run() -> None:
        await pending

    task = asyncio.ensure_future(run())
    for _ in range(100):
        await asyncio.sleep(0.005)
        if pause.held.in_use:
            return task
    raise AssertionError("the call was never held")


async def test_not_paused_returns_none_without_a_coroutine(store: MemoryStore) -> None:
    pause = stage(store)
    assert pause(call_of()) is None
    await store.pause("agent", "someone-else", until=None, by="ops", reason="")
    assert pause(call_of("a1", "r1")) is None


async def test_held_until_resumed_then_goes_on(store: MemoryStore) -> None:
    pause = stage(store)
    await store.pause("agent", "a1", until=None, by="ops", reason="checking")
    call = call_of()
    task = await started(pause, call)
    await asyncio.sleep(0.05)
    assert not task.done()
    assert pause.held.held_by("a1") == 1
    began = time.monotonic()
    assert await store.resume("agent", "a1", by="ops")
    await asyncio.wait_for(task, 1.0)
    assert time.monotonic() - began < 0.2  # woken, not polled
    assert pause.held.in_use == 0 and call.error is None


async def test_past_the_hold_it_is_refused_agent_paused(store: MemoryStore) -> None:
    pause = stage(store, hold=0.2)
    await store.pause("agent", "a1", until=None, by="ops", reason="secret reason")
    began = time.monotonic()
    with pytest.raises(AgentPaused) as info:
        pending = pause(call_of())
        assert pending is not None
        await pending
    assert 0.15 < time.monotonic() - began < 1.0
    err = info.value
    assert err.status == 503 and err.reason == "agent_paused"
    assert err.headers["Retry-After"] == str(RETRY_AFTER_S)
    assert "agent 'a1' is paused" in err.detail
    assert "secret reason" not in err.detail and "ops" not in err.detail
    assert pause.held.in_use == 0


async def test_retry_after_follows_the_pause_until(store: MemoryStore) -> None:
    pause = stage(store, hold=0.1)
    await store.pause("run", "r1", until=time.time() + 42, by="ops", reason="")
    with pytest.raises(AgentPaused) as info:
        pending = pause(call_of(run="r1"))
        assert pending is not None
        await pending
    assert 40 <= int(info.value.headers["Retry-After"]) <= 42


async def test_a_pause_that_ends_lets_the_call_go_on(store: MemoryStore) -> None:
    pause = stage(store, hold=5)
    await store.pause("agent", "a1", until=time.time() + 0.2, by="ops", reason="")
    began = time.monotonic()
    pending = pause(call_of())
    assert pending is not None
    await asyncio.wait_for(pending, 2.0)
    assert 0.1 < time.monotonic() - began < 1.0


async def test_other_agents_and_runs_are_not_held(store: MemoryStore) -> None:
    pause = stage(store)
    await store.pause("agent", "a1", until=None, by="ops", reason="")
    await store.pause("run", "r1", until=None, by="ops", reason="")
    assert pause(call_of("a2")) is None
    assert pause(call_of("a2", "r2")) is None  # another run of an agent whose run r1 is paused
    held = pause(call_of("a2", "r1"))
    assert held is not None
    await store.resume("run", "r1", by="ops")
    await asyncio.wait_for(held, 1.0)


async def test_agent_and_run_both_paused_waits_for_both(store: MemoryStore) -> None:
    pause = stage(store)
    await store.pause("agent", "a1", until=None, by="ops", reason="")
    await store.pause("run", "r1", until=None, by="ops", reason="")
    task = await started(pause, call_of("a1", "r1"))
    await store.resume("agent", "a1", by="ops")
    await asyncio.sleep(0.05)
    assert not task.done()  # the run is still paused
    await store.resume("run", "r1", by="ops")
    await asyncio.wait_for(task, 1.0)


async def test_over_the_share_it_is_refused_at_once(store: MemoryStore) -> None:
    pause = stage(store, per_agent=2)
    await store.pause("agent", "a1", until=None, by="ops", reason="")
    first = await started(pause, call_of())
    second = await started(pause, call_of())
    began = time.monotonic()
    with pytest.raises(AgentPaused) as info:
        pending = pause(call_of())
        assert pending is not None
        await pending
    assert time.monotonic() - began < 0.1
    assert "already has 2 calls held" in info.value.detail
    # Another agent has a share of its own.
    await store.pause("agent", "a2", until=None, by="ops", reason="")
    other = await started(pause, call_of("a2"))
    await store.resume("agent", "a1", by="ops")
    await store.resume("agent", "a2", by="ops")
    await asyncio.wait_for(asyncio.gather(first, second, other), 1.0)
    assert pause.held.in_use == 0


async def test_the_hold_ends_when_the_token_expires(store: MemoryStore) -> None:
    pause = stage(store, hold=5)
    await store.pause("agent", "a1", until=None, by="ops", reason="")
    pending = pause(call_of(ttl=0.2))
    assert pending is not None
    with pytest.raises(TokenExpired):
        await asyncio.wait_for(pending, 2.0)
    assert pause.held.in_use == 0


async def test_a_stop_cuts_a_held_call(store: MemoryStore) -> None:
    inflight = InFlight()
    pause = Pause(store, inflight, hold=5)
    store.on_pause(pause.changed)
    store.on_revoke(inflight.cancel)
    await store.pause("agent", "a1", until=None, by="ops", reason="")
    call = call_of()
    task = await started(pause, call)
    assert len(inflight) == 1
    await store.revoke("agent", "a1", by="ops", reason="stop")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert isinstance(call.revoked, TokenRevoked)
    assert pause.held.in_use == 0


async def test_cancelled_by_its_agent_leaves_nothing_held(store: MemoryStore) -> None:
    pause = stage(store)
    await store.pause("agent", "a1", until=None, by="ops", reason="")
    task = await started(pause, call_of())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pause.held.in_use == 0 and pause._waiting == {}


class FlakyStore(MemoryStore):
    """A store whose mirror can be made untrusted, like Redis while it reconnects."""

    stale = False

    def paused(self, agent: str, run: str | None) -> PauseEntry | None:
        if self.stale:
            raise StateUnavailable("mirror not in sync")
        return super().paused(agent, run)


async def test_an_untrusted_mirror_is_deferred_to_match_policy() -> None:
    store = FlakyStore()
    await store.start()
    pause = stage(store)
    store.stale = True
    call = call_of()
    assert pause(call) is None
    assert isinstance(call.state_error, StateUnavailable)


async def test_a_held_call_stays_held_while_the_mirror_is_untrusted() -> None:
    store = FlakyStore()
    await store.start()
    pause = stage(store, hold=5)
    await store.pause("agent", "a1", until=time.time() + 0.1, by="ops", reason="")
    call = call_of()
    task = await started(pause, call)
    store.stale = True
    await asyncio.sleep(0.3)  # the pause's until passed while nobody could vouch for it
    assert not task.done()
    store.stale = False
    await asyncio.wait_for(task, 2.0)  # looked again, found it over
    # And when the hold ends before the mirror is back: state_unavailable, not agent_paused.
    short = stage(store, hold=0.2)
    await store.pause("agent", "a1", until=None, by="ops", reason="")
    pending = short(call_of())
    assert pending is not None
    store.stale = True
    with pytest.raises(StateUnavailable):
        await asyncio.wait_for(pending, 2.0)
