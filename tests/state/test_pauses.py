"""Pauses and who revoked what, in the StateStore contract, on both backends (see conftest:
``store``, ``store_pair``), then the Redis-only behaviour: resync and a Redis lost."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from gateway.errors import StateUnavailable
from gateway.state import StateStore, open_store
from gateway.state.base import PauseEntry
from tests.redis_server import RedisServer
from tests.state.conftest import StoreFactory, needs_redis
from tests.state.test_store import eventually


def _unavailable(store: StateStore) -> bool:
    try:
        store.paused("a", None)
    except StateUnavailable:
        return True
    return False


# --- pause, resume, expiry, listing ---------------------------------------------------------


async def test_pause_and_resume_each_kind(store: StateStore) -> None:
    assert store.paused("agent-1", "run-1") is None
    await store.pause("agent", "agent-1", until=None, by="ops-alice", reason="looks stuck")
    entry = store.paused("agent-1", "run-1")
    assert isinstance(entry, PauseEntry)
    assert (entry.kind, entry.value, entry.until) == ("agent", "agent-1", None)
    assert (entry.by, entry.reason) == ("ops-alice", "looks stuck")
    assert abs(entry.since - time.time()) < 5
    assert store.paused("agent-2", "run-1") is None

    await store.pause("run", "run-2", until=None, by="ops-bob", reason="")
    assert store.paused("agent-2", "run-2") is not None
    assert store.paused("agent-2", "run-2").kind == "run"  # type: ignore[union-attr]
    assert store.paused("agent-2", None) is None
    assert store.paused("agent-2", "run-3") is None
    # The agent is checked first.
    assert store.paused("agent-1", "run-2").kind == "agent"  # type: ignore[union-attr]

    assert await store.resume("agent", "agent-1", by="ops-alice") is True
    assert store.paused("agent-1", "run-1") is None
    assert store.paused("agent-1", "run-2").kind == "run"  # type: ignore[union-attr]
    assert await store.resume("agent", "agent-1", by="ops-alice") is False  # not paused any more
    assert await store.resume("run", "never-paused", by="ops") is False
    assert await store.resume("run", "run-2", by="ops") is True
    assert store.paused("agent-1", "run-2") is None


async def test_pause_expires_at_until(store: StateStore) -> None:
    await store.pause("agent", "short", until=time.time() + 0.3, by="ops", reason="r")
    assert store.paused("short", None) is not None
    assert [p["value"] for p in store.pauses()] == ["short"]
    await asyncio.sleep(0.35)
    assert store.paused("short", None) is None
    assert store.pauses() == []
    assert await store.resume("agent", "short", by="ops") is False  # it was over


async def test_pausing_again_replaces_the_entry(store: StateStore) -> None:
    await store.pause("agent", "a1", until=time.time() + 0.2, by="ops-1", reason="first")
    await store.pause("agent", "a1", until=None, by="ops-2", reason="second")
    await asyncio.sleep(0.3)
    entry = store.paused("a1", None)
    assert entry is not None and (entry.by, entry.reason, entry.until) == ("ops-2", "second", None)


async def test_pauses_lists_each_live_pause(store: StateStore) -> None:
    until = time.time() + 60
    await store.pause("agent", "a1", until=until, by="ops-alice", reason="why not")
    await store.pause("run", "r1", until=None, by="ops-bob", reason="")
    listed = sorted(store.pauses(), key=lambda p: p["kind"])
    assert [set(p) for p in listed] == [{"kind", "value", "since", "until", "by", "reason"}] * 2
    assert listed[0] | {"since": 0} == {
        "kind": "agent",
        "value": "a1",
        "since": 0,
        "until": until,
        "by": "ops-alice",
        "reason": "why not",
    }
    assert (listed[1]["kind"], listed[1]["value"], listed[1]["until"]) == ("run", "r1", None)
    json.dumps(listed)  # for the console: plain JSON


@pytest.mark.parametrize(
    "kind,value,until,by,reason,match",
    [
        ("jti", "x", None, "ops", "", "kind"),
        ("agent", "", None, "ops", "", "non-empty"),
        ("agent", "a", float("nan"), "ops", "", "until"),
        ("agent", "a", 1.0, "ops", "", "past"),
        ("agent", "a", None, "", "", "by"),
        ("agent", "a", None, "ops", "x" * 1001, "reason"),
        ("agent", "a", None, None, "", "by"),
    ],
)
async def test_pause_rejects_bad_arguments(
    store: StateStore, kind: Any, value: Any, until: Any, by: Any, reason: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        await store.pause(kind, value, until=until, by=by, reason=reason)
    assert store.pauses() == []


async def test_on_pause_hears_pause_and_resume_once(store: StateStore, backend: str) -> None:
    heard: list[tuple[str, str, bool]] = []
    store.on_pause(lambda kind, value, paused: heard.append((kind, value, paused)))
    await store.pause("run", "r1", until=None, by="ops", reason="")
    assert heard == [("run", "r1", True)]  # before pause() returns
    await store.resume("run", "r1", by="ops")
    assert heard == [("run", "r1", True), ("run", "r1", False)]
    await store.resume("run", "r1", by="ops")
    if backend != "memory":
        await asyncio.sleep(0.2)  # our own pub/sub echoes change nothing
    assert heard == [("run", "r1", True), ("run", "r1", False)]


async def test_pause_and_resume_reach_the_other_store(
    store_pair: tuple[StateStore, StateStore],
) -> None:
    first, second = store_pair
    heard: list[tuple[str, str, bool]] = []
    second.on_pause(lambda kind, value, paused: heard.append((kind, value, paused)))
    await first.pause("agent", "rogue", until=None, by="ops-alice", reason="too many calls")
    await eventually(lambda: second.paused("rogue", None) is not None, within=1.0)
    entry = second.paused("rogue", None)
    assert entry is not None and entry.by == "ops-alice" and entry.reason == "too many calls"
    assert [p["value"] for p in second.pauses()] == ["rogue"]
    # Resumed from the other one.
    assert await second.resume("agent", "rogue", by="ops-bob") is True
    await eventually(lambda: first.paused("rogue", None) is None, within=1.0)
    await eventually(lambda: ("agent", "rogue", False) in heard, within=1.0)
    assert heard[0] == ("agent", "rogue", True)


async def test_pauses_before_start_and_after_close_fail_closed(store_url: str) -> None:
    store = open_store(store_url)
    with pytest.raises(StateUnavailable):
        store.paused("a", None)
    with pytest.raises(StateUnavailable):
        await store.pause("agent", "a", until=None, by="ops", reason="")
    await store.start()
    await store.pause("agent", "a", until=None, by="ops", reason="")
    await store.close()
    with pytest.raises(StateUnavailable):
        store.paused("a", None)
    with pytest.raises(StateUnavailable):
        store.pauses()
    with pytest.raises(StateUnavailable):
        await store.resume("agent", "a", by="ops")


# --- who revoked, and why -------------------------------------------------------------------


async def test_revocation_keeps_by_and_reason(store_pair: tuple[StateStore, StateStore]) -> None:
    first, second = store_pair
    await first.revoke("agent", "a1", by="ops-alice", reason="exfiltration attempt")
    await first.revoke("run", "r1", until=time.time() + 60)  # the old call still works
    await eventually(lambda: second.is_revoked("j", "a1", "r1") == "agent", within=1.0)
    await eventually(lambda: len(second.revocations()) == 2, within=1.0)
    for store in (first, second):
        listed = {r["kind"]: r for r in store.revocations()}
        assert listed["agent"]["value"] == "a1" and listed["agent"]["until"] is None
        assert listed["agent"]["by"] == "ops-alice"
        assert listed["agent"]["reason"] == "exfiltration attempt"
        assert abs(listed["agent"]["since"] - time.time()) < 5
        assert listed["run"]["by"] is None and listed["run"]["reason"] is None
        assert listed["run"]["until"] > time.time()
    # A repeat that does not extend it keeps the first who and why.
    await second.revoke("agent", "a1", by="ops-bob", reason="again")
    await asyncio.sleep(0.1)
    for store in (first, second):
        [agent] = [r for r in store.revocations() if r["kind"] == "agent"]
        assert agent["by"] == "ops-alice"


async def test_revoke_rejects_bad_by_and_reason(store: StateStore) -> None:
    with pytest.raises(ValueError, match="by"):
        await store.revoke("agent", "a", by="")
    with pytest.raises(ValueError, match="reason"):
        await store.revoke("agent", "a", by="ops", reason="x" * 1001)
    assert store.is_revoked("j", "a", None) is None


# --- Redis only -----------------------------------------------------------------------------


@pytest.mark.redis
@needs_redis
async def test_a_store_started_later_loads_pauses_and_infos(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    first = await make_store(redis_server.url)
    await first.pause("agent", "a1", until=None, by="ops-alice", reason="held")
    await first.pause("run", "gone", until=time.time() + 0.2, by="ops", reason="")
    await first.revoke("jti", "j1", by="ops-bob", reason="leaked token")
    await asyncio.sleep(0.25)
    late = await make_store(redis_server.url)
    entry = late.paused("a1", None)
    assert entry is not None and (entry.by, entry.reason) == ("ops-alice", "held")
    assert late.paused("x", "gone") is None  # expired before the snapshot
    [revoked] = late.revocations()
    assert (revoked["by"], revoked["reason"]) == ("ops-bob", "leaked token")


@pytest.mark.redis
@needs_redis
async def test_resume_missed_while_disconnected_is_applied_by_the_resync(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    writer = await make_store(redis_server.url)
    reader = await make_store(redis_server.url)
    await writer.pause("agent", "a1", until=None, by="ops", reason="")
    await eventually(lambda: reader.paused("a1", None) is not None)
    heard: list[tuple[str, str, bool]] = []
    reader.on_pause(lambda kind, value, paused: heard.append((kind, value, paused)))

    # Drop every pub/sub connection, then resume before the reader has resubscribed.
    assert redis_server.command("CLIENT", "KILL", "TYPE", "pubsub").startswith(b":")
    assert await writer.resume("agent", "a1", by="ops") is True

    def resumed() -> bool:
        try:
            return reader.paused("a1", None) is None
        except StateUnavailable:
            return False

    await eventually(resumed, within=3.0)
    await eventually(lambda: ("agent", "a1", False) in heard)
    # And it stays resumed: pauses are never written back by a resync.
    await asyncio.sleep(0.2)
    assert reader.paused("a1", None) is None and writer.paused("a1", None) is None


@pytest.mark.redis
@needs_redis
async def test_a_redis_that_restarts_empty_has_no_pauses(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = await make_store(redis_server.url)
    heard: list[tuple[str, str, bool]] = []
    store.on_pause(lambda kind, value, paused: heard.append((kind, value, paused)))
    await store.pause("agent", "a1", until=None, by="ops", reason="")
    await store.revoke("agent", "stopped", by="ops", reason="stop")

    redis_server.restart()  # comes back empty
    await eventually(lambda: _unavailable(store), within=1.0)
    with pytest.raises(StateUnavailable):
        store.pauses()  # fail closed meanwhile

    def back() -> bool:
        try:
            return store.paused("a1", None) is None
        except StateUnavailable:
            return False

    await eventually(back, within=5.0)
    assert ("agent", "a1", False) in heard  # held calls are told to go on
    assert store.pauses() == []
    # A pause is operational, not durable; a revocation is written back.
    late = await make_store(redis_server.url)
    assert late.pauses() == []
    await eventually(lambda: late.is_revoked("j", "stopped", None) == "agent", within=2.0)
    await eventually(lambda: [r["by"] for r in late.revocations()] == ["ops"], within=2.0)


@pytest.mark.redis
@needs_redis
async def test_pause_fails_when_redis_is_down_and_nothing_is_paused(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = await make_store(redis_server.url, socket_timeout=0.25, connect_timeout=0.25)
    redis_server.kill()
    with pytest.raises(StateUnavailable):
        await store.pause("agent", "a1", until=None, by="ops", reason="")
    redis_server.start()

    def synced() -> bool:
        return not _unavailable(store)

    await eventually(synced, within=5.0)
    assert store.paused("a1", None) is None


@pytest.mark.redis
@needs_redis
async def test_pause_messages_use_their_own_channel(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    # A gateway of an older version reads every message on the revocations channel as a
    # revocation: a pause must never be published there.
    store = await make_store(redis_server.url)
    revoked: list[tuple[str, str]] = []
    store.on_revoke(lambda kind, value: revoked.append((kind, value)))
    await store.pause("agent", "a1", until=None, by="ops", reason="")
    await store.resume("agent", "a1", by="ops")
    await asyncio.sleep(0.2)
    assert revoked == []
    assert store.is_revoked("j", "a1", None) is None
