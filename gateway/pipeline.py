"""The stages of one call, in order. Read this to know what happens to a call.

    receive -> route -> authenticate -> pause -> match_policy -> count_attempts -> validate
            -> throttle -> taint_gate -> approve -> inject
            -> audit the decision (written before anything is forwarded) -> taint_mark
            -> dispatch (live upstream | recorder | replay) -> respond -> audit (observers)

Each check stage either returns or ends the call by raising a ``GatewayError``. Anything else
that escapes is a bug: it is logged with its traceback, and the call is denied with
``internal_error`` (fail closed); the agent gets only the request id.

A stage is an object built once with the collaborators it uses (``Services``), and called
with the ``Call``. Nothing below this module knows how the gateway is wired.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.approvals import Approvals
from gateway.audit_record import BodyMac
from gateway.call import Call, CallObserver, CallProtocol, DecisionLog
from gateway.check_workers import CheckWorkers
from gateway.credentials import Credentialing
from gateway.errors import ClientClosed, GatewayError, GatewayStopping, InternalError
from gateway.inflight import InFlight
from gateway.shares import UpstreamShares
from gateway.stages.approve import Approve
from gateway.stages.audit import Audit
from gateway.stages.authenticate import Authenticate, RevocationCheck
from gateway.stages.count_attempts import CountAttempts
from gateway.stages.dispatch import Dispatch
from gateway.stages.inject import Inject
from gateway.stages.match_policy import MatchPolicy
from gateway.stages.pause import Pause
from gateway.stages.receive import Receive
from gateway.stages.respond import Respond
from gateway.stages.route import PolicySource, Route
from gateway.stages.throttle import Throttle
from gateway.stages.validate import Validate
from gateway.state.base import StateStore
from gateway.taint import TaintGate, TaintMark, Taints
from gateway.telemetry_plan import PHASES
from gateway.tokens import TokenVerifier
from gateway.transport import Transport

if TYPE_CHECKING:
    from gateway.telemetry import Telemetry

log = logging.getLogger("capgate")

# A stage returns None when it is done, or an awaitable when it must wait (a body to read,
# the state store, a person): most calls pass most stages without creating a coroutine.
Stage = Callable[[Call], Awaitable[None] | None]


@dataclass(frozen=True, eq=False)
class Services:
    """What the stages are built with; ``app.py`` builds one per process."""

    policies: PolicySource
    protocols: Mapping[str, CallProtocol]
    verifier: TokenVerifier
    state: StateStore
    credentials: Credentialing
    approvals: Approvals
    inflight: InFlight
    transport: Transport
    mac: BodyMac
    observers: Sequence[CallObserver]
    upstream_shares: UpstreamShares
    taints: Taints
    notify: Callable[[dict[str, Any]], None] | None = None  # the live event stream
    pause_hold: float = 300.0  # how long a call of a paused agent or run is held
    check_workers: CheckWorkers | None = None  # heavy payload checks off the event loop
    decisions: DecisionLog | None = None  # the audit trail: allowed decisions, before forwarding
    telemetry: Telemetry | None = None


# The check stages' names, in order (``Pipeline.checks``), for the phases tracing shows as
# child spans.
CHECK_STAGES = (
    "receive",
    "route",
    "authenticate",
    "pause",
    "match_policy",
    "count_attempts",
    "validate",
    "throttle",
    "taint_gate",
    "approve",
    "inject",
)


class _RequestIds:
    """Request ids: 8 bytes of the operating system's CSPRNG each, unguessable as before, drawn
    from a 4 KiB buffer (one ``getrandom`` call per 512 ids instead of one per call). A forked
    child starts with a fresh buffer, so no two processes hand out the same ids."""

    SIZE = 4096

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool = b""
        self._at = 0

    def __call__(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool = os.urandom(self.SIZE)
            at = 0
        self._at = at + 8
        return self._pool[at : at + 8].hex()


new_request_id = _RequestIds()


class Pipeline:
    """One call from the agent's request to the answer, the stages written down once."""

    def __init__(self, services: Services) -> None:
        self.inflight = services.inflight
        self.revocation = RevocationCheck(services.state)
        # Its ``changed`` is the store's on_pause listener (wired by app.running).
        self.pause = Pause(services.state, services.inflight, hold=services.pause_hold)
        self.checks: tuple[Stage, ...] = (
            Receive(),
            Route(services.policies, services.protocols),
            Authenticate(services.verifier, self.revocation),
            self.pause,
            MatchPolicy(),
            CountAttempts(services.state),
            Validate(services.check_workers),
            Throttle(services.state, on_evict=services.notify),
            TaintGate(services.taints),
            Approve(services.approvals, services.inflight, services.policies),
            Inject(services.credentials),
        )
        names = CHECK_STAGES
        assert len(names) == len(self.checks)
        telemetry = services.telemetry
        self.tracing = telemetry if telemetry is not None and telemetry.tracing else None
        if self.tracing is not None:
            self.tracing.phases = tuple(
                (span, names.index(first), names.index(after)) for span, first, after in PHASES
            )
        self.upstream_shares = services.upstream_shares
        self.taint_mark = TaintMark(services.taints)
        self.dispatch = Dispatch(services.transport, telemetry)
        self.respond = Respond(services.mac, services.taints)
        self.audit = Audit(services.mac, services.observers, services.decisions)

    async def decide(self, call: Call) -> None:
        """Run every check stage; ``call.error`` says why the call was refused, if it was."""
        marks = call.marks
        try:
            if marks is None:
                for stage in self.checks:
                    pending = stage(call)
                    if pending is not None:
                        await pending
            else:
                # Tracing: the end of each stage, for the child spans (built at the end).
                clock = time.monotonic
                for stage in self.checks:
                    pending = stage(call)
                    if pending is not None:
                        await pending
                    marks.append(clock())
        except GatewayError as exc:
            call.error = exc
        except Exception as exc:
            _deny_bug(call, exc)
        if marks is not None and call.error is not None:
            marks.append(time.monotonic())  # the end of the stage that refused the call

    async def run(self, request: web.BaseRequest) -> web.StreamResponse:
        call = Call(
            method=request.method,
            raw_target=request.raw_path,
            headers=request.headers,
            request_id=new_request_id(),
            request=request,
        )
        if self.tracing is not None:
            self.tracing.call_started(call)
        task = asyncio.current_task()
        try:
            await self.decide(call)
            if call.error is None:
                # The allowed decision is on record before anything is forwarded.
                pending = self.audit.decided(call)
                if pending is not None:
                    await pending
            if call.error is not None:
                return await self.respond(call)
            self.inflight.add(call, task)
            return await self.forward(call)
        except asyncio.CancelledError:
            # A revocation cancels the calls in flight of the revoked token, agent or run, and
            # the end of the shutdown grace cuts every call in flight (``call.revoked`` says
            # why); the upstream connection was closed as the cancellation unwound.
            if call.revoked is None or task is None:
                # The agent hung up (the server cancels the handler) or the gateway's
                # shutdown grace is over: the upstream was let go as the cancellation unwound.
                call.error = (
                    GatewayStopping("the gateway stopped before this call finished")
                    if self.inflight.stopping
                    else ClientClosed("the agent's connection closed before the answer")
                )
                raise
            task.uncancel()
            call.error = call.revoked
            if call.streaming:
                if request.transport is not None:
                    request.transport.close()
                raise
            # The refusal, or its event on the stream a held MCP call was kept alive on.
            return await self.respond(call)
        finally:
            self.inflight.discard(call)
            self.audit(call)

    async def forward(self, call: Call) -> web.StreamResponse:
        """Send the allowed call and answer with the upstream's response, holding one of the
        agent's share of calls in flight to that upstream from before it is sent until the
        answer has been passed on (an agent at its share waits for one of its own calls,
        never for other agents')."""
        assert call.upstream is not None and call.claims is not None
        up, agent = call.upstream, call.claims.agent
        shares = self.upstream_shares.of(up.name, up.concurrency, up.per_agent)
        if not shares.try_acquire(agent):  # the common case takes a slot without a coroutine
            try:
                await shares.acquire(agent, wait=up.connect_timeout)
            except GatewayError as exc:
                call.error = exc
                return await self.respond(call)
        try:
            try:
                # A revocation that arrived since the token was checked still stops it.
                self.revocation(call)
                marking = self.taint_mark(call)  # before untrusted content can come back
                if marking is not None:
                    await marking
                await self.dispatch(call)
            except GatewayError as exc:
                call.error = exc
            except Exception as exc:
                _deny_bug(call, exc)
            return await self.respond(call)
        finally:
            shares.release(agent)


def _deny_bug(call: Call, exc: Exception) -> None:
    """A bug: the traceback goes to the log, the call is denied, the agent learns nothing."""
    log.exception("internal error in request %s", call.request_id)
    call.error = InternalError.wrap(exc)
