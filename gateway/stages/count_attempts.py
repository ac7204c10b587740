"""count_attempts: each operation's attempt at its rule, counted before its payload is checked.

A rule's ``attempts:`` (default for rules with ``sql:``: ``DEFAULT_SQL_ATTEMPTS``) bounds how
often one agent may make the gateway check a payload for that rule, whatever the verdict:
payload checks cost CPU even when they refuse, and the rule's ``rate`` and ``quota`` (the
throttle stage, after validate) count allowed calls only. Refused attempts are 429
``attempts_limited`` with ``Retry-After``. When the state store is down the rule's
``on_state_error`` decides, as for its rate.
"""

from __future__ import annotations

from collections.abc import Awaitable

from gateway.call import Call
from gateway.errors import StateUnavailable
from gateway.limits import Limiter
from gateway.state.base import StateStore


class CountAttempts:
    def __init__(self, state: StateStore, limiter: Limiter | None = None) -> None:
        self.state = state
        self.limiter = limiter or Limiter()

    def __call__(self, call: Call) -> Awaitable[None] | None:
        """Counted without a coroutine while the store answers at once (its own buckets, or
        a lease of tokens); from the first operation it cannot, the rest are awaited."""
        for index, op in enumerate(call.operations):
            if not op.governed or op.match is None or op.match.rule.attempts is None:
                continue
            rule = op.match.rule
            assert call.claims is not None
            try:
                if not self.limiter.check_attempt_now(
                    self.state, agent=call.claims.agent, rule_id=rule.id, attempts=rule.attempts
                ):
                    return self._count_all(call, index)
            except StateUnavailable:
                if rule.on_state_error != "allow":
                    raise
                call.state_error_allowed = True
        return None

    async def _count_all(self, call: Call, start: int = 0) -> None:
        assert call.claims is not None
        for op in call.operations[start:]:
            if not op.governed or op.match is None or op.match.rule.attempts is None:
                continue
            rule = op.match.rule
            try:
                await self.limiter.check_attempt(
                    self.state, agent=call.claims.agent, rule_id=rule.id, attempts=rule.attempts
                )
            except StateUnavailable:
                if rule.on_state_error != "allow":
                    raise
                call.state_error_allowed = True
