"""pause: hold the calls of a paused agent or run until an operator resumes it.

Runs right after ``authenticate``: the token is verified, so its agent and run are known.
When neither is paused (the local mirror says so, without a round trip), the stage returns
None and the call goes on at once. Otherwise the call waits, taking one of its agent's share
of held calls, until the first of:

* the pause is lifted (``resume``, here or at any gateway sharing the store) or its ``until``
  passes: the call goes on through the remaining stages, as if it had just arrived;
* the hold (``pause_hold``, 5 minutes by default) is over: 503 ``agent_paused``, with
  ``Retry-After``;
* the token expires: 401 ``token_expired`` (a held call never outlives its token);
* a stop (a revocation of the token, agent or run) arrives: 401 ``token_revoked`` (the held
  call is registered in ``InFlight``, so the revocation cancels it);
* the agent hangs up: ``client_closed``.

An agent that already has its share of calls held is refused at once (``agent_paused``), so a
paused fleet of calls stays bounded. The problem detail names what is paused, never who
paused it or why (those are for the operators' console).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable

from gateway.call import Call
from gateway.errors import AgentPaused, StateUnavailable, TokenExpired
from gateway.inflight import InFlight
from gateway.shares import Shares
from gateway.state.base import PauseEntry, StateStore

HELD_PER_AGENT = 32
"""Calls of one agent held by a pause at once; more are refused at once with agent_paused (a
paused agent retrying in a loop must not fill the gateway with waiting calls)."""
MAX_HELD = 1000
"""Calls held by pauses at once, all agents together."""
RETRY_AFTER_S = 30
"""Retry-After of a refusal when the pause has no ``until``: a person will resume it, the
agent cannot know when."""
RECHECK_S = 0.5
"""While the store cannot vouch for its mirror (Redis reconnecting), a held call looks again
this often: it stays held, and is refused state_unavailable only if the hold ends first."""


class Pause:
    """Hold calls while their agent or run is paused (``StateStore.paused``); ``changed`` is
    the store's ``on_pause`` listener that wakes them."""

    def __init__(
        self,
        state: StateStore,
        inflight: InFlight,
        *,
        hold: float,
        per_agent: int = HELD_PER_AGENT,
        capacity: int = MAX_HELD,
    ) -> None:
        self.state = state
        self.inflight = inflight
        self.hold = hold
        self.held = Shares("calls held by a pause", capacity, per_agent)
        self._waiting: dict[tuple[str, str], set[asyncio.Future[None]]] = {}

    def __call__(self, call: Call) -> Awaitable[None] | None:
        claims = call.claims
        assert claims is not None
        try:
            entry = self.state.paused(claims.agent, claims.run)
        except StateUnavailable as exc:
            # Kept like the revocation check's: match_policy raises it unless the rule says
            # on_state_error: allow.
            if call.state_error is None:
                call.state_error = exc
            return None
        if entry is None:
            return None
        return self._hold(call, entry)

    def changed(self, kind: str, value: str, paused: bool) -> None:
        """A pause was set, changed or lifted: the calls it holds look again."""
        for waiter in self._waiting.get((kind, value), ()):
            if not waiter.done():
                waiter.set_result(None)

    async def _hold(self, call: Call, entry: PauseEntry) -> None:
        claims = call.claims
        assert claims is not None
        if not self.held.try_acquire(claims.agent):
            raise refusal(
                entry,
                f"agent {claims.agent!r} already has {self.held.per_agent} calls held, so "
                "this one was not sent",
            )
        # While it waits, a stop (revocation of its token, agent or run) must cut it.
        self.inflight.add(call, asyncio.current_task())
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.hold
        token_deadline = started + (claims.expires_at - time.time())
        try:
            await self._wait_until_resumed(call, entry, deadline, token_deadline)
        finally:
            self.held.release(claims.agent)

    async def _wait_until_resumed(
        self, call: Call, entry: PauseEntry, deadline: float, token_deadline: float
    ) -> None:
        claims = call.claims
        assert claims is not None
        loop = asyncio.get_running_loop()
        unknown: StateUnavailable | None = None
        current = entry
        while True:
            try:
                # Looked up again each time (the first too: the pause may have been lifted
                # between the check and this coroutine's start).
                found, unknown = self.state.paused(claims.agent, claims.run), None
            except StateUnavailable as exc:
                unknown = exc  # still held: whether it was resumed is not known yet
            else:
                if found is None:
                    return
                current = found
            now = loop.time()
            if now >= token_deadline:
                raise TokenExpired("the token expired while its call was held by a pause")
            if now >= deadline:
                if unknown is not None:
                    raise unknown
                raise refusal(current, f"this call was held {self.hold:g} s and not sent")
            wait = min(deadline, token_deadline) - now
            if unknown is not None:
                wait = min(wait, RECHECK_S)
            elif current.until is not None:
                wait = min(wait, current.until - time.time())
            await self._wait(current.kind, current.value, max(wait, 0.0))

    async def _wait(self, kind: str, value: str, timeout: float) -> None:
        """Until ``changed`` is told of this pause, or ``timeout`` seconds."""
        key = (kind, value)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiting.setdefault(key, set())
        waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            waiters.discard(waiter)
            if not waiters:
                self._waiting.pop(key, None)


def refusal(entry: PauseEntry, why: str) -> AgentPaused:
    """``agent_paused`` for a call of ``entry``'s agent or run, with ``Retry-After``."""
    if entry.until is not None:
        retry = min(max(1, math.ceil(entry.until - time.time())), 86_400)
    else:
        retry = RETRY_AFTER_S
    return AgentPaused(
        f"{entry.kind} {entry.value!r} is paused by an operator; {why}",
        headers={"Retry-After": str(retry)},
    )
