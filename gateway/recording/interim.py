"""Interim wiring of the two pipeline hooks recording needs, until the lead lands them.

Recording needs two things the pipeline does not give transports yet:

1. the token's ``roles`` and ``caps`` on each ``UpstreamRequest`` (for policy regression);
2. a call to ``gw.transport.observe_denial(denial_of(call))`` for every refused call.

The intended change is two lines in ``gateway/stages/dispatch.py`` / ``transports/base.py``
and three in ``gateway/pipeline.py`` (see ``docs/recording.md``, "Integration"). Until then,
``install()`` emulates exactly those lines by wrapping ``pipeline.dispatch`` and
``pipeline.decide``; it detects each hook once it is really wired and then leaves it alone,
so it is safe to keep calling. Used by ``make_example`` and ``tests/recording``; delete this
module when both hooks are in place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from gateway import pipeline
from gateway.stages import dispatch as dispatch_stage
from gateway.transports.base import UpstreamRequest

if TYPE_CHECKING:
    from gateway.tokens import Claims

_CLAIMS: ContextVar[Claims | None] = ContextVar("capgate_recording_claims", default=None)


def _roles() -> tuple[str, ...]:
    claims = _CLAIMS.get()
    return tuple(claims.roles) if claims is not None else ()


def _caps() -> frozenset[str] | None:
    claims = _CLAIMS.get()
    return claims.caps if claims is not None else None


@dataclass(slots=True)
class _RequestWithClaims(UpstreamRequest):
    roles: tuple[str, ...] = field(default_factory=_roles)
    caps: frozenset[str] | None = field(default_factory=_caps)


def request_claims_wired() -> bool:
    return "roles" in getattr(UpstreamRequest, "__dataclass_fields__", {})


def denials_wired() -> bool:
    return "observe_denial" in inspect.getsource(pipeline)


_installed = 0  # nested install() calls share one installation


def _swap(module: ModuleType, name: str, value: Any) -> Any:
    """Set a module global; return what it was."""
    namespace = vars(module)
    old = namespace[name]
    namespace[name] = value
    return old


def install() -> Callable[[], None]:
    """Emulate the hooks not yet wired; returns a function that undoes it. Re-entrant."""
    global _installed
    _installed += 1
    if _installed > 1:
        return _release
    undo: list[Callable[[], None]] = []
    if not request_claims_wired():
        real_dispatch = vars(pipeline)["dispatch"]

        async def dispatch_with_claims(call: Any, gw: Any) -> None:
            token = _CLAIMS.set(call.claims)
            try:
                await real_dispatch(call, gw)
            finally:
                _CLAIMS.reset(token)

        _swap(pipeline, "dispatch", dispatch_with_claims)
        real_request = _swap(dispatch_stage, "UpstreamRequest", _RequestWithClaims)
        undo.append(lambda: _swap(pipeline, "dispatch", real_dispatch))
        undo.append(lambda: _swap(dispatch_stage, "UpstreamRequest", real_request))
    if not denials_wired():
        from gateway.recording.denial import denial_of

        real_decide = vars(pipeline)["decide"]

        async def decide_and_observe(call: Any, gw: Any) -> None:
            await real_decide(call, gw)
            if call.error is not None:
                observe = getattr(gw.transport, "observe_denial", None)
                if observe is not None:
                    observe(denial_of(call))

        _swap(pipeline, "decide", decide_and_observe)
        undo.append(lambda: _swap(pipeline, "decide", real_decide))
    _undo[:] = undo
    return _release


_undo: list[Callable[[], None]] = []


def _release() -> None:
    global _installed
    _installed -= 1
    if _installed == 0:
        for step in reversed(_undo):
            step()
        _undo.clear()
