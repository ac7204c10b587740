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

Finer taint (``taint_arguments``, ``gateway/taint_reads.py``): when the policy has a rule
with it, the answer of each untrusted call is read (up to ``RESPONSE_CAP``), normalised and
appended to the run's record in the state store *before any of it is passed to the agent*
(``Respond``); a record that cannot be written refuses the answer. A sensitive call of a
tainted run whose every sensitive rule names its ``taint_arguments`` is then held only when
one of those arguments' values appears in the record (or is too short to tell); the approver
is told which argument and which read. The record must be whole to clear a call: it starts
with the mark of the call that tainted the run (``begin <request id>``, written with the
mark), and an answer too large to record, a record past ``RUN_CAP``, an untrusted call made
under a policy that does not record, a store that lost the record, or one that cannot be
read, each make the run hold every sensitive call again, as without ``taint_arguments``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.audit_record import timestamp
from gateway.call import Call, Operation
from gateway.errors import RunTainted, StateUnavailable
from gateway.payload import ArgumentsPayload
from gateway.state.base import StateStore
from gateway.taint_reads import (
    READS_TTL_S,
    RUN_CAP,
    Read,
    Unreadable,
    find,
    response_text,
    vouched_text,
)

TAINT_TTL_S = 30 * 24 * 3600.0  # longer than any run is expected to live
REMEMBERED = 65_536  # runs this gateway remembers having tainted
ON_LOOP = 16 * 1024  # answers up to this size are normalised on the event loop
BEGIN = "begin "  # a run's record starts with the mark: BEGIN + the tainting request's id


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
        self._unrecorded: OrderedDict[str, None] = OrderedDict()  # runs whose record we ended

    async def mark(self, key: str, cause: dict[str, Any], *, recording: bool = False) -> None:
        if key not in self._mine:
            kept = await self.state.taint(key, cause, ttl_s=TAINT_TTL_S)
            _remember(self._mine, key, kept)
            # Ours when the store kept this cause (Redis hands back its own copy, equal, not
            # the same object): only the call that tainted the run begins its record and
            # announces it.
            if kept == cause:
                if recording:
                    begin = BEGIN + str(cause.get("request_id"))
                    await self.state.record_read(key, begin, cap=RUN_CAP, ttl_s=READS_TTL_S)
                if self.on_taint is not None:
                    self.on_taint({"type": "taint", "key": key, **cause})
        if not recording and key not in self._unrecorded:
            # Read under a policy that does not record: the run's record (if a former policy
            # began one) no longer holds all it read, and must never clear a call.
            await self.state.drop_reads(key, ttl_s=READS_TTL_S)
            _remember(self._unrecorded, key, None)

    async def of(self, key: str) -> dict[str, Any] | None:
        mine = self._mine.get(key)
        if mine is not None:
            return mine
        return await self.state.taint_of(key)

    async def record(
        self, key: str, source: str, body: bytes | None, headers: Mapping[str, str]
    ) -> None:
        """Keep what an untrusted answer says, before the agent gets any of it; an answer
        that is not whole (``body`` None: larger than ``RESPONSE_CAP``) or cannot be read as
        text ends the run's record instead (it then holds every sensitive call)."""
        try:
            if body is None:
                raise Unreadable("the answer is larger than the bytes recorded of one answer")
            if len(body) <= ON_LOOP:
                entry = _entry(source, body, headers)
            else:  # ~1 s a MiB of text: off the event loop, which then keeps its turns
                entry = await asyncio.to_thread(_entry, source, body, headers)
        except Unreadable:
            await self.state.drop_reads(key, ttl_s=READS_TTL_S)
            return
        await self.state.record_read(key, entry, cap=RUN_CAP, ttl_s=READS_TTL_S)

    async def reads(self, key: str, cause: dict[str, Any]) -> list[Read] | None:
        """What the run read since ``cause`` tainted it, or None unless the record is whole."""
        entries = await self.state.reads_of(key)
        if not entries or entries[0] != BEGIN + str(cause.get("request_id")):
            return None
        return [Read.of_entry(e) for e in entries[1:] if "\n" in e]


def _entry(source: str, body: bytes, headers: Mapping[str, str]) -> str:
    content_type = headers.get("Content-Type", "")
    text = response_text(body, content_type, headers.get("Content-Encoding", ""))
    return Read.of_text(source, text).entry()


def _remember(memory: OrderedDict[str, Any], key: str, value: Any) -> None:
    memory[key] = value
    if len(memory) > REMEMBERED:
        memory.popitem(last=False)


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
        readable = True
        try:
            cause = await self.taints.of(key)
        except StateUnavailable as exc:
            readable = False
            cause = {"source": "unknown: the state store could not be read", "detail": exc.detail}
        if cause is None:
            return
        sensitive = [
            op
            for op in call.operations
            if op.governed and op.match is not None and op.match.rule.sensitive
        ]
        rules = [op.match.rule for op in sensitive if op.match is not None]
        why = (
            f"run {key} read untrusted content ({cause.get('source')}, at {cause.get('time')}) "
            f"before this sensitive call ({', '.join(r.id for r in rules)})"
        )
        if readable and all(r.taint_arguments for r in rules):
            assert call.claims is not None
            vouched = vouched_text(call.claims.extra)
            found = await self._provenance(key, cause, sensitive, vouched)
            if found is None:
                return  # none of the arguments that matter could have come from what it read
            why += f"; {found}"
        denying = [r for r in rules if r.when_tainted == "deny"]
        if denying:
            raise RunTainted(why + "; the rule refuses such calls", rule=denying[0].id)
        call.taint = why

    async def _provenance(
        self, key: str, cause: dict[str, Any], sensitive: list[Operation], vouched: str
    ) -> str | None:
        """Why the call must still be held, or None when its ``taint_arguments`` values do
        not appear in what the run read (fail closed: an unreadable or partial record, or
        arguments that cannot be read, hold it)."""
        try:
            reads = await self.taints.reads(key, cause)
        except StateUnavailable:
            return "what the run read could not be looked up (the state store did not answer)"
        if reads is None:
            return (
                "what the run read is not on record in full (too large, read under a policy "
                "that does not record it, or lost by the state store)"
            )
        for op in sensitive:
            assert op.match is not None
            payload = op.payload
            if not isinstance(payload, ArgumentsPayload):
                return f"the arguments of {op.match.rule.id} cannot be read"
            found = find(payload.arguments, op.match.rule.taint_arguments, reads, vouched)
            if found is not None:
                return f"{op.match.rule.id}: {found}"
        return None


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
        recording = call.policy is not None and call.policy.records_reads
        if recording:
            # Respond records the answer under this name before the agent gets any of it.
            call.taint_read = f"{source} at {cause['time']} (request {call.request_id})"
        return self.taints.mark(key, cause, recording=recording)
