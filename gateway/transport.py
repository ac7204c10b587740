"""The one seam between the pipeline and the outside: ``Transport.send`` (and ``close``).

The implementations live in ``gateway/transports/``: live forwarding (``upstream.py``),
recording (``record.py``) and replay (``replay.py``), chosen once at start by mode
(``modes.py``, called from ``app.py``); no stage branches on the mode.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from multidict import CIMultiDict

from gateway.policy.model import Rule, Upstream

if TYPE_CHECKING:
    from gateway.credentials import Injection

Body = bytes | AsyncIterator[bytes] | None


@dataclass(slots=True)
class UpstreamRequest:
    """What is sent: the checked method, target (path + query) and body, exactly."""

    upstream: Upstream
    method: str
    target: str  # raw path and query, relative to the upstream's base path; starts with "/"
    headers: CIMultiDict[str]
    body: Body
    agent: str = ""
    run: str | None = None
    rule: Rule | None = None  # the rule that allowed the call (volatile fields, ids)
    injection: Injection | None = None  # the credential added (redacted by provenance)
    request_id: str = ""
    roles: tuple[str, ...] = ()  # the token's roles and caps: recordings keep them so that
    caps: frozenset[str] | None = None  # `policy test` can replay decisions under a new policy
    fault: str | None = None  # set by the chaos transport when it injected one (``chaos.py``)
    # The call's deadline (event-loop time), for a transport that keeps it itself (its class
    # says ``keeps_deadline = True``): the answer's head must come before it. Other transports
    # are held to it by the dispatch stage's own timer.
    deadline: float | None = None


class UpstreamResponse(Protocol):
    status: int
    reason: str
    headers: CIMultiDict[str]

    @property
    def complete(self) -> bool:
        """Whether the whole body is already here: reading it will not wait."""

    def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk, as it arrives."""

    async def read_all(self) -> bytes:
        """The whole body at once; only called when ``Content-Length`` declares a small one."""

    async def close(self) -> None:
        """Release the connection (abort it if the body was not read to its end)."""


class Transport(Protocol):
    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        """Send the request; raise ``UpstreamError`` (or ``ReplayMiss``) when no answer."""

    async def close(self) -> None:
        """Release pooled connections and files."""
