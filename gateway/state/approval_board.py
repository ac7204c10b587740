"""Where pending approvals are shown and decided: in this process, or in Redis for a fleet.

A held call waits in the gateway whose agent connection holds it; the *board* is where its
record is published and where a decision is taken, exactly once:

* ``LocalApprovalBoard`` (memory state): this gateway's own approvals only.
* ``RedisApprovalBoard`` (redis state): every gateway publishes its pending approvals, so a
  console attached to any gateway lists them all and may decide any of them. Layout (``P``
  is the store's prefix)::

      P approval:<id>      hash: record (JSON of the public record), body_sha256,
                           decision (JSON, once set never changed); expires after the deadline
      P approvals          sorted set: pending ids, score = deadline (unix s)

  A decision is one script: it refuses an unknown or expired id, a body digest that is not
  the held call's, and an id already decided (``HSETNX``), so of two operators clicking on
  two gateways at the same moment exactly one wins. The holding gateway reads decisions of
  its pending ids in one round trip every ``POLL_S`` (a missed message cannot strand a call);
  its own timeout and cancellations claim the id the same way, so a decision that races a
  timeout either wins whole or loses whole.

Any failure to reach Redis is ``StateUnavailable`` (the held call is refused, fail closed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, Protocol, TypeVar

T = TypeVar("T")
Claim = Literal["decided", "not_found", "mismatch"]
POLL_S = 0.25
MAX_LISTED = 1000


class ApprovalBoard(Protocol):
    shared: bool
    """True when other gateways see and decide this board's approvals (Redis)."""

    async def publish(self, approval_id: str, record: dict[str, Any], deadline: float) -> None:
        """Show a pending approval (its public record) until ``deadline``."""
        ...

    async def claim(
        self, approval_id: str, decision: dict[str, Any], body_sha256: str | None
    ) -> Claim:
        """Decide ``approval_id`` once: ``decided`` for the one claim that wins."""
        ...

    async def decisions(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The decisions taken so far among ``ids`` (those not decided are absent)."""
        ...

    async def listing(self) -> list[dict[str, Any]]:
        """Every pending approval's record, soonest deadline first."""
        ...

    async def forget(self, approval_id: str) -> None:
        """Take an ended approval off the board."""
        ...

    async def set_checks(self, approval_id: str, checks: dict[str, list[str]]) -> None:
        """Attach the digests of a pending approval's masked values (``approval_checks.py``)
        for the fleet to check against; nothing if it has ended."""
        ...

    async def checks_of(self, approval_id: str) -> dict[str, list[str]] | None:
        """The digests attached to an undecided pending approval; None if there is none."""
        ...


class LocalApprovalBoard:
    shared = False

    def __init__(self) -> None:
        self._records: dict[str, tuple[dict[str, Any], float]] = {}
        self._decided: dict[str, dict[str, Any]] = {}

    async def publish(self, approval_id: str, record: dict[str, Any], deadline: float) -> None:
        self._records[approval_id] = (record, deadline)

    async def claim(
        self, approval_id: str, decision: dict[str, Any], body_sha256: str | None
    ) -> Claim:
        held = self._records.get(approval_id)
        if held is None or held[1] < time.time() or approval_id in self._decided:
            return "not_found"
        if body_sha256 is not None and body_sha256 != (held[0].get("body_sha256") or ""):
            return "mismatch"
        self._decided[approval_id] = decision
        return "decided"

    async def decisions(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        return {i: self._decided[i] for i in ids if i in self._decided}

    async def listing(self) -> list[dict[str, Any]]:
        held = sorted(self._records.values(), key=lambda item: item[1])
        return [record for record, _ in held]

    async def forget(self, approval_id: str) -> None:
        self._records.pop(approval_id, None)
        self._decided.pop(approval_id, None)

    async def set_checks(self, approval_id: str, checks: dict[str, list[str]]) -> None:
        return None  # one process: its approvals check the held body itself

    async def checks_of(self, approval_id: str) -> dict[str, list[str]] | None:
        return None


# KEYS[1] approval hash, KEYS[2] pending set; ARGV[1] decision JSON, ARGV[2] id,
# ARGV[3] body digest the decision was made on ("" for none). 1 decided, 0 unknown or
# already decided, -1 another body.
CLAIM_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'body_sha256') ~= ARGV[3] then return -1 end
if redis.call('HSETNX', KEYS[1], 'decision', ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""

# KEYS[1] approval hash; ARGV[1] checks JSON. Only while it is pending (never recreates it).
CHECKS_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'decision') == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'checks', ARGV[1])
return 1
"""

Caller = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]]


class RedisApprovalBoard:
    shared = True

    def __init__(self, client: Any, prefix: str, call: Caller) -> None:
        self._client = client
        self._pending = prefix + "approvals"
        self._prefix = prefix + "approval:"
        self._call = call  # the store's bounded, fail-closed runner of one operation
        self._claim = client.register_script(CLAIM_LUA)
        self._checks = client.register_script(CHECKS_LUA)
        # what a cluster store loads on every node at start
        self.scripts = (CLAIM_LUA, CHECKS_LUA)

    def _key(self, approval_id: str) -> str:
        return self._prefix + approval_id

    async def publish(self, approval_id: str, record: dict[str, Any], deadline: float) -> None:
        key = self._key(approval_id)
        fields = {"record": json.dumps(record), "body_sha256": record.get("body_sha256") or ""}

        async def write() -> None:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=fields)
                pipe.expireat(key, int(deadline) + 60)
                pipe.zadd(self._pending, {approval_id: deadline})
                await pipe.execute()

        await self._call("approval publish", write)

    async def claim(
        self, approval_id: str, decision: dict[str, Any], body_sha256: str | None
    ) -> Claim:
        keys = [self._key(approval_id), self._pending]
        args = [json.dumps(decision), approval_id, body_sha256 or ""]
        result = await self._call("approval claim", lambda: self._claim(keys=keys, args=args))
        return {1: "decided", -1: "mismatch"}.get(int(result), "not_found")  # type: ignore[return-value]

    async def decisions(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        if not ids:
            return {}

        async def read() -> list[Any]:
            async with self._client.pipeline(transaction=False) as pipe:
                for approval_id in ids:
                    pipe.hget(self._key(approval_id), "decision")
                return list(await pipe.execute())

        found = await self._call("approval decisions", read)
        return {i: json.loads(d) for i, d in zip(ids, found, strict=True) if d is not None}

    async def listing(self) -> list[dict[str, Any]]:
        now = time.time()

        async def read() -> list[Any]:
            await self._client.zremrangebyscore(self._pending, "-inf", now)
            ids = await self._client.zrange(self._pending, 0, MAX_LISTED - 1)
            if not ids:
                return []
            async with self._client.pipeline(transaction=False) as pipe:
                for approval_id in ids:
                    pipe.hget(self._key(approval_id), "record")
                return list(await pipe.execute())

        records = await self._call("approval listing", read)
        return [json.loads(r) for r in records if r is not None]

    async def forget(self, approval_id: str) -> None:
        async def drop() -> None:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.zrem(self._pending, approval_id)
                pipe.delete(self._key(approval_id))
                await pipe.execute()

        await self._call("approval forget", drop)

    async def set_checks(self, approval_id: str, checks: dict[str, list[str]]) -> None:
        keys, args = [self._key(approval_id)], [json.dumps(checks)]
        await self._call("approval checks", lambda: self._checks(keys=keys, args=args))

    async def checks_of(self, approval_id: str) -> dict[str, list[str]] | None:
        key = self._key(approval_id)

        async def read() -> list[Any]:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hget(key, "decision")
                pipe.hget(key, "checks")
                return list(await pipe.execute())

        decision, checks = await self._call("approval checks", read)
        if decision is not None or checks is None:
            return None
        found = json.loads(checks)
        return found if isinstance(found, dict) else None
