"""Rates and their text form, as a policy writes them.

A policy writes a rate as ``<count>/<unit>``, optionally followed by ``burst <n>``::

    3/hour   60/minute   10/second   100/day   60/minute burst 10

``count`` calls are allowed per ``unit`` on average; ``burst`` (default: ``count``) is how
many may be made back to back from a rested state. A fresh ``60/minute`` therefore admits
exactly 60 calls at once, then one more each second.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["MAX_RATE_PER_SECOND", "UNITS", "Rate", "parse_rate"]

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
