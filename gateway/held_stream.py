"""The event stream that keeps a held MCP call alive until its answer.

MCP clients give up on a silent call. A ``tools/call`` held for approval whose client
accepts ``text/event-stream`` and sent a progress token (``params._meta.progressToken``) is
answered with an event stream as soon as it starts waiting (MCP Streamable HTTP: 200,
``Content-Type: text/event-stream``, the request's notifications, then its response, then
the end of the stream). While it waits, a ``notifications/progress`` for that token every
``mcp: {approval_keepalive}`` ("capgate: awaiting approval <id>", progress 1, 2, 3...); once
decided, the answer the gateway would have given in a body (the upstream's JSON-RPC
messages, masked and filtered as ever, or the refusal) is written as the stream's last
events by ``respond``.

The notifications are written by a task of their own while the call's task waits for the
decision; ``stop`` ends it (and waits for it) before anybody else writes, so the stream has
one writer at a time. A write that fails means the agent went away: the task ends quietly
(the server cancels the agent's handler when its connection closes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable

from aiohttp import web

from gateway.errors import GatewayError

log = logging.getLogger("capgate")

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def sse_message(data: bytes) -> bytes:
    """One JSON-RPC message (or batch) as one SSE ``message`` event: a ``data:`` line per line
    of it (a client joins them with line feeds, which JSON reads as blanks)."""
    lines = b"".join(b"data: " + line + b"\n" for line in _LINE_BREAK.split(data))
    return b"event: message\n" + lines + b"\n"


class HeldStream:
    """The answer to one held MCP POST, as an event stream opened while it waits."""

    def __init__(
        self,
        request: web.BaseRequest,
        request_id: str,
        token: str | int,
        every: float,
        refusal: Callable[[GatewayError], bytes | None],
    ) -> None:
        self.request = request
        self.request_id = request_id
        self.token = token  # the request's progressToken
        self.every = every  # seconds between two notifications
        # The JSON-RPC answer to the request for a refusal, from its protocol.
        self.refusal = refusal
        self.response: web.StreamResponse | None = None  # once the stream has begun
        self.approval: str | None = None  # the approval the call waits on
        self.progress = 0
        self._ticker: asyncio.Task[None] | None = None

    def waiting(self, approval: str) -> None:
        """The call waits on ``approval`` (told again if it waits on another): notifications
        begin now, naming it."""
        self.approval = approval
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick(), name="capgate-keepalive")

    async def _tick(self) -> None:
        try:
            while True:
                await self._notify()
                await asyncio.sleep(self.every)
        except OSError:  # ConnectionResetError, aiohttp's ClientConnectionResetError...
            log.debug("request %s: the agent left while its call was held", self.request_id)
        except Exception:  # a bug: logged here, the call goes on waiting without keepalives
            log.exception("request %s: the held call's keepalive failed", self.request_id)

    async def _notify(self) -> None:
        if self.response is None:
            response = web.StreamResponse(
                status=200,
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-store",
                    "X-Request-Id": self.request_id,
                },
            )
            await response.prepare(self.request)
            self.response = response
        self.progress += 1
        note = {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {
                "progressToken": self.token,
                "progress": self.progress,
                "message": f"capgate: awaiting approval {self.approval}",
            },
        }
        data = json.dumps(note, separators=(",", ":")).encode()
        await self.response.write(sse_message(data))

    async def stop(self) -> None:
        """No more notifications: the call was decided (or ended). Returns once the task that
        wrote them is over, so whoever writes next writes alone."""
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.cancel()
            await asyncio.wait((ticker,))  # raises only if this task itself is cancelled

    async def send(self, data: bytes) -> None:
        """One JSON-RPC message (or batch) as an event."""
        assert self.response is not None
        await self.response.write(sse_message(data))

    async def write(self, chunk: bytes) -> None:
        """Bytes of an event stream as they are (relayed from the upstream's)."""
        assert self.response is not None
        await self.response.write(chunk)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()
