"""The live event stream: every decision as it is made, for the console and ``capgate watch``.

``EventHub`` is an observer of ended calls (listed in ``app.build_gateway`` with the audit
trail and the spans) and is told of approvals and operator actions too. Events are built
from the closed ``AuditRecord`` (and, for approvals, from the same kind of names), so the
stream can carry no body, query value, header value, SQL text or tool argument.

Bounded in every direction: the hub keeps the last ``keep`` calls for ``GET /calls``; each
subscriber has a queue of ``queue`` events, and a subscriber that falls that far behind is
sent ``lagged`` and dropped (it reconnects and reads ``/calls`` to catch up) rather than
making the gateway hold events for it; at most ``max_subscribers`` streams are open, and one
operator may hold at most a quarter of them. The hub also counts decisions since start by
decision and reason (``GET /stats``), a table bounded by the closed set of reason codes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gateway.audit_record import AuditRecord
from gateway.call import Call
from gateway.shares import Shares

KEEP = 2000
QUEUE = 1000
MAX_SUBSCRIBERS = 32
FILTER_KEYS = ("agent", "run", "decision", "type")


@dataclass(frozen=True, slots=True)
class Filters:
    """Exact-match filters of a subscription or a query; an empty filter matches all."""

    agent: str | None = None
    run: str | None = None
    decision: str | None = None
    type: str | None = None

    @classmethod
    def of(cls, query: Mapping[str, str]) -> Filters:
        return cls(**{k: query[k] for k in FILTER_KEYS if query.get(k)})

    def __call__(self, event: Mapping[str, Any]) -> bool:
        return (
            (self.agent is None or event.get("agent") == self.agent)
            and (self.run is None or event.get("run") == self.run)
            and (self.decision is None or event.get("decision") == self.decision)
            and (self.type is None or event.get("type") == self.type)
        )


@dataclass(eq=False)
class Subscription:
    filters: Filters
    queue: asyncio.Queue[dict[str, Any]]
    lagged: bool = False

    def offer(self, event: dict[str, Any]) -> None:
        if self.lagged or not self.filters(event):
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.lagged = True
            # Make room for the one event that says so; the reader ends the stream on it.
            self.queue.get_nowait()
            self.queue.put_nowait({"type": "lagged", "dropped_after": event.get("seq")})


@dataclass(eq=False)
class EventHub:
    keep: int = KEEP
    queue: int = QUEUE
    max_subscribers: int = MAX_SUBSCRIBERS
    recent: deque[dict[str, Any]] = field(init=False)
    _subscribers: set[Subscription] = field(default_factory=set)
    _seq: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    listeners: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)
    streams: Shares = field(init=False)
    # Decisions since start by (decision, reason): bounded by the closed set of reason codes.
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    since: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.keep)
        self.streams = Shares(
            "event streams", self.max_subscribers, max(1, self.max_subscribers // 4)
        )

    # --- producers ------------------------------------------------------------------------

    def call_ended(self, call: Call, records: Sequence[AuditRecord]) -> None:
        for record in records:
            event: dict[str, Any] = {"type": "call", **record}
            self.counts[(record["decision"], record["reason"])] += 1
            self.recent.append(event)
            self.publish(event)

    def publish(self, event: dict[str, Any]) -> None:
        """Stamp ``event`` with its sequence number and hand it to every subscriber."""
        event["seq"] = next(self._seq)
        for sub in self._subscribers:
            sub.offer(event)
        for listener in self.listeners:  # quick and never blocking (the approval webhook)
            listener(event)

    # --- consumers ------------------------------------------------------------------------

    def calls(self, filters: Filters, limit: int) -> list[dict[str, Any]]:
        """The most recent calls that match, newest first."""
        out: list[dict[str, Any]] = []
        for event in reversed(self.recent):
            if filters(event):
                out.append(event)
                if len(out) >= limit:
                    break
        return out

    def stats(self) -> dict[str, Any]:
        """Decisions since start: in all, by decision, and by decision and reason (most
        frequent first). An MCP call counts once per JSON-RPC message, as it is audited."""
        by_decision: Counter[str] = Counter()
        for (decision, _), count in self.counts.items():
            by_decision[decision] += count
        return {
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
            "total": sum(by_decision.values()),
            "by_decision": {"allow": by_decision["allow"], "deny": by_decision["deny"]},
            "by_reason": [
                {"decision": decision, "reason": reason, "count": count}
                for (decision, reason), count in self.counts.most_common()
            ],
        }

    @contextmanager
    def subscribe(self, filters: Filters, who: str) -> Iterator[Subscription]:
        """A subscription for ``who`` (an operator), within its share of open streams;
        raises ``ConcurrencyLimited`` beyond it."""
        if not self.streams.try_acquire(who):
            raise self.streams.refusal(who)
        sub = Subscription(filters, asyncio.Queue(self.queue))
        self._subscribers.add(sub)
        try:
            yield sub
        finally:
            self._subscribers.discard(sub)
            self.streams.release(who)


def sse(event: Mapping[str, Any]) -> bytes:
    """One server-sent event: its sequence number as the id, its type as the event name."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=True)
    name = event.get("type", "message")
    return f"id: {event.get('seq', '')}\nevent: {name}\ndata: {data}\n\n".encode()
