"""throttle: each operation's rule and role rate limits and the run's quotas, in the store.

Every governed operation counts on its own: an MCP batch of three tool calls spends three
units of each rate and quota it falls under, exactly as three separate calls would.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping

from gateway.call import Call
from gateway.errors import StateUnavailable
from gateway.limits import Limiter
from gateway.policy.model import Role, Rule
from gateway.state.base import StateStore


class Throttle:
    def __init__(self, state: StateStore, limiter: Limiter | None = None) -> None:
        self.state = state
        self.limiter = limiter or Limiter()

    def __call__(self, call: Call) -> Awaitable[None] | None:
        assert call.policy is not None
        roles = call.policy.roles
        for op in call.operations:
            if op.governed and op.match is not None and _limited(op.match.rule, roles):
                return self._count_all(call)
        return None  # no limit or quota applies: the store is not asked

    async def _count_all(self, call: Call) -> None:
        assert call.claims is not None and call.policy is not None
        for op in call.operations:
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


def _limited(rule: Rule, roles: Mapping[str, Role]) -> bool:
    role = roles[rule.role]
    return not (
        rule.rate is None and role.rate is None and rule.quota is None and role.run_quota is None
    )
