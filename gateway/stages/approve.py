"""approve: hold a call whose rule requires approval until a person decides."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.call import Call


async def approve(call: Call, gw: Gateway) -> None:
    assert call.match is not None and call.claims is not None and call.target is not None
    rule = call.match.rule
    if not rule.approval:
        return
    # While it waits, a revocation of its token, agent or run must still stop it.
    gw.inflight.add(call, asyncio.current_task())
    call.approval = await gw.approvals.hold(
        agent=call.claims.agent,
        run=call.claims.run,
        rule=rule.id,
        method=call.method,
        target=call.raw_target.partition("?")[0],
        body=call.body,
    )
