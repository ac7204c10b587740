"""``CheckWorkers``: payload checks too costly for the event loop, run in a few threads, a
share of them per agent.

A check of a long, never-seen SQL text takes milliseconds to tens of milliseconds (measured
in ``bench/sql_bench.py``: ~20 ms for a 10 KB PostgreSQL statement, ~45 ms SQLite); run on
the event loop, a flood of them would hold up every other agent's calls for that long each.
Such checks run in a small thread pool instead: the loop keeps serving other calls (the
checks are mostly Python, so they share the interpreter with it, but the interpreter hands
the loop its turn every few milliseconds instead of after the whole check).

One agent holds at most ``per_agent`` of the ``capacity`` workers at once (``Shares``): its
next heavy check waits up to ``wait`` seconds for one of its own to end, then is refused with
429 ``concurrency_limited`` (``Retry-After: 1``), so an agent flooding heavy statements
cannot take every worker from the others. A worker slot is given back when the check has
really ended, even if the call was abandoned meanwhile, so the slots never undercount the
threads at work. The checks' wall-clock backstop is unchanged (a check that took too long is
refused and never cached).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

from gateway.shares import Shares

T = TypeVar("T")

WORKERS = 4
"""Threads for heavy checks. The checks are mostly Python under one interpreter lock, so more
threads would not check faster; four let four agents' heavy checks proceed side by side."""
WORKERS_PER_AGENT = 1
"""Workers one agent may hold at once. One: an agent's heavy checks run one after another
(they could not run faster side by side), and every extra busy thread lengthens the turns
the event loop waits for (measured: a second thread of the same agent doubled the other
agents' latency and pushed some checks past the wall-clock backstop)."""
WORKER_WAIT_S = 1.0
"""How long a heavy check over its agent's share waits for a worker before 429."""


class CheckWorkers:
    """A thread pool for heavy checks, shared out per agent. The threads start on first use
    and stop with ``close``."""

    def __init__(
        self,
        capacity: int = WORKERS,
        per_agent: int = WORKERS_PER_AGENT,
        wait: float = WORKER_WAIT_S,
    ) -> None:
        self.shares = Shares("SQL check workers", capacity, per_agent)
        self.wait = wait
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.shares.capacity, thread_name_prefix="capgate-check"
            )
        return self._pool

    async def run(self, agent: str, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread, holding one of ``agent``'s share of workers until it
        ends; ``ConcurrencyLimited`` when no worker can be had within ``wait``."""
        await self.shares.acquire(agent, self.wait)
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor(), fn)
        except BaseException:
            self.shares.release(agent)
            raise

        def done(f: asyncio.Future[T]) -> None:
            self.shares.release(agent)
            if not f.cancelled():
                f.exception()  # retrieved: an abandoned check's refusal is not an error

        future.add_done_callback(done)
        # Shielded: a cancelled call leaves its check to finish (a thread cannot be stopped)
        # and the slot is given back when it does.
        return await asyncio.shield(future)

    def snapshot(self) -> dict[str, object]:
        return self.shares.snapshot()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
