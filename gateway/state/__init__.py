"""Shared state: revocations, rate limits and quotas, behind one interface, two backends.

``open_store(url)`` picks the backend from the URL:

* ``memory`` or ``memory://``: in-process (the default; one gateway only);
* ``redis://[[user]:password@]host:port/db`` or ``rediss://...`` (TLS): shared by every
  gateway pointed at the same Redis and prefix.

The returned store must be ``await store.start()``-ed before use and ``await store.close()``-d
after. See ``gateway.state.base.StateStore`` for the contract.
"""

from __future__ import annotations

from typing import Any

from gateway.state.base import (
    DEFAULT_PREFIX,
    REVOCATION_KINDS,
    Admission,
    RevocationKind,
    RevocationListener,
    StateStore,
    redact_url,
)
from gateway.state.memory import MemoryStore

__all__ = [
    "DEFAULT_PREFIX",
    "REVOCATION_KINDS",
    "Admission",
    "MemoryStore",
    "RevocationKind",
    "RevocationListener",
    "StateStore",
    "open_store",
]


def open_store(url: str, **opts: Any) -> StateStore:
    """A store for ``url`` (not started). ``opts`` go to the backend's constructor.

    Raises ``ValueError`` naming the URL (password redacted) when no backend serves it.
    """
    if not isinstance(url, str):
        raise ValueError(f"state store URL must be a string, not {type(url).__name__}")
    scheme = url.partition("://")[0].lower() if "://" in url else url.lower()
    if url in ("memory", "memory://"):
        return MemoryStore(**opts)
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster") and "://" in url:
        # Imported here so the memory default never needs the redis package.
        from gateway.state.redis import RedisStore

        return RedisStore(url, **opts)
    raise ValueError(
        f"unknown state store URL {redact_url(url)!r}: use 'memory', "
        "'redis://[:password@]host:port/db', 'rediss://...' or 'redis+cluster://host:port' "
        "(any node of a Redis Cluster)"
    )
