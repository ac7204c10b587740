"""``python -m gateway.healthcheck [URL]``: the container image's HEALTHCHECK.

Asks the running gateway's ``GET /_capgate/health`` and exits 0 when it answers 200, 1
otherwise (503 ``degraded``: the state store unreachable, the audit failing; no answer at
all). With ``--alive``, any HTTP answer counts (a liveness check: a gateway whose Redis is
down is alive and must not be restarted for it).

The address comes from the same ``CAPGATE_*`` variables the gateway reads (the image sets
them): the health listener (``CAPGATE_HEALTH_HOST``/``CAPGATE_HEALTH_PORT``) when there is
one, else the agents' port (``CAPGATE_HOST``/``CAPGATE_PORT``). A wildcard address
(``0.0.0.0``, ``::``) is asked on loopback. Settings given by flags or a ``--config`` file are
not seen: pass the URL then. Standard library only, so it starts in a few milliseconds.
"""

from __future__ import annotations

import http.client
import os
import sys
import urllib.parse
from collections.abc import Mapping, Sequence

HEALTH_PATH = "/_capgate/health"
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def health_url(environ: Mapping[str, str]) -> str:
    """Where the gateway configured by ``environ`` answers its health check."""
    host = environ.get("CAPGATE_HOST", "127.0.0.1")
    port = environ.get("CAPGATE_PORT", "8787")
    if environ.get("CAPGATE_HEALTH_PORT", "").strip():
        host = environ.get("CAPGATE_HEALTH_HOST", host)
        port = environ["CAPGATE_HEALTH_PORT"]
    host = WILDCARDS.get(host.strip(), host.strip())
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port.strip()}{HEALTH_PATH}"


def check(url: str, *, alive: bool = False, timeout: float = 3.0) -> tuple[bool, str]:
    """(healthy, what was seen)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return False, f"not an http:// URL: {url}"
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", parts.path or HEALTH_PATH, headers={"Connection": "close"})
        resp = conn.getresponse()
        resp.read(65536)
    except (OSError, http.client.HTTPException) as exc:
        return False, f"{url}: no answer ({exc})"
    finally:
        conn.close()
    ok = resp.status == 200 or alive
    return ok, f"{url}: {resp.status}"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    alive = "--alive" in args
    rest = [a for a in args if a != "--alive"]
    if len(rest) > 1 or any(a.startswith("-") for a in rest):
        print("usage: python -m gateway.healthcheck [--alive] [URL]", file=sys.stderr)
        return 2
    # A process of its own (not the gateway): it reads its environment here, and imports none
    # of gateway.config (which would cost the health check ~0.5 s of imports).
    given = os.environ if environ is None else environ  # noqa: TID251
    url = rest[0] if rest else health_url(given)
    ok, seen = check(url, alive=alive)
    print(seen, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
