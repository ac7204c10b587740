"""The revocation journal: revocations outlive Redis restarting empty and every gateway
restarting with it (until they expire), with either backend."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gateway.errors import StateUnavailable
from gateway.state import open_store
from gateway.state.base import RevocationInfo
from gateway.state.journal import JournalEntry, RevocationJournal
from tests.redis_server import RedisServer
from tests.state.conftest import FAST, StoreFactory, needs_redis
from tests.state.test_store import eventually


def test_entries_round_trip_and_bad_lines_are_refused() -> None:
    entry = JournalEntry("agent", "a-1", None, RevocationInfo(5.0, "alice", "leaked key"))
    assert JournalEntry.parse(entry.line()) == entry
    timed = JournalEntry("jti", "j", 2e9, None)
    assert JournalEntry.parse(timed.line()) == timed
    for bad in (
        b"not json",
        b"[]",
        b'{"kind": "user", "value": "x", "until": null}',
        b'{"kind": "agent", "value": 7, "until": null}',
        b'{"kind": "agent", "value": "x", "until": true}',
        b'{"kind": "agent", "value": "x", "until": "soon"}',
        b'{"kind": "agent", "value": "", "until": null}',
        b'{"kind": "agent", "value": "x"}',
    ):
        assert JournalEntry.parse(bad) is None, bad


def test_load_skips_a_torn_line_and_unreadable_lines_and_compacts(tmp_path: Path) -> None:
    path = tmp_path / "revocations"
    now = time.time()
    live = JournalEntry("agent", "live", None, None)
    expired = JournalEntry("jti", "old", now - 10, None)
    path.write_bytes(
        live.line() + b"garbage\n" + expired.line() + b'{"kind": "agent", "value": "to'
    )
    journal = RevocationJournal(path)
    assert journal.load(now) == [live]
    # Rewritten: only the live entry, whole lines, still private.
    assert path.read_bytes() == live.line()
    assert path.stat().st_mode & 0o777 == 0o600
    assert journal.lines == 1


def test_a_journal_that_cannot_be_written_is_reported_not_raised(tmp_path: Path) -> None:
    journal = RevocationJournal(tmp_path / "missing-dir" / "revocations")
    journal.append(JournalEntry("agent", "x", None, None))
    assert journal.error is not None and "No such file" in journal.error
    (tmp_path / "missing-dir").mkdir()
    journal.append(JournalEntry("agent", "x", None, None))
    assert journal.error is None and journal.lines == 1


async def test_memory_state_keeps_a_revocation_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "revocations"
    first = open_store("memory")
    first.keep_revocations(RevocationJournal(path))
    await first.start()
    await first.revoke("run", "run-9", by="alice", reason="stop")
    await first.revoke("jti", "short", until=time.time() + 0.2)
    await first.close()
    time.sleep(0.3)  # the jti's revocation ends with its token
    again = open_store("memory")
    assert again.keep_revocations(RevocationJournal(path)) == 1
    await again.start()
    assert again.is_revoked("j", "a", "run-9") == "run"
    assert again.is_revoked("short", "a", None) is None
    [listed] = again.revocations()
    assert (listed["by"], listed["reason"]) == ("alice", "stop")
    await again.close()


@pytest.mark.redis
@needs_redis
async def test_redis_and_every_gateway_restarted_a_revoked_token_stays_refused(
    redis_server: RedisServer, make_store: StoreFactory, tmp_path: Path
) -> None:
    journals = [tmp_path / "gw1.revocations", tmp_path / "gw2.revocations"]
    gateways = []
    for path in journals:
        store = open_store(redis_server.url, **FAST)
        store.keep_revocations(RevocationJournal(path))
        await store.start()
        gateways.append(store)
    await gateways[0].revoke("agent", "bad-agent", by="alice", reason="exfiltration")
    # The other gateway hears it and keeps it on its own disk too.
    await eventually(lambda: gateways[1].is_revoked("j", "bad-agent", None) == "agent", within=2.0)
    await eventually(lambda: b"bad-agent" in journals[1].read_bytes(), within=2.0)
    for store in gateways:
        await store.close()
    redis_server.restart()  # comes back empty
    assert redis_server.command("DBSIZE") == b":0"
    # Only the second gateway comes back: its journal restores the revocation and its sync
    # writes it back to Redis, where a gateway without a journal finds it.
    back = open_store(redis_server.url, **FAST)
    assert back.keep_revocations(RevocationJournal(journals[1])) == 1
    await back.start()
    assert back.is_revoked("j", "bad-agent", None) == "agent"
    fresh = await make_store(redis_server.url)
    await eventually(lambda: fresh.is_revoked("j", "bad-agent", None) == "agent", within=2.0)
    [listed] = fresh.revocations()
    assert (listed["by"], listed["reason"]) == ("alice", "exfiltration")
    await back.close()


@pytest.mark.redis
@needs_redis
async def test_a_known_revocation_is_enforced_while_the_mirror_is_out_of_sync(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    """``on_state_error: allow`` admits calls while the store cannot vouch for its mirror,
    but never one the gateway already knows to be revoked."""
    store = await make_store(redis_server.url)
    await store.revoke("agent", "known-bad")
    redis_server.kill()

    def stale() -> bool:
        try:
            store.is_revoked("j", "someone-else", None)
        except StateUnavailable:
            return True
        return False

    await eventually(stale, within=2.0)
    assert store.is_revoked("j", "known-bad", None) == "agent"  # known: refused, no error


def test_the_journal_file_is_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "revocations"
    journal = RevocationJournal(path)
    journal.append(JournalEntry("agent", "a", None, RevocationInfo(1.5, "bob", None)))
    [line] = path.read_text().splitlines()
    assert json.loads(line) == {
        "kind": "agent",
        "value": "a",
        "until": None,
        "since": 1.5,
        "by": "bob",
        "reason": None,
    }
    assert os.stat(path).st_mode & 0o777 == 0o600


@pytest.mark.redis
@needs_redis
async def test_health_warns_when_redis_keeps_nothing_on_disk(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    store = await make_store(redis_server.url)
    health = await store.health()
    assert health["reachable"] is True
    assert health["persistence"] == {
        "known": True,
        "aof": False,
        "rdb": False,
        "warning": health["warnings"][0],
    }
    assert "keeps nothing on disk" in health["warnings"][0]
    redis_server.command("CONFIG", "SET", "appendonly", "yes")
    fresh = await make_store(redis_server.url)
    health = await fresh.health()
    assert health["persistence"] == {"known": True, "aof": True, "rdb": False}
    assert "warnings" not in health


@pytest.mark.redis
@needs_redis
async def test_a_known_pause_holds_while_the_mirror_is_out_of_sync(
    redis_server: RedisServer, make_store: StoreFactory
) -> None:
    """Like a known revocation: ``on_state_error: allow`` must not let a paused agent's call
    through because Redis went away after the pause was heard."""
    store = await make_store(redis_server.url)
    await store.pause("agent", "held-agent", until=None, by="ops", reason="look first")
    redis_server.kill()

    def stale() -> bool:
        try:
            store.paused("someone-else", None)
        except StateUnavailable:
            return True
        return False

    await eventually(stale, within=2.0)
    entry = store.paused("held-agent", None)
    assert entry is not None and entry.by == "ops"


def test_a_journal_that_cannot_be_read_stops_the_start_in_one_line(tmp_path: Path) -> None:
    """Starting without the revocations it holds would forget them: refuse instead."""
    from gateway.errors import ConfigError

    folder = tmp_path / "revocations"
    folder.mkdir()  # not a file: reading it fails
    with pytest.raises(ConfigError, match="revocation journal .* cannot be read"):
        RevocationJournal(folder).load()
