"""The ``Limiter`` the throttle stage calls: a rule's rate and a run's quotas, in the store.

The ``Limiter`` turns a rule's rate and quotas into store calls and the store's answer into
``RateLimited`` / ``QuotaExhausted``. Key layout (the store adds its own prefix and the
``rate:`` / ``quota:`` namespace; every component is percent-encoded so no id can forge
another's key)::

    rate:   <agent>:<rule>                 one limiter per (agent, rule)
    rate:   <agent>:<rule>:attempts        attempts per (agent, rule), before any check
    quota:  {<run>}:total                  the run's calls in total
    quota:  {<run>}:rule:<rule>            the run's calls to one rule

The ``{<run>}`` hash tag keeps a run's quota counters in one Redis Cluster slot, so both are
checked and counted in one atomic script. Rates themselves are in ``rates.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote

from gateway.errors import AttemptsLimited, QuotaExhausted, RateLimited
from gateway.rates import Rate
from gateway.state.base import Admission, StateStore

__all__ = ["Limiter", "attempts_key", "rate_key", "rule_quota_key", "run_quota_key"]


def _q(part: str) -> str:
    return quote(part, safe="")


# Keys are asked for on every limited call, for a few agents and rules: remembered, not
# percent-encoded again each time.
@functools.lru_cache(maxsize=16384)
def rate_key(agent: str, rule_id: str) -> str:
    """The limiter key for one agent's calls to one rule."""
    return f"{_q(agent)}:{_q(rule_id)}"


@functools.lru_cache(maxsize=16384)
def attempts_key(agent: str, rule_id: str) -> str:
    """The limiter key for one agent's attempts at one rule (a rule id never holds an
    unencoded ':', so this key is no rate key's)."""
    return f"{_q(agent)}:{_q(rule_id)}:attempts"


def run_quota_key(run: str) -> str:
    """The counter of all calls in one run."""
    return f"{{{_q(run)}}}:total"


def rule_quota_key(run: str, rule_id: str) -> str:
    """The counter of one run's calls to one rule."""
    return f"{{{_q(run)}}}:rule:{_q(rule_id)}"


def retry_after_header(seconds: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds, rounded up, never below 1."""
    if not math.isfinite(seconds):
        seconds = 86400.0
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


@dataclass(frozen=True, slots=True)
class Limiter:
    """Applies a rule's rate and the run's quotas to one call, through a ``StateStore``.

    ``quota_ttl_s`` is how long a run's counters are kept after its last call; a run that
    is idle for longer starts counting from zero again.
    """

    quota_ttl_s: float = 7 * 86400.0

    async def check_attempt(
        self, store: StateStore, *, agent: str, rule_id: str, attempts: Rate
    ) -> None:
        """Count one attempt at ``rule_id`` by ``agent`` or raise ``AttemptsLimited``.

        Counted before the payload checks, allowed or not, so that a flood of refused (or
        costly) payloads is bounded; the rule's rate and quotas count allowed calls only.
        ``StateUnavailable`` from the store propagates unchanged.
        """
        got = await store.take(attempts_key(agent, rule_id), attempts)
        if not got.allowed:
            raise _attempts_limited(attempts, rule_id, got)

    def check_attempt_now(
        self, store: StateStore, *, agent: str, rule_id: str, attempts: Rate
    ) -> bool:
        """``check_attempt`` when the store answers without waiting: True when counted (or
        raises as it does); False when nothing was counted and ``check_attempt`` must run."""
        got = store.take_now(attempts_key(agent, rule_id), attempts)
        if got is None:
            return False
        if not got.allowed:
            raise _attempts_limited(attempts, rule_id, got)
        return True

    def check_now(self, store: StateStore, *, agent: str, rule_id: str, rate: Rate) -> bool:
        """``check`` of a rate alone (no quota applies) when the store answers without
        waiting: True when admitted (or raises ``RateLimited`` as ``check`` does); False when
        nothing was taken and ``check`` must run."""
        got = store.take_now(rate_key(agent, rule_id), rate)
        if got is None:
            return False
        if not got.allowed:
            raise _rate_limited(rate, rule_id, got)
        return True

    async def check(
        self,
        store: StateStore,
        *,
        agent: str,
        rule_id: str,
        rate: Rate | None,
        run: str | None,
        run_quota: int | None,
        rule_quota: int | None,
    ) -> None:
        """Admit the call or raise ``RateLimited`` / ``QuotaExhausted``.

        The rate is checked first, so a call refused by its rate never spends quota; both
        quotas are then checked and counted together (all or nothing), so a refused call
        never counts against either. A call refused by a quota has still used one unit of
        its rate. Quotas apply only to calls that belong to a run (``run`` is not None).
        ``StateUnavailable`` from the store propagates unchanged.
        """
        if rate is not None:
            got = await store.take(rate_key(agent, rule_id), rate)
            if not got.allowed:
                raise _rate_limited(rate, rule_id, got)
        if run is None:
            return
        items: list[tuple[str, int]] = []
        details: list[str] = []
        if run_quota is not None:
            items.append((run_quota_key(run), run_quota))
            details.append(f"this run has spent its quota of {run_quota} calls")
        if rule_quota is not None:
            items.append((rule_quota_key(run, rule_id), rule_quota))
            details.append(
                f"this run has spent its quota of {rule_quota} calls to rule '{rule_id}'"
            )
        if not items:
            return
        got = await store.consume_quotas(items, ttl_s=self.quota_ttl_s)
        if not got.allowed:
            detail = details[got.limited_by if got.limited_by is not None else 0]
            raise QuotaExhausted(detail, rule=rule_id, headers=retry_after_header(got.retry_after))


def _rate_limited(rate: Rate, rule_id: str, got: Admission) -> RateLimited:
    return _refused(
        RateLimited,
        f"the rate of {rate} for rule '{rule_id}' is used up for this agent",
        rule_id,
        got,
    )


def _attempts_limited(attempts: Rate, rule_id: str, got: Admission) -> AttemptsLimited:
    what = (
        f"the attempts of {attempts} at rule '{rule_id}' are used up for this agent "
        "(counted before the payload is checked)"
    )
    return _refused(AttemptsLimited, what, rule_id, got)


_Refusal = TypeVar("_Refusal", RateLimited, AttemptsLimited)


def _refused(kind: type[_Refusal], what: str, rule_id: str, got: Admission) -> _Refusal:
    headers = retry_after_header(got.retry_after)
    return kind(f"{what}; retry in {headers['Retry-After']} s", rule=rule_id, headers=headers)
