"""The embedded state store: one gateway, no external service, same semantics as Redis.

Everything lives in dicts owned by one event loop (no awaits inside an update, so every
operation is atomic). Rate limiters and quota counters carry their own expiry and are swept
periodically; revocations and pauses expire at their ``until``. Limiters use the monotonic clock, so
wall-clock jumps neither grant nor withhold calls. State is lost when the process ends.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gateway.errors import StateUnavailable
from gateway.state.approval_board import ApprovalBoard, LocalApprovalBoard
from gateway.state.base import (
    DEFAULT_PREFIX,
    Admission,
    PauseEntry,
    PauseKind,
    PauseListener,
    Pauses,
    RevocationInfo,
    RevocationKeeper,
    RevocationKind,
    RevocationListener,
    Revocations,
    check_cost,
    check_operator,
    check_pause,
    check_quota_args,
    check_resume,
    check_revocation,
    gcra,
)

if TYPE_CHECKING:
    from gateway.rates import Rate

__all__ = ["MemoryStore"]

_NS = 1_000_000_000


class MemoryStore:
    """In-process ``StateStore``. ``sweep_interval_s`` bounds how long expired limiter and
    quota entries may linger before they are dropped."""

    backend = "memory"

    def __init__(self, *, prefix: str = DEFAULT_PREFIX, sweep_interval_s: float = 10.0) -> None:
        self._board = LocalApprovalBoard()
        self._taints: dict[str, tuple[dict[str, Any], int]] = {}  # key -> (cause, expires ns)
        # key -> (what the run read, or None once incomplete; characters; expires ns)
        self._reads: dict[str, tuple[list[str] | None, int, int]] = {}
        # The prefix has no use in-process; it is accepted so every backend takes the same
        # options, and kept in keys so tests and dumps read like Redis.
        self.prefix = prefix
        self._sweep_ns = max(1, int(sweep_interval_s * _NS))
        self._revocations = Revocations()
        self._pauses = Pauses()
        self._rates: dict[str, int] = {}  # key -> theoretical arrival time (monotonic ns)
        self._quotas: dict[str, tuple[int, int]] = {}  # key -> (used, expires at, monotonic ns)
        self._next_sweep = time.monotonic_ns() + self._sweep_ns
        self._running = False

    def __repr__(self) -> str:
        return f"MemoryStore(prefix={self.prefix!r})"

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        self._running = True

    async def close(self) -> None:
        self._running = False

    async def health(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "reachable": self._running,
            "detail": (
                ("in-process store" if self._running else "in-process store (not running)")
                + f": {len(self._revocations)} revocations, {len(self._pauses)} pauses, "
                f"{len(self._rates)} rate limiters, "
                f"{len(self._quotas)} quota counters"
            ),
        }

    def _check_open(self) -> None:
        if not self._running:
            raise StateUnavailable("the in-process state store is not started or was closed")

    # --- revocations --------------------------------------------------------------------

    async def revoke(
        self,
        kind: RevocationKind,
        value: str,
        *,
        until: float | None = None,
        by: str | None = None,
        reason: str | None = None,
    ) -> None:
        check_revocation(kind, value, until)
        check_operator(by, reason)
        self._check_open()
        now = time.time()
        self._revocations.apply(kind, value, until, now=now, info=RevocationInfo(now, by, reason))

    def revocations(self) -> list[dict[str, Any]]:
        self._check_open()
        return self._revocations.listing(now=time.time())

    def is_revoked(self, jti: str, agent: str, run: str | None) -> RevocationKind | None:
        self._check_open()
        return self._revocations.match(jti, agent, run, now=time.time())

    def approval_board(self) -> ApprovalBoard:
        return self._board

    def keep_revocations(self, journal: RevocationKeeper) -> int:
        return journal.restore(self._revocations, time.time())

    def on_revoke(self, callback: RevocationListener) -> None:
        self._revocations.add_listener(callback)

    # --- pauses -------------------------------------------------------------------------

    async def pause(
        self, kind: PauseKind, value: str, *, until: float | None, by: str, reason: str
    ) -> None:
        now = time.time()
        check_pause(kind, value, until, by, reason, now=now)
        self._check_open()
        until = None if until is None else float(until)
        self._pauses.set(PauseEntry(kind, value, now, until, by, reason), now=now)

    async def resume(self, kind: PauseKind, value: str, *, by: str) -> bool:
        check_resume(kind, value, by)
        self._check_open()
        entry = self._pauses.clear(kind, value)
        return entry is not None and entry.live(time.time())

    def paused(self, agent: str, run: str | None) -> PauseEntry | None:
        self._check_open()
        return self._pauses.match(agent, run, now=time.time())

    def pauses(self) -> list[dict[str, Any]]:
        self._check_open()
        return [entry.public() for entry in self._pauses.entries(now=time.time())]

    def on_pause(self, callback: PauseListener) -> None:
        self._pauses.add_listener(callback)

    # --- rates --------------------------------------------------------------------------

    async def take(self, key: str, rate: Rate, *, cost: int = 1) -> Admission:
        return self._take(key, rate, cost)

    def take_now(self, key: str, rate: Rate) -> Admission:
        return self._take(key, rate, 1)

    def _take(self, key: str, rate: Rate, cost: int) -> Admission:
        check_cost(cost, rate)
        self._check_open()
        now = time.monotonic_ns()
        self._maybe_sweep(now)
        full_key = self.prefix + "rate:" + key
        got, new_tat = gcra(
            self._rates.get(full_key), now, interval=rate.interval(_NS), burst=rate.burst, cost=cost
        )
        if new_tat is not None:
            self._rates[full_key] = new_tat
        return Admission(got.allowed, got.retry_after / _NS, got.remaining)

    # --- quotas -------------------------------------------------------------------------

    async def taint(self, key: str, cause: dict[str, Any], *, ttl_s: float) -> dict[str, Any]:
        self._check_open()
        now = time.monotonic_ns()
        self._maybe_sweep(now)
        held = self._taints.get(key)
        if held is not None and held[1] > now:
            return held[0]
        self._taints[key] = (dict(cause), now + max(1, int(ttl_s * _NS)))
        return cause

    async def taint_of(self, key: str) -> dict[str, Any] | None:
        self._check_open()
        held = self._taints.get(key)
        if held is None or held[1] <= time.monotonic_ns():
            return None
        return held[0]

    async def record_read(self, key: str, entry: str, *, cap: int, ttl_s: float) -> bool:
        self._check_open()
        now = time.monotonic_ns()
        self._maybe_sweep(now)
        expires = now + max(1, int(ttl_s * _NS))
        held = self._reads.get(key)
        if held is not None and held[2] <= now:
            held = None
        entries, size = (held[0], held[1]) if held is not None else ([], 0)
        if entries is None or size + len(entry) > cap:
            self._reads[key] = (None, 0, expires)
            return False
        entries.append(entry)
        self._reads[key] = (entries, size + len(entry), expires)
        return True

    async def drop_reads(self, key: str, *, ttl_s: float) -> None:
        self._check_open()
        self._reads[key] = (None, 0, time.monotonic_ns() + max(1, int(ttl_s * _NS)))

    async def reads_of(self, key: str) -> list[str] | None:
        self._check_open()
        held = self._reads.get(key)
        if held is None or held[2] <= time.monotonic_ns() or held[0] is None:
            return None
        return list(held[0])

    async def consume_quota(
        self, key: str, limit: int, *, ttl_s: float, cost: int = 1
    ) -> Admission:
        got = await self.consume_quotas([(key, limit)], ttl_s=ttl_s, cost=cost)
        return Admission(got.allowed, got.retry_after, got.remaining)

    async def consume_quotas(
        self, items: Sequence[tuple[str, int]], *, ttl_s: float, cost: int = 1
    ) -> Admission:
        check_quota_args(items, ttl_s, cost)
        self._check_open()
        now = time.monotonic_ns()
        self._maybe_sweep(now)
        ttl_ns = max(1, int(ttl_s * _NS))
        keyed = [(self.prefix + "quota:" + key, limit) for key, limit in items]
        counts: list[tuple[int, int]] = []
        for index, (key, limit) in enumerate(keyed):
            used, expires = self._quotas.get(key, (0, 0))
            if expires <= now:
                used, expires = 0, 0
            if used + cost > limit:
                retry = (expires - now) / _NS if expires else ttl_s
                return Admission(False, retry, max(0, limit - used), limited_by=index)
            counts.append((used, expires))
        remaining = None
        for (key, limit), (used, expires) in zip(keyed, counts, strict=True):
            self._quotas[key] = (used + cost, max(expires, now + ttl_ns))
            left = limit - used - cost
            remaining = left if remaining is None else min(remaining, left)
        return Admission(True, 0.0, remaining or 0)

    # --- housekeeping -------------------------------------------------------------------

    def _maybe_sweep(self, now: int) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + self._sweep_ns
        self._rates = {k: tat for k, tat in self._rates.items() if tat > now}
        self._quotas = {k: v for k, v in self._quotas.items() if v[1] > now}
        self._taints = {k: v for k, v in self._taints.items() if v[1] > now}
        self._reads = {k: v for k, v in self._reads.items() if v[2] > now}
        wall = time.time()
        self._revocations.prune(wall)
        self._pauses.prune(wall)
