"""throttle: each operation's rule and role rate limits and the run's quotas, in the store.

Every governed operation counts on its own: an MCP batch of three tool calls spends three
units of each rate and quota it falls under, exactly as three separate calls would.

Throttle, then evict: a rule with ``evict_after: N`` stops the run (revokes it, or the token
when there is no run) at its Nth refusal by the rule's rate or quota; the refusals are
counted in the store, per rule and run, and the stop is announced (``on_evict``) so the
console shows why. The refused call's answer says the run was stopped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.call import Call
from gateway.errors import StateUnavailable, Throttled
from gateway.limits import Limiter
from gateway.policy.model import Role, Rule
from gateway.state.base import RevocationKind, StateStore

EVICT_WINDOW_S = 30 * 24 * 3600.0  # refusals of a run are counted for this long


class Throttle:
    def __init__(
        self,
        state: StateStore,
        limiter: Limiter | None = None,
        on_evict: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.state = state
        self.limiter = limiter or Limiter()
        self.on_evict = on_evict

    def __call__(self, call: Call) -> Awaitable[None] | None:
        """Counted without a coroutine while every limit met is a rule's rate alone and the
        store answers at once (its own buckets, or a lease of tokens); from the first
        operation that needs more, the rest are awaited. No limit: the store is not asked."""
        assert call.policy is not None
        roles = call.policy.roles
        for index, op in enumerate(call.operations):
            if not op.governed or op.match is None or not _limited(op.match.rule, roles):
                continue
            try:
                if not self._count_now(call, op.match.rule):
                    return self._count_all(call, index)
            except Throttled as exc:
                if op.match.rule.evict_after is not None:
                    return self._refused(call, op.match.rule, exc)
                raise
        return None

    def _count_now(self, call: Call, rule: Rule) -> bool:
        """The rule's rate when it is the only limit met (no role rate, no quota for this
        call) and the store can answer now; False when nothing was counted."""
        assert call.claims is not None and call.policy is not None
        role = call.policy.roles[rule.role]
        quotas = call.claims.run is not None and (
            role.run_quota is not None or rule.quota is not None
        )
        if role.rate is not None or quotas or rule.rate is None:
            return False
        try:
            return self.limiter.check_now(
                self.state, agent=call.claims.agent, rule_id=rule.id, rate=rule.rate
            )
        except StateUnavailable:
            if rule.on_state_error == "allow":
                call.state_error_allowed = True
                return True
            raise

    async def _refused(self, call: Call, rule: Rule, exc: Throttled) -> None:
        await self._count_refusal(call, rule, exc)
        raise exc

    async def _count_all(self, call: Call, start: int = 0) -> None:
        assert call.claims is not None and call.policy is not None
        for op in call.operations[start:]:
            if op.governed:
                assert op.match is not None
                await self._count(call, op.match.rule)

    async def _count(self, call: Call, rule: Rule) -> None:
        assert call.claims is not None and call.policy is not None
        role = call.policy.roles[rule.role]
        if (
            rule.rate is None
            and role.rate is None
            and rule.quota is None
            and role.run_quota is None
        ):
            return
        try:
            if role.rate is not None:
                # A role's rate is shared by all of its rules: one limiter per (agent, role).
                await self.limiter.check(
                    self.state,
                    agent=call.claims.agent,
                    rule_id="role:" + role.name,
                    rate=role.rate,
                    run=None,
                    run_quota=None,
                    rule_quota=None,
                )
            await self.limiter.check(
                self.state,
                agent=call.claims.agent,
                rule_id=rule.id,
                rate=rule.rate,
                run=call.claims.run,
                run_quota=role.run_quota,
                rule_quota=rule.quota,
            )
        except StateUnavailable:
            if rule.on_state_error == "allow":
                call.state_error_allowed = True
                return
            raise
        except Throttled as exc:
            if rule.evict_after is not None:
                await self._count_refusal(call, rule, exc)
            raise

    async def _count_refusal(self, call: Call, rule: Rule, exc: Throttled) -> None:
        """One more refusal of the run by ``rule``; at ``evict_after`` the run is stopped."""
        assert call.claims is not None and rule.evict_after is not None
        claims = call.claims
        kind: RevocationKind = "run" if claims.run else "jti"
        value = claims.run or claims.jti
        counted = await self.state.consume_quota(
            f"evict:{rule.id}:{kind}:{value}", rule.evict_after - 1, ttl_s=EVICT_WINDOW_S
        )
        if counted.allowed:
            return  # not yet the Nth refusal
        why = f"rule {rule.id} refused it {rule.evict_after} time(s) ({exc.reason.value})"
        await self.state.revoke(
            kind,
            value,
            until=claims.expires_at if kind == "jti" else None,
            by="policy",
            reason=why,
        )
        exc.detail += f"; the {kind} {value} was stopped: {why}"
        if self.on_evict is not None:
            self.on_evict(
                {
                    "type": "operator",
                    "action": "stop",
                    "by": "policy",
                    "agent": claims.agent,
                    "run": claims.run,
                    "kind": kind,
                    "value": value,
                    "reason": why,
                }
            )


def _limited(rule: Rule, roles: Mapping[str, Role]) -> bool:
    role = roles[rule.role]
    return not (
        rule.rate is None and role.rate is None and rule.quota is None and role.run_quota is None
    )
