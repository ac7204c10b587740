"""Rate limits on Redis leased in batches (``gateway/state/leases.py``): fewer round trips,
the stated bound on what the fleet admits, and failures that still fail closed."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.errors import StateUnavailable
from gateway.rates import Rate, parse_rate
from gateway.state.leases import LEASE_MAX, LEASE_TTL, Leases, lease_size
from tests.redis_server import RedisServer
from tests.state.conftest import StoreFactory, needs_redis


class Bucket:
    """A fake shared bucket: hands out up to ``tokens``, counts the refills in flight."""

    def __init__(self, tokens: int, retry_after: float = 5.0) -> None:
        self.tokens = tokens
        self.retry_after = retry_after
        self.calls = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.fail: Exception | None = None
        self.delay = 0.01

    async def refill(self, key: str, rate: Rate, wanted: int) -> tuple[int, float, int]:
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.fail is not None:
                raise self.fail
            granted = min(wanted, self.tokens)
            self.tokens -= granted
            return granted, 0.0 if granted else self.retry_after, self.tokens
        finally:
            self.in_flight -= 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


FAST = parse_rate("1000/second")  # burst 1000: leases of LEASE_MAX


def test_lease_size_is_a_quarter_of_the_burst_and_small_bursts_are_never_leased() -> None:
    assert lease_size(parse_rate("1000/second")) == LEASE_MAX
    assert lease_size(parse_rate("60/minute")) == 15
    assert lease_size(parse_rate("60/minute burst 10")) == 2
    assert lease_size(parse_rate("3/minute")) == 1
    assert lease_size(parse_rate("100/second burst 3")) == 1


async def test_one_round_trip_serves_a_lease_of_calls() -> None:
    bucket = Bucket(10_000)
    leases = Leases(bucket.refill)
    got = [await leases.take("k", FAST) for _ in range(100)]
    assert all(a.allowed for a in got)
    assert bucket.calls == 2  # 64, then 36 of the next 64
    assert got[0].remaining == LEASE_MAX - 1 + (10_000 - LEASE_MAX)


async def test_callers_that_find_the_lease_empty_share_one_refill() -> None:
    bucket = Bucket(10_000)
    leases = Leases(bucket.refill)
    got = await asyncio.gather(*(leases.take("k", FAST) for _ in range(200)))
    assert all(a.allowed for a in got)
    assert bucket.most_in_flight == 1
    assert bucket.calls == 4  # ceil(200 / 64)


async def test_the_fleet_never_gets_more_than_the_bucket_holds() -> None:
    bucket = Bucket(100)
    gateways = [Leases(bucket.refill) for _ in range(3)]
    got = await asyncio.gather(*(g.take("k", FAST) for g in gateways for _ in range(80)))
    assert sum(a.allowed for a in got) == 100


async def test_a_refusal_is_kept_until_its_retry_after() -> None:
    bucket = Bucket(0, retry_after=2.0)
    clock = Clock()
    leases = Leases(bucket.refill, clock=clock)
    first = await leases.take("k", FAST)
    assert not first.allowed and first.retry_after == 2.0
    for _ in range(10):
        assert not (await leases.take("k", FAST)).allowed
    assert bucket.calls == 1  # refused locally meanwhile
    clock.now += 2.0
    bucket.tokens = 5
    assert (await leases.take("k", FAST)).allowed
    assert bucket.calls == 2


async def test_unused_tokens_are_dropped_when_the_lease_expires() -> None:
    bucket = Bucket(10_000)
    clock = Clock()
    leases = Leases(bucket.refill, clock=clock)
    assert (await leases.take("k", FAST)).allowed
    clock.now += LEASE_TTL + 0.001
    assert (await leases.take("k", FAST)).allowed
    assert bucket.calls == 2  # the first lease's 63 tokens were not used a second late


async def test_a_failed_refill_fails_every_waiting_caller_and_caches_nothing() -> None:
    bucket = Bucket(10_000)
    bucket.fail = StateUnavailable("redis is down")
    leases = Leases(bucket.refill)
    got = await asyncio.gather(*(leases.take("k", FAST) for _ in range(20)), return_exceptions=True)
    assert all(isinstance(g, StateUnavailable) for g in got)
    assert bucket.calls == 1
    bucket.fail = None
    assert (await leases.take("k", FAST)).allowed


async def test_a_refill_whose_caller_hangs_up_leaves_the_others_waiting_to_ask_again() -> None:
    bucket = Bucket(10_000)
    bucket.delay = 0.2
    leases = Leases(bucket.refill)
    first = asyncio.ensure_future(leases.take("k", FAST))
    await asyncio.sleep(0.05)
    others = [asyncio.ensure_future(leases.take("k", FAST)) for _ in range(5)]
    await asyncio.sleep(0.01)
    first.cancel()
    got = await asyncio.gather(*others)
    assert all(a.allowed for a in got)
    assert first.cancelled()


# --- on a real Redis ------------------------------------------------------------------------


def _evalsha_calls(server: RedisServer) -> int:
    with __import__("socket").create_connection(("127.0.0.1", server.port), timeout=2) as sock:
        sock.sendall(b"*2\r\n$4\r\nINFO\r\n$12\r\ncommandstats\r\n")
        sock.settimeout(2)
        data = b""
        while not data.endswith(b"\r\n\r\n") or b"cmdstat" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    for line in data.decode().splitlines():
        if line.startswith("cmdstat_evalsha:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


@pytest.mark.redis
@needs_redis
async def test_on_redis_a_hundred_calls_take_two_round_trips(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = await make_store(redis_server.url)
    assert (await store.take("warm-up", FAST)).allowed  # the script is loaded (NOSCRIPT once)
    before = _evalsha_calls(redis_server)
    got = [await store.take("agent:a:rule:r", FAST) for _ in range(100)]
    assert all(a.allowed for a in got)
    assert _evalsha_calls(redis_server) - before == 2


@pytest.mark.redis
@needs_redis
async def test_on_redis_two_gateways_stay_within_the_stated_bound(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    """Over a window, at most the rate over the window stretched by LEASE_TTL, and at most
    one lease per gateway less than the rate allows."""
    rate = parse_rate("40/second")  # burst 40: leases of 10
    first, second = await make_store(redis_server.url), await make_store(redis_server.url)
    admitted = 0
    started = time.monotonic()
    while time.monotonic() - started < 1.0:
        got = await asyncio.gather(
            *(s.take("shared", rate) for s in (first, second) for _ in range(10))
        )
        admitted += sum(a.allowed for a in got)
        await asyncio.sleep(0.01)
    window = time.monotonic() - started
    assert admitted <= rate.burst + 40 * (window + LEASE_TTL) + 2 * lease_size(rate)
    assert (
        admitted
        >= rate.burst + 40 * window - 2 * lease_size(rate) * (window / LEASE_TTL + 1) - 40 * 0.1
    )


@pytest.mark.redis
@needs_redis
async def test_when_redis_dies_leased_tokens_last_at_most_their_ttl_then_it_fails_closed(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = await make_store(redis_server.url)
    assert (await store.take("k", FAST)).allowed  # leases 64
    redis_server.kill()
    served = 0
    deadline = time.monotonic() + LEASE_TTL + 1.0
    with pytest.raises(StateUnavailable):
        while time.monotonic() < deadline:
            assert (await store.take("k", FAST)).allowed
            served += 1
            await asyncio.sleep(0.005)
    assert served <= LEASE_MAX - 1


async def test_many_keys_are_swept_once_their_leases_expire_and_not_on_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sweep walks every lease: with many live keys it runs at most once per LEASE_TTL, so
    a new key costs no walk of the others on every call; expired ones are then dropped."""
    import gateway.state.leases as leases_module

    monkeypatch.setattr(leases_module, "MAX_LEASES", 50)
    bucket = Bucket(10**9)
    bucket.delay = 0
    clock = Clock()
    leases = Leases(bucket.refill, clock=clock)
    sweeps = 0
    real = leases._sweep

    def counted() -> None:
        nonlocal sweeps
        sweeps += 1
        real()

    monkeypatch.setattr(leases, "_sweep", counted)
    for i in range(200):  # all live: within one TTL
        assert (await leases.take(f"k{i}", FAST)).allowed
    assert sweeps == 1 and len(leases) == 200
    clock.now += LEASE_TTL + 0.01
    assert (await leases.take("fresh", FAST)).allowed
    assert sweeps == 2 and len(leases) == 1  # the expired 200 went


async def test_a_held_lease_answers_at_once_and_otherwise_asks_for_a_refill() -> None:
    bucket = Bucket(10_000)
    clock = Clock()
    leases = Leases(bucket.refill, clock=clock)
    assert leases.take_now("k", FAST) is None  # no lease yet: nothing taken
    assert (await leases.take("k", FAST)).allowed  # the refill: 64, one used
    now = [leases.take_now("k", FAST) for _ in range(LEASE_MAX - 1)]
    assert all(a is not None and a.allowed for a in now)
    assert leases.take_now("k", FAST) is None  # spent: the caller awaits a refill
    assert bucket.calls == 1
    assert (await leases.take("k", FAST)).allowed and bucket.calls == 2
    clock.now += LEASE_TTL + 0.001
    assert leases.take_now("k", FAST) is None  # expired tokens are not served at once


async def test_a_local_refusal_is_answered_at_once_until_its_retry_after() -> None:
    bucket = Bucket(0, retry_after=2.0)
    clock = Clock()
    leases = Leases(bucket.refill, clock=clock)
    assert not (await leases.take("k", FAST)).allowed
    refused = leases.take_now("k", FAST)
    assert refused is not None and not refused.allowed and refused.retry_after == 2.0
    clock.now += 2.0
    assert leases.take_now("k", FAST) is None


async def test_a_lease_being_refilled_is_not_answered_at_once() -> None:
    bucket = Bucket(10_000)
    leases = Leases(bucket.refill)
    refill = asyncio.create_task(leases.take("k", FAST))
    await asyncio.sleep(0)
    assert leases.take_now("k", FAST) is None  # the waiters of the refill go first
    assert (await refill).allowed


@pytest.mark.redis
@needs_redis
async def test_on_redis_a_lease_is_served_without_a_coroutine_and_not_after_close(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = await make_store(redis_server.url)
    assert store.take_now("agent:a:rule:r", FAST) is None  # nothing leased yet
    assert (await store.take("agent:a:rule:r", FAST)).allowed
    before = _evalsha_calls(redis_server)
    got = [store.take_now("agent:a:rule:r", FAST) for _ in range(LEASE_MAX - 1)]
    assert all(a is not None and a.allowed for a in got)
    assert _evalsha_calls(redis_server) == before
    assert store.take_now("agent:a:rule:r", parse_rate("3/minute")) is None  # never leased
    await store.close()
    with pytest.raises(StateUnavailable):
        store.take_now("agent:a:rule:r", FAST)
