"""The approval webhook: a JSON POST to a configured URL when a call starts waiting for a
person, for chat or pager integrations (``--approval-webhook URL``).

It never slows a call: events go into a bounded queue, one background task posts them one
at a time with a short timeout, and when the queue is full (the receiver is down or slow)
the newest are dropped and counted (shown in health, logged once per minute), never waited
for. What is posted is the approval event of the live stream (ids, agent, run, rule,
method, path, why, expiry): never a body, query value or header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import aiohttp

log = logging.getLogger("capgate")

QUEUE = 256
TIMEOUT_S = 5.0


class ApprovalWebhook:
    def __init__(self, url: str, *, queue: int = QUEUE, timeout: float = TIMEOUT_S) -> None:
        self.url = url
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(queue)
        self._timeout = timeout
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._last_warning = 0.0

    def __call__(self, event: dict[str, Any]) -> None:
        """An event of the live stream; only calls starting to wait are posted."""
        if event.get("type") != "approval" or event.get("state") != "held":
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1
            self._warn(f"approval webhook: queue full, {self.dropped} event(s) dropped so far")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 60:
            self._last_warning = now
            log.warning("%s", message)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="capgate-approval-webhook")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def health(self) -> dict[str, int]:
        return {"sent": self.sent, "failed": self.failed, "dropped": self.dropped}

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                event = await self._queue.get()
                await self._post(session, event)

    async def _post(self, session: aiohttp.ClientSession, event: dict[str, Any]) -> None:
        body = json.dumps({"capgate": "approval_waiting", **event}).encode()
        try:
            async with session.post(
                self.url,
                data=body,
                headers={"Content-Type": "application/json"},
                allow_redirects=False,
            ) as resp:
                await resp.read()
                if resp.status >= 300:
                    raise aiohttp.ClientResponseError(
                        resp.request_info, (), status=resp.status, message=resp.reason or ""
                    )
            self.sent += 1
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.failed += 1
            self._warn(f"approval webhook {self.url}: {type(exc).__name__}: {exc}")
