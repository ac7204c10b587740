"""Per-agent shares of a shared resource: one agent can never take what the others need.

A ``Shares`` has ``capacity`` slots in all (connections to an upstream, calls held for
approval, workers for payload checks) and lets one agent hold at most ``per_agent`` of them
at once. ``acquire(agent, wait)`` takes a slot, waiting up to ``wait`` seconds for one (0:
not at all); past that it raises ``ConcurrencyLimited`` (429), naming whose share was full.
Waiters are served in arrival order among those that can go: an agent at its share never
holds up another agent that is under its own.

Everything here runs on the event loop (no locks); the state is a count per agent holding
slots (bounded by ``capacity``) and a queue of waiters per agent (bounded by the callers'
deadlines). Handing out a freed slot costs one look at the head of each waiting agent's
queue, not one at every waiter: an agent that floods a resource with waiting calls makes
its own queue long, not every other agent's release slow.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.errors import ConcurrencyLimited


@dataclass(slots=True)
class _Waiter:
    agent: str
    future: asyncio.Future[None]
    seq: int  # arrival order, across agents
    gone: bool = False  # served, expired or cancelled: no longer counted as waiting


# The expiry heap is rebuilt from the waiters still waiting once it holds this many more
# entries than them (entries of served waiters stay until their deadline would have passed).
_HEAP_SLACK = 1024


class Shares:
    """``capacity`` slots of one resource, at most ``per_agent`` of them to one agent."""

    def __init__(self, what: str, capacity: int, per_agent: int) -> None:
        if capacity < 1 or per_agent < 1:
            raise ValueError("capacity and per_agent must be at least 1")
        self.what = what
        self.capacity = capacity
        self.per_agent = min(per_agent, capacity)
        self._held: dict[str, int] = {}
        self._total = 0
        # Each waiting agent's waiters in arrival order; an entry that is ``gone`` is skipped
        # when it reaches the head (removing it from the middle would cost its queue's length).
        self._queues: dict[str, collections.deque[_Waiter]] = {}
        self._live: dict[str, int] = {}  # each waiting agent's waiters not gone
        self._waiting = 0
        self._seq = 0
        # Every waiter's deadline, earliest first, and one timer for the earliest that is still
        # waiting: not one timer per wait (made and cancelled for half the calls of an agent
        # at its share, each a Python-level entry in the event loop's own timer heap).
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._timer: asyncio.TimerHandle | None = None

    # -- observing ---------------------------------------------------------------------------

    @property
    def in_use(self) -> int:
        return self._total

    def held_by(self, agent: str) -> int:
        return self._held.get(agent, 0)

    def snapshot(self) -> dict[str, object]:
        """For the health endpoint: totals and the agents at their share."""
        return {
            "capacity": self.capacity,
            "per_agent": self.per_agent,
            "in_use": self._total,
            "waiting": self._waiting,
            "agents_at_share": sorted(a for a, n in self._held.items() if n >= self.per_agent),
        }

    # -- taking and giving back ----------------------------------------------------------------

    def _can_take(self, agent: str) -> bool:
        return self._total < self.capacity and self._held.get(agent, 0) < self.per_agent

    def _take(self, agent: str) -> None:
        self._held[agent] = self._held.get(agent, 0) + 1
        self._total += 1

    def try_acquire(self, agent: str) -> bool:
        """Take a slot now if the agent's share and the capacity allow; never waits. (A waiter
        that could take a slot has already been given one: ``release`` hands them out.)"""
        if self._can_take(agent):
            self._take(agent)
            return True
        return False

    def release(self, agent: str) -> None:
        held = self._held.get(agent, 0)
        if held <= 0:
            raise RuntimeError(f"{self.what}: {agent!r} released a slot it did not hold")
        if held == 1:
            del self._held[agent]
        else:
            self._held[agent] = held - 1
        self._total -= 1
        self._wake()

    def _wake(self) -> None:
        """Hand freed slots to waiters that can take them: of the agents under their share,
        the one whose next waiter came first (arrival order across agents)."""
        while self._waiting and self._total < self.capacity:
            first: _Waiter | None = None
            for agent, queue in list(self._queues.items()):  # (_head may drop a queue)
                if self._held.get(agent, 0) >= self.per_agent:
                    continue
                head = self._head(queue)
                if head is not None and (first is None or head.seq < first.seq):
                    first = head
            if first is None:
                return
            self._forget(first)
            self._take(first.agent)  # taken on the waiter's behalf, before it runs
            first.future.set_result(None)

    def _head(self, queue: collections.deque[_Waiter]) -> _Waiter | None:
        """The first waiter of ``queue`` still waiting (dropping those gone before it)."""
        while queue:
            head = queue[0]
            if not head.gone and not head.future.done():
                return head
            queue.popleft()
            self._forget(head)  # a future cancelled with its task, not yet forgotten
        return None

    def _forget(self, waiter: _Waiter) -> None:
        """``waiter`` no longer waits (once); an agent with no waiter left has no queue."""
        if waiter.gone:
            return
        waiter.gone = True
        self._waiting -= 1
        agent = waiter.agent
        left = self._live[agent] - 1
        if not left:
            del self._live[agent]
            del self._queues[agent]
            return
        self._live[agent] = left
        queue = self._queues[agent]
        if len(queue) > 2 * left + 32:
            # Mostly waiters gone (expired while their agent stayed at its share): keep the
            # live ones, so a queue never holds more than twice them (amortised O(1) each).
            self._queues[agent] = collections.deque(w for w in queue if not w.gone)

    async def acquire(self, agent: str, wait: float) -> None:
        """Take a slot for ``agent``, waiting up to ``wait`` seconds; ``ConcurrencyLimited``
        past that. A caller cancelled while waiting leaves nothing taken."""
        if self.try_acquire(agent):
            return
        if wait <= 0:
            raise self.refusal(agent)
        # One future per wait (not wait_for around a shield: half the calls of an agent at
        # its share take this path, so it is kept lean) and an entry in the expiry heap.
        # ``_wake`` resolves the future with the slot already taken; ``_expire`` fails it
        # with the refusal once its deadline has passed.
        loop = asyncio.get_running_loop()
        self._seq += 1
        waiter = _Waiter(agent, loop.create_future(), self._seq)
        queue = self._queues.get(agent)
        if queue is None:
            queue = self._queues[agent] = collections.deque()
        queue.append(waiter)
        self._live[agent] = self._live.get(agent, 0) + 1
        self._waiting += 1
        deadline = loop.time() + wait
        heap = self._deadlines
        heapq.heappush(heap, (deadline, waiter.seq, waiter))
        timer = self._timer
        if timer is None or deadline < timer.when():
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(deadline, self._expire)
        if len(heap) > 2 * self._waiting + _HEAP_SLACK:
            self._deadlines = [e for e in heap if not e[2].gone]
            heapq.heapify(self._deadlines)
        try:
            await waiter.future
        except asyncio.CancelledError:
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(agent)  # granted in the same instant: give it back
            else:
                self._forget(waiter)
            raise

    def _expire(self) -> None:
        """The expiry timer: refuse every waiter whose deadline has passed, drop the entries
        of waiters already gone, and set the timer for the earliest one still waiting."""
        self._timer = None
        heap = self._deadlines
        if not heap:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        while heap:
            deadline, _, waiter = heap[0]
            if not (waiter.gone or waiter.future.done()):
                if deadline > now:
                    self._timer = loop.call_at(deadline, self._expire)
                    return
                self._forget(waiter)
                waiter.future.set_exception(self.refusal(waiter.agent))
            heapq.heappop(heap)

    @contextlib.asynccontextmanager
    async def slot(self, agent: str, wait: float) -> AsyncIterator[None]:
        """``async with shares.slot(agent, wait):`` holds one slot for the block."""
        await self.acquire(agent, wait)
        try:
            yield
        finally:
            self.release(agent)

    def refusal(self, agent: str) -> ConcurrencyLimited:
        """The error for ``agent`` when no slot can be had (its share, or all, taken)."""
        if self._held.get(agent, 0) >= self.per_agent:
            return ConcurrencyLimited(
                f"agent {agent!r} already holds its share of {self.what} "
                f"({self.per_agent} at once); retry when one of its calls ends"
            )
        return ConcurrencyLimited(f"all {self.capacity} {self.what} are in use; retry shortly")


class UpstreamShares:
    """The calls in flight to each upstream: one ``Shares`` per upstream (and per setting, so
    a reload that changes ``concurrency`` or ``per_agent`` starts a fresh count while calls
    under the old one finish against it)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, int, int], Shares] = {}

    def of(self, name: str, concurrency: int, per_agent: int) -> Shares:
        key = (name, concurrency, per_agent)
        shares = self._by_key.get(key)
        if shares is None:
            if len(self._by_key) >= 1024:  # reloads with new settings: drop the idle ones
                self._by_key = {k: s for k, s in self._by_key.items() if s.in_use}
            shares = self._by_key[key] = Shares(
                f"calls in flight to upstream {name!r}", concurrency, per_agent
            )
        return shares

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {name: s.snapshot() for (name, _, _), s in self._by_key.items() if s.in_use}
