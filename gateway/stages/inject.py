"""inject: build the upstream headers from an allow-list and add the agent's credential.

Only headers that are known to be safe, that a matched rule names, or that the protocol
needs are forwarded. Whatever the agent sent as ``Authorization``, ``Cookie``, ``Proxy-*``,
``Host``, ``Forwarded`` or ``X-Forwarded-*`` never leaves the gateway, nor does any
hop-by-hop header or a header named in ``Connection``. The credential is added last, after
every check has passed.
"""

from __future__ import annotations

from collections.abc import Collection

from multidict import CIMultiDict

from gateway.call import Call
from gateway.credentials import Credentialing
from gateway.http_headers import HOP_BY_HOP, connection_named

# Range is not here: two ranges of an answer that reflects the credential could rebuild it
# past the mask; a rule lets it through by naming it under ``headers``.
FORWARDED_REQUEST_HEADERS = frozenset(
    {
        "accept",
        "accept-language",
        "content-type",
        "user-agent",
        "if-match",
        "if-none-match",
        "if-modified-since",
        "if-unmodified-since",
        "cache-control",
    }
)


class Inject:
    def __init__(self, credentials: Credentialing) -> None:
        self.credentials = credentials

    def __call__(self, call: Call) -> None:
        assert call.upstream is not None and call.claims is not None
        assert call.protocol is not None
        ops = call.operations
        named: Collection[str]
        if len(ops) == 1 and ops[0].match is not None:
            named = ops[0].match.rule.headers.keys()
        else:
            named = {h for op in ops if op.match is not None for h in op.match.rule.headers}
        dropped = connection_named(call.headers) if "Connection" in call.headers else ()
        extra = call.protocol.forwarded_headers
        prefixes = call.protocol.forwarded_header_prefixes
        pairs: list[tuple[str, str]] = []
        checked_type = call.content_type
        for name, value in call.headers.items():
            low = name.lower()
            if checked_type is not None and low == "content-type":
                continue  # replaced by the type the body was checked as
            if (
                low in FORWARDED_REQUEST_HEADERS
                or low in named
                or low in extra
                or (prefixes and low.startswith(prefixes))
            ) and (low not in dropped and low not in HOP_BY_HOP):
                pairs.append((name, value))
        if checked_type is not None:
            pairs.append(("Content-Type", checked_type))
        out: CIMultiDict[str] = CIMultiDict(pairs)
        out["Accept-Encoding"] = "identity"
        out["X-Request-Id"] = call.request_id
        injection = self.credentials.injection(
            call.upstream.name, call.upstream.credentials, call.claims.agent
        )
        if injection is not None:
            out[injection.header] = injection.value.reveal()
            call.injection = injection
        call.outbound_headers = out
