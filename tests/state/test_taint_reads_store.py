"""What a tainted run read (``record_read``, ``drop_reads``, ``reads_of``), on every backend:
kept in order and shared by a fleet, bounded (past the cap the record is dropped and stays
incomplete for good: fail closed, never oldest-dropped), and expiring."""

from __future__ import annotations

import asyncio

from gateway.state import StateStore


async def test_a_record_is_kept_in_order_and_shared(
    store_pair: tuple[StateStore, StateStore],
) -> None:
    one, two = store_pair
    assert await one.reads_of("run-1") is None  # nothing recorded: not a whole record
    assert await one.record_read("run-1", "begin r1", cap=1000, ttl_s=60)
    assert await two.record_read("run-1", "src\ntext", cap=1000, ttl_s=60)
    assert await two.reads_of("run-1") == ["begin r1", "src\ntext"]
    assert await one.reads_of("run-1") == ["begin r1", "src\ntext"]
    assert await one.reads_of("run-2") is None


async def test_past_the_cap_the_record_is_incomplete_for_good(
    store_pair: tuple[StateStore, StateStore],
) -> None:
    one, two = store_pair
    assert await one.record_read("run-1", "a" * 60, cap=100, ttl_s=60)
    assert not await one.record_read("run-1", "b" * 60, cap=100, ttl_s=60)
    assert await two.reads_of("run-1") is None
    # A small entry after it does not make it whole again, on any gateway.
    assert not await two.record_read("run-1", "c", cap=100, ttl_s=60)
    assert await one.reads_of("run-1") is None


async def test_a_dropped_record_is_incomplete_for_good(
    store_pair: tuple[StateStore, StateStore],
) -> None:
    one, two = store_pair
    await one.drop_reads("never-begun", ttl_s=60)
    assert not await two.record_read("never-begun", "begin x", cap=1000, ttl_s=60)
    assert await two.reads_of("never-begun") is None
    assert await one.record_read("run-1", "begin r", cap=1000, ttl_s=60)
    await two.drop_reads("run-1", ttl_s=60)
    assert await one.reads_of("run-1") is None


async def test_a_record_expires(store: StateStore) -> None:
    assert await store.record_read("run-1", "begin r", cap=1000, ttl_s=0.2)
    assert await store.reads_of("run-1") == ["begin r"]
    await asyncio.sleep(0.4)
    assert await store.reads_of("run-1") is None
