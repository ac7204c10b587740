"""The StateStore contract, on both backends (see conftest: ``store``, ``store_pair``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.errors import StateUnavailable
from gateway.rates import parse_rate
from gateway.state import StateStore, open_store


async def eventually(check, *, within: float = 2.0, step: float = 0.005):  # type: ignore[no-untyped-def]
    """Poll ``check()`` until it returns a truthy value; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(step)


# --- lifecycle --------------------------------------------------------------------------


async def test_store_satisfies_protocol(store: StateStore, backend: str) -> None:
    assert isinstance(store, StateStore)
    assert store.backend == ("redis" if backend == "cluster" else backend)


async def test_health_reports_reachable(store: StateStore, backend: str) -> None:
    health = await store.health()
    assert health["backend"] == ("redis" if backend == "cluster" else backend)
    assert health["reachable"] is True
    assert isinstance(health["detail"], str) and health["detail"]


async def test_calls_before_start_and_after_close_fail_closed(store_url: str) -> None:
    store = open_store(store_url)
    rate = parse_rate("5/second")
    with pytest.raises(StateUnavailable):
        store.is_revoked("j", "a", None)
    with pytest.raises(StateUnavailable):
        await store.take("k", rate)
    leased = parse_rate("1000/second")  # on Redis: tokens leased in batches
    await store.start()
    assert (await store.take("k", rate)).allowed
    assert (await store.take("big", leased)).allowed
    await store.revoke("agent", "known")
    await store.close()
    with pytest.raises(StateUnavailable):
        await store.take("k", rate)
    with pytest.raises(StateUnavailable):
        await store.take("big", leased)  # the lease's tokens are not served after close
    with pytest.raises(StateUnavailable):
        await store.consume_quota("q", 5, ttl_s=60)
    with pytest.raises(StateUnavailable):
        store.is_revoked("j", "a", None)
    with pytest.raises(StateUnavailable):
        store.is_revoked("j", "known", None)  # closed: nothing answered, known or not
    await store.close()  # idempotent


# --- revocations ------------------------------------------------------------------------


async def test_revoke_each_kind(store: StateStore) -> None:
    assert store.is_revoked("jti-1", "agent-1", "run-1") is None
    await store.revoke("jti", "jti-1")
    assert store.is_revoked("jti-1", "agent-1", "run-1") == "jti"
    assert store.is_revoked("jti-2", "agent-1", "run-1") is None

    await store.revoke("agent", "agent-2")
    assert store.is_revoked("jti-2", "agent-2", "run-1") == "agent"
    assert store.is_revoked("jti-2", "agent-3", None) is None

    await store.revoke("run", "run-3")
    assert store.is_revoked("jti-2", "agent-3", "run-3") == "run"
    assert store.is_revoked("jti-2", "agent-3", None) is None
    # Checked in the order jti, agent, run.
    assert store.is_revoked("jti-1", "agent-2", "run-3") == "jti"
    assert store.is_revoked("jti-9", "agent-2", "run-3") == "agent"


async def test_revoke_rejects_bad_arguments(store: StateStore) -> None:
    with pytest.raises(ValueError, match="kind"):
        await store.revoke("token", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        await store.revoke("jti", "")
    with pytest.raises(ValueError, match="until"):
        await store.revoke("jti", "x", until=float("nan"))


async def test_revocation_expires_at_until(store: StateStore) -> None:
    await store.revoke("jti", "short", until=time.time() + 0.3)
    await store.revoke("jti", "past", until=time.time() - 1)
    assert store.is_revoked("short", "a", None) == "jti"
    assert store.is_revoked("past", "a", None) is None
    await asyncio.sleep(0.35)
    assert store.is_revoked("short", "a", None) is None


async def test_later_until_wins(store: StateStore) -> None:
    await store.revoke("agent", "a1", until=time.time() + 0.2)
    await store.revoke("agent", "a1")  # forever
    await store.revoke("agent", "a1", until=time.time() + 0.1)  # shorter: ignored
    await asyncio.sleep(0.3)
    assert store.is_revoked("j", "a1", None) == "agent"


async def test_on_revoke_fires_once_per_new_revocation(store: StateStore, backend: str) -> None:
    seen: list[tuple[str, str]] = []
    store.on_revoke(lambda kind, value: seen.append((kind, value)))
    await store.revoke("run", "r1")
    assert seen == [("run", "r1")]  # synchronously, before revoke() returns
    await store.revoke("run", "r1")  # a repeat changes nothing
    if backend != "memory":
        await asyncio.sleep(0.2)  # our own pub/sub echo must not be announced again
    assert seen == [("run", "r1")]


async def test_failing_listener_does_not_break_others(store: StateStore) -> None:
    seen: list[str] = []

    def broken(kind: str, value: str) -> None:
        raise RuntimeError("listener bug")

    store.on_revoke(broken)
    store.on_revoke(lambda kind, value: seen.append(value))
    await store.revoke("jti", "j1")
    assert seen == ["j1"]
    assert store.is_revoked("j1", "a", None) == "jti"


async def test_revocation_reaches_other_store_quickly(
    store_pair: tuple[StateStore, StateStore],
) -> None:
    first, second = store_pair
    heard: list[tuple[str, str, float]] = []
    second.on_revoke(lambda kind, value: heard.append((kind, value, time.perf_counter())))

    started = time.perf_counter()
    await first.revoke("agent", "rogue")
    await eventually(lambda: second.is_revoked("j", "rogue", None) == "agent", within=1.0)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"revocation took {elapsed:.3f} s to reach the other store"
    await eventually(lambda: heard, within=1.0)
    assert heard[0][:2] == ("agent", "rogue")
    assert heard[0][2] - started < 1.0


# --- rates ------------------------------------------------------------------------------


@pytest.mark.parametrize("text,count", [("20/minute", 20), ("3/hour", 3), ("60/minute burst 5", 5)])
async def test_rate_admits_exactly_burst_from_fresh(
    store: StateStore, text: str, count: int
) -> None:
    rate = parse_rate(text)
    results = [await store.take("agent:rule", rate) for _ in range(count)]
    assert all(r.allowed for r in results)
    assert [r.remaining for r in results] == list(range(count - 1, -1, -1))
    refused = await store.take("agent:rule", rate)
    assert not refused.allowed
    assert refused.remaining == 0
    assert 0 < refused.retry_after <= rate.interval_s + 0.05
    assert refused.retry_after > rate.interval_s - 0.5


async def test_rate_refills_at_the_sustained_rate(store: StateStore) -> None:
    rate = parse_rate("20/second")
    for _ in range(20):
        assert (await store.take("k", rate)).allowed
    refused = await store.take("k", rate)
    assert not refused.allowed
    await asyncio.sleep(refused.retry_after + 0.01)
    assert (await store.take("k", rate)).allowed
    assert not (await store.take("k", rate)).allowed


async def test_rate_keys_are_independent(store: StateStore) -> None:
    rate = parse_rate("1/minute")
    assert (await store.take("a", rate)).allowed
    assert not (await store.take("a", rate)).allowed
    assert (await store.take("b", rate)).allowed


async def test_rate_cost(store: StateStore) -> None:
    rate = parse_rate("10/minute")
    got = await store.take("k", rate, cost=7)
    assert got.allowed and got.remaining == 3
    refused = await store.take("k", rate, cost=4)
    assert not refused.allowed and refused.remaining == 3
    assert (await store.take("k", rate, cost=3)).allowed
    with pytest.raises(ValueError, match="burst"):
        await store.take("k", rate, cost=11)
    with pytest.raises(ValueError, match="cost"):
        await store.take("k", rate, cost=0)


async def test_rate_is_exact_across_stores_under_concurrency(
    store_pair: tuple[StateStore, StateStore],
) -> None:
    first, second = store_pair
    rate = parse_rate("20/minute")
    calls = [first.take("shared", rate) for _ in range(50)]
    calls += [second.take("shared", rate) for _ in range(50)]
    results = await asyncio.gather(*calls)
    assert sum(r.allowed for r in results) == 20
    assert all(r.retry_after > 0 for r in results if not r.allowed)


# --- quotas -----------------------------------------------------------------------------


async def test_quota_counts_to_limit_and_never_refills(store: StateStore) -> None:
    got = [await store.consume_quota("run-1", 3, ttl_s=60) for _ in range(3)]
    assert [g.allowed for g in got] == [True, True, True]
    assert [g.remaining for g in got] == [2, 1, 0]
    for _ in range(3):
        refused = await store.consume_quota("run-1", 3, ttl_s=60)
        assert not refused.allowed and refused.remaining == 0
        assert 0 < refused.retry_after <= 60
    # A higher limit shows the refused calls were not counted.
    assert (await store.consume_quota("run-1", 4, ttl_s=60)).remaining == 0


async def test_quota_refusal_does_not_consume(store: StateStore) -> None:
    assert (await store.consume_quota("q", 5, ttl_s=60, cost=4)).allowed
    refused = await store.consume_quota("q", 5, ttl_s=60, cost=2)
    assert not refused.allowed and refused.remaining == 1
    last = await store.consume_quota("q", 5, ttl_s=60)
    assert last.allowed and last.remaining == 0


async def test_quota_never_over_counts_under_concurrency(
    store_pair: tuple[StateStore, StateStore],
) -> None:
    first, second = store_pair
    calls = [first.consume_quota("run-x", 25, ttl_s=60) for _ in range(20)]
    calls += [second.consume_quota("run-x", 25, ttl_s=60) for _ in range(20)]
    results = await asyncio.gather(*calls)
    assert sum(r.allowed for r in results) == 25
    # The counter stopped at exactly 25: one more unit is available under a limit of 26.
    probe = await first.consume_quota("run-x", 26, ttl_s=60)
    assert probe.allowed and probe.remaining == 0


async def test_consume_quotas_is_all_or_nothing(store: StateStore) -> None:
    items = [("run:total", 10), ("run:rule", 1)]
    first = await store.consume_quotas(items, ttl_s=60)
    assert first.allowed and first.remaining == 0 and first.limited_by is None
    refused = await store.consume_quotas(items, ttl_s=60)
    assert not refused.allowed and refused.limited_by == 1
    # The run total was not counted for the refused call: 9 left of 10.
    assert (await store.consume_quota("run:total", 10, ttl_s=60)).remaining == 8
    with pytest.raises(ValueError, match="same key"):
        await store.consume_quotas([("a", 1), ("a", 2)], ttl_s=60)
    with pytest.raises(ValueError, match="at least one"):
        await store.consume_quotas([], ttl_s=60)


async def test_quota_counter_expires_after_ttl(store: StateStore) -> None:
    assert (await store.consume_quota("brief", 1, ttl_s=0.2)).allowed
    refused = await store.consume_quota("brief", 1, ttl_s=0.2)
    assert not refused.allowed and 0 < refused.retry_after <= 0.2
    await asyncio.sleep(0.3)
    assert (await store.consume_quota("brief", 1, ttl_s=0.2)).allowed


async def test_zero_quota_refuses_everything(store: StateStore) -> None:
    refused = await store.consume_quota("none", 0, ttl_s=60)
    assert not refused.allowed and refused.retry_after > 0 and refused.remaining == 0
