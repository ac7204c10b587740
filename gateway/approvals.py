"""Held calls: a rule with ``approval: required`` waits for a person's decision.

The ``approve`` stage puts the call here and waits; a person decides through the admin API
(``gateway/admin.py``, its own listener with its own token) or ``capgate approvals``. The
call goes on when approved, ends with ``approval_denied`` when declined, and with
``approval_timeout`` when nobody decides before the deadline. Pending approvals belong to the
gateway that holds the call: the agent's connection is open there.

Fail closed: without an admin listener nobody could approve, so a policy that requires
approval is refused at start (and on reload) instead of holding calls for nothing.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import ApprovalDenied, ApprovalTimeout
from gateway.shares import Shares

MAX_PENDING = 1000
MAX_REASON = 500  # characters of an operator's note on a decision
BODY_PREVIEW = 4096


@dataclass(frozen=True, slots=True)
class Decision:
    approved: bool
    by: str  # the operator's name
    reason: str = ""


@dataclass
class Pending:
    id: str
    agent: str
    run: str | None
    rule: str
    method: str
    target: str
    body: str | None
    created: float
    deadline: float
    decided: asyncio.Future[Decision] = field(repr=False)

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "agent": self.agent,
            "run": self.run,
            "rule": self.rule,
            "method": self.method,
            "target": self.target,
            "body": self.body,
            "created": self.created,
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
        event = {
            "type": "approval",
            "state": state,
            "id": pending.id,
            "agent": pending.agent,
            "run": pending.run,
            "rule": pending.rule,
            "method": pending.method,
            "path": pending.target,
        }
        if decision is not None:
            event["operator"] = decision.by
            if decision.reason:
                event["note"] = decision.reason
        self.on_event(event)

    def pending(self) -> list[dict[str, Any]]:
        return [p.public() for p in self._pending.values()]

    def decide(self, approval_id: str, approve: bool, by: str, reason: str = "") -> bool:
        """Record a decision by the operator ``by``; False when there is no such pending
        approval (any more), so of two operators deciding at once exactly one wins."""
        pending = self._pending.get(approval_id)
        if pending is None or pending.decided.done():
            return False
        decision = Decision(approve, by, reason[:MAX_REASON])
        pending.decided.set_result(decision)
        self._tell(pending, "approved" if approve else "denied", decision)
        return True

    async def hold(
        self,
        *,
        agent: str,
        run: str | None,
        rule: str,
        method: str,
        target: str,
        body: bytes | None,
    ) -> tuple[str, Decision]:
        """Wait for a decision; return the approval id and the decision when approved, raise
        otherwise (``ConcurrencyLimited`` when the agent already has its share held)."""
        if not self.slots.try_acquire(agent):
            raise self.slots.refusal(agent)
        try:
            return await self._hold(agent, run, rule, method, target, body)
        finally:
            self.slots.release(agent)

    async def _hold(
        self,
        agent: str,
        run: str | None,
        rule: str,
        method: str,
        target: str,
        body: bytes | None,
    ) -> tuple[str, Decision]:
        approval_id = os.urandom(8).hex()
        now = time.time()
        preview = None
        if body:
            preview = body[:BODY_PREVIEW].decode("utf-8", "replace")
        pending = Pending(
            id=approval_id,
            agent=agent,
            run=run,
            rule=rule,
            method=method,
            target=target,
            body=preview,
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
                rule=rule,
            ) from None
        finally:
            self._pending.pop(approval_id, None)
        if not decision.approved:
            note = f": {decision.reason}" if decision.reason else ""
            raise ApprovalDenied(f"approval {approval_id} was declined{note}", rule=rule)
        return approval_id, decision
