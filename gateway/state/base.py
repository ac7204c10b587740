"""The one interface of capgate's shared state, and the pieces both backends share.

The gateway's stages need three things from shared state, and this interface offers exactly
those, not a key-value store:

* **Revocations** (the token stage). ``revoke`` records a revoked token id (``jti``), agent
  or run; ``is_revoked`` answers synchronously from a local mirror, so the hot path never
  waits on the network. ``on_revoke`` listeners hear every revocation that reaches the
  mirror, local or remote, so the gateway can drop cached verdicts and cancel calls.
* **Rates** (the throttle stage). ``take`` is a GCRA limiter: atomic, and timed by one clock
  (the Redis server's, on Redis), so many gateways share one limit exactly.
* **Quotas** (the throttle stage). ``consume_quota(s)`` counts calls of a run against a limit
  that never refills; a refused call counts nothing.
* **Pauses** (the pause stage, operators). ``pause`` holds the new calls of an agent or a run
  until ``resume`` (or until the pause's ``until``); ``paused`` answers synchronously from a
  local mirror like ``is_revoked``; ``on_pause`` listeners hear each pause and resume, so
  held calls go on at once. A pause is operational, not durable: it lives as long as the
  memory store's process, or the Redis server's data, and is never written back.

Revocations carry who made them and why (``by``, ``reason``), listed with ``revocations()``;
pauses with ``pauses()``: both for the operators' console.

Every method that needs the backing service either answers within a short timeout or raises
``StateUnavailable``; the gateway fails closed on it.

* **Taint** (``gateway/taint.py``). ``taint`` marks a run that read untrusted content, once,
  for good; ``taint_of`` reads the mark. ``record_read`` keeps what a run read (normalised,
  bounded: past its cap the record is dropped and incomplete for good, ``drop_reads``),
  ``reads_of`` reads it back (``taint_arguments``).
* **Approvals** (the approve stage). ``approval_board`` is where held calls are listed and
  decided exactly once: this process with memory state, the whole fleet with Redis.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args, runtime_checkable
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from gateway.rates import Rate
    from gateway.state.approval_board import ApprovalBoard

__all__ = [
    "DEFAULT_PREFIX",
    "REVOCATION_KINDS",
    "PAUSE_KINDS",
    "Admission",
    "PauseEntry",
    "PauseKind",
    "PauseListener",
    "Pauses",
    "RevocationInfo",
    "RevocationKind",
    "RevocationListener",
    "Revocations",
    "StateStore",
    "gcra",
    "redact_url",
]

log = logging.getLogger("gateway.state")

DEFAULT_PREFIX = "capgate:"
# Where shared state lives: one Redis server (TLS: rediss), or any node of a Redis Cluster.
REDIS_URLS = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")
"""The default namespace of every key (and channel) a store writes."""

RevocationKind = Literal["jti", "agent", "run"]
REVOCATION_KINDS: tuple[RevocationKind, ...] = get_args(RevocationKind)
RevocationListener = Callable[[str, str], None]
# (kind, value, until or None for forever, who and why): everything the mirror keeps of it.
RevocationRecorder = Callable[[str, str, "float | None", "RevocationInfo | None"], None]
"""Called as ``listener(kind, value)``; must be quick and must not block."""

PauseKind = Literal["agent", "run"]
PAUSE_KINDS: tuple[PauseKind, ...] = get_args(PauseKind)
PauseListener = Callable[[str, str, bool], None]
"""Called as ``listener(kind, value, paused)``: ``paused`` is True when a pause is set (or
changed), False when it is lifted. Must be quick and must not block."""

MAX_BY = 200
"""Longest operator name kept beside a pause or revocation (characters)."""
MAX_REASON = 1000
"""Longest reason kept beside a pause or revocation (characters)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """A limiter's or quota's answer to one call.

    ``retry_after`` is 0 when allowed, else seconds until a retry can succeed (for a spent
    quota: until its counter is forgotten). ``remaining`` is how many more unit-cost calls
    would be admitted right now. ``limited_by`` is, for ``consume_quotas``, the index of the
    item that refused the call.
    """

    allowed: bool
    retry_after: float
    remaining: int
    limited_by: int | None = None


@runtime_checkable
class StateStore(Protocol):
    """Shared state as the gateway's stages need it. Implemented by the memory and redis
    backends; create one with ``gateway.state.open_store(url)``."""

    backend: str
    """``"memory"`` or ``"redis"``."""

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and load the revocation mirror. Raises ``StateUnavailable`` on failure."""
        ...

    async def close(self) -> None:
        """Stop background work and release connections. Idempotent."""
        ...

    async def health(self) -> dict[str, Any]:
        """``{"backend": str, "reachable": bool, "detail": str}`` (may hold more keys).

        Never raises; bounded by the store's timeout."""
        ...

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
        """Revoke a token id, an agent or a run, for every gateway sharing this store.

        ``until`` is the unix time after which the entry no longer matches and may be
        forgotten (for a ``jti``, the token's ``exp``); ``None`` means forever. Revoking
        again keeps the later ``until``. The local mirror is updated (and listeners told)
        before the shared write, so this gateway enforces the revocation even if that write
        fails with ``StateUnavailable``.

        ``by`` (who) and ``reason`` (why) are kept beside the entry for ``revocations()``;
        a repeat that does not extend the entry keeps the first ones.
        """
        ...

    def revocations(self) -> list[dict[str, Any]]:
        """Every live revocation of the mirror, for the console: ``{"kind", "value", "until"
        (None: forever), "since" (None: unknown), "by", "reason"}`` (``by``/``reason`` None
        when not given). Raises ``StateUnavailable`` like ``is_revoked``."""
        ...

    def is_revoked(self, jti: str, agent: str, run: str | None) -> RevocationKind | None:
        """Which of ``jti``, ``agent`` or ``run`` (checked in that order) is revoked, if any.

        Synchronous and O(1): reads the local mirror only. Raises ``StateUnavailable``
        while the mirror cannot be trusted to be current (fail closed).
        """
        ...

    def on_revoke(self, callback: RevocationListener) -> None:
        """Call ``callback(kind, value)`` whenever the mirror learns a revocation: revoked
        here, published by another gateway, or found in a resync after a disconnect. A
        repeat that changes nothing (e.g. our own message echoed back) is not announced."""
        ...

    def keep_revocations(self, journal: RevocationKeeper) -> int:
        """Load the journal's live revocations into the mirror, and append to it every
        revocation the mirror learns from now on; returns how many were loaded. Called
        before ``start``: the Redis store then writes back what Redis lacks."""
        ...

    # --- approvals ----------------------------------------------------------------------

    def approval_board(self) -> ApprovalBoard:
        """Where pending approvals are published and decided exactly once: this process
        (memory) or the fleet (Redis); see ``gateway/state/approval_board.py``."""
        ...

    # --- taint --------------------------------------------------------------------------

    async def taint(self, key: str, cause: dict[str, Any], *, ttl_s: float) -> dict[str, Any]:
        """Mark ``key`` (a run, or a token with no run) as having read untrusted content.
        The first cause is kept and returned; a mark is never cleared before ``ttl_s``."""
        ...

    async def taint_of(self, key: str) -> dict[str, Any] | None:
        """The cause ``key`` was tainted with, or None."""
        ...

    async def record_read(self, key: str, entry: str, *, cap: int, ttl_s: float) -> bool:
        """Append ``entry`` (what run ``key`` read, ``gateway/taint_reads.py``) to the run's
        record, unless the record would then hold more than ``cap`` characters: then it is
        dropped and the run's record is incomplete for good (``reads_of`` answers None);
        False. A record lives ``ttl_s`` from its last write."""
        ...

    async def drop_reads(self, key: str, *, ttl_s: float) -> None:
        """Make run ``key``'s record incomplete for good (something it read was not kept)."""
        ...

    async def reads_of(self, key: str) -> list[str] | None:
        """Run ``key``'s record, oldest first; None when it is incomplete or there is none."""
        ...

    # --- rates --------------------------------------------------------------------------

    async def take(self, key: str, rate: Rate, *, cost: int = 1) -> Admission:
        """Take ``cost`` units from the limiter ``key`` (GCRA). A refusal takes nothing."""
        ...

    def take_now(self, key: str, rate: Rate) -> Admission | None:
        """``take`` of one unit when it can be answered without waiting (a bucket in this
        process, or a lease of tokens it holds); None when the caller must ``await take``
        instead (nothing was taken then). Raises ``StateUnavailable`` as ``take`` does."""
        ...

    # --- quotas -------------------------------------------------------------------------

    async def consume_quota(
        self, key: str, limit: int, *, ttl_s: float, cost: int = 1
    ) -> Admission:
        """Count ``cost`` calls against a counter that never refills, unless that would pass
        ``limit``; then count nothing and refuse. The counter is kept at least ``ttl_s``
        after its last use."""
        ...

    async def consume_quotas(
        self, items: Sequence[tuple[str, int]], *, ttl_s: float, cost: int = 1
    ) -> Admission:
        """``consume_quota`` over several ``(key, limit)`` counters at once, all or nothing:
        if any would pass its limit none is counted, and ``limited_by`` is its index. On
        Redis Cluster the keys must share a hash tag."""
        ...

    # --- pauses -------------------------------------------------------------------------

    async def pause(
        self, kind: PauseKind, value: str, *, until: float | None, by: str, reason: str
    ) -> None:
        """Hold the new calls of an agent or a run, at every gateway sharing this store, until
        ``resume`` or until ``until`` (unix time; ``None``: until resumed). Pausing again
        replaces the entry (its ``until``, ``by``, ``reason`` and ``since``). The shared write
        comes first: on ``StateUnavailable`` nothing was paused anywhere.

        Raises ``ValueError`` for a bad kind, an empty value or ``by``, an ``until`` that is
        not a unix time in the future, or a ``by``/``reason`` past its length limit."""
        ...

    async def resume(self, kind: PauseKind, value: str, *, by: str) -> bool:
        """Lift a pause everywhere; False when it was not paused (or its ``until`` had passed).
        Listeners are told, so held calls go on at once. Never undone by a resync."""
        ...

    def paused(self, agent: str, run: str | None) -> PauseEntry | None:
        """The pause holding calls of ``agent`` or ``run`` (checked in that order), if any.

        Synchronous and O(1): reads the local mirror only; an entry whose ``until`` has passed
        no longer matches. Raises ``StateUnavailable`` while the mirror cannot be trusted to
        be current (fail closed)."""
        ...

    def pauses(self) -> list[dict[str, Any]]:
        """Every live pause, for the console: ``{"kind", "value", "since", "until", "by",
        "reason"}``. Raises ``StateUnavailable`` like ``paused``."""
        ...

    def on_pause(self, callback: PauseListener) -> None:
        """Call ``callback(kind, value, paused)`` whenever the mirror learns a pause (True) or
        a resume (False): made here, published by another gateway, or found by a resync after
        a disconnect. An entry whose ``until`` passes is not announced (it just stops
        matching); a repeat that changes nothing is not announced."""
        ...

    # --- approvals (reserved) -----------------------------------------------------------
    #
    # Held calls waiting for a person's decision will live here, shaped like the rest:
    # create a pending approval with a deadline, decide it (from any gateway), and wait for
    # the decision with a timeout. On Redis the decision will be published like revocations
    # so the waiting gateway hears it at once. Not implemented yet.


class RevocationKeeper(Protocol):
    """Where a store's revocations are kept beyond its process (``journal.py``)."""

    def restore(self, mirror: Revocations, now: float) -> int:
        """Load what is kept into ``mirror``, keep what it learns from now on; returns how
        many revocations were loaded."""
        ...


class Revocations:
    """The local revocation mirror: O(1) lookups, expiring entries, change listeners.

    Entries map a value to its ``until`` (``math.inf`` for forever). An entry matches while
    the current time is before its ``until``; expired entries are dropped by ``prune`` (called
    from ``apply`` and the stores' housekeeping), so memory stays bounded by the live set.
    Not thread-safe: used from one event loop.
    """

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, float]] = {kind: {} for kind in REVOCATION_KINDS}
        # Who revoked and why, beside the entry (console only; never read on the hot path).
        self._info: dict[str, dict[str, RevocationInfo]] = {k: {} for k in REVOCATION_KINDS}
        self._expiry: list[tuple[float, str, str]] = []  # heap of (until, kind, value)
        self._listeners: list[RevocationListener] = []
        # Told every change with all of it (the revocation journal keeps it on disk).
        self._recorders: list[RevocationRecorder] = []

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())

    def add_listener(self, callback: RevocationListener) -> None:
        self._listeners.append(callback)

    def add_recorder(self, callback: RevocationRecorder) -> None:
        self._recorders.append(callback)

    def apply(
        self,
        kind: str,
        value: str,
        until: float | None,
        *,
        now: float,
        info: RevocationInfo | None = None,
    ) -> bool:
        """Record a revocation; tell the listeners if it is new or now lasts longer.

        Returns whether anything changed (a repeat, e.g. our own message echoed back by
        pub/sub, changes nothing and is not announced twice). ``info`` (who, why, when) is
        kept when the entry changes, or when the entry has none yet.
        """
        entries = self._entries.get(kind)
        if entries is None:
            raise ValueError(f"unknown revocation kind {kind!r}: use jti, agent or run")
        expires = math.inf if until is None else float(until)
        if math.isnan(expires):
            raise ValueError("revocation 'until' must be a unix time or None, not NaN")
        if expires <= now:
            return False  # already over: nothing to enforce
        current = entries.get(value)
        if current is not None and current >= expires:
            if info is not None and value not in self._info[kind]:
                self._info[kind][value] = info
            return False
        entries[value] = expires
        if info is not None:
            self._info[kind][value] = info
        if expires != math.inf:
            heapq.heappush(self._expiry, (expires, kind, value))
        self.prune(now)
        kept = self._info[kind].get(value)
        for recorder in tuple(self._recorders):
            try:
                recorder(kind, value, None if expires == math.inf else expires, kept)
            except Exception:
                log.exception("revocation recorder %r failed for a %s revocation", recorder, kind)
        for listener in tuple(self._listeners):
            try:
                listener(kind, value)
            except Exception:
                log.exception("revocation listener %r failed for a %s revocation", listener, kind)
        return True

    def match(self, jti: str, agent: str, run: str | None, *, now: float) -> RevocationKind | None:
        until = self._entries["jti"].get(jti)
        if until is not None and until > now:
            return "jti"
        until = self._entries["agent"].get(agent)
        if until is not None and until > now:
            return "agent"
        if run is not None:
            until = self._entries["run"].get(run)
            if until is not None and until > now:
                return "run"
        return None

    def entries(self, *, now: float) -> list[tuple[str, str, float]]:
        """Every live entry as ``(kind, value, until)``."""
        return [
            (kind, value, until)
            for kind, entries in self._entries.items()
            for value, until in entries.items()
            if until > now
        ]

    def info(self, kind: str, value: str) -> RevocationInfo | None:
        return self._info[kind].get(value)

    def listing(self, *, now: float) -> list[dict[str, Any]]:
        """Every live entry with who revoked it and why (``revocations()``)."""
        out = []
        for kind, value, until in self.entries(now=now):
            info = self._info[kind].get(value)
            out.append(
                {
                    "kind": kind,
                    "value": value,
                    "until": None if until == math.inf else until,
                    "since": info.since if info is not None else None,
                    "by": info.by if info is not None else None,
                    "reason": info.reason if info is not None else None,
                }
            )
        return out

    def prune(self, now: float) -> int:
        """Forget entries whose ``until`` has passed; returns how many were dropped."""
        dropped = 0
        heap = self._expiry
        while heap and heap[0][0] <= now:
            until, kind, value = heapq.heappop(heap)
            entries = self._entries[kind]
            if entries.get(value) == until:  # not extended since this heap entry was pushed
                del entries[value]
                self._info[kind].pop(value, None)
                dropped += 1
        return dropped


@dataclass(frozen=True, slots=True)
class RevocationInfo:
    """Who revoked an entry, why, and when (unix time); kept beside it for the console."""

    since: float
    by: str | None
    reason: str | None

    def as_json(self) -> dict[str, Any]:
        return {"since": self.since, "by": self.by, "reason": self.reason}

    @classmethod
    def from_json(cls, body: Any) -> RevocationInfo | None:
        """From a message or a stored hash field; None when absent or unreadable."""
        if not isinstance(body, dict):
            return None
        since, by, reason = body.get("since"), body.get("by"), body.get("reason")
        if not (isinstance(since, int | float) and not isinstance(since, bool)):
            return None
        if not (by is None or isinstance(by, str)) or not (
            reason is None or isinstance(reason, str)
        ):
            return None
        return cls(float(since), by, reason)


@dataclass(frozen=True, slots=True)
class PauseEntry:
    """One pause: calls of the agent or run named by ``kind``/``value`` are held from
    ``since`` until it is resumed or ``until`` (unix time; None: until resumed) passes."""

    kind: PauseKind
    value: str
    since: float
    until: float | None
    by: str
    reason: str

    def live(self, now: float) -> bool:
        return self.until is None or self.until > now

    def public(self) -> dict[str, Any]:
        """For the console (and the shared store's JSON)."""
        return {
            "kind": self.kind,
            "value": self.value,
            "since": self.since,
            "until": self.until,
            "by": self.by,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, body: Any) -> PauseEntry:
        """From ``public()``'s shape; ``ValueError`` when it is not one."""
        if not isinstance(body, dict):
            raise ValueError("a pause entry must be a JSON object")
        kind, value, since, until = (body.get(k) for k in ("kind", "value", "since", "until"))
        by, reason = body.get("by"), body.get("reason")
        if kind not in PAUSE_KINDS or not isinstance(value, str) or not value:
            raise ValueError("a pause entry needs a kind (agent or run) and a value")
        if not isinstance(since, int | float) or not _is_time(since):
            raise ValueError("a pause entry's since must be a unix time")
        if not (until is None or (isinstance(until, int | float) and _is_time(until))):
            raise ValueError("a pause entry's until must be a unix time or null")
        if not isinstance(by, str) or not isinstance(reason, str):
            raise ValueError("a pause entry's by and reason must be strings")
        return cls(kind, value, float(since), None if until is None else float(until), by, reason)


def _is_time(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class Pauses:
    """The local pause mirror: O(1) lookups, change listeners. Entries whose ``until`` has
    passed stop matching at once and are dropped by ``prune``. Not thread-safe: used from
    one event loop."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, PauseEntry]] = {kind: {} for kind in PAUSE_KINDS}
        self._listeners: list[PauseListener] = []

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())

    def add_listener(self, callback: PauseListener) -> None:
        self._listeners.append(callback)

    def _announce(self, kind: str, value: str, paused: bool) -> None:
        for listener in tuple(self._listeners):
            try:
                listener(kind, value, paused)
            except Exception:
                log.exception("pause listener %r failed for a %s pause", listener, kind)

    def set(self, entry: PauseEntry, *, now: float) -> bool:
        """Record a pause (replacing one of the same kind and value); tell the listeners if
        that changed anything. An entry already over is not recorded."""
        entries = self._entries[entry.kind]
        if not entry.live(now):
            return False
        if entries.get(entry.value) == entry:
            return False  # a repeat (our own message echoed back)
        entries[entry.value] = entry
        self._announce(entry.kind, entry.value, True)
        return True

    def clear(self, kind: str, value: str) -> PauseEntry | None:
        """Lift a pause; the entry lifted (None if there was none). Listeners are told."""
        entry = self._entries[kind].pop(value, None)
        if entry is not None:
            self._announce(kind, value, False)
        return entry

    def replace(self, entries: list[PauseEntry], *, now: float) -> None:
        """Make the mirror exactly ``entries`` (a resync): pauses lifted while we were not
        listening are announced as resumed, new or changed ones as paused."""
        fresh: dict[str, dict[str, PauseEntry]] = {kind: {} for kind in PAUSE_KINDS}
        for entry in entries:
            if entry.live(now):
                fresh[entry.kind][entry.value] = entry
        old, self._entries = self._entries, fresh
        for kind in PAUSE_KINDS:
            for value in old[kind].keys() - fresh[kind].keys():
                self._announce(kind, value, False)
            for value, entry in fresh[kind].items():
                if old[kind].get(value) != entry:
                    self._announce(kind, value, True)

    def match(self, agent: str, run: str | None, *, now: float) -> PauseEntry | None:
        entry = self._entries["agent"].get(agent)
        if entry is not None and (entry.until is None or entry.until > now):
            return entry
        if run is not None:
            entry = self._entries["run"].get(run)
            if entry is not None and (entry.until is None or entry.until > now):
                return entry
        return None

    def entries(self, *, now: float) -> list[PauseEntry]:
        return [e for kind in PAUSE_KINDS for e in self._entries[kind].values() if e.live(now)]

    def prune(self, now: float) -> int:
        """Forget entries whose ``until`` has passed; returns how many were dropped."""
        dropped = 0
        for entries in self._entries.values():
            for value in [v for v, e in entries.items() if not e.live(now)]:
                del entries[value]
                dropped += 1
        return dropped


def gcra(
    tat: int | None, now: int, *, interval: int, burst: int, cost: int
) -> tuple[Admission, int | None]:
    """One step of the generic cell rate algorithm, in integer ticks (exact arithmetic).

    ``tat`` is the stored theoretical arrival time (None when fresh). Returns the admission
    (``retry_after`` still in ticks) and the new ``tat`` to store (None when refused). The
    Redis backend runs the same arithmetic in Lua; keep the two in step.
    """
    base = now if tat is None or tat < now else tat
    new_tat = base + cost * interval
    allow_at = new_tat - burst * interval
    if allow_at > now:
        available = max(0, (now - (base - burst * interval)) // interval)
        return Admission(False, allow_at - now, available), None
    return Admission(True, 0, (now - allow_at) // interval), new_tat


def check_cost(cost: int, rate: Rate) -> None:
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ValueError(f"cost must be a whole number of at least 1, not {cost!r}")
    if cost > rate.burst:
        raise ValueError(f"cost {cost} can never be admitted by a rate with burst {rate.burst}")


def check_quota_args(items: Sequence[tuple[str, int]], ttl_s: float, cost: int) -> None:
    if not items:
        raise ValueError("consume_quotas needs at least one (key, limit) item")
    for key, limit in items:
        if not isinstance(key, str) or not key:
            raise ValueError(f"quota key must be a non-empty string, not {key!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"quota limit must be a whole number >= 0, not {limit!r}")
    if len({key for key, _ in items}) != len(items):
        raise ValueError("consume_quotas was given the same key twice")
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ValueError(f"cost must be a whole number of at least 1, not {cost!r}")
    if not (isinstance(ttl_s, int | float) and math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"ttl_s must be a positive number of seconds, not {ttl_s!r}")


def check_revocation(kind: str, value: str, until: float | None) -> None:
    if kind not in REVOCATION_KINDS:
        raise ValueError(f"unknown revocation kind {kind!r}: use jti, agent or run")
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {kind} revocation needs a non-empty string value")
    if until is not None and (
        isinstance(until, bool) or not isinstance(until, int | float) or math.isnan(until)
    ):
        raise ValueError(f"revocation 'until' must be a unix time or None, not {until!r}")


def check_operator(by: str | None, reason: str | None) -> None:
    """``by`` and ``reason`` beside a pause or revocation: strings within their limits (None
    means not given)."""
    if by is not None and (not isinstance(by, str) or not by or len(by) > MAX_BY):
        raise ValueError(f"'by' must be a non-empty string of at most {MAX_BY} characters")
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON):
        raise ValueError(f"'reason' must be a string of at most {MAX_REASON} characters")


def _check_pause_target(kind: str, value: str) -> None:
    if kind not in PAUSE_KINDS:
        raise ValueError(f"unknown pause kind {kind!r}: use agent or run")
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {kind} pause needs a non-empty string value")


def check_pause(
    kind: str, value: str, until: float | None, by: str, reason: str, *, now: float
) -> None:
    _check_pause_target(kind, value)
    if until is not None and not _is_time(until):
        raise ValueError(f"pause 'until' must be a unix time or None, not {until!r}")
    if until is not None and until <= now:
        raise ValueError("pause 'until' is already past")
    if by is None or reason is None:
        raise ValueError("a pause needs 'by' (who) and 'reason' (why; may be empty)")
    check_operator(by, reason)


def check_resume(kind: str, value: str, by: str) -> None:
    _check_pause_target(kind, value)
    if by is None:
        raise ValueError("a resume needs 'by' (who)")
    check_operator(by, None)


def redact_url(url: str) -> str:
    """``url`` with any credential replaced by ``***`` (for messages and logs)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        parts, password = None, None
    if parts is not None and password is not None:
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        return parts._replace(netloc=f"{user}:***@{host}").geturl()
    if "@" in url:  # not parseable as user:password@host, but may still hold a secret
        scheme, sep, rest = url.rpartition("://")
        return (
            f"{scheme}{sep}***@{rest.rpartition('@')[2]}"
            if sep
            else "***@" + url.rpartition("@")[2]
        )
    return url
