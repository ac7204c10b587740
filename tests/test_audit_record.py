"""The audit record's keyed digests: exactly HMAC-SHA256 (RFC 2104), whole or streamed; its
times and durations: exactly the plain formatting they replace."""

from __future__ import annotations

import hashlib
import hmac
import time

from hypothesis import given
from hypothesis import strategies as st

from gateway.audit_record import BodyMac, milliseconds, names, timestamp


@given(
    key=st.binary(min_size=1, max_size=200),
    body=st.binary(max_size=5000),
    cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=8),
)
def test_body_digests_are_hmac_sha256(key: bytes, body: bytes, cuts: list[int]) -> None:
    expected = hmac.new(key, body, hashlib.sha256).hexdigest()
    mac = BodyMac(key)
    assert mac.of(body) == {"size": len(body), "hmac": expected}
    hasher = mac.stream()
    last = 0
    for cut in sorted(c for c in cuts if c <= len(body)):
        hasher.update(body[last:cut])
        last = cut
    hasher.update(body[last:])
    assert hasher.result() == {"size": len(body), "hmac": expected}
    # A copy per digest: digests do not disturb one another.
    assert mac.of(body) == mac.of(body)


def test_without_a_key_only_sizes() -> None:
    mac = BodyMac(None)
    assert mac.of(b"abc") == {"size": 3}
    hasher = mac.stream()
    hasher.update(b"ab")
    assert hasher.result() == {"size": 2}


def test_names_are_deduplicated_and_capped() -> None:
    mac = BodyMac(b"k" * 32)
    assert names(mac, ["a", "b", "a"]) == ["a", "b"]
    assert len(names(mac, [f"t{i}" for i in range(100)])) == 32


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False))
def test_timestamps_are_utc_to_the_millisecond(t: float) -> None:
    whole = int(t)
    expected = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    millis = min(int((t - whole) * 1000), 999)  # (a fraction a hair below 1 stays in its second)
    assert timestamp(t) == f"{expected}.{millis:03d}Z"


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_durations_are_milliseconds_to_the_microsecond(seconds: float) -> None:
    ms = milliseconds(seconds)
    assert abs(ms - round(seconds * 1000, 3)) <= 0.001 + 1e-9 * ms
    assert ms == round(ms, 3)  # written with three decimals at most
