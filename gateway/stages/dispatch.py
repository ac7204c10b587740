"""dispatch: send the checked call through the transport (live upstream, recorder or replay)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.audit_record import BodyHasher, BodyMac
from gateway.call import Call
from gateway.errors import PayloadTooLarge, UpstreamError
from gateway.transport import Body, Transport, UpstreamRequest


class _BodyLimit:
    """Streams the agent's body to the upstream, stopping at the upstream's size limit."""

    def __init__(self, call: Call, limit: int, hasher: BodyHasher) -> None:
        self.call = call
        self.limit = limit
        self.exceeded = False
        self.hasher = hasher

    async def chunks(self) -> AsyncIterator[bytes]:
        assert self.call.request is not None
        size = 0
        try:
            async for chunk in self.call.request.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > self.limit:
                    self.exceeded = True
                    raise PayloadTooLarge(f"the request body is larger than {self.limit} bytes")
                self.hasher.update(chunk)
                yield chunk
        finally:
            self.call.request_digest = self.hasher.result()


class Dispatch:
    def __init__(self, transport: Transport, mac: BodyMac) -> None:
        self.transport = transport
        self.mac = mac

    async def __call__(self, call: Call) -> None:
        assert call.upstream is not None and call.target is not None
        assert call.outbound_headers is not None and call.claims is not None
        limit = call.upstream.max_request_body
        body: Body = call.body
        streamer: _BodyLimit | None = None
        if body is None and call.request is not None and call.request.body_exists:
            declared = call.request.content_length
            if declared is not None and declared > limit:
                raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
            await call.invite_body()
            streamer = _BodyLimit(call, limit, self.mac.stream())
            body = streamer.chunks()
        request = UpstreamRequest(
            upstream=call.upstream,
            method=call.method,
            target=call.target.forward_target,
            headers=call.outbound_headers,
            body=body,
            agent=call.claims.agent,
            run=call.claims.run,
            rule=call.match.rule if call.match is not None else None,
            injection=call.injection,
            request_id=call.request_id,
            roles=call.claims.roles,
            caps=call.claims.caps,
        )
        call.dispatched = True
        try:
            call.response = await self.transport.send(request)
        except (UpstreamError, OSError) as exc:
            if streamer is not None and streamer.exceeded:
                raise PayloadTooLarge(f"the request body is larger than {limit} bytes") from exc
            raise
