"""Signing keys for the services mock: generate a key pair, publish its JWKS, mint JWTs.

The services mock (`mocks.servers.services_app`) only ever sees public keys. Tests and the
launcher use `SigningKey` to produce a key pair whose public half goes into the mock's JWKS and
whose private half signs the tokens a test (or capgate itself) presents.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from jwt.algorithms import ECAlgorithm, OKPAlgorithm

SigningAlgorithm = Literal["EdDSA", "ES256"]

# JWK members that carry private or symmetric key material; never published.
PRIVATE_JWK_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})


@dataclass(frozen=True)
class SigningKey:
    """A private key with the `kid` and algorithm its tokens are signed with."""

    kid: str
    alg: SigningAlgorithm
    private_key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey

    @classmethod
    def generate(cls, alg: SigningAlgorithm = "EdDSA", kid: str | None = None) -> SigningKey:
        private_key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
        if alg == "EdDSA":
            private_key = ed25519.Ed25519PrivateKey.generate()
        elif alg == "ES256":
            private_key = ec.generate_private_key(ec.SECP256R1())
        else:
            raise ValueError(f"unsupported signing algorithm {alg!r}; use 'EdDSA' or 'ES256'")
        kid = kid or f"mock-{alg.lower()}-{uuid.uuid4().hex[:8]}"
        return cls(kid=kid, alg=alg, private_key=private_key)

    def public_jwk(self) -> dict[str, Any]:
        """The public half as a JWK, with `kid`, `alg` and `use` set."""
        public_key = self.private_key.public_key()
        if isinstance(public_key, ed25519.Ed25519PublicKey):
            jwk = OKPAlgorithm.to_jwk(public_key, as_dict=True)
        else:
            jwk = ECAlgorithm.to_jwk(public_key, as_dict=True)
        jwk = {k: v for k, v in jwk.items() if k not in PRIVATE_JWK_MEMBERS}
        jwk.update(kid=self.kid, alg=self.alg, use="sig")
        return jwk

    def jwks(self) -> dict[str, Any]:
        """A JWK Set holding only this key's public half."""
        return {"keys": [self.public_jwk()]}

    def mint(
        self,
        sub: str,
        *,
        audience: str = "services",
        issuer: str = "capgate",
        ttl_seconds: float = 60.0,
        now: float | None = None,
        **extra_claims: Any,
    ) -> str:
        """Sign a JWT with `sub`, `aud`, `iss`, `iat` and `exp` (plus any extra claims)."""
        issued_at = int(time.time() if now is None else now)
        claims: dict[str, Any] = {
            "sub": sub,
            "aud": audience,
            "iss": issuer,
            "iat": issued_at,
            "exp": issued_at + int(ttl_seconds),
            **extra_claims,
        }
        return jwt.encode(claims, self.private_key, algorithm=self.alg, headers={"kid": self.kid})


def merge_jwks(*keys: SigningKey) -> dict[str, Any]:
    """One JWK Set with the public halves of several keys."""
    return {"keys": [key.public_jwk() for key in keys]}
