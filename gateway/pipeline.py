"""The stages of one call, in order. Read this to know what happens to a call.

    receive -> authenticate -> match_policy -> validate -> throttle -> approve -> inject
            -> dispatch (live upstream | recorder | replay) -> respond -> audit

Each check stage either returns or ends the call by raising a ``GatewayError``. Anything else
that escapes is a bug: it is logged with its traceback, and the call is denied with
``internal_error`` (fail closed); the agent gets only the request id.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.call import Call
from gateway.errors import GatewayError, InternalError, TokenRevoked
from gateway.recording.denial import denial_of
from gateway.stages.approve import approve
from gateway.stages.audit import audit
from gateway.stages.authenticate import authenticate, check_revoked
from gateway.stages.dispatch import dispatch
from gateway.stages.inject import inject
from gateway.stages.match_policy import match_policy
from gateway.stages.receive import receive
from gateway.stages.respond import refusal, respond
from gateway.stages.throttle import throttle
from gateway.stages.validate import validate

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("capgate")

CHECKS = (receive, authenticate, match_policy, validate, throttle, approve, inject)


def new_request_id() -> str:
    return os.urandom(8).hex()


async def decide(call: Call, gw: Gateway) -> None:
    """Run every check stage; ``call.error`` says why the call was refused, if it was."""
    try:
        for stage in CHECKS:
            await stage(call, gw)
    except GatewayError as exc:
        call.error = exc
    except Exception as exc:
        _deny_bug(call, exc)


def _deny_bug(call: Call, exc: Exception) -> None:
    """A bug: the traceback goes to the log, the call is denied, the agent learns nothing."""
    log.exception("internal error in request %s", call.request_id)
    call.error = InternalError.wrap(exc)


async def run(request: web.BaseRequest, gw: Gateway) -> web.StreamResponse:
    call = Call(
        method=request.method,
        raw_target=request.raw_path,
        headers=request.headers,
        request_id=new_request_id(),
        request=request,
    )
    task = asyncio.current_task()
    try:
        await decide(call, gw)
        if call.error is not None:
            try:
                gw.transport.observe_denial(denial_of(call))
            except Exception:  # a recorder's failure must not change an answer already decided
                log.exception("could not record the denial of request %s", call.request_id)
        else:
            gw.inflight.add(call, task)
            try:
                # A revocation that arrived since the token was checked still stops the call.
                check_revoked(call, gw)
                await dispatch(call, gw)
            except GatewayError as exc:
                call.error = exc
            except Exception as exc:
                _deny_bug(call, exc)
        return await respond(call, gw, request)
    except asyncio.CancelledError:
        # A revocation cancels the calls in flight of the revoked token, agent or run; the
        # upstream connection was closed as the cancellation unwound through the transport.
        if call.revoked is None or task is None:
            raise
        task.uncancel()
        call.error = call.revoked
        if call.streaming:
            if request.transport is not None:
                request.transport.close()
            raise
        return refusal(call, call.revoked)
    finally:
        gw.inflight.discard(call)
        audit(call, gw)


class InFlight:
    """Calls being forwarded, so that a revocation can cancel them."""

    def __init__(self) -> None:
        self._calls: dict[Call, asyncio.Task[Any]] = {}

    def add(self, call: Call, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._calls[call] = task

    def discard(self, call: Call) -> None:
        self._calls.pop(call, None)

    def __len__(self) -> int:
        return len(self._calls)

    def cancel(self, kind: str, value: str) -> int:
        """Cancel every call whose token matches a new revocation; the number cancelled."""
        cancelled = 0
        for call, task in list(self._calls.items()):
            claims = call.claims
            if claims is None:
                continue
            hit = {"jti": claims.jti, "agent": claims.agent, "run": claims.run}.get(kind)
            if hit == value and call.revoked is None:
                call.revoked = TokenRevoked(f"this token's {kind} was revoked during the call")
                task.cancel()
                cancelled += 1
        return cancelled
