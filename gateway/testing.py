"""Helpers for testing a stage on its own: build a call and the collaborators it needs.

    policy = policy_from_text(POLICY_YAML)
    call = make_call("POST", "/db/query", body=b'{"sql": "SELECT 1"}', roles=["analyst"])
    await run_stages(call, *matching(policy), Validate())

``make_call`` gives the call verified ``Claims`` (as if ``authenticate`` had passed) unless
``roles`` is None. Anything that crosses HTTP is tested against the real mock servers in
``mocks/`` instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from multidict import CIMultiDict

from gateway.audit_record import AuditRecord
from gateway.call import Call
from gateway.policy.load import load_policy
from gateway.policy.model import Policy
from gateway.tokens import Claims

__all__ = [
    "CollectingObserver",
    "FixedPolicy",
    "make_call",
    "make_claims",
    "policy_from_text",
    "matching",
    "run_stages",
]


def matching(policy: Policy) -> tuple[Callable[[Call], Awaitable[None] | None], ...]:
    """The stages that read a call and match it to ``policy`` (receive, route, match)."""
    from gateway.protocols import PROTOCOLS
    from gateway.stages.match_policy import MatchPolicy
    from gateway.stages.receive import Receive
    from gateway.stages.route import Route

    return (Receive(), Route(FixedPolicy(policy), PROTOCOLS), MatchPolicy())


async def run_stages(call: Call, *stages: Callable[[Call], Awaitable[None] | None]) -> Call:
    """Run stages on ``call`` in order, as the pipeline does (awaiting those that wait)."""
    for stage in stages:
        pending = stage(call)
        if pending is not None:
            await pending
    return call


def make_claims(
    agent: str = "test-agent",
    roles: Iterable[str] = (),
    *,
    caps: Iterable[str] | None = None,
    run: str | None = None,
    jti: str = "test-jti",
) -> Claims:
    """Claims as ``authenticate`` would set them for a valid token."""
    return Claims.assumed(agent, roles, caps=caps, run=run, jti=jti, issuer="capgate")


def make_call(
    method: str = "GET",
    target: str = "/",
    *,
    headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    body: bytes | None = None,
    roles: Iterable[str] | None = None,
    agent: str = "test-agent",
    caps: Iterable[str] | None = None,
    run: str | None = None,
    request_id: str = "test-request",
) -> Call:
    """A call as the agent sent it; with ``roles``, also as ``authenticate`` left it."""
    hdrs: CIMultiDict[str] = CIMultiDict(headers or ())
    if body is not None and "Content-Type" not in hdrs:
        hdrs["Content-Type"] = "application/json"
    call = Call(method=method, raw_target=target, headers=hdrs, request_id=request_id, body=body)
    if roles is not None:
        call.claims = make_claims(agent, roles, caps=caps, run=run)
    return call


def policy_from_text(text: str, name: str = "policy.yaml") -> Policy:
    """A policy compiled from YAML text (``PolicyError`` lists every problem)."""
    return load_policy(name, text=text)


@dataclass
class FixedPolicy:
    """A ``PolicySource`` that always gives the same policy."""

    policy: Policy


@dataclass
class CollectingObserver:
    """An observer of ended calls that keeps what it was told."""

    ended: list[tuple[Call, Sequence[AuditRecord]]] = field(default_factory=list)

    def call_ended(self, call: Call, records: Sequence[AuditRecord]) -> None:
        self.ended.append((call, records))

    @property
    def records(self) -> list[AuditRecord]:
        return [record for _, records in self.ended for record in records]
