"""dispatch: send the checked call through the transport (live upstream, recorder or replay).

The body sent is the one the checks read (``call.body``) or none: validate refuses a body
that no check of the rule takes, so no unchecked bytes are streamed past the gateway.

The upstream exchange has one deadline (the upstream's ``timeouts.total``), set here and kept
by ``respond`` while the answer streams: an upstream that trickles a byte at a time under its
read timeout still cannot hold the call past it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from gateway.call import Call
from gateway.errors import UpstreamTimeout
from gateway.transport import Transport, UpstreamRequest

if TYPE_CHECKING:
    from gateway.telemetry import Telemetry


class Dispatch:
    def __init__(self, transport: Transport, telemetry: Telemetry | None = None) -> None:
        self.transport = transport
        # A transport that keeps the call's deadline itself (the live one: its connection's
        # read timer does, so a call makes no timer of its own); any other is held to it here.
        self.keeps_deadline = bool(getattr(transport, "keeps_deadline", False))
        # Only when tracing: the upstream span, whose context goes upstream as traceparent.
        self.tracing = telemetry if telemetry is not None and telemetry.tracing else None

    async def __call__(self, call: Call) -> None:
        assert call.upstream is not None and call.target is not None
        assert call.outbound_headers is not None and call.claims is not None
        if self.tracing is not None:
            self.tracing.upstream_started(call)
        request = UpstreamRequest(
            upstream=call.upstream,
            method=call.method,
            target=call.target.forward_target,
            headers=call.outbound_headers,
            body=call.body,
            agent=call.claims.agent,
            run=call.claims.run,
            rule=call.match.rule if call.match is not None else None,
            injection=call.injection,
            request_id=call.request_id,
            roles=call.claims.roles,
            caps=call.claims.caps,
        )
        loop = asyncio.get_running_loop()
        call.deadline = loop.time() + call.upstream.total_timeout
        call.dispatched = True
        call.upstream_started = time.monotonic()
        if self.keeps_deadline:
            request.deadline = call.deadline
            try:
                call.response = await self.transport.send(request)
            finally:
                call.upstream_ended = time.monotonic()
                call.fault = request.fault
            return
        deadline = asyncio.timeout_at(call.deadline)
        try:
            async with deadline:
                call.response = await self.transport.send(request)
        except TimeoutError:
            if not deadline.expired():
                raise  # the transport's own (connect or read) timeout, already explained
            raise UpstreamTimeout(
                f"upstream {call.upstream.name!r} did not answer within the call's deadline "
                f"({call.upstream.total_timeout:g} s)"
            ) from None
        finally:
            call.upstream_ended = time.monotonic()
            call.fault = request.fault
