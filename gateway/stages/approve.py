"""approve: hold a call whose rules require approval until a person decides.

What is held is the call as it will be forwarded (its body was read and checked before), so
the approval binds to it (``gateway/approvals.py``). An approval given under a policy that
is no longer in force when the decision arrives is refused (``approval_stale``): the person
approved the call as the old policy judged it.

MCP clients give up on a silent call after a few minutes: a held ``tools/call`` is answered
past its upstream's ``mcp: {approval_patience}`` (``approval_pending``, a tool result the
model reads, with the approval's id). Its approval stays pending; the same call sent again
(``protocols/mcp.approval_key``: same agent, run, upstream, tool and arguments, whatever its
JSON-RPC id) attaches to it, and runs once approved, once.

While it waits, a held ``tools/call`` whose client accepts an event stream and sent a
progress token is kept alive (``held_stream.py``): its answer becomes an event stream of
``notifications/progress`` every ``mcp: {approval_keepalive}``, and ``respond`` writes the
decision's answer on it. The notifications stop when the wait ends, however it ends.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable

from gateway.approvals import Approvals, Decision, HeldCall
from gateway.call import Call
from gateway.errors import ApprovalDenied, ApprovalPending, ApprovalStale
from gateway.held_stream import HeldStream
from gateway.inflight import InFlight
from gateway.protocols.mcp import (
    accepts_event_stream,
    approval_key,
    jsonrpc_error_body,
    progress_token,
)
from gateway.stages.route import PolicySource


class Approve:
    def __init__(self, approvals: Approvals, inflight: InFlight, policies: PolicySource) -> None:
        self.approvals = approvals
        self.inflight = inflight
        self.policies = policies

    def __call__(self, call: Call) -> Awaitable[None] | None:
        if call.taint is not None:
            return self._hold(call)
        for op in call.operations:
            if op.governed and op.match is not None and op.match.rule.approval:
                return self._hold(call)
        return None

    async def _hold(self, call: Call) -> None:
        assert call.claims is not None and call.target is not None and call.policy is not None
        held = [
            op.match.rule.id
            for op in call.operations
            if op.governed
            and op.match is not None
            and (op.match.rule.approval or (call.taint and op.match.rule.sensitive))
        ]
        call.held = True
        rules = ", ".join(dict.fromkeys(held))
        why = call.taint or f"rule {rules} requires approval"
        judged_by = call.policy.digest
        # While it waits, a revocation of its token, agent or run must still stop it.
        self.inflight.add(call, asyncio.current_task())
        stream = call.held_stream = _held_stream(call)
        try:
            call.approval, decision = await self._held(call, rules, why, judged_by, stream)
        except ApprovalDenied as exc:
            call.operator = exc.operator
            raise
        except ApprovalPending as exc:
            call.approval = exc.approval  # still pending: the audit line names it
            raise
        except asyncio.CancelledError:
            # Revoked or cut while it waited: its approval ends with it. (An agent that hung
            # up leaves it pending: its retry attaches to it.)
            key = self._key(call)
            if call.revoked is not None and key is not None:
                self.approvals.withdraw(key)
            raise
        finally:
            if stream is not None:
                await stream.stop()  # respond writes the answer on it, alone
        call.operator = decision.by
        if self.policies.policy.digest != judged_by:
            raise ApprovalStale(
                f"approval {call.approval} was given under policy {judged_by}, but policy "
                f"{self.policies.policy.digest} is in force now; the call was not forwarded: "
                "send it again to have it checked and held under the policy in force",
                rule=call.match.rule.id if call.match is not None else None,
            )

    @staticmethod
    def _key(call: Call) -> str | None:
        """What a held MCP tools/call sent again must match to attach to its approval."""
        if call.upstream is None or call.upstream.kind != "mcp":
            return None
        return approval_key(call)

    def _held(
        self, call: Call, rules: str, why: str, judged_by: str, stream: HeldStream | None
    ) -> Awaitable[tuple[str, Decision]]:
        assert call.claims is not None and call.upstream is not None
        key = self._key(call)
        # An MCP client gives up on a silent call: answered past the upstream's patience, the
        # approval stays pending for the same call sent again.
        patience = call.upstream.mcp_approval_patience if key is not None else None
        return self.approvals.hold(
            HeldCall(
                agent=call.claims.agent,
                run=call.claims.run,
                rule=rules,
                why=why,
                method=call.method,
                target=call.raw_target,
                body=call.body,
                tools=tuple(call.tools),
                policy=judged_by,
            ),
            key=key,
            patience=patience,
            on_wait=stream.waiting if stream is not None else None,
        )


def _held_stream(call: Call) -> HeldStream | None:
    """The event stream that keeps a held MCP tools/call alive, when its upstream sends
    keepalives and its client accepts an event stream and sent a progress token."""
    upstream = call.upstream
    if call.request is None or upstream is None or upstream.kind != "mcp":
        return None
    every = upstream.mcp_approval_keepalive
    if every is None or approval_key(call) is None or not accepts_event_stream(call):
        return None
    token = progress_token(call)
    if token is None:
        return None
    refusal = functools.partial(jsonrpc_error_body, call)
    return HeldStream(call.request, call.request_id, token, every, refusal)
