"""``gateway.limits``: rate parsing, and the Limiter on both backends."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import QuotaExhausted, RateLimited, Reason
from gateway.limits import Limiter, rate_key, rule_quota_key, run_quota_key
from gateway.rates import Rate, parse_rate
from gateway.state import StateStore

# --- parse_rate -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("3/hour", Rate(3, 3600.0, 3)),
        ("60/minute", Rate(60, 60.0, 60)),
        ("10/second", Rate(10, 1.0, 10)),
        ("100/day", Rate(100, 86400.0, 100)),
        ("60/minute burst 10", Rate(60, 60.0, 10)),
        ("  5 / Minute  BURST  50 ", Rate(5, 60.0, 50)),
        ("10/s", Rate(10, 1.0, 10)),
        ("10/sec", Rate(10, 1.0, 10)),
        ("2/min", Rate(2, 60.0, 2)),
        ("2/h", Rate(2, 3600.0, 2)),
        ("2/d", Rate(2, 86400.0, 2)),
        ("1000000/second", Rate(1_000_000, 1.0, 1_000_000)),
    ],
)
def test_parse_rate_valid(text: str, expected: Rate) -> None:
    assert parse_rate(text) == expected


def test_parse_rate_separate_burst() -> None:
    assert parse_rate("60/minute", burst=5) == Rate(60, 60.0, 5)
    assert parse_rate("60/minute", burst=None).burst == 60


@pytest.mark.parametrize(
    "text,burst,message",
    [
        ("", None, "expected '<count>/<unit>'"),
        ("60", None, "expected '<count>/<unit>'"),
        ("60/", None, "expected '<count>/<unit>'"),
        ("/minute", None, "expected '<count>/<unit>'"),
        ("-1/minute", None, "expected '<count>/<unit>'"),
        ("1.5/minute", None, "expected '<count>/<unit>'"),
        ("60/minute burst", None, "expected '<count>/<unit>'"),
        ("60/minute burst -1", None, "expected '<count>/<unit>'"),
        ("60/fortnight", None, "unknown unit 'fortnight'"),
        ("60/minutes", None, "unknown unit"),
        ("60/minute surge 5", None, "expected 'burst <n>'"),
        ("0/minute", None, "at least 1"),
        ("60/minute burst 0", None, "burst must be at least 1"),
        ("60/minute", 0, "burst must be at least 1"),
        ("60/minute burst 5", 5, "both in the text and separately"),
        ("2000000/second", None, "too high"),
        ("9" * 40 + "/second", None, "too large"),
        ("\u0663/second", None, "expected '<count>/<unit>'"),  # non-ASCII digit
    ],
)
def test_parse_rate_invalid(text: str, burst: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_rate(text, burst=burst)
    if text:
        assert repr(text[:20])[1:-1] in str(info.value) or "..." in str(info.value)


def test_parse_rate_rejects_non_text() -> None:
    with pytest.raises(ValueError, match="text"):
        parse_rate(60)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="whole number"):
        parse_rate("60/minute", burst=2.5)  # type: ignore[arg-type]


def test_rate_validates_and_prints() -> None:
    with pytest.raises(ValueError):
        Rate(0, 60.0, 1)
    with pytest.raises(ValueError):
        Rate(1, 0.0, 1)
    with pytest.raises(ValueError):
        Rate(1, float("inf"), 1)
    with pytest.raises(ValueError):
        Rate(1, 60.0, True)  # type: ignore[arg-type]
    assert str(parse_rate("60/minute")) == "60/minute"
    assert str(parse_rate("60/minute burst 10")) == "60/minute burst 10"
    assert parse_rate(str(parse_rate("3/hour burst 7"))) == parse_rate("3/hour burst 7")
    assert parse_rate("60/minute").interval_s == 1.0
    assert parse_rate("7/hour").interval(1_000_000) == round(3600e6 / 7)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_parse_rate_never_crashes_on_random_text(text: str) -> None:
    try:
        rate = parse_rate(text)
    except ValueError:
        return
    assert rate.limit >= 1 and rate.burst >= 1 and rate.period_s > 0


@settings(max_examples=100, deadline=None)
@given(
    st.from_regex(
        r"\s*[0-9]{1,7}\s*/\s*(second|minute|hour|day|s|sec|min|h|d)(\s+burst\s+[0-9]{1,7})?\s*",
        fullmatch=True,
    ),
    st.one_of(st.none(), st.integers(min_value=-5, max_value=10**7)),
)
def test_parse_rate_near_valid_text(text: str, burst: int | None) -> None:
    try:
        rate = parse_rate(text, burst=burst)
    except ValueError:
        return
    assert parse_rate(str(rate)) == rate


# --- keys -------------------------------------------------------------------------------


def test_keys_cannot_collide_through_separators() -> None:
    assert rate_key("a:b", "c") != rate_key("a", "b:c")
    assert rule_quota_key("r}:x", "y") != rule_quota_key("r", "x}:y")
    assert run_quota_key("r") == "{r}:total"
    assert rule_quota_key("r", "rule") == "{r}:rule:rule"


# --- Limiter ----------------------------------------------------------------------------


async def test_limiter_rate(store: StateStore) -> None:
    limiter = Limiter()
    rate = parse_rate("2/minute")
    for _ in range(2):
        await limiter.check(
            store, agent="a1", rule_id="r1", rate=rate, run=None, run_quota=None, rule_quota=None
        )
    with pytest.raises(RateLimited) as info:
        await limiter.check(
            store, agent="a1", rule_id="r1", rate=rate, run=None, run_quota=None, rule_quota=None
        )
    err = info.value
    assert err.reason is Reason.RATE_LIMITED and err.status == 429
    assert err.rule == "r1"
    assert err.headers == {"Retry-After": "30"}
    assert "2/minute" in err.detail and "r1" in err.detail
    # Per (agent, rule): another agent or rule has its own allowance.
    await limiter.check(
        store, agent="a2", rule_id="r1", rate=rate, run=None, run_quota=None, rule_quota=None
    )
    await limiter.check(
        store, agent="a1", rule_id="r2", rate=rate, run=None, run_quota=None, rule_quota=None
    )


async def test_limiter_run_and_rule_quotas(store: StateStore) -> None:
    limiter = Limiter()

    async def call(rule: str, run: str = "run-1") -> None:
        await limiter.check(
            store, agent="a", rule_id=rule, rate=None, run=run, run_quota=3, rule_quota=2
        )

    await call("search")
    await call("search")
    with pytest.raises(QuotaExhausted) as info:
        await call("search")  # the rule's quota of 2
    assert info.value.reason is Reason.QUOTA_EXHAUSTED
    assert "2 calls to rule 'search'" in info.value.detail
    assert int(info.value.headers["Retry-After"]) >= 1
    await call("fetch")  # the refused call did not count against the run: 3rd of 3
    with pytest.raises(QuotaExhausted) as info:
        await call("fetch")  # the run's quota of 3
    assert "quota of 3 calls" in info.value.detail and "rule" not in info.value.detail
    await call("fetch", run="run-2")  # another run starts afresh


async def test_limiter_rate_refusal_spends_no_quota(store: StateStore) -> None:
    limiter = Limiter()
    rate = parse_rate("1/minute")
    kwargs = {"agent": "a", "rule_id": "r", "rate": rate, "run": "run", "run_quota": 1}
    await limiter.check(store, rule_quota=None, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(RateLimited):
        await limiter.check(store, rule_quota=None, **kwargs)  # type: ignore[arg-type]
    # The run quota of 1 was spent by the first call only.
    assert (await store.consume_quota(run_quota_key("run"), 2, ttl_s=60)).remaining == 0


async def test_limiter_without_run_or_limits_is_a_no_op(store: StateStore) -> None:
    limiter = Limiter()
    for _ in range(5):
        await limiter.check(
            store, agent="a", rule_id="r", rate=None, run=None, run_quota=1, rule_quota=1
        )
        await limiter.check(
            store, agent="a", rule_id="r", rate=None, run="x", run_quota=None, rule_quota=None
        )
