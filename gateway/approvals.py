"""Held calls: a rule with ``approval: required`` waits for a person's decision.

The ``approve`` stage puts the call here and waits; an approver decides through the admin
API (``gateway/admin.py``) or ``capgate approvals``. The call goes on when approved, ends
with ``approval_denied`` when declined, and with ``approval_timeout`` when nobody decides
before the deadline. Pending approvals belong to the gateway that holds the call: the
agent's connection is open there.

An approval is bound to the exact call. The body was read and checked before the call is
held, and it is what will be forwarded; the approver is shown all of it (up to
``SHOWN_BODY``), with secret-looking values masked by the recordings' redactor, beside its
SHA-256, the full target (masked the same way), the MCP tools it runs, the policy's digest
and the expiry. A decision may name the digest the approver saw (``body_sha256``): if it is
not this call's, nothing is decided (``mismatch``). Each id releases one call, once: of two
operators deciding at the same moment exactly one decision counts. The ``approve`` stage
refuses an approved call if the policy changed while it waited (``approval_stale``).

Fail closed: without an admin listener nobody could approve, so a policy that requires
approval is refused at start (and on reload) instead of holding calls for nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.errors import ApprovalDenied, ApprovalTimeout
from gateway.recording.redact import Redactor
from gateway.shares import Shares

MAX_PENDING = 1000
MAX_REASON = 500  # characters of an operator's note on a decision
SHOWN_BODY = 64 * 1024  # bytes of a held body shown to approvers (its digest covers all)
_REDACTOR = Redactor()

Outcome = Literal["decided", "not_found", "mismatch"]


@dataclass(frozen=True, slots=True)
class Decision:
    approved: bool
    by: str  # the operator's name
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HeldCall:
    """What is held: the call as it will be forwarded, and why it waits."""

    agent: str
    run: str | None
    rule: str
    why: str
    method: str
    target: str  # path and query, as the agent sent them
    body: bytes | None
    tools: tuple[str, ...]
    policy: str  # digest of the policy that judged the call


@dataclass
class Pending:
    id: str
    call: HeldCall
    body_sha256: str | None
    created: float
    deadline: float
    decided: asyncio.Future[Decision] = field(repr=False)

    def public(self) -> dict[str, Any]:
        call = self.call
        body = call.body
        shown = None
        if body is not None:
            shown = _REDACTOR.body(body[:SHOWN_BODY]).data.decode("utf-8", "replace")
        return {
            "id": self.id,
            "agent": call.agent,
            "run": call.run,
            "rule": call.rule,
            "why": call.why,
            "method": call.method,
            "target": _REDACTOR.target(call.target),
            "tools": list(call.tools),
            "body": shown,
            "body_size": None if body is None else len(body),
            "body_truncated": body is not None and len(body) > SHOWN_BODY,
            "body_sha256": self.body_sha256,
            "policy": call.policy,
            "created": self.created,
            "expires_at": self.deadline,
            "expires_in_s": max(0, round(self.deadline - time.time())),
        }


class Approvals:
    """Pending approvals of this gateway: at most ``MAX_PENDING`` in all and ``per_agent`` of
    one agent at once (``Shares``), so one agent's held calls never refuse another's."""

    def __init__(
        self,
        timeout: float,
        *,
        per_agent: int = 10,
        capacity: int = MAX_PENDING,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.timeout = timeout
        self._pending: dict[str, Pending] = {}
        self.slots = Shares("calls held for approval", capacity, per_agent)
        self.on_event = on_event

    def _tell(self, pending: Pending, state: str, decision: Decision | None = None) -> None:
        if self.on_event is None:
            return
        call = pending.call
        event = {
            "type": "approval",
            "state": state,
            "id": pending.id,
            "agent": call.agent,
            "run": call.run,
            "rule": call.rule,
            "method": call.method,
            "path": call.target.partition("?")[0],
        }
        if decision is not None:
            event["operator"] = decision.by
            if decision.reason:
                event["note"] = decision.reason
        self.on_event(event)

    def pending(self) -> list[dict[str, Any]]:
        return [p.public() for p in self._pending.values()]

    def decide(
        self,
        approval_id: str,
        approve: bool,
        by: str,
        reason: str = "",
        *,
        body_sha256: str | None = None,
    ) -> Outcome:
        """Record a decision by the operator ``by``. ``not_found`` when there is no such
        pending approval (any more: of two operators deciding at once, exactly one wins);
        ``mismatch`` when ``body_sha256`` names another body than the held call's."""
        pending = self._pending.get(approval_id)
        if pending is None or pending.decided.done():
            return "not_found"
        if body_sha256 is not None and body_sha256 != (pending.body_sha256 or ""):
            return "mismatch"
        decision = Decision(approve, by, reason[:MAX_REASON])
        pending.decided.set_result(decision)
        self._tell(pending, "approved" if approve else "denied", decision)
        return "decided"

    async def hold(self, call: HeldCall) -> tuple[str, Decision]:
        """Wait for a decision; return the approval id and the decision when approved, raise
        otherwise (``ConcurrencyLimited`` when the agent already has its share held)."""
        if not self.slots.try_acquire(call.agent):
            raise self.slots.refusal(call.agent)
        try:
            return await self._hold(call)
        finally:
            self.slots.release(call.agent)

    async def _hold(self, call: HeldCall) -> tuple[str, Decision]:
        approval_id = os.urandom(8).hex()
        now = time.time()
        pending = Pending(
            id=approval_id,
            call=call,
            body_sha256=None if call.body is None else hashlib.sha256(call.body).hexdigest(),
            created=now,
            deadline=now + self.timeout,
            decided=asyncio.get_running_loop().create_future(),
        )
        self._pending[approval_id] = pending
        self._tell(pending, "held")
        try:
            decision = await asyncio.wait_for(asyncio.shield(pending.decided), self.timeout)
        except TimeoutError:
            self._tell(pending, "expired")
            raise ApprovalTimeout(
                f"nobody approved this call within {int(self.timeout)} s (approval {approval_id})",
                rule=call.rule,
            ) from None
        finally:
            self._pending.pop(approval_id, None)
        if not decision.approved:
            note = f": {decision.reason}" if decision.reason else ""
            raise ApprovalDenied(f"approval {approval_id} was declined{note}", rule=call.rule)
        return approval_id, decision
