"""``open_store``: choosing the backend from the URL."""

from __future__ import annotations

import pytest

from gateway.state import MemoryStore, StateStore, open_store
from gateway.state.base import redact_url
from gateway.state.redis import RedisStore


@pytest.mark.parametrize("url", ["memory", "memory://"])
def test_memory_urls(url: str) -> None:
    store = open_store(url)
    assert isinstance(store, MemoryStore) and isinstance(store, StateStore)
    assert store.backend == "memory"


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6399/0",
        "redis://:pw@redis.internal:6380/2",
        "redis://user:pw@redis.internal",
        "rediss://:pw@redis.example.com:6380/0",
        "REDIS://localhost",
    ],
)
def test_redis_urls(url: str) -> None:
    store = open_store(url, prefix="test:")
    assert isinstance(store, RedisStore) and isinstance(store, StateStore)
    assert store.backend == "redis" and store.prefix == "test:"
    assert "pw" not in store.target and "pw" not in repr(store)


def test_rediss_is_tls() -> None:
    store = open_store("rediss://:pw@redis.example.com:6380/1")
    assert isinstance(store, RedisStore)
    assert store.target == "rediss://redis.example.com:6380/1"


@pytest.mark.parametrize(
    "url", ["", "memcached://localhost", "http://x", "redis", "memory:///x", "unix:///tmp/r.sock"]
)
def test_unknown_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="unknown state store URL") as info:
        open_store(url)
    assert repr(url) in str(info.value)


def test_refusal_never_shows_a_password() -> None:
    with pytest.raises(ValueError) as info:
        open_store("postgres://admin:hunter2@db:5432/x")
    assert "hunter2" not in str(info.value)
    assert "admin:***@db:5432" in str(info.value)
    with pytest.raises(ValueError) as info:
        open_store("redis://:hunter2@host:notaport/0")
    assert "hunter2" not in str(info.value)


def test_unknown_options_and_bad_values() -> None:
    with pytest.raises(TypeError):
        open_store("memory", colour="blue")
    with pytest.raises(ValueError, match="socket_timeout"):
        open_store("redis://localhost", socket_timeout=0)


@pytest.mark.parametrize(
    "url,shown",
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://u:pw@h/0", "redis://u:***@h/0"),
        ("redis://h:1/0", "redis://h:1/0"),
        ("weird:pw@host", "***@host"),
        ("x://a:b@c@d", "x://a:***@d"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
