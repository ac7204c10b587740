"""Shared helpers for the core unit tests (tokens, target, policy, config, credentials, CLI).

Hypothesis profiles: ``fast`` (the default, ~200 examples) and ``deep`` (set
``HYPOTHESIS_PROFILE=deep``). They are not loaded globally, so other test modules keep their
own settings; fuzz tests decorate themselves with ``FUZZ``.

Token helpers sign arbitrary headers and payloads, so a test can craft any token: PyJWT for
ordinary ones, ``sign_jws`` (cryptography directly, over exact bytes) for JSON that PyJWT
would never produce, such as a payload with a duplicated key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from hypothesis import HealthCheck, settings

from gateway.policy.load import load_policy
from gateway.policy.model import Policy
from gateway.tokens import TOKEN_TYPE, Keyset, TokenSettings, TokenVerifier, key_id, public_jwk

# --- hypothesis -------------------------------------------------------------------------------

# CI runs the fast profile with a fixed seed, so a landing never hinges on a draw; local runs
# keep exploring new examples each time.
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
settings.register_profile(
    "fast",
    max_examples=200,
    deadline=None,
    database=None,
    derandomize=IN_CI,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "deep",
    max_examples=5000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
FUZZ = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))
"""Decorate fuzz tests with ``@FUZZ`` (``fast`` unless ``HYPOTHESIS_PROFILE=deep``)."""


# --- base64url and JWS ------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def raw_signature(
    key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey, data: bytes
) -> bytes:
    """The JWS signature bytes (Ed25519 raw, or ES256 as r||s) over ``data``."""
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def sign_jws(header: bytes | dict[str, Any], payload: bytes | dict[str, Any], key: Any) -> str:
    """A compact JWS over the exact header and payload bytes given (no re-serialisation)."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    p = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    signing_input = f"{b64(h)}.{b64(p)}".encode()
    return f"{signing_input.decode()}.{b64(raw_signature(key, signing_input))}"


def hmac_jws(header: dict[str, Any], payload: dict[str, Any], secret: bytes) -> str:
    """An HS256 token, hand-made (PyJWT refuses to use key material that looks asymmetric)."""
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"
    mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(mac)}"


def noncanonical(segment: str) -> str:
    """The same bytes spelled differently: set an unused trailing bit of a base64url segment."""
    assert len(segment) % 4 in (2, 3), "this segment length has no unused bits"
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    last = alphabet.index(segment[-1])
    assert last & 1 == 0, "already non-canonical"
    spelled = segment[:-1] + alphabet[last | 1]
    assert unb64(spelled) == unb64(segment)
    return spelled


# --- keys, claims, verifiers ------------------------------------------------------------------


class Signer:
    """One private key with its kid, keyset and verifier factory."""

    def __init__(self, algorithm: str = "EdDSA") -> None:
        self.algorithm = algorithm
        self.key: Any = (
            ed25519.Ed25519PrivateKey.generate()
            if algorithm == "EdDSA"
            else ec.generate_private_key(ec.SECP256R1())
        )
        self.kid = key_id(self.key.public_key())

    @property
    def jwk(self) -> dict[str, str]:
        return public_jwk(self.key.public_key(), self.kid)

    def keyset(self) -> Keyset:
        return Keyset.from_jwks({"keys": [self.jwk]}, self.algorithm)

    def verifier(self, clock: Callable[[], float] = time.time, **settings_kw: Any) -> TokenVerifier:
        s = TokenSettings(algorithm=self.algorithm, **settings_kw)
        return TokenVerifier(self.keyset(), s, clock=clock)

    def header(self, **over: Any) -> dict[str, Any]:
        h: dict[str, Any] = {"alg": self.algorithm, "typ": TOKEN_TYPE, "kid": self.kid}
        for k, v in over.items():
            if v is DROP:
                h.pop(k, None)
            else:
                h[k] = v
        return h

    def sign(self, payload: dict[str, Any], **header_over: Any) -> str:
        """Sign any payload (any JSON, unchecked) with this key; ``header_over`` adds, changes
        or (``DROP``) removes header fields. The signature is always made with this key."""
        return sign_jws(self.header(**header_over), payload, self.key)


class _Drop:
    def __repr__(self) -> str:
        return "DROP"


DROP: Any = _Drop()
"""Marker for ``claims(...)``/``Signer.header(...)``: leave this field out."""


def claims(now: float | None = None, **over: Any) -> dict[str, Any]:
    """A valid payload (5 min lifetime) with fields replaced or (``DROP``) removed."""
    t = int(time.time() if now is None else now)
    c: dict[str, Any] = {
        "iss": "capgate",
        "aud": "capgate",
        "sub": "agent-1",
        "iat": t,
        "nbf": t,
        "exp": t + 300,
        "jti": "jti-0001",
        "roles": ["sre-diagnostics"],
    }
    for k, v in over.items():
        if v is DROP:
            c.pop(k, None)
        else:
            c[k] = v
    return c


class Clock:
    """A settable clock for ``TokenVerifier``/``CredentialStore``."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.time() if now is None else now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- policies ---------------------------------------------------------------------------------


def policy_from_text(text: str, name: str = "inline.yaml") -> Policy:
    return load_policy(name, text)


REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
