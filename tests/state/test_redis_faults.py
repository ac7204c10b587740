"""The Redis backend when Redis misbehaves: killed, restarted, paused, wrong password.

These need a real server to break, so they run on the redis backend only.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.errors import StateUnavailable
from gateway.rates import parse_rate
from gateway.state import StateStore, open_store
from tests.redis_server import RedisServer, free_port
from tests.state.conftest import FAST, PROD_TIMEOUTS, StoreFactory, needs_redis
from tests.state.test_store import eventually

pytestmark = [pytest.mark.redis, needs_redis]

# A burst under 4 is never leased (leases.py): every take is a round trip, which these
# tests break on purpose. Leased rates under faults: tests/state/test_leases.py.
RATE = parse_rate("1000/second burst 3")
PASSWORD = "s3cret-pw"  # noqa: S105 (a test server's password)


def _is_unavailable(store: StateStore) -> bool:
    try:
        store.is_revoked("j", "a", None)
    except StateUnavailable:
        return True
    return False


def _is_available(store: StateStore) -> bool:
    return not _is_unavailable(store)


async def _elapsed_raising(call) -> tuple[float, StateUnavailable]:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    with pytest.raises(StateUnavailable) as info:
        await call()
    return time.perf_counter() - started, info.value


async def test_killed_redis_fails_closed_then_recovers_on_restart(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = await make_store(redis_server.url, **PROD_TIMEOUTS)
    assert (await store.take("k", RATE)).allowed
    assert store.is_revoked("j", "a", None) is None

    redis_server.kill()

    took, err = await _elapsed_raising(lambda: store.take("k", RATE))
    assert took < 1.0, f"take took {took:.3f} s to fail"
    assert f"127.0.0.1:{redis_server.port}" in err.detail
    assert err.__cause__ is not None
    took, _ = await _elapsed_raising(lambda: store.consume_quota("q", 5, ttl_s=60))
    assert took < 1.0, f"consume_quota took {took:.3f} s to fail"
    took, _ = await _elapsed_raising(lambda: store.revoke("jti", "during-outage"))
    assert took < 1.0

    await eventually(lambda: _is_unavailable(store), within=1.0)
    health = await store.health()
    assert health["reachable"] is False and health["mirror_synced"] is False

    redis_server.restart()

    # Same store object: the pool reconnects, the subscriber resyncs.
    async def take_ok() -> bool:
        try:
            return (await store.take("k", RATE)).allowed
        except StateUnavailable:
            return False

    deadline = time.monotonic() + 5
    while not await take_ok():
        assert time.monotonic() < deadline, "take did not recover after restart"
        await asyncio.sleep(0.05)
    assert (await store.consume_quota("q", 5, ttl_s=60)).allowed
    await eventually(lambda: _is_available(store), within=5.0)
    assert (await store.health())["reachable"] is True
    # The revocation whose shared write failed during the outage was enforced locally.
    assert store.is_revoked("during-outage", "a", None) == "jti"


async def test_resync_writes_back_revocations_redis_lost(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    first = await make_store(redis_server.url)
    await first.revoke("agent", "bad-agent")
    redis_server.restart()  # comes back empty
    await eventually(lambda: _is_unavailable(first), within=1.0)
    await eventually(lambda: _is_available(first), within=5.0)
    # A gateway started after the data loss learns it from the write-back.
    late = await make_store(redis_server.url)
    await eventually(lambda: late.is_revoked("j", "bad-agent", None) == "agent", within=2.0)


async def test_resync_delivers_revocations_missed_while_disconnected(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    writer = await make_store(redis_server.url)
    reader = await make_store(redis_server.url)
    heard: list[tuple[str, str]] = []
    reader.on_revoke(lambda kind, value: heard.append((kind, value)))

    # Drop every pub/sub connection, then revoke before the reader has resubscribed.
    assert redis_server.command("CLIENT", "KILL", "TYPE", "pubsub").startswith(b":")
    await writer.revoke("jti", "missed")

    await eventually(lambda: _is_available(reader) and reader.is_revoked("missed", "a", None))
    assert reader.is_revoked("missed", "a", None) == "jti"
    await eventually(lambda: ("jti", "missed") in heard)


async def test_paused_redis_times_out_instead_of_hanging(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = await make_store(redis_server.url, **PROD_TIMEOUTS)  # op_timeout: 0.5 s
    assert (await store.take("k", RATE)).allowed
    redis_server.pause(1200)
    took, err = await _elapsed_raising(lambda: store.take("k", RATE))
    assert 0.2 <= took < 0.8, f"take failed after {took:.3f} s"
    assert "did not answer" in err.detail
    took, _ = await _elapsed_raising(lambda: store.consume_quota("q", 5, ttl_s=60))
    assert took < 0.8
    health = await store.health()
    assert health["reachable"] is False

    async def works() -> bool:
        try:
            await store.take("k", RATE)
        except StateUnavailable:
            return False
        return True

    deadline = time.monotonic() + 3
    while not await works():
        assert time.monotonic() < deadline, "store did not recover after the pause"
        await asyncio.sleep(0.05)


async def test_silent_pubsub_marks_mirror_stale(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = await make_store(redis_server.url, heartbeat_s=0.2, heartbeat_timeout_s=0.6)
    redis_server.pause(1500)
    started = time.perf_counter()
    await eventually(lambda: _is_unavailable(store), within=1.4)
    assert time.perf_counter() - started < 1.4
    await eventually(lambda: _is_available(store), within=4.0)


async def test_start_fails_when_redis_is_down(tmp_path: Path) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    store = open_store(url, **{**FAST, "start_timeout_s": 0.5})
    started = time.perf_counter()
    with pytest.raises(StateUnavailable) as info:
        await store.start()
    assert time.perf_counter() - started < 1.5
    assert PASSWORD not in info.value.detail
    assert "127.0.0.1" in info.value.detail


async def test_password_protected_redis_and_no_password_in_messages(
    tmp_path: Path, make_store: StoreFactory
) -> None:
    server = RedisServer(tmp_path / "auth", password=PASSWORD)
    server.start()
    try:
        store = await make_store(server.url)
        assert PASSWORD in server.url
        assert (await store.take("k", RATE)).allowed
        health = await store.health()
        assert health["reachable"] and PASSWORD not in health["detail"]
        assert PASSWORD not in repr(store)

        wrong = open_store(server.url.replace(PASSWORD, "wrong-pw"), **FAST)
        with pytest.raises(StateUnavailable) as info:
            await wrong.start()
        assert "wrong-pw" not in info.value.detail

        server.kill()
        for call in (
            lambda: store.take("k", RATE),
            lambda: store.consume_quota("q", 1, ttl_s=5),
            lambda: store.revoke("jti", "x"),
        ):
            _, err = await _elapsed_raising(call)
            assert PASSWORD not in err.detail
            assert PASSWORD not in str(err)
        await eventually(lambda: _is_unavailable(store), within=1.0)
        with pytest.raises(StateUnavailable) as info:
            store.is_revoked("j", "a", None)
        assert PASSWORD not in info.value.detail
        assert PASSWORD not in (await store.health())["detail"]
    finally:
        server.close()


async def test_stores_with_different_prefixes_do_not_share(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    one = await make_store(redis_server.url, prefix="one:")
    two = await make_store(redis_server.url, prefix="two:")
    rate = parse_rate("1/minute")
    assert (await one.take("k", rate)).allowed
    assert (await two.take("k", rate)).allowed
    await one.revoke("jti", "j1")
    await asyncio.sleep(0.1)
    assert two.is_revoked("j1", "a", None) is None


async def test_rate_uses_the_server_clock(
    redis_server: RedisServer, make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await make_store(redis_server.url)
    second = await make_store(redis_server.url)
    rate = parse_rate("2/minute")
    assert (await first.take("k", rate)).allowed
    # A gateway whose clock is an hour ahead must not see a refilled limiter.
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    assert (await second.take("k", rate)).allowed
    assert not (await second.take("k", rate)).allowed


async def test_a_cancellation_redis_py_turns_into_an_error_is_still_a_cancellation(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    """A shutdown cancels the gateway's background loop while it waits on Redis; redis-py may
    answer that with a connection error. Turned into StateUnavailable (which health and the
    loop handle and forget), the cancellation was swallowed and the shutdown waited forever
    (seen once in CI: a fleet test's teardown hung for 120 s)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    store = await make_store(redis_server.url)

    async def answer_cancel_with_an_error() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RedisConnectionError("Connection closed by server.") from None

    task = asyncio.ensure_future(store._call("PING", answer_cancel_with_an_error))  # type: ignore[attr-defined]
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    # A plain failure is still a state error.
    async def fail() -> None:
        raise RedisConnectionError("refused")

    with pytest.raises(StateUnavailable):
        await store._call("PING", fail)  # type: ignore[attr-defined]
