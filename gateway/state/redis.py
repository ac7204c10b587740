"""The shared state store on Redis: many gateways, one set of limits, revocations and pauses.

Layout (``P`` is the prefix, ``capgate:`` by default)::

    P revoked:jti | P revoked:agent | P revoked:run     sorted sets: member = value,
                                                         score = until (unix s, +inf = forever)
    P revoked:<kind>:info                                hash beside each: field = value,
                                                         JSON {"since", "by", "reason"}
    P revocations                                        pub/sub channel, one JSON message
                                                         {"kind", "value", "until", "since",
                                                         "by", "reason"} per revoke
    P paused:agent | P paused:run                        hashes: field = value, JSON {"kind",
                                                         "value", "since", "until" (unix s or
                                                         null), "by", "reason"}
    P pauses                                             pub/sub channel: {"op": "pause", ...
                                                         the entry} or {"op": "resume", "kind",
                                                         "value", "by"}
    P rate:<key>                                         GCRA theoretical arrival time (us)
    P quota:<key>                                        quota counter
    P taint:<run> | P taint:jti:<id>                     the first untrusted read (JSON), SET NX
    P reads:<key>, P readsize:<key>, P readsover:<key>   what a tainted run read (list of
                                                         entries), its size, and the flag set
                                                         when it is incomplete (READ_LUA)

Revocations. ``revoke`` runs one script that records the entry (``ZADD GT``: the later
``until`` wins), drops expired entries and, if the set changed, publishes the message, so
the write and the announcement cannot part. Every store keeps a local mirror for
``is_revoked``. A background task (with its own two-connection pool, so a busy hot path
cannot starve it) owns one pub/sub connection: it subscribes, waits for the subscription to
be confirmed, *then* loads the sorted sets (so nothing published in between is missed),
marks the mirror trusted, and applies messages as they come. It PINGs on that connection
every ``heartbeat_s``; if the connection fails or no answer comes within
``heartbeat_timeout_s`` the mirror is marked untrusted (``is_revoked`` raises
``StateUnavailable``) and the task reconnects with jittered exponential backoff, trusting
the mirror again only after a full resync. A resync also writes back any entry this gateway
holds that Redis lacks (a revoke whose shared write failed, or a Redis that restarted
empty); the script announces each only once, however many gateways write it back.

Pauses. ``pause`` and ``resume`` each run one script that writes the hash and publishes on
the sibling channel ``P pauses`` (a channel of its own, so a gateway of an older version,
which reads every message on ``P revocations`` as a revocation, never takes a pause for a
stop). The shared write comes first and the mirror is updated once it succeeded; a pause that
could not be written is not in force anywhere. The pauses are loaded by the same
subscribe-then-snapshot resync as the revocations (both channels confirmed before the
snapshot), and a resync *replaces* the pause mirror with what Redis holds: a resume missed
while disconnected is applied (and announced, so held calls go on). Pauses are never written
back: a resume can never be undone by a gateway that still remembered the pause, and a Redis
that restarts empty has no pauses (a pause is operational, not durable; revocations are
written back). A pause whose ``until`` has passed no longer matches; its field is dropped by
the next pause of that kind. Local pause and resume writes and the snapshot of a resync take
one lock, so a resync never overwrites a newer local write with an older snapshot.

Rates and quotas. Each is one Lua script (``EVALSHA``, reloaded automatically after a Redis
restart), hence atomic across gateways. The limiter reads the clock with ``TIME`` inside the
script, so gateways with skewed clocks agree.

Failures. Every call is bounded: socket and connect timeouts (0.25 s by default), no
client-side retries, and an overall ``asyncio.timeout``. Any failure becomes
``StateUnavailable`` whose detail names the server without its password; the cause is
chained. The connection pool reconnects on its own once Redis is back. A call that timed out
may still have run on the server (e.g. after ``CLIENT PAUSE``), so an outage can over-count a
rate or quota by the calls it refused, never under-count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import StateUnavailable
from gateway.state.approval_board import ApprovalBoard, RedisApprovalBoard
from gateway.state.base import (
    DEFAULT_PREFIX,
    PAUSE_KINDS,
    REVOCATION_KINDS,
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
    redact_url,
)
from gateway.state.leases import LEASE_LUA, Leases, lease_size

if TYPE_CHECKING:
    from gateway.rates import Rate

__all__ = ["RedisStore", "redact_url"]

log = logging.getLogger("gateway.state.redis")

T = TypeVar("T")
_US = 1_000_000

# GCRA limiter. KEYS[1]: limiter key. ARGV: interval (us), burst, cost.
# Returns {allowed (0/1), retry_after (us), remaining}. Mirrors base.gcra().
RATE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]))
if tat == nil or tat < now then tat = now end
local new_tat = tat + cost * interval
local allow_at = new_tat - burst * interval
if allow_at > now then
  local available = math.floor((now - (tat - burst * interval)) / interval)
  if available < 0 then available = 0 end
  return {0, allow_at - now, available}
end
local ttl_ms = math.ceil((new_tat - now) / 1000)
redis.call('SET', KEYS[1], string.format('%d', new_tat), 'PX', string.format('%d', ttl_ms))
return {1, 0, math.floor((now - allow_at) / interval)}
"""

# Quota counters, all or nothing. KEYS: counters. ARGV: cost, ttl (ms), then one limit per key.
# Returns {allowed (0/1), refusing key (1-based, 0 if allowed), its PTTL (ms), remaining}.
QUOTA_LUA = """
local cost = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local remaining = -1
for i, key in ipairs(KEYS) do
  local used = tonumber(redis.call('GET', key)) or 0
  local limit = tonumber(ARGV[i + 2])
  if used + cost > limit then
    local left = limit - used
    if left < 0 then left = 0 end
    return {0, i, redis.call('PTTL', key), left}
  end
  local left = limit - used - cost
  if remaining < 0 or left < remaining then remaining = left end
end
for _, key in ipairs(KEYS) do
  redis.call('INCRBY', key, cost)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ARGV[2]) end
end
return {1, 0, 0, remaining}
"""

# What a tainted run read (``record_read``), bounded: past the cap the list is dropped and
# the run's record is incomplete for good (the flag outlives it). KEYS: the list, its size
# (characters), the incomplete flag. ARGV: entry ('' with cap -1: just mark incomplete), cap,
# ttl (ms). Returns 1 if kept.
READ_LUA = """
local ttl = ARGV[3]
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('PEXPIRE', KEYS[3], ttl)
  return 0
end
local size = redis.call('INCRBY', KEYS[2], string.len(ARGV[1]))
if size > tonumber(ARGV[2]) then
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('SET', KEYS[3], '1', 'PX', ttl)
  return 0
end
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
"""

# Record a revocation and, if that changed the set, announce it (so a repeat, or the same
# write-back from many gateways after a Redis restart, is published once). Who and why are
# kept in the info hash beside the set when the entry changed. Expired entries are dropped
# from both (the info hash by at most 1000 a call, so one call stays short).
# KEYS[1]: the kind's sorted set, KEYS[2]: its info hash. ARGV: value, until (score; '+inf' =
# forever), channel, message, info JSON ('' = none). Returns 1 if announced.
REVOKE_LUA = """
local t = redis.call('TIME')
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. t[1], 'LIMIT', 0, 1000)
if #gone > 0 then redis.call('HDEL', KEYS[2], unpack(gone)) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. t[1])
if redis.call('ZADD', KEYS[1], 'GT', 'CH', ARGV[2], ARGV[1]) == 1 then
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[5]) end
  redis.call('PUBLISH', ARGV[3], ARGV[4])
  return 1
end
return 0
"""

# Set a pause (replacing one of the same value), drop the kind's expired pauses, announce.
# KEYS[1]: the kind's hash. ARGV: value, entry JSON, channel, message. Returns 1.
PAUSE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local ok, e = pcall(cjson.decode, all[i + 1])
  if not ok or type(e) ~= 'table' or (type(e['until']) == 'number' and e['until'] <= now) then
    redis.call('HDEL', KEYS[1], all[i])
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
"""

# Lift a pause and announce it. KEYS[1]: the kind's hash. ARGV: value, channel, message.
# Returns 1 if a pause still in force was lifted, 0 if there was none (or it had expired).
RESUME_LUA = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
local ok, e = pcall(cjson.decode, raw)
local t = redis.call('TIME')
if ok and type(e) == 'table' and type(e['until']) == 'number'
    and e['until'] <= tonumber(t[1]) + tonumber(t[2]) / 1000000 then
  return 0
end
return 1
"""


def _describe_target(url: str) -> str:
    """``scheme://host:port/db``: what messages call the server (never any credential)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "localhost"
        port = parts.port or 6379
    except ValueError:
        return "redis (unparseable URL)"
    db = parts.path.strip("/") or "0"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}/{db}"


def _failure(exc: BaseException) -> str:
    """A short description of a client failure that copies nothing from the server."""
    if isinstance(exc, TimeoutError | RedisTimeoutError):
        return "timed out"
    if isinstance(exc, AuthenticationError):
        return "authentication failed"
    if isinstance(exc, BusyLoadingError):
        return "server is still loading its data"
    if isinstance(exc, RedisConnectionError):
        return "connection failed"
    if isinstance(exc, ResponseError):
        return f"server replied with an error ({type(exc).__name__})"
    return type(exc).__name__


def _score(until: float | None) -> str:
    return "+inf" if until is None or until == math.inf else repr(float(until))


class _BadMessage(Exception):
    """A revocation or pause message we cannot read: the mirror must be rebuilt from Redis."""


CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def cluster_prefix(prefix: str) -> str:
    """``prefix`` with a hash tag (``capgate:`` -> ``{capgate}:``) unless it has one."""
    if "{" in prefix and "}" in prefix.partition("{")[2]:
        return prefix
    stem = prefix.rstrip(":") or "capgate"
    return "{" + stem + "}:"


class RedisStore:
    """``StateStore`` on Redis (``redis://`` or ``rediss://`` URL).

    Options: ``prefix`` namespaces keys and the channel. ``socket_timeout`` and
    ``connect_timeout`` bound each socket read and connect; ``op_timeout`` bounds a whole
    call (default: their sum). ``max_connections`` caps the pool (callers beyond it wait,
    within ``op_timeout``). ``start_timeout_s`` is how long ``start`` waits for the first
    sync; ``sync_timeout_s`` bounds one subscribe + snapshot load. ``heartbeat_s`` and
    ``heartbeat_timeout_s`` detect a silent pub/sub connection; ``reconnect_min_s`` and
    ``reconnect_max_s`` bound the reconnect backoff.
    """

    backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        socket_timeout: float = 0.25,
        connect_timeout: float = 0.25,
        op_timeout: float | None = None,
        max_connections: int = 32,
        start_timeout_s: float = 5.0,
        sync_timeout_s: float = 5.0,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 3.0,
        reconnect_min_s: float = 0.1,
        reconnect_max_s: float = 3.0,
        client_name: str | None = "capgate",
    ) -> None:
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in ("redis", "rediss", *CLUSTER_SCHEMES):
            raise ValueError(
                f"not a redis URL: {redact_url(url)!r} (use redis://, rediss://, "
                "redis+cluster:// or rediss+cluster://)"
            )
        self.cluster = scheme in CLUSTER_SCHEMES
        if self.cluster:
            # Redis Cluster runs a script only on keys of one slot: every key of this store
            # (and its channels) carry one hash tag, so they all live in one slot.
            url = scheme.removesuffix("+cluster") + url[len(scheme) :]
            prefix = cluster_prefix(prefix)
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections!r}")
        for name, value in (
            ("socket_timeout", socket_timeout),
            ("connect_timeout", connect_timeout),
            ("start_timeout_s", start_timeout_s),
            ("sync_timeout_s", sync_timeout_s),
            ("heartbeat_s", heartbeat_s),
            ("heartbeat_timeout_s", heartbeat_timeout_s),
            ("reconnect_min_s", reconnect_min_s),
            ("reconnect_max_s", reconnect_max_s),
            ("op_timeout", 1.0 if op_timeout is None else op_timeout),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        self.prefix = prefix
        self.target = _describe_target(url) + (" (cluster)" if self.cluster else "")
        self._op_timeout = (
            op_timeout if op_timeout is not None else socket_timeout + connect_timeout
        )
        self._start_timeout = start_timeout_s
        self._sync_timeout = sync_timeout_s
        self._heartbeat = heartbeat_s
        self._heartbeat_timeout = max(heartbeat_timeout_s, heartbeat_s)
        self._reconnect_min = reconnect_min_s
        self._reconnect_max = max(reconnect_max_s, reconnect_min_s)
        common: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
            "decode_responses": True,
            "client_name": client_name,
            # RESP2: the long-proven pub/sub path (redis-py 8 misreads a RESP3 PONG
            # when responses are decoded).
            "protocol": 2,
        }
        self._call_slots = asyncio.Semaphore(max_connections) if self.cluster else None
        if self.cluster:
            self._client, self._sub_client = self._cluster_clients(url, max_connections, common)
        else:
            self._client, self._sub_client = self._clients(url, max_connections, common)
        self._finish_init(prefix)

    def _cluster_clients(
        self, url: str, max_connections: int, common: dict[str, Any]
    ) -> tuple[Any, Any]:
        """Two cluster clients (calls; the subscriber and its snapshots): no hidden retries,
        like the single-server pools; the subscriber's has two connections per node."""
        from redis.asyncio.cluster import RedisCluster

        try:
            client = RedisCluster.from_url(
                url,
                # Room above the calls' own limit (``_call_slots``) for a fan-out to every
                # node (loading a script after a node restarted).
                max_connections=max_connections + 8,
                retry=Retry(NoBackoff(), 0),
                **common,
            )
            sub_client = RedisCluster.from_url(
                url,
                max_connections=2,
                retry=Retry(NoBackoff(), 0, supported_errors=()),
                **common,
            )
        except (ValueError, RedisError) as exc:
            raise ValueError(f"invalid redis cluster URL {redact_url(url)!r}: {exc}") from None
        return client, sub_client

    def _clients(self, url: str, max_connections: int, common: dict[str, Any]) -> tuple[Any, Any]:
        try:
            # Calls: no hidden retries (we answer within our timeout); a failed connection
            # is dropped and the pool opens a fresh one for the next call.
            pool = BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=self._op_timeout,
                retry=Retry(NoBackoff(), 0),
                **common,
            )
            # The subscriber: its own small pool (pub/sub + snapshot), so a busy hot path
            # cannot starve a resync. No retry handler at all: redis-py would otherwise
            # reconnect and resubscribe behind our back, and we rebuild from scratch instead.
            sub_pool = BlockingConnectionPool.from_url(
                url,
                max_connections=2,
                timeout=self._sync_timeout,
                retry=Retry(NoBackoff(), 0, supported_errors=()),
                **common,
            )
        except ValueError as exc:
            # redis-py's messages name the bad part, never the password; the URL is redacted.
            raise ValueError(f"invalid redis URL {redact_url(url)!r}: {exc}") from None
        return Redis.from_pool(pool), Redis.from_pool(sub_pool)

    def _finish_init(self, prefix: str) -> None:
        self.prefix = prefix
        self._rate_script = self._client.register_script(RATE_LUA)
        self._lease_script = self._client.register_script(LEASE_LUA)
        self._leases = Leases(self._lease)
        self._quota_script = self._client.register_script(QUOTA_LUA)
        self._read_script = self._client.register_script(READ_LUA)
        self._revoke_script = self._client.register_script(REVOKE_LUA)
        self._board = RedisApprovalBoard(self._client, prefix, self._call)
        self._pause_script = self._client.register_script(PAUSE_LUA)
        self._resume_script = self._client.register_script(RESUME_LUA)
        self._channel = prefix + "revocations"
        self._pause_channel = prefix + "pauses"
        self._revocations = Revocations()
        self._persistence_seen: tuple[float, dict[str, Any]] | None = None
        self._pauses = Pauses()
        # Held by pause/resume (shared write + mirror update) and by a resync's snapshot
        # (read + mirror replace): neither interleaves with the other.
        self._pause_lock = asyncio.Lock()
        self._synced = False
        self._stale_reason = "not started"
        self._stale_since = time.monotonic()
        self._first_sync: asyncio.Event | None = None
        self._start_error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._running = False
        self._closed = False

    def __repr__(self) -> str:
        return f"RedisStore({self.target!r}, prefix={self.prefix!r})"

    # --- keys ---------------------------------------------------------------------------

    def _revoked_key(self, kind: str) -> str:
        return f"{self.prefix}revoked:{kind}"

    def _info_key(self, kind: str) -> str:
        return f"{self.prefix}revoked:{kind}:info"

    def _paused_key(self, kind: str) -> str:
        return f"{self.prefix}paused:{kind}"

    def _revoke_args(
        self, kind: str, value: str, until: float | None, info: RevocationInfo | None
    ) -> list[str]:
        body: dict[str, Any] = {"kind": kind, "value": value, "until": until}
        if info is not None:
            body.update(info.as_json())
        info_json = json.dumps(info.as_json()) if info is not None else ""
        return [value, _score(until), self._channel, json.dumps(body), info_json]

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the subscriber and wait for the first full sync of the revocation mirror."""
        if self._closed:
            raise RuntimeError("a closed RedisStore cannot be started again; open a new one")
        if self._task is not None:
            return
        self._running = True
        if self.cluster:
            await self._load_scripts()
        self._first_sync = asyncio.Event()
        self._task = asyncio.create_task(self._subscriber(), name="capgate-state-subscriber")
        try:
            async with asyncio.timeout(self._start_timeout):
                await self._first_sync.wait()
        except TimeoutError as exc:
            cause: BaseException = exc
        else:
            if self._start_error is None:
                return
            cause = self._start_error  # a failure that waiting will not cure
        reason = self._stale_reason
        await self.close()
        raise StateUnavailable(
            f"could not load revocations from redis at {self.target} ({reason})"
        ) from cause

    async def _load_scripts(self) -> None:
        """Cluster: every script loaded on every primary before the first call, so a burst
        of calls never races to load one (each load fans out to all the nodes)."""
        scripts = (
            RATE_LUA,
            LEASE_LUA,
            QUOTA_LUA,
            READ_LUA,
            REVOKE_LUA,
            PAUSE_LUA,
            RESUME_LUA,
            *self._board.scripts,
        )
        try:
            async with asyncio.timeout(self._start_timeout):
                for script in scripts:
                    await self._client.script_load(script)
        except (TimeoutError, RedisError, OSError) as exc:
            self._running = False
            await self.close()
            raise StateUnavailable(
                f"could not load the state scripts into the redis cluster at {self.target} "
                f"({_failure(exc)})"
            ) from exc

    async def close(self) -> None:
        self._running = False
        self._closed = True
        self._mark_stale("store closed")
        task, self._task = self._task, None
        if task is not None:
            # The subscriber also stops by itself once it sees _running is False; cancelling
            # again covers a cancellation swallowed inside the client library.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
            if not task.cancelled() and task.exception() is not None:
                log.error("the revocation subscriber failed", exc_info=task.exception())
        await self._sub_client.aclose()
        await self._client.aclose()

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "backend": self.backend,
            "reachable": False,
            "mirror_synced": self._synced,
            "revocations": len(self._revocations),
            "pauses": len(self._pauses),
        }
        if self._synced:
            mirror = f"revocation mirror in sync ({len(self._revocations)} entries)"
        else:
            age = time.monotonic() - self._stale_since
            mirror = f"revocation mirror NOT in sync for {age:.1f} s ({self._stale_reason})"
        try:
            started = time.perf_counter()
            await self._call("PING", self._client.ping)
        except StateUnavailable as exc:
            result["detail"] = f"{exc.detail}; {mirror}"
            return result
        latency_ms = (time.perf_counter() - started) * 1000
        result["reachable"] = True
        result["detail"] = f"redis at {self.target} answered PING in {latency_ms:.1f} ms; {mirror}"
        persistence = await self._persistence()
        result["persistence"] = persistence
        if persistence.get("warning"):
            result["warnings"] = [persistence["warning"]]
        return result

    async def _persistence(self) -> dict[str, Any]:
        """Whether Redis keeps anything on disk (AOF, RDB snapshots), read at most once a
        minute. Without either, a restart empties it: rate limits, quotas, pauses, taints
        and pending approvals are lost (revocations survive in the gateways' journals)."""
        now = time.monotonic()
        if self._persistence_seen is not None and now - self._persistence_seen[0] < 60.0:
            return self._persistence_seen[1]
        try:
            aof = await self._call("CONFIG GET", lambda: self._client.config_get("appendonly"))
            save = await self._call("CONFIG GET", lambda: self._client.config_get("save"))
        except StateUnavailable as exc:
            # Managed services often disable CONFIG: say it is unknown, once a minute.
            found: dict[str, Any] = {"known": False, "detail": exc.detail}
        else:
            on_aof = str(aof.get("appendonly", "no")).lower() == "yes"
            on_rdb = bool(str(save.get("save", "")).strip())
            found = {"known": True, "aof": on_aof, "rdb": on_rdb}
            if not (on_aof or on_rdb):
                found["warning"] = (
                    f"redis at {self.target} keeps nothing on disk (no AOF, no RDB "
                    "snapshots): a restart loses rate limits, quotas, pauses, taints and "
                    "pending approvals; revocations survive in the gateways' journals"
                )
        self._persistence_seen = (now, found)
        return found

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
        self._check_running()
        # Local first: this gateway enforces the revocation even if the shared write fails
        # (a later resync writes it back to Redis).
        now = time.time()
        info = RevocationInfo(now, by, reason)
        self._revocations.apply(kind, value, until, now=now, info=info)
        keys = [self._revoked_key(kind), self._info_key(kind)]
        args = self._revoke_args(kind, value, until, info)
        await self._call("revoke", lambda: self._revoke_script(keys=keys, args=args))

    def _check_synced(self) -> None:
        if not (self._synced and self._running):
            raise StateUnavailable(
                f"the revocation list is not in sync with redis at {self.target} "
                f"({self._stale_reason}); refusing calls until it is"
            )

    def is_revoked(self, jti: str, agent: str, run: str | None) -> RevocationKind | None:
        # What the mirror knows is enforced even while it is out of sync: only a "not
        # revoked" needs a current mirror (so on_state_error: allow never admits a
        # revocation this gateway has heard of).
        if not self._running:
            self._check_synced()  # a store not started, or closed, answers nothing
        kind = self._revocations.match(jti, agent, run, now=time.time())
        if kind is None:
            self._check_synced()
        return kind

    def approval_board(self) -> ApprovalBoard:
        return self._board

    def revocations(self) -> list[dict[str, Any]]:
        self._check_synced()
        return self._revocations.listing(now=time.time())

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
        self._check_running()
        entry = PauseEntry(kind, value, now, None if until is None else float(until), by, reason)
        stored = json.dumps(entry.public())
        message = json.dumps({"op": "pause", **entry.public()})
        keys = [self._paused_key(kind)]
        args = [value, stored, self._pause_channel, message]

        async def write() -> None:
            async with self._pause_lock:
                await self._pause_script(keys=keys, args=args)
                # Shared write first: the mirror learns the pause only once Redis has it.
                self._pauses.set(entry, now=time.time())

        await self._call("pause", write)

    async def resume(self, kind: PauseKind, value: str, *, by: str) -> bool:
        check_resume(kind, value, by)
        self._check_running()
        message = json.dumps({"op": "resume", "kind": kind, "value": value, "by": by})
        keys = [self._paused_key(kind)]
        args = [value, self._pause_channel, message]

        async def write() -> bool:
            async with self._pause_lock:
                lifted = await self._resume_script(keys=keys, args=args)
                self._pauses.clear(kind, value)
                return bool(int(lifted))

        return await self._call("resume", write)

    def paused(self, agent: str, run: str | None) -> PauseEntry | None:
        # As for revocations: a pause the mirror knows holds the call even while the mirror
        # is out of sync; only "not paused" needs a current mirror.
        if not self._running:
            self._check_synced()  # a store not started, or closed, answers nothing
        entry = self._pauses.match(agent, run, now=time.time())
        if entry is None:
            self._check_synced()
        return entry

    def pauses(self) -> list[dict[str, Any]]:
        self._check_synced()
        return [entry.public() for entry in self._pauses.entries(now=time.time())]

    def on_pause(self, callback: PauseListener) -> None:
        self._pauses.add_listener(callback)

    # --- rates --------------------------------------------------------------------------

    async def take(self, key: str, rate: Rate, *, cost: int = 1) -> Admission:
        check_cost(cost, rate)
        if cost == 1 and lease_size(rate) > 1:
            self._check_running()  # a closed store serves no leased token either
            return await self._leases.take(key, rate)  # no round trip while a lease lasts
        keys = [f"{self.prefix}rate:{key}"]
        args = [rate.interval(_US), rate.burst, cost]
        reply = await self._call("take", lambda: self._rate_script(keys=keys, args=args))
        allowed, retry_us, remaining = (int(x) for x in reply)
        return Admission(bool(allowed), retry_us / _US, remaining)

    def take_now(self, key: str, rate: Rate) -> Admission | None:
        if lease_size(rate) <= 1:
            return None  # every call asks Redis
        self._check_running()
        return self._leases.take_now(key, rate)

    async def _lease(self, key: str, rate: Rate, wanted: int) -> tuple[int, float, int]:
        """One refill of ``Leases``: up to ``wanted`` tokens of the shared bucket."""
        keys = [f"{self.prefix}rate:{key}"]
        args = [rate.interval(_US), rate.burst, wanted]
        reply = await self._call("take", lambda: self._lease_script(keys=keys, args=args))
        granted, retry_us, left = (int(x) for x in reply)
        return granted, retry_us / _US, left

    # --- quotas -------------------------------------------------------------------------

    async def taint(self, key: str, cause: dict[str, Any], *, ttl_s: float) -> dict[str, Any]:
        name = f"{self.prefix}taint:{key}"
        ttl_ms = max(1, int(ttl_s * 1000))
        text = json.dumps(cause)

        async def mark() -> Any:
            # The first cause wins; a later mark only reads it back.
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.set(name, text, nx=True, px=ttl_ms)
                pipe.get(name)
                return (await pipe.execute())[1]

        kept = await self._call("taint", mark)
        return json.loads(kept) if kept else cause

    async def taint_of(self, key: str) -> dict[str, Any] | None:
        kept = await self._call("taint_of", lambda: self._client.get(f"{self.prefix}taint:{key}"))
        return json.loads(kept) if kept else None

    def _read_keys(self, key: str) -> list[str]:
        return [f"{self.prefix}{part}:{key}" for part in ("reads", "readsize", "readsover")]

    async def record_read(self, key: str, entry: str, *, cap: int, ttl_s: float) -> bool:
        keys = self._read_keys(key)
        args = [entry, cap, max(1, int(ttl_s * 1000))]
        kept = await self._call("record_read", lambda: self._read_script(keys=keys, args=args))
        return int(kept) == 1

    async def drop_reads(self, key: str, *, ttl_s: float) -> None:
        await self.record_read(key, "", cap=-1, ttl_s=ttl_s)

    async def reads_of(self, key: str) -> list[str] | None:
        keys = self._read_keys(key)

        async def read() -> list[Any]:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.exists(keys[2])
                pipe.lrange(keys[0], 0, -1)
                return list(await pipe.execute())

        over, entries = await self._call("reads_of", read)
        if int(over) or not entries:
            return None
        return [e.decode() if isinstance(e, bytes) else str(e) for e in entries]

    async def consume_quota(
        self, key: str, limit: int, *, ttl_s: float, cost: int = 1
    ) -> Admission:
        got = await self.consume_quotas([(key, limit)], ttl_s=ttl_s, cost=cost)
        return Admission(got.allowed, got.retry_after, got.remaining)

    async def consume_quotas(
        self, items: Sequence[tuple[str, int]], *, ttl_s: float, cost: int = 1
    ) -> Admission:
        check_quota_args(items, ttl_s, cost)
        keys = [f"{self.prefix}quota:{key}" for key, _ in items]
        args = [cost, max(1, math.ceil(ttl_s * 1000)), *(limit for _, limit in items)]
        reply = await self._call("consume_quota", lambda: self._quota_script(keys=keys, args=args))
        allowed, index, pttl_ms, remaining = (int(x) for x in reply)
        if allowed:
            return Admission(True, 0.0, remaining)
        retry = pttl_ms / 1000 if pttl_ms > 0 else float(ttl_s)
        return Admission(False, retry, remaining, limited_by=index - 1)

    # --- calls --------------------------------------------------------------------------

    def _check_running(self) -> None:
        if not self._running:
            raise StateUnavailable(
                f"the state store for redis at {self.target} is not started or was closed"
            )

    async def _call(self, op: str, make: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis operation within ``op_timeout``; every failure is StateUnavailable."""
        self._check_running()
        try:
            async with asyncio.timeout(self._op_timeout):
                if self._call_slots is None:
                    return await make()
                # A cluster client's pools do not wait for a free connection: calls beyond
                # max_connections wait here instead (within the same timeout), as the single
                # server's blocking pool makes them wait.
                async with self._call_slots:
                    return await make()
        except (TimeoutError, RedisTimeoutError) as exc:
            raise StateUnavailable(
                f"redis at {self.target} did not answer {op} within {self._op_timeout:g} s"
            ) from exc
        except (RedisError, OSError) as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # redis-py may answer a cancellation with a connection error: it is still
                # the caller's cancellation, never a state error to be handled and forgotten.
                raise asyncio.CancelledError from exc
            raise StateUnavailable(f"redis at {self.target} failed {op}: {_failure(exc)}") from exc

    # --- the subscriber -----------------------------------------------------------------

    def _mark_stale(self, reason: str) -> None:
        if self._synced:
            self._stale_since = time.monotonic()
        self._synced = False
        self._stale_reason = reason

    async def _subscriber(self) -> None:
        """Keep the mirror in sync for as long as the store runs: sync, listen, and on any
        failure mark it stale and reconnect with jittered exponential backoff."""
        delay = self._reconnect_min
        failures = 0
        while self._running:
            pubsub = self._sub_client.pubsub()
            try:
                if self.cluster:
                    # Its map of slots to nodes, which pub/sub needs before the first command.
                    async with asyncio.timeout(self._sync_timeout):
                        await self._sub_client.initialize()
                await self._sync(pubsub)
                if failures:
                    log.info("revocation mirror resynced with redis at %s", self.target)
                delay, failures = self._reconnect_min, 0
                await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = (
                    "a revocation message could not be read"
                    if isinstance(exc, _BadMessage)
                    else f"pub/sub {_failure(exc)}"
                )
                was_synced = self._synced
                self._mark_stale(reason)
                first = self._first_sync
                fatal = isinstance(exc, AuthenticationError | ResponseError)
                if fatal and first is not None and not first.is_set():
                    # Misconfigured (password, ACL): waiting will not help, so start() fails now.
                    self._start_error = exc
                    first.set()
                failures += 1
                level = logging.WARNING if was_synced or failures == 1 else logging.DEBUG
                log.log(
                    level,
                    "revocation mirror not in sync with redis at %s (%s); failing closed, "
                    "retrying in %.2f s",
                    self.target,
                    reason,
                    delay,
                )
            finally:
                await self._close_pubsub(pubsub)
            if not self._running:
                return
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # noqa: S311 (jitter)
            delay = min(delay * 2, self._reconnect_max)

    async def _close_pubsub(self, pubsub: PubSub) -> None:
        try:
            async with asyncio.timeout(self._op_timeout):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # untyped in redis-py
        except Exception:
            log.debug("closing the pub/sub connection failed", exc_info=True)

    async def _sync(self, pubsub: PubSub) -> None:
        """Subscribe, wait until the subscriptions are live, then load the full snapshot."""
        channels = (self._channel, self._pause_channel)
        async with asyncio.timeout(self._sync_timeout):
            await pubsub.subscribe(*channels)
            confirmed: set[str] = set()
            while len(confirmed) < len(channels):
                # A confirmation proves the server now routes that channel's messages to us.
                message = await pubsub.get_message(timeout=self._sync_timeout)
                if message is not None and message["type"] == "subscribe":
                    confirmed.add(message["channel"])
                elif message is not None and message["type"] == "message":
                    self._on_message(message["channel"], message["data"])
            async with self._pause_lock:
                snapshot = await self._load_snapshot()
                in_redis = self._apply_snapshot(*snapshot)
                if not self._running:
                    return
                self._synced = True
                self._stale_reason = "in sync"
        if self._first_sync is not None:
            self._first_sync.set()
        try:
            await self._write_back(in_redis)
        except (TimeoutError, RedisError, OSError) as exc:
            # Best effort: the mirror itself is in sync; the next resync tries again.
            log.warning(
                "could not write local revocations back to redis at %s (%s)",
                self.target,
                _failure(exc),
            )

    async def _load_snapshot(
        self,
    ) -> tuple[list[list[tuple[str, float]]], list[dict[str, str]], list[dict[str, str]]]:
        """Every revocation (with its info) and every pause Redis holds, in one round trip."""
        async with self._sub_client.pipeline(transaction=False) as pipe:
            for kind in REVOCATION_KINDS:
                pipe.zrange(self._revoked_key(kind), 0, -1, withscores=True)
            for kind in REVOCATION_KINDS:
                pipe.hgetall(self._info_key(kind))
            for kind in PAUSE_KINDS:
                pipe.hgetall(self._paused_key(kind))
            replies: list[Any] = await pipe.execute()
        n = len(REVOCATION_KINDS)
        return replies[:n], replies[n : 2 * n], replies[2 * n :]

    def _apply_snapshot(
        self,
        revoked: list[list[tuple[str, float]]],
        infos: list[dict[str, str]],
        paused: list[dict[str, str]],
    ) -> dict[tuple[str, str], float]:
        """Load the snapshot into the mirrors; returns the revocations Redis holds (for the
        write-back). The pause mirror becomes exactly what Redis holds."""
        now = time.time()
        in_redis: dict[tuple[str, str], float] = {}
        for kind, entries, info in zip(REVOCATION_KINDS, revoked, infos, strict=True):
            for value, until in entries:
                in_redis[(kind, value)] = until
                found = _read_info(info.get(value))
                self._revocations.apply(kind, value, until, now=now, info=found)
        pauses: list[PauseEntry] = []
        for kind, fields in zip(PAUSE_KINDS, paused, strict=True):
            for value, raw in fields.items():
                try:
                    entry = PauseEntry.from_json(json.loads(raw))
                except ValueError:
                    log.warning("ignoring an unreadable %s pause entry in redis", kind)
                    continue
                if entry.kind == kind and entry.value == value:
                    pauses.append(entry)
        self._pauses.replace(pauses, now=now)
        return in_redis

    async def _write_back(self, in_redis: dict[tuple[str, str], float]) -> None:
        """Give Redis the live entries it lacks (a revoke whose shared write failed, or a
        Redis that came back empty), announcing each so other gateways learn them too."""
        missing = [
            (kind, value, until)
            for kind, value, until in self._revocations.entries(now=time.time())
            if in_redis.get((kind, value), -math.inf) < until
        ]
        if not missing:
            return
        async with asyncio.timeout(self._sync_timeout):
            async with self._sub_client.pipeline(transaction=False) as pipe:
                for kind, value, until in missing:
                    await self._revoke_script(
                        keys=[self._revoked_key(kind), self._info_key(kind)],
                        args=self._revoke_args(
                            kind,
                            value,
                            None if until == math.inf else until,
                            self._revocations.info(kind, value),
                        ),
                        client=pipe,
                    )
                announced = sum(await pipe.execute())
        if announced:
            log.warning(
                "wrote %d revocation(s) known here but missing from redis at %s back to it",
                announced,
                self.target,
            )

    async def _listen(self, pubsub: PubSub) -> None:
        """Apply messages until the connection fails or stops answering the heartbeat."""
        loop = asyncio.get_running_loop()
        last_heard = loop.time()
        next_ping = last_heard + self._heartbeat
        while self._running:
            message = await pubsub.get_message(timeout=max(0.0, next_ping - loop.time()))
            now = loop.time()
            if message is not None:
                last_heard = now
                if message["type"] == "message":
                    self._on_message(message["channel"], message["data"])
            if now >= next_ping:
                if now - last_heard > self._heartbeat_timeout:
                    raise RedisTimeoutError("no answer to the pub/sub heartbeat")
                async with asyncio.timeout(self._op_timeout):
                    await pubsub.ping()
                next_ping = now + self._heartbeat
                wall = time.time()
                self._revocations.prune(wall)
                self._pauses.prune(wall)

    def _on_message(self, channel: Any, data: Any) -> None:
        if channel == self._pause_channel:
            self._on_pause_message(data)
            return
        try:
            body = json.loads(data)
            kind, value, until = body["kind"], body["value"], body["until"]
            check_revocation(kind, value, until)
        except (ValueError, TypeError, KeyError) as exc:
            raise _BadMessage("unreadable revocation message") from exc
        info = RevocationInfo.from_json(body)
        self._revocations.apply(kind, value, until, now=time.time(), info=info)

    def _on_pause_message(self, data: Any) -> None:
        try:
            body = json.loads(data)
            op = body["op"]
            if op == "pause":
                entry = PauseEntry.from_json(body)
            elif op == "resume":
                kind, value = body["kind"], body["value"]
                if kind not in PAUSE_KINDS or not isinstance(value, str):
                    raise ValueError("bad resume message")
            else:
                raise ValueError(f"unknown pause message op {op!r}")
        except (ValueError, TypeError, KeyError) as exc:
            raise _BadMessage("unreadable pause message") from exc
        if op == "pause":
            self._pauses.set(entry, now=time.time())
        else:
            self._pauses.clear(kind, value)


def _read_info(raw: str | None) -> RevocationInfo | None:
    if raw is None:
        return None
    try:
        return RevocationInfo.from_json(json.loads(raw))
    except ValueError:
        return None
