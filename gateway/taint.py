"""Taint: a run that has read untrusted content needs a person for its sensitive calls.

A prompt injection needs three things: content a third party wrote, private data, and a way
out. capgate cannot read the agent's mind, but it sees the first and the last: an upstream or
rule marked ``trust: untrusted`` (web pages, mail, documents, chat messages) and a rule
marked ``sensitive: true`` (sending money or mail, writing data, sharing, changing
credentials, and tools that reach arbitrary destinations). Once a run has called an untrusted
source, every sensitive call of that run is held for approval (``when_tainted: approve``,
the default) or refused (``when_tainted: deny``, reason ``run_tainted``), and the approver and
the refusal are told why: which upstream, rule or tool tainted the run, and when.

* The taint is keyed by the run (the token's ``run`` claim), or by the token (``jti``) when
  it has no run. It never clears within a run; it lives in the state store (shared by the
  fleet with Redis) and, as well, in this gateway's own memory of the runs it tainted, so a
  store that restarts empty cannot clear a taint this gateway set.
* It is set *before* the untrusted call is forwarded (``TaintMark``, from ``Pipeline.forward``):
  untrusted content cannot reach the agent before the mark is written, so no sensitive call
  composed after reading it can race past the check.
* Fail closed: if the store cannot be read for a sensitive call, the run is treated as
  tainted; if the mark cannot be written, the untrusted call is refused
  (``state_unavailable``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.audit_record import timestamp
from gateway.call import Call
from gateway.errors import RunTainted, StateUnavailable
from gateway.state.base import StateStore

TAINT_TTL_S = 30 * 24 * 3600.0  # longer than any run is expected to live
REMEMBERED = 65_536  # runs this gateway remembers having tainted


def taint_key(call: Call) -> str | None:
    claims = call.claims
    if claims is None:
        return None
    return claims.run if claims.run else f"jti:{claims.jti}"


def untrusted_source(call: Call) -> str | None:
    """What makes this call read untrusted content, named for people; None if nothing."""
    upstream = call.upstream
    if upstream is not None and upstream.untrusted:
        return f"upstream {upstream.name}"
    for op in call.operations:
        # A protocol message (MCP handshake, listing, notification) is allowed by any rule on
        # the endpoint but reads nothing under it: only what a rule governs can taint.
        if op.governed and op.match is not None and op.match.rule.untrusted:
            tool = f" (tool {op.tool})" if op.tool else ""
            return f"rule {op.match.rule.id}{tool}"
    return None


class Taints:
    """The state store's taints, and this gateway's memory of the ones it set."""

    def __init__(
        self, state: StateStore, on_taint: Callable[[dict[str, Any]], None] | None
    ) -> None:
        self.state = state
        self.on_taint = on_taint
        self._mine: OrderedDict[str, dict[str, Any]] = OrderedDict()

    async def mark(self, key: str, cause: dict[str, Any]) -> None:
        if key in self._mine:
            return
        kept = await self.state.taint(key, cause, ttl_s=TAINT_TTL_S)
        self._mine[key] = kept
        if len(self._mine) > REMEMBERED:
            self._mine.popitem(last=False)
        # Ours when the store kept this cause (Redis hands back its own copy, equal, not the
        # same object): only the call that tainted the run announces it.
        if kept == cause and self.on_taint is not None:
            self.on_taint({"type": "taint", "key": key, **cause})

    async def of(self, key: str) -> dict[str, Any] | None:
        mine = self._mine.get(key)
        if mine is not None:
            return mine
        return await self.state.taint_of(key)


class TaintGate:
    """The check stage before ``approve``: a sensitive call of a tainted run is marked to be
    held (``call.taint``), or refused when its rule says ``when_tainted: deny``."""

    def __init__(self, taints: Taints) -> None:
        self.taints = taints

    def __call__(self, call: Call) -> Awaitable[None] | None:
        for op in call.operations:
            if op.governed and op.match is not None and op.match.rule.sensitive:
                return self._check(call)
        return None

    async def _check(self, call: Call) -> None:
        key = taint_key(call)
        if key is None:
            return
        try:
            cause = await self.taints.of(key)
        except StateUnavailable as exc:
            cause = {"source": "unknown: the state store could not be read", "detail": exc.detail}
        if cause is None:
            return
        sensitive = [
            op.match.rule
            for op in call.operations
            if op.governed and op.match is not None and op.match.rule.sensitive
        ]
        why = (
            f"run {key} read untrusted content ({cause.get('source')}, at {cause.get('time')}) "
            f"before this sensitive call ({', '.join(r.id for r in sensitive)})"
        )
        denying = [r for r in sensitive if r.when_tainted == "deny"]
        if denying:
            raise RunTainted(why + "; the rule refuses such calls", rule=denying[0].id)
        call.taint = why


class TaintMark:
    """Before an untrusted call is forwarded: the run is marked, once, for good."""

    def __init__(self, taints: Taints) -> None:
        self.taints = taints

    def __call__(self, call: Call) -> Awaitable[None] | None:
        source = untrusted_source(call)
        if source is None:
            return None
        key = taint_key(call)
        if key is None:
            return None
        assert call.claims is not None
        cause = {
            "source": source,
            "time": timestamp(time.time()),
            "agent": call.claims.agent,
            "run": call.claims.run,
            "request_id": call.request_id,
        }
        return self.taints.mark(key, cause)
