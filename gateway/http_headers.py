"""HTTP header facts every part agrees on: which headers are hop-by-hop (RFC 9110 7.6.1)."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

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
