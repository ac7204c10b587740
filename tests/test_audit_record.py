"""The audit record's keyed digests: exactly HMAC-SHA256 (RFC 2104), whole or streamed."""

from __future__ import annotations

import hashlib
import hmac

from hypothesis import given
from hypothesis import strategies as st

from gateway.audit_record import BodyMac, names


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
