"""Rate limits on Redis without a round trip per call: tokens leased in batches.

A shared ``rate`` is a GCRA bucket in Redis. Asking Redis on every call costs a round trip
(~0.5 ms and ~230 us of CPU here). Instead a gateway takes up to ``lease_size(rate)`` tokens
in one round trip (``LEASE_LUA``: as many as the bucket holds, at most that many), and admits
its next calls from them locally, for at most ``LEASE_TTL`` seconds; what it has not used by
then is dropped. One refill per key is in flight at a time: callers that find the lease empty
wait for it rather than each asking Redis. A refusal is kept until its ``retry_after``: the
bucket cannot have a token before then, whoever asks. ``remaining`` is the lease's tokens
plus what the shared bucket held beyond it when it was taken (exact for one gateway; an
estimate across several).

The bound, stated: a lease is taken from the shared bucket when it is leased, so the fleet
never admits more tokens than the bucket gives out; a leased token may be *used* up to
``LEASE_TTL`` later, so over any window the fleet admits at most what the rate allows over
that window stretched by ``LEASE_TTL`` (at most one lease per gateway more). Tokens a gateway
leased and did not use are lost: at most one lease per gateway per ``LEASE_TTL`` is admitted
less than the rate allows. A rate whose burst is under ``4`` is never leased (each call asks
Redis), so small limits stay exact; ``cost`` above 1 (never used by the stages) asks Redis too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.rates import Rate
from gateway.state.base import Admission

LEASE_TTL = 1.0  # seconds a leased token may wait to be used
LEASE_MAX = 64  # tokens one round trip may take
MAX_LEASES = 10_000  # keys with a lease kept; beyond it, expired leases are swept (once a TTL)

# Lease up to ARGV[3] tokens of a GCRA bucket. KEYS[1]: limiter key. ARGV: interval (us),
# burst, wanted. Returns {granted, retry_after (us; when none granted), remaining after}.
# The arithmetic is RATE_LUA's (base.gcra) with the cost chosen as what is available.
LEASE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local wanted = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]))
if tat == nil or tat < now then tat = now end
local available = math.floor((now - (tat - burst * interval)) / interval)
if available < 1 then
  return {0, tat + interval - burst * interval - now, 0}
end
local granted = math.min(wanted, available)
local new_tat = tat + granted * interval
local ttl_ms = math.ceil((new_tat - now) / 1000)
redis.call('SET', KEYS[1], string.format('%d', new_tat), 'PX', string.format('%d', ttl_ms))
return {granted, 0, available - granted}
"""


def lease_size(rate: Rate) -> int:
    """Tokens one round trip takes for ``rate``: a quarter of its burst, at most LEASE_MAX;
    1 (no lease: every call asks Redis) for a burst under 4."""
    return max(1, min(LEASE_MAX, rate.burst // 4))


@dataclass
class _Lease:
    tokens: int = 0
    shared: int = 0  # what the shared bucket held beyond this lease when it was taken
    expires: float = 0.0  # monotonic; the tokens are dropped then
    refused_until: float = 0.0  # monotonic; refused locally until then
    refill: asyncio.Future[None] | None = field(default=None, repr=False)


# (granted, retry_after seconds, left in the shared bucket) for one refill of ``wanted`` tokens.
Refill = Callable[[str, Rate, int], Awaitable[tuple[int, float, int]]]


class Leases:
    """The leased tokens of one store, by limiter key."""

    def __init__(self, refill: Refill, clock: Callable[[], float] = time.monotonic) -> None:
        self._refill = refill
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._next_sweep = 0.0  # a sweep walks every lease: at most once per LEASE_TTL
        self.round_trips = 0  # refills asked of Redis (tests, health)

    def __len__(self) -> int:
        return len(self._leases)

    def take_now(self, key: str, rate: Rate) -> Admission | None:
        """``take`` when the lease answers without a refill: a token it holds, or a local
        refusal still running; None otherwise (nothing taken)."""
        lease = self._leases.get(key)
        if lease is None or lease.refill is not None:
            return None
        return self._local(lease)

    def _local(self, lease: _Lease) -> Admission | None:
        """A token the lease holds, or its refusal while it runs; None: a refill is due."""
        now = self._clock()
        if lease.tokens > 0 and lease.expires > now:
            lease.tokens -= 1
            return Admission(True, 0.0, lease.tokens + lease.shared)
        if lease.refused_until > now:
            return Admission(False, lease.refused_until - now, 0)
        return None

    async def take(self, key: str, rate: Rate) -> Admission:
        """One call's token: from the lease when it holds one, else after one refill (shared
        by every caller waiting on this key). Raises what the refill raises."""
        size = lease_size(rate)
        lease = self._leases.get(key)
        if lease is None:
            if len(self._leases) >= MAX_LEASES and self._clock() >= self._next_sweep:
                self._sweep()
            lease = self._leases[key] = _Lease()
        while True:
            local = self._local(lease)
            if local is not None:
                return local
            refill = lease.refill
            if refill is not None:
                await asyncio.wait({refill})  # raises only if this caller is cancelled
                if not refill.cancelled() and refill.exception() is not None:
                    raise refill.exception()  # type: ignore[misc]  # the refill's error
                continue  # (a refill whose caller went away: the next one asks again)
            return await self._ask(key, rate, size, lease)

    async def _ask(self, key: str, rate: Rate, size: int, lease: _Lease) -> Admission:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lease.refill = done
        try:
            self.round_trips += 1
            granted, retry_after, shared = await self._refill(key, rate, size)
        except Exception as exc:
            done.set_exception(exc)
            done.exception()  # marked retrieved: the waiters re-raise it themselves
            raise
        except BaseException:
            done.cancel()  # this caller was cancelled: a waiter asks again
            raise
        finally:
            lease.refill = None
        now = self._clock()
        if granted < 1:
            lease.tokens = 0
            lease.refused_until = now + retry_after
            done.set_result(None)
            return Admission(False, retry_after, 0)
        lease.tokens, lease.shared = granted - 1, shared
        lease.expires = now + LEASE_TTL
        done.set_result(None)
        return Admission(True, 0.0, lease.tokens + shared)

    def _sweep(self) -> None:
        now = self._clock()
        self._next_sweep = now + LEASE_TTL
        for key in [
            k
            for k, lease in self._leases.items()
            if lease.refill is None and lease.expires <= now and lease.refused_until <= now
        ]:
            del self._leases[key]
