"""The stages of one call, in order. Read this to know what happens to a call.

    receive -> authenticate -> match_policy -> validate -> throttle -> inject
            -> dispatch (live upstream | recorder | replay) -> respond -> audit

Each check stage either returns or ends the call by raising a ``GatewayError``. Anything else
that escapes is a bug: it is logged with its traceback, and the call is denied with
``internal_error`` (fail closed); the agent gets only the request id.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from aiohttp import web

from gateway.call import Call
from gateway.errors import GatewayError, InternalError
from gateway.stages.audit import audit
from gateway.stages.authenticate import authenticate
from gateway.stages.dispatch import dispatch
from gateway.stages.inject import inject
from gateway.stages.match_policy import match_policy
from gateway.stages.receive import receive
from gateway.stages.respond import respond
from gateway.stages.throttle import throttle
from gateway.stages.validate import validate

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("capgate")

CHECKS = (receive, authenticate, match_policy, validate, throttle, inject)


def new_request_id() -> str:
    return os.urandom(8).hex()


async def decide(call: Call, gw: Gateway) -> None:
    """Run every check stage; ``call.error`` says why the call was refused, if it was."""
    try:
        for stage in CHECKS:
            await stage(call, gw)
    except GatewayError as exc:
        call.error = exc
    except Exception as exc:  # a bug: deny the call, leak nothing
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
    try:
        await decide(call, gw)
        if call.error is None:
            try:
                await dispatch(call, gw)
            except GatewayError as exc:
                call.error = exc
            except Exception as exc:
                log.exception("internal error in request %s", call.request_id)
                call.error = InternalError.wrap(exc)
        return await respond(call, gw, request)
    finally:
        audit(call, gw)
