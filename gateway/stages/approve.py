"""approve: hold a call whose rules require approval until a person decides."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from gateway.approvals import Approvals
from gateway.call import Call
from gateway.inflight import InFlight


class Approve:
    def __init__(self, approvals: Approvals, inflight: InFlight) -> None:
        self.approvals = approvals
        self.inflight = inflight

    def __call__(self, call: Call) -> Awaitable[None] | None:
        for op in call.operations:
            if op.governed and op.match is not None and op.match.rule.approval:
                return self._hold(call)
        return None

    async def _hold(self, call: Call) -> None:
        assert call.claims is not None and call.target is not None
        held = [
            op.match.rule.id
            for op in call.operations
            if op.governed and op.match is not None and op.match.rule.approval
        ]
        # While it waits, a revocation of its token, agent or run must still stop it.
        self.inflight.add(call, asyncio.current_task())
        call.approval, decision = await self.approvals.hold(
            agent=call.claims.agent,
            run=call.claims.run,
            rule=", ".join(dict.fromkeys(held)),
            method=call.method,
            target=call.raw_target.partition("?")[0],
            body=call.body,
        )
        call.approved_by = decision.by
