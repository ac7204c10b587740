"""dispatch: send the checked call through the transport (live upstream, recorder or replay).

The body sent is the one the checks read (``call.body``) or none: validate refuses a body
that no check of the rule takes, so no unchecked bytes are streamed past the gateway.
"""

from __future__ import annotations

from gateway.call import Call
from gateway.transport import Transport, UpstreamRequest


class Dispatch:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    async def __call__(self, call: Call) -> None:
        assert call.upstream is not None and call.target is not None
        assert call.outbound_headers is not None and call.claims is not None
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
        call.dispatched = True
        call.response = await self.transport.send(request)
