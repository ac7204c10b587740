"""``Denial``: a call the gateway refused before sending it, as recorders observe it.

``DenialRecorder`` is an observer of ended calls (listed in ``app.py`` when the mode records
or replays): for every call refused before it was sent, it hands ``denial_of(call)`` to its
``DenialSink``. The recorder writes it (so a recording holds the denials too, for replay
reports and policy regression); replay checks it against the recorded denials.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gateway.http_headers import HOP_BY_HOP

if TYPE_CHECKING:
    from gateway.audit_record import AuditRecord
    from gateway.call import Call

# The agent's headers kept with a denial: everything but routing and framing. Credentials
# (the agent's own Authorization) are kept by name only; the writer redacts their values.
DENIAL_DROP_HEADERS = HOP_BY_HOP | {"host", "content-length"}


@dataclass(frozen=True, slots=True)
class Denial:
    """A refused call: who, what, and why."""

    request_id: str
    agent: str | None  # None when the token itself was refused
    run: str | None
    upstream: str | None  # None when the target could not be parsed
    method: str
    target: str  # relative to the upstream; the agent's raw target when upstream is None
    body: bytes | None  # as far as the checks read it; None when never read
    headers: tuple[tuple[str, str], ...]
    reason: str
    rule: str | None
    status: int
    roles: tuple[str, ...] = ()
    caps: frozenset[str] | None = None
    wall: float = field(default=0.0, compare=False)


def denial_of(call: Call) -> Denial:
    """The ``Denial`` for a call whose checks refused it (``call.error`` is set)."""
    err = call.error
    assert err is not None
    claims = call.claims
    target = call.target
    headers = tuple(
        (name, value)
        for name, value in call.headers.items()
        if name.lower() not in DENIAL_DROP_HEADERS
    )
    return Denial(
        request_id=call.request_id,
        agent=claims.agent if claims else None,
        run=claims.run if claims else None,
        upstream=target.upstream if target else None,
        method=call.method,
        target=target.forward_target if target else call.raw_target,
        body=call.body,
        headers=headers,
        reason=err.reason.value,
        rule=call.rule_id,
        status=err.status,
        roles=tuple(claims.roles) if claims else (),
        caps=claims.caps if claims else None,
        wall=call.wall_started,
    )


class DenialSink(Protocol):
    def observe_denial(self, denial: Denial) -> None:
        """A call the checks refused (never sent)."""


class DenialRecorder:
    """Observer of ended calls: tells its sink of each call refused before it was sent."""

    def __init__(self, sink: DenialSink) -> None:
        self.sink = sink

    def call_ended(self, call: Call, records: Sequence[AuditRecord]) -> None:
        if call.error is None or call.dispatched:
            return
        self.sink.observe_denial(denial_of(call))
