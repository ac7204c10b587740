"""Rates, their text form, and the ``Limiter`` the throttle stage calls.

A policy writes a rate as ``<count>/<unit>``, optionally followed by ``burst <n>``::

    3/hour   60/minute   10/second   100/day   60/minute burst 10

``count`` calls are allowed per ``unit`` on average; ``burst`` (default: ``count``) is how
many may be made back to back from a rested state. A fresh ``60/minute`` therefore admits
exactly 60 calls at once, then one more each second.

The ``Limiter`` turns a rule's rate and quotas into store calls and the store's answer into
``RateLimited`` / ``QuotaExhausted``. Key layout (the store adds its own prefix and the
``rate:`` / ``quota:`` namespace; every component is percent-encoded so no id can forge
another's key)::

    rate:   <agent>:<rule>                 one limiter per (agent, rule)
    quota:  {<run>}:total                  the run's calls in total
    quota:  {<run>}:rule:<rule>            the run's calls to one rule

The ``{<run>}`` hash tag keeps a run's quota counters in one Redis Cluster slot, so both are
checked and counted in one atomic script.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

from gateway.errors import QuotaExhausted, RateLimited

if TYPE_CHECKING:
    from gateway.state.base import StateStore

__all__ = ["MAX_RATE_PER_SECOND", "UNITS", "Limiter", "Rate", "parse_rate"]

UNITS: dict[str, float] = {
    "second": 1.0,
    "sec": 1.0,
    "s": 1.0,
    "minute": 60.0,
    "min": 60.0,
    "hour": 3600.0,
    "h": 3600.0,
    "day": 86400.0,
    "d": 86400.0,
}
"""Accepted units and their length in seconds."""

MAX_RATE_PER_SECOND = 1_000_000
"""Highest average rate a ``Rate`` may express (the limiters count in microseconds)."""

_MAX_DIGITS = 12
_RATE_RE = re.compile(
    r"\s*(?P<limit>[0-9]+)\s*/\s*(?P<unit>[A-Za-z]+)"
    r"(?:\s+(?P<kw>[A-Za-z]+)\s+(?P<burst>[0-9]+))?\s*",
    re.ASCII,
)
_CANONICAL_UNIT = {1.0: "second", 60.0: "minute", 3600.0: "hour", 86400.0: "day"}


@dataclass(frozen=True, slots=True)
class Rate:
    """``limit`` calls per ``period_s`` seconds on average, at most ``burst`` back to back."""

    limit: int
    period_s: float
    burst: int

    def __post_init__(self) -> None:
        for name in ("limit", "burst"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rate {name} must be a whole number of at least 1, not {value!r}")
        period = self.period_s
        if isinstance(period, bool) or not isinstance(period, int | float):
            raise ValueError(f"rate period must be a number of seconds, not {period!r}")
        if not math.isfinite(period) or period <= 0:
            raise ValueError(f"rate period must be a positive number of seconds, not {period!r}")
        if self.limit / period > MAX_RATE_PER_SECOND:
            raise ValueError(
                f"rate of {self.limit} per {period:g} s is too high: "
                f"at most {MAX_RATE_PER_SECOND} per second"
            )

    @property
    def interval_s(self) -> float:
        """The emission interval: seconds between calls at the sustained rate."""
        return self.period_s / self.limit

    def interval(self, ticks_per_second: int) -> int:
        """The emission interval in whole ticks (e.g. 1_000_000 for microseconds), >= 1."""
        return max(1, round(self.period_s * ticks_per_second / self.limit))

    def __str__(self) -> str:
        unit = _CANONICAL_UNIT.get(float(self.period_s))
        text = f"{self.limit}/{unit}" if unit else f"{self.limit} per {self.period_s:g} s"
        return text if self.burst == self.limit else f"{text} burst {self.burst}"


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:57] + "...")


def parse_rate(text: str, burst: int | None = None) -> Rate:
    """Parse ``"60/minute"`` or ``"60/minute burst 10"``; ``burst`` may also be given apart.

    Raises ``ValueError`` with a message naming the text and what is wrong with it.
    """
    if not isinstance(text, str):
        raise ValueError(f"a rate must be text such as '60/minute', not {type(text).__name__}")
    shown = _shown(text)
    m = _RATE_RE.fullmatch(text)
    if m is None:
        raise ValueError(
            f"invalid rate {shown}: expected '<count>/<unit>' such as '60/minute', "
            f"optionally followed by 'burst <n>' as in '60/minute burst 10'"
        )
    unit = m["unit"].lower()
    if unit not in UNITS:
        raise ValueError(
            f"invalid rate {shown}: unknown unit {m['unit']!r} (use second, minute, hour or day)"
        )
    if m["kw"] is not None and m["kw"].lower() != "burst":
        raise ValueError(
            f"invalid rate {shown}: expected 'burst <n>' after the rate, not {m['kw']!r}"
        )
    if len(m["limit"]) > _MAX_DIGITS or (m["burst"] and len(m["burst"]) > _MAX_DIGITS):
        raise ValueError(f"invalid rate {shown}: number too large")
    limit = int(m["limit"])
    if limit < 1:
        raise ValueError(f"invalid rate {shown}: the count must be at least 1")
    text_burst = int(m["burst"]) if m["burst"] is not None else None
    if text_burst is not None and burst is not None:
        raise ValueError(f"invalid rate {shown}: burst given both in the text and separately")
    if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int)):
        raise ValueError(f"invalid burst {burst!r}: must be a whole number")
    chosen = text_burst if text_burst is not None else burst
    if chosen is not None and chosen < 1:
        raise ValueError(f"invalid rate {shown}: burst must be at least 1, not {chosen}")
    period = UNITS[unit]
    if limit / period > MAX_RATE_PER_SECOND:
        raise ValueError(
            f"invalid rate {shown}: too high, at most {MAX_RATE_PER_SECOND} per second"
        )
    return Rate(limit=limit, period_s=period, burst=chosen if chosen is not None else limit)


def _q(part: str) -> str:
    return quote(part, safe="")


def rate_key(agent: str, rule_id: str) -> str:
    """The limiter key for one agent's calls to one rule."""
    return f"{_q(agent)}:{_q(rule_id)}"


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
                headers = retry_after_header(got.retry_after)
                raise RateLimited(
                    f"the rate of {rate} for rule '{rule_id}' is used up for this agent; "
                    f"retry in {headers['Retry-After']} s",
                    rule=rule_id,
                    headers=headers,
                )
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
