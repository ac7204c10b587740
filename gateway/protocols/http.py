"""Plain HTTP: one request is one operation, matched and checked as a whole."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.call import Operation

if TYPE_CHECKING:
    from gateway.call import Call, Refusal, Rewriter
    from gateway.errors import GatewayError
    from gateway.transport import UpstreamResponse


class PlainHttp:
    kind = "http"
    forwarded_headers: frozenset[str] = frozenset()
    forwarded_header_prefixes: tuple[str, ...] = ()

    async def inspect(self, call: Call) -> list[Operation]:
        return [Operation(kind="request", method=call.method)]

    def finish(self, call: Call) -> None:
        return None  # the body's checks rewrite the body itself (validate)

    def rewrite_response(self, call: Call, response: UpstreamResponse) -> Rewriter | None:
        return None

    def refusal(self, call: Call, err: GatewayError) -> Refusal | None:
        return None
