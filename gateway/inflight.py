"""Calls in flight (held for approval or being forwarded), so a revocation, or the end of the
shutdown grace, can cancel them with a reason the agent is told."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.call import Call
from gateway.errors import GatewayStopping, TokenRevoked


class InFlight:
    def __init__(self) -> None:
        self._calls: dict[Call, asyncio.Task[Any]] = {}
        # Set when the shutdown grace is over: a call cancelled from then on was cut by the
        # gateway (gateway_stopping), not abandoned by its agent (client_closed).
        self.stopping = False

    def add(self, call: Call, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._calls[call] = task

    def discard(self, call: Call) -> None:
        self._calls.pop(call, None)

    def __len__(self) -> int:
        return len(self._calls)

    def calls(self) -> list[Call]:
        return list(self._calls)

    def cancel(self, kind: str, value: str, by: str | None = None) -> int:
        """Cancel every call whose token matches a new revocation (by the operator ``by``,
        when this gateway knows); the number cancelled."""
        cancelled = 0
        for call, task in list(self._calls.items()):
            claims = call.claims
            if claims is None:
                continue
            hit = {"jti": claims.jti, "agent": claims.agent, "run": claims.run}.get(kind)
            if hit == value and call.revoked is None:
                call.revoked = TokenRevoked(f"this token's {kind} was revoked during the call")
                call.operator = by
                task.cancel()
                cancelled += 1
        return cancelled

    def cut_all(self) -> int:
        """The shutdown grace is over: cancel every call still in flight, each answered (if its
        answer has not started) and audited as ``gateway_stopping``; the number cut."""
        self.stopping = True
        cut = 0
        for call, task in list(self._calls.items()):
            if call.revoked is None:
                call.revoked = GatewayStopping("the gateway stopped before this call finished")
                task.cancel()
                cut += 1
        return cut
