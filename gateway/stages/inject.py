"""inject: build the upstream headers from an allow-list and add the agent's credential.

Only headers that are known to be safe, or that the rule names, are forwarded. Whatever the
agent sent as ``Authorization``, ``Cookie``, ``Proxy-*``, ``Host``, ``Forwarded`` or
``X-Forwarded-*`` never leaves the gateway, nor does any hop-by-hop header or a header named
in ``Connection``. The credential is added last, after every check has passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from multidict import CIMultiDict, CIMultiDictProxy

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.call import Call

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
        "range",
    }
)
# MCP Streamable HTTP headers, forwarded to MCP upstreams only. The routing headers
# (Mcp-Method, Mcp-Name, Mcp-Param-*) were checked against the JSON-RPC body by checks/mcp.py.
MCP_REQUEST_HEADERS = frozenset(
    {"mcp-session-id", "mcp-protocol-version", "last-event-id", "mcp-method", "mcp-name"}
)
MCP_PARAM_PREFIX = "mcp-param-"
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def connection_named(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    """Header names listed in ``Connection``: hop-by-hop by declaration (RFC 9110 7.6.1)."""
    names: set[str] = set()
    for value in headers.getall("Connection", ()):
        names.update(n.strip().lower() for n in value.split(",") if n.strip())
    return names


async def inject(call: Call, gw: Gateway) -> None:
    assert call.match is not None and call.upstream is not None and call.claims is not None
    rule = call.match.rule
    dropped = connection_named(call.headers)
    mcp = call.upstream.kind == "mcp"
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in call.headers.items():
        low = name.lower()
        if low in dropped or low in HOP_BY_HOP:
            continue
        if (
            low in FORWARDED_REQUEST_HEADERS
            or low in rule.headers
            or (mcp and (low in MCP_REQUEST_HEADERS or low.startswith(MCP_PARAM_PREFIX)))
        ):
            out.add(name, value)
    out["Accept-Encoding"] = "identity"
    out["X-Request-Id"] = call.request_id
    injection = gw.credentials.injection(
        call.upstream.name, call.upstream.credentials, call.claims.agent
    )
    if injection is not None:
        out[injection.header] = injection.value.reveal()
        call.injection = injection
    call.outbound_headers = out
