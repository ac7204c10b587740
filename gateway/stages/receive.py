"""receive: the call's canonical target, and a refusal of what its framing or headers would
let the upstream read differently from the gateway.

Nothing here needs the token or the body, so these refusals cost nothing and reveal nothing.
"""

from __future__ import annotations

from aiohttp import HttpVersion11

from gateway.call import Call
from gateway.errors import FramingAmbiguous, QueryInvalid, UnsupportedMediaType
from gateway.http_headers import connection_named
from gateway.target import parse_target

# ``Connection`` may say these; naming any other header makes it hop-by-hop, and dropping a
# header the policy checked (or the Content-Type a body check relied on) changes the call.
CONNECTION_OPTIONS = frozenset({"keep-alive", "close", "te"})


class Receive:
    def __call__(self, call: Call) -> None:
        headers = call.headers
        if "Content-Encoding" in headers:
            codings = {
                c.strip().lower()
                for value in headers.getall("Content-Encoding")
                for c in value.split(",")
            }
            if codings - {"identity", ""}:
                # SECURITY: a compressed upload is never inflated (a small gzip bomb costs
                # seconds of the event loop), and a check of compressed bytes checks nothing.
                raise UnsupportedMediaType("request bodies with a content coding are refused")
        if "Transfer-Encoding" in headers:
            request = call.request
            if request is not None and request.version < HttpVersion11:
                raise FramingAmbiguous("HTTP/1.0 has no Transfer-Encoding (RFC 9112 6.1)")
        if "Connection" in headers:
            named = connection_named(headers) - CONNECTION_OPTIONS
            if named:
                raise QueryInvalid(
                    f"the Connection header names {sorted(named)[:5]}: a header the gateway "
                    "may check is never dropped on the way"
                )
        call.target = parse_target(call.raw_target)
