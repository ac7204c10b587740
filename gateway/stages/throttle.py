"""throttle: the rule's and role's rate limits and the run's quotas, through the state store."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.errors import StateUnavailable
from gateway.limits import Limiter

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.call import Call

LIMITER = Limiter()


async def throttle(call: Call, gw: Gateway) -> None:
    assert call.match is not None and call.claims is not None and call.policy is not None
    rule = call.match.rule
    role = call.policy.roles[rule.role]
    if rule.rate is None and role.rate is None and rule.quota is None and role.run_quota is None:
        return
    try:
        if role.rate is not None:
            # A role's rate is shared by all of its rules: one limiter per (agent, role).
            await LIMITER.check(
                gw.state,
                agent=call.claims.agent,
                rule_id="role:" + role.name,
                rate=role.rate,
                run=None,
                run_quota=None,
                rule_quota=None,
            )
        await LIMITER.check(
            gw.state,
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
