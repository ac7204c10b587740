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

With Redis state the pending approvals are published on a shared board
(``gateway/state/approval_board.py``): a console attached to any gateway of the fleet lists
them all and may decide any of them, exactly once; the holding gateway reads the decisions
of its pending approvals a few times a second. With memory state the board is this process.

A held MCP ``tools/call`` outlives its caller (``hold(key=..., patience=...)``): past the
patience the caller is answered ``approval_pending`` and the approval stays pending in a
task of its own until its deadline; a call with the same key (``protocols/mcp.approval_key``)
attaches to it. Once decided it is remembered for another ``timeout``: the first call with
its key to come takes an approval (the others are held anew), a denial or expiry answers
every one. The record keeps its agent's slot until it is decided; a revocation of the call
that waits on it withdraws it. Each call waiting on a record, the one that opened it or one
attached to it, takes a slot of its agent's share of waiting calls (``waiting``), so sending
a held call again and again cannot hold more of the agent's connections (CG-2026-36).

Fail closed: without an admin listener nobody could approve, so a policy that requires
approval is refused at start (and on reload) instead of holding calls for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.approval_checks import digests, masked_values, matches
from gateway.errors import ApprovalDenied, ApprovalPending, ApprovalTimeout, StateUnavailable
from gateway.recording.redact import Redactor
from gateway.shares import Shares
from gateway.state.approval_board import POLL_S, ApprovalBoard, LocalApprovalBoard

log = logging.getLogger("capgate")

MAX_PENDING = 1000
MAX_REASON = 500  # characters of an operator's note on a decision
SHOWN_BODY = 64 * 1024  # bytes of a held body shown to approvers (its digest covers all)
_REDACTOR = Redactor()

Outcome = Literal["decided", "not_found", "mismatch"]
CheckOutcome = Literal["equal", "different", "not_found", "not_checkable"]


def _masked_of(body: bytes | None) -> dict[str, str]:
    """The values the approvers' view masks, by path, for checks (``approval_checks.py``)."""
    if body is None or len(body) > SHOWN_BODY:
        return {}
    return masked_values(body, _REDACTOR.body(body).data)


@dataclass(frozen=True, slots=True)
class Decision:
    approved: bool
    by: str  # the operator's name
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"approved": self.approved, "by": self.by, "reason": self.reason}

    @classmethod
    def of(cls, data: dict[str, Any]) -> Decision:
        return cls(bool(data.get("approved")), str(data.get("by", "")), str(data.get("reason", "")))


EXPIRED = Decision(False, "", "expired")


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
    key: str | None = None  # what a call sent again must match to attach to it
    life: asyncio.Task[Decision] = field(init=False, repr=False)
    taken: bool = False  # approved and taken by a call: nobody else attaches to it
    linger: asyncio.TimerHandle | None = field(default=None, repr=False)
    # masked values an approver may check (approval_checks.py): path -> value, never shown
    masked: dict[str, str] = field(default_factory=dict, repr=False)
    digesting: asyncio.Task[None] | None = field(default=None, repr=False)

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
            "checkable": sorted(self.masked),
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
        board: ApprovalBoard | None = None,
    ) -> None:
        self.timeout = timeout
        self._pending: dict[str, Pending] = {}  # undecided
        self._keyed: dict[str, Pending] = {}  # by key: undecided, or decided and not taken
        self.slots = Shares("calls held for approval", capacity, per_agent)
        # Calls waiting for a decision, attached to an approval of their own or to another's
        # (the same MCP call sent again): each takes one, so repeating a held call cannot
        # hold more of the agent's connections than its share (CG-2026-36).
        self.waiting = Shares("calls waiting for approval", capacity, per_agent)
        self.on_event = on_event
        self.board: ApprovalBoard = board if board is not None else LocalApprovalBoard()
        self._poller: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def count(self) -> int:
        """Calls held now (read by the metrics' collection, from another thread)."""
        return len(self._pending)

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

    def held_here(self) -> int:
        return len(self._pending)

    async def pending(self) -> list[dict[str, Any]]:
        """Every pending approval on the board (the whole fleet's, with Redis state)."""
        if not self.board.shared:
            return [p.public() for p in self._pending.values()]
        now = time.time()
        records = await self.board.listing()
        for record in records:
            record.setdefault("checkable", [])
            record["expires_in_s"] = max(0, round(float(record.get("expires_at", now)) - now))
        return records

    async def check(self, approval_id: str, path: str, value: str) -> CheckOutcome:
        """Whether the masked value at ``path`` of a pending approval's body is ``value``
        (``approval_checks.py``): ``equal``, ``different``, ``not_found`` (no such pending
        approval) or ``not_checkable`` (no masked value there)."""
        pending = self._pending.get(approval_id)
        if pending is not None:  # held here: against the held value itself
            if pending.decided.done():
                return "not_found"
            held = pending.masked.get(path)
            if held is None:
                return "not_checkable"
            # (JSON may carry a lone surrogate, on either side: compared as the digests are.)
            same = hmac.compare_digest(
                held.encode("utf-8", "surrogatepass"), value.encode("utf-8", "surrogatepass")
            )
            return "equal" if same else "different"
        checks = await self.board.checks_of(approval_id) if self.board.shared else None
        if checks is None:
            return "not_found"
        entry = checks.get(path)
        if not isinstance(entry, list) or len(entry) != 2:
            return "not_checkable"
        equal = await asyncio.to_thread(matches, value, entry)
        return "equal" if equal else "different"

    async def _digests(self, pending: Pending) -> None:
        """The fleet's way to check a masked value of a call held here: salted scrypt
        digests on the board (computed off the loop, after the call is published)."""
        try:
            checks = await asyncio.to_thread(digests, pending.masked)
            await self.board.set_checks(pending.id, checks)
        except StateUnavailable as exc:
            log.warning("approvals: cannot publish checks of %s: %s", pending.id, exc.detail)

    async def decide(
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
        decision = Decision(approve, by, reason[:MAX_REASON])
        outcome = await self.board.claim(approval_id, decision.as_dict(), body_sha256)
        if outcome == "decided":
            self._settle(approval_id, decision)
        return outcome

    def _settle(self, approval_id: str, decision: Decision) -> None:
        """A decision taken on the board reaches the held call, if it is held here."""
        pending = self._pending.get(approval_id)
        if pending is None or pending.decided.done():
            return
        pending.decided.set_result(decision)
        self._tell(pending, "approved" if decision.approved else "denied", decision)

    async def _poll(self) -> None:
        """Read the board's decisions of the calls held here (other gateways' consoles)."""
        try:
            while self._pending:
                await asyncio.sleep(POLL_S)
                ids = [i for i, p in self._pending.items() if not p.decided.done()]
                try:
                    found = await self.board.decisions(ids)
                except StateUnavailable as exc:
                    log.warning("approvals: cannot read decisions: %s", exc.detail)
                    continue
                for approval_id, data in found.items():
                    self._settle(approval_id, Decision.of(data))
        finally:
            self._poller = None

    async def hold(
        self,
        call: HeldCall,
        *,
        key: str | None = None,
        patience: float | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> tuple[str, Decision]:
        """Wait for a decision; return the approval id and the decision when approved, raise
        otherwise (``ConcurrencyLimited`` when the agent already has its share held).

        With a ``key`` (what makes two calls the same call, the request id aside) the
        approval outlives its caller: past ``patience`` seconds ``ApprovalPending`` is
        raised and the record stays pending until its deadline; a call with the same key
        attaches to it. An approval is taken by one call only: the others attached to it
        are held anew (a new approval). ``on_wait`` is told the id of each approval the call
        starts waiting on (the held stream's notifications name it).

        Each call waiting here takes a slot of its agent's share of waiting calls, whether it
        opened the approval or attached to one (``ConcurrencyLimited`` past it)."""
        if not self.waiting.try_acquire(call.agent):
            raise self.waiting.refusal(call.agent)
        try:
            return await self._hold(call, key, patience, on_wait)
        finally:
            self.waiting.release(call.agent)

    async def _hold(
        self,
        call: HeldCall,
        key: str | None,
        patience: float | None,
        on_wait: Callable[[str], None] | None,
    ) -> tuple[str, Decision]:
        while True:
            pending = self._keyed.get(key) if key is not None else None
            if pending is None:
                pending = await self._open(call, key)
            if on_wait is not None:
                on_wait(pending.id)
            try:
                decision = await asyncio.wait_for(asyncio.shield(pending.life), patience)
            except TimeoutError:
                raise ApprovalPending(
                    f"this call awaits a person's approval (approval {pending.id}); it was not "
                    "forwarded: call the tool again with the same arguments to continue it, "
                    "it runs once approved",
                    approval=pending.id,
                    rule=call.rule,
                ) from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling() == 0 and not self._closing:
                    continue  # not this call: the approval was withdrawn by another's end
                if key is None:  # nobody can attach to it: it ends with its caller
                    pending.life.cancel()
                raise
            if not decision.approved or not pending.taken:
                break
            # Another call with the same key took this approval: this one is a new call.
        return self._take(pending, decision)

    async def _open(self, call: HeldCall, key: str | None) -> Pending:
        if not self.slots.try_acquire(call.agent):
            raise self.slots.refusal(call.agent)
        approval_id = os.urandom(8).hex()
        now = time.time()
        pending = Pending(
            id=approval_id,
            call=call,
            body_sha256=None if call.body is None else hashlib.sha256(call.body).hexdigest(),
            created=now,
            deadline=now + self.timeout,
            decided=asyncio.get_running_loop().create_future(),
            key=key,
            masked=_masked_of(call.body),
        )
        self._pending[approval_id] = pending
        if key is not None:
            self._keyed[key] = pending
        try:
            await self.board.publish(approval_id, pending.public(), pending.deadline)
        except BaseException:
            self._pending.pop(approval_id, None)
            self._forget_key(pending)
            self.slots.release(call.agent)
            raise
        self._tell(pending, "held")
        if self.board.shared and self._poller is None:
            self._poller = asyncio.create_task(self._poll(), name="capgate-approvals")
        if self.board.shared and pending.masked:
            pending.digesting = asyncio.create_task(self._digests(pending), name="capgate-digests")
        pending.life = asyncio.create_task(self._life(pending), name="capgate-approval")
        pending.life.add_done_callback(_retrieved)
        return pending

    async def _life(self, pending: Pending) -> Decision:
        """A pending approval from its creation to its decision (or expiry); a keyed one is
        then remembered for ``timeout`` more seconds, for the calls that come back for it."""
        try:
            decision = await self._wait(pending)
        except BaseException:
            self._forget_key(pending)
            raise
        finally:
            self._pending.pop(pending.id, None)
            self.slots.release(pending.call.agent)
            with contextlib.suppress(StateUnavailable):
                await self.board.forget(pending.id)
        if pending.key is not None and not pending.taken:
            loop = asyncio.get_running_loop()
            pending.linger = loop.call_later(self.timeout, self._forget_key, pending)
        return decision

    def withdraw(self, key: str) -> None:
        """The call that waits on the approval ``key`` was revoked or cut: the approval ends
        with it instead of staying pending for a retry."""
        pending = self._keyed.get(key)
        if pending is not None:
            self._forget_key(pending)
            pending.life.cancel()

    def _forget_key(self, pending: Pending) -> None:
        if pending.key is not None and self._keyed.get(pending.key) is pending:
            del self._keyed[pending.key]
        if pending.linger is not None:
            pending.linger.cancel()

    def _take(self, pending: Pending, decision: Decision) -> tuple[str, Decision]:
        """The decision for the call that takes it: an approval is taken once."""
        call = pending.call
        if decision is EXPIRED:
            raise ApprovalTimeout(
                f"nobody approved this call within {int(self.timeout)} s (approval {pending.id})",
                rule=call.rule,
            )
        if not decision.approved:
            note = f": {decision.reason}" if decision.reason else ""
            refused = ApprovalDenied(f"approval {pending.id} was declined{note}", rule=call.rule)
            refused.operator = decision.by
            raise refused
        pending.taken = True
        self._forget_key(pending)
        return pending.id, decision

    async def close(self) -> None:
        """End the pending approvals' waits (the gateway stops)."""
        self._closing = True
        lives = [p.life for p in self._keyed.values()] + [p.life for p in self._pending.values()]
        for life in lives:
            life.cancel()
        for pending in list(self._keyed.values()):
            self._forget_key(pending)
        await asyncio.gather(*lives, return_exceptions=True)

    async def _wait(self, pending: Pending) -> Decision:
        """The decision, or ``EXPIRED``: at the deadline the expiry claims the id like a
        decision would, so a decision racing it either wins whole or loses whole."""
        try:
            left = max(0.0, pending.deadline - time.time())
            return await asyncio.wait_for(asyncio.shield(pending.decided), left)
        except TimeoutError:
            pass
        if await self.board.claim(pending.id, EXPIRED.as_dict(), None) == "decided":
            self._tell(pending, "expired")
            return EXPIRED
        found = await self.board.decisions([pending.id])  # someone decided just in time
        if pending.id in found:
            self._settle(pending.id, Decision.of(found[pending.id]))
        if pending.decided.done():
            return pending.decided.result()
        self._tell(pending, "expired")
        return EXPIRED


def _retrieved(life: asyncio.Task[Decision]) -> None:
    """A detached approval's failure (the board unreachable at its expiry) was logged by
    nobody waiting: log it here."""
    if not life.cancelled() and life.exception() is not None:
        log.warning("approvals: a pending approval ended in error: %r", life.exception())
