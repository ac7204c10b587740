"""approve: hold a call whose rules require approval until a person decides."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from gateway.approvals import Approvals
from gateway.call import Call
from gateway.inflight import InFlight
from gateway.recording.redact import DEFAULT_REDACTOR

REDACT_INLINE = 64 * 1024  # bytes of a held body masked on the event loop; more in a thread


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
            body=await _masked(call.body),
        )
        call.approved_by = decision.by


async def _masked(body: bytes | None) -> bytes | None:
    """The body as an approver is shown it (``GET /approvals``, the console).

    SECURITY: an approver sees what the agent sends, not the secrets in it: values under
    sensitive keys, token shapes and URL credentials are masked as in a recording
    (``gateway/recording/redact.py``); the upstream still gets every byte. About 0.6 s per
    MiB of JSON, so a large body is masked off the event loop."""
    if not body:
        return body
    if len(body) > REDACT_INLINE:
        return (await asyncio.to_thread(DEFAULT_REDACTOR.body, body)).data
    return DEFAULT_REDACTOR.body(body).data
