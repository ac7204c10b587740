"""Capability tokens: minting, strict verification, the keyset, and the verified-token cache.

A capability token is a compact JWS (a JWT) signed with Ed25519 (``EdDSA``) by default or
ES256. Verification never trusts the token to say how it should be verified (RFC 8725):

- the algorithm is pinned by configuration; a header ``alg`` that differs is refused;
- the key is chosen by ``kid`` from the configured keyset (a JWKS file) only; the header may
  carry nothing but ``alg``, ``typ`` and ``kid`` (so ``jku``, ``x5u``, ``x5c``, ``jwk`` and
  ``crit`` are refused);
- ``typ`` must be ``capgate+jwt`` (RFC 8725 §3.11: explicit typing, so an ID token or another
  JWT signed by the same key cannot be replayed as a capability);
- segments must be canonical unpadded base64url, so one signature has one spelling;
- header and payload are parsed by us first, refusing duplicate keys (PyJWT keeps the last);
- required claims, their JSON types and the lifetime bound are checked here, because PyJWT
  accepts a token without ``exp``, an ``exp`` given as a string, or a ten-year lifetime.

Verified tokens are cached until expiry, keyed by the exact token text, so the hot path does
not re-verify a signature per call. Revocation is not cached here: the authenticate stage
checks it on every call against the state store's local mirror.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from gateway.errors import ConfigError, TokenExpired, TokenInvalid

TOKEN_TYPE = "capgate+jwt"  # noqa: S105 (the JWT typ header value)
ALGORITHMS = ("EdDSA", "ES256")
ALLOWED_HEADER_KEYS = frozenset({"alg", "typ", "kid"})
REQUIRED_CLAIMS = ("iss", "aud", "sub", "iat", "nbf", "exp", "jti", "roles")
AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}")
_B64URL = re.compile(r"[A-Za-z0-9_-]+")

PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
PublicKey = ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey


@dataclass(frozen=True, slots=True)
class Claims:
    """The verified claims of one capability token."""

    agent: str
    jti: str
    roles: tuple[str, ...]
    caps: frozenset[str] | None
    run: str | None
    issuer: str
    audience: tuple[str, ...]
    issued_at: float
    not_before: float
    expires_at: float
    kid: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def assumed(
        cls,
        agent: str,
        roles: Iterable[str],
        *,
        caps: Iterable[str] | None = None,
        run: str | None = None,
        jti: str = "assumed",
        issuer: str = "assumed",
    ) -> Claims:
        """Claims taken as given, not read from a verified token: for ``policy explain``
        (which asks what a token with these roles could do) and for tests of one stage."""
        return cls(
            agent=agent,
            jti=jti,
            roles=tuple(roles),
            caps=frozenset(caps) if caps is not None else None,
            run=run,
            issuer=issuer,
            audience=(issuer,),
            issued_at=0,
            not_before=0,
            expires_at=0,
        )


MAX_LIFETIME_CEILING = 86400.0
"""No gateway accepts a token living longer than a day: ``max_token_lifetime`` (default 1h)
may be raised up to this and no further, and ``capgate token mint`` refuses to sign beyond
it (a token every gateway refuses is a mistake, found at minting, not at the first call)."""
DEFAULT_MAX_LIFETIME = 3600.0


@dataclass(frozen=True, slots=True)
class TokenSettings:
    algorithm: str = "EdDSA"
    audience: str = "capgate"
    issuers: tuple[str, ...] = ("capgate",)
    max_lifetime: float = DEFAULT_MAX_LIFETIME
    leeway: float = 30.0
    max_size: int = 8192
    cache_size: int = 10_000


# --- encoding helpers ---------------------------------------------------------------------


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode_canonical(segment: str, what: str) -> bytes:
    if not segment or not _B64URL.fullmatch(segment):
        raise TokenInvalid(f"token {what} is not unpadded base64url")
    try:
        data = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
    except (binascii.Error, ValueError):
        raise TokenInvalid(f"token {what} is not valid base64url") from None
    if b64url(data) != segment:
        # Unused trailing bits set: a second spelling of the same bytes.
        raise TokenInvalid(f"token {what} is not canonical base64url")
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise TokenInvalid(f"token JSON has a duplicated key {key!r}")
        out[key] = value
    return out


def _not_json_constant(name: str) -> Any:
    # json.loads accepts NaN, Infinity and -Infinity, which are not JSON (RFC 8259).
    raise TokenInvalid(f"token JSON contains {name}, which is not JSON")


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_not_json_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise TokenInvalid(f"token {what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise TokenInvalid(f"token {what} is not a JSON object")
    return value


def key_id(public_key: PublicKey) -> str:
    """RFC 7638 JWK thumbprint (SHA-256, base64url), used as ``kid``."""
    jwk = public_jwk(public_key, kid=None)
    members = {k: jwk[k] for k in sorted(jwk) if k in ("crv", "kty", "x", "y")}
    canonical = json.dumps(members, separators=(",", ":"), sort_keys=True).encode()
    return b64url(hashlib.sha256(canonical).digest())


def public_jwk(public_key: PublicKey, kid: str | None) -> dict[str, str]:
    if isinstance(public_key, ed25519.Ed25519PublicKey):
        raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        jwk = {"kty": "OKP", "crv": "Ed25519", "x": b64url(raw), "alg": "EdDSA", "use": "sig"}
    elif isinstance(public_key, ec.EllipticCurvePublicKey) and isinstance(
        public_key.curve, ec.SECP256R1
    ):
        nums = public_key.public_numbers()
        jwk = {
            "kty": "EC",
            "crv": "P-256",
            "x": b64url(nums.x.to_bytes(32, "big")),
            "y": b64url(nums.y.to_bytes(32, "big")),
            "alg": "ES256",
            "use": "sig",
        }
    else:
        raise ConfigError("only Ed25519 and P-256 keys are supported")
    if kid is not None:
        jwk["kid"] = kid
    return jwk


def algorithm_of(key: PrivateKey | PublicKey) -> str:
    if isinstance(key, ed25519.Ed25519PrivateKey | ed25519.Ed25519PublicKey):
        return "EdDSA"
    return "ES256"


# --- keys on disk --------------------------------------------------------------------------


def generate_keys(directory: str | Path, algorithm: str = "EdDSA") -> tuple[Path, Path]:
    """Write ``signing-key.pem`` (0600) and ``jwks.json`` into ``directory``."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"algorithm has value {algorithm!r}; expected one of {list(ALGORITHMS)}")
    d = Path(directory)
    private: PrivateKey = (
        ed25519.Ed25519PrivateKey.generate()
        if algorithm == "EdDSA"
        else ec.generate_private_key(ec.SECP256R1())
    )
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public = private.public_key()
    jwks = {"keys": [public_jwk(public, key_id(public))]}
    key_path = d / "signing-key.pem"
    jwks_path = d / "jwks.json"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if key_path.exists():
            key_path.unlink()
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)
        jwks_path.write_text(json.dumps(jwks, indent=2) + "\n")
    except OSError as exc:
        # One readable line for the CLI, not a traceback (e.g. --dir names a file).
        raise ConfigError(f"cannot write keys to {str(d)!r}: {exc.strerror}") from exc
    return key_path, jwks_path


def load_private_key(path: str | Path) -> PrivateKey:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read signing key {str(path)!r}: {exc.strerror}") from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"signing key {str(path)!r} is not an unencrypted PEM key") from exc
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    raise ConfigError(f"signing key {str(path)!r} must be Ed25519 or P-256")


class Keyset:
    """Public keys by ``kid``, from a JWKS document; all of one pinned algorithm."""

    def __init__(self, keys: dict[str, PublicKey], algorithm: str) -> None:
        self.keys = keys
        self.algorithm = algorithm

    @classmethod
    def from_jwks(cls, document: Any, algorithm: str, source: str = "jwks") -> Keyset:
        if algorithm not in ALGORITHMS:
            raise ConfigError(f"tokens.algorithm has value {algorithm!r}; expected EdDSA or ES256")
        if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
            raise ConfigError(f"{source}: expected a JWKS object with a 'keys' list")
        keys: dict[str, PublicKey] = {}
        for i, entry in enumerate(document["keys"]):
            if not isinstance(entry, dict):
                raise ConfigError(f"{source}: keys[{i}] is not an object")
            kid = entry.get("kid")
            if not isinstance(kid, str) or not kid:
                raise ConfigError(f"{source}: keys[{i}] has no 'kid'")
            if kid in keys:
                raise ConfigError(f"{source}: duplicate kid {kid!r}")
            if "d" in entry:
                raise ConfigError(
                    f"{source}: keys[{i}] contains a private key; publish public keys only"
                )
            want = {"EdDSA": ("OKP", "Ed25519"), "ES256": ("EC", "P-256")}[algorithm]
            if (entry.get("kty"), entry.get("crv")) != want:
                # Keys of another type are skipped, never used with the pinned algorithm.
                continue
            if entry.get("alg") not in (None, algorithm):
                continue
            try:
                key = jwt.PyJWK(entry, algorithm=algorithm).key
            except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError) as exc:
                raise ConfigError(f"{source}: keys[{i}] is not a valid key: {exc}") from exc
            keys[kid] = key
        if not keys:
            raise ConfigError(f"{source}: no {algorithm} key in the keyset")
        return cls(keys, algorithm)

    @classmethod
    def from_file(cls, path: str | Path, algorithm: str) -> Keyset:
        try:
            document = json.loads(Path(path).read_text("utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read keyset {str(path)!r}: {exc.strerror}") from exc
        except ValueError as exc:
            raise ConfigError(f"keyset {str(path)!r} is not valid JSON: {exc}") from exc
        return cls.from_jwks(document, algorithm, source=str(path))


# --- minting -------------------------------------------------------------------------------


def mint_token(
    private_key: PrivateKey,
    *,
    agent: str,
    roles: Iterable[str],
    ttl: float = 300.0,
    run: str | None = None,
    caps: Iterable[str] | None = None,
    audience: str = "capgate",
    issuer: str = "capgate",
    now: float | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """A signed capability token for ``agent`` (used by the CLI and by tests)."""
    if not AGENT_ID.fullmatch(agent):
        raise ValueError(f"agent id {agent!r} must be letters, digits and _.:@- (max 128)")
    issued = int(now if now is not None else time.time())
    claims: dict[str, Any] = {
        "iss": issuer,
        "aud": audience,
        "sub": agent,
        "iat": issued,
        "nbf": issued,
        "exp": issued + int(ttl),
        "jti": uuid.uuid4().hex,
        "roles": list(roles),
    }
    if run is not None:
        claims["run"] = run
    if caps is not None:
        claims["caps"] = list(caps)
    if extra:
        claims.update(extra)
    kid = key_id(private_key.public_key())
    return jwt.encode(
        claims,
        private_key,
        algorithm=algorithm_of(private_key),
        headers={"kid": kid, "typ": TOKEN_TYPE},
    )


def mint_upstream_jwt(
    private_key: PrivateKey, *, issuer: str, audience: str, agent: str, ttl: float, now: float
) -> str:
    """A short-lived JWT naming ``agent`` for an upstream (the ``agent-jwt`` credential)."""
    issued = int(now)
    return jwt.encode(
        {
            "iss": issuer,
            "aud": audience,
            "sub": agent,
            "iat": issued,
            "nbf": issued,
            "exp": issued + int(ttl),
            "jti": uuid.uuid4().hex,
        },
        private_key,
        algorithm=algorithm_of(private_key),
        headers={"kid": key_id(private_key.public_key())},
    )


# --- verification --------------------------------------------------------------------------


def _expect_str(
    claims: dict[str, Any], name: str, *, pattern: re.Pattern[str] | None = None
) -> str:
    value = claims.get(name)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise TokenInvalid(f"claim {name!r} must be a non-empty string", errors=[{"claim": name}])
    if pattern is not None and not pattern.fullmatch(value):
        raise TokenInvalid(
            f"claim {name!r} has characters that are not allowed", errors=[{"claim": name}]
        )
    return value


def _expect_time(claims: dict[str, Any], name: str) -> float:
    value = claims.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TokenInvalid(
            f"claim {name!r} must be a NumericDate (a number)", errors=[{"claim": name}]
        )
    try:
        seconds = float(value)
    except OverflowError:  # an integer too large for a float: checked before the signature
        seconds = math.inf
    if not math.isfinite(seconds):
        raise TokenInvalid(f"claim {name!r} must be a finite NumericDate", errors=[{"claim": name}])
    return seconds


def _expect_str_list(claims: dict[str, Any], name: str, *, allow_empty: bool) -> tuple[str, ...]:
    value = claims.get(name)
    if (
        not isinstance(value, list)
        or (not value and not allow_empty)
        or len(value) > 256
        or not all(isinstance(v, str) and v and len(v) <= 128 for v in value)
    ):
        raise TokenInvalid(
            f"claim {name!r} must be a list of non-empty strings", errors=[{"claim": name}]
        )
    return tuple(value)


class TokenVerifier:
    """Verifies capability tokens against one keyset and caches the verdicts until expiry."""

    def __init__(
        self,
        keyset: Keyset,
        settings: TokenSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # SECURITY: the algorithm comes from configuration (settings/keyset), never from the
        # token header (RFC 8725 §3.1). The keyset and settings must agree.
        if keyset.algorithm != settings.algorithm:
            raise ConfigError("tokens.algorithm and the keyset's algorithm differ")
        self.keyset = keyset
        self.settings = settings
        self.clock = clock
        self._cache: OrderedDict[str, Claims] = OrderedDict()

    def forget(self, predicate: Callable[[Claims], bool] | None = None) -> None:
        """Drop cached verdicts (all, or those matching), e.g. after a revocation."""
        if predicate is None:
            self._cache.clear()
            return
        for token in [t for t, c in self._cache.items() if predicate(c)]:
            del self._cache[token]

    def verify(self, token: str) -> Claims:
        """The claims of a valid token, or raise ``TokenInvalid``/``TokenExpired``."""
        cached = self._cache.get(token)
        if cached is not None:
            if self.clock() >= cached.expires_at + self.settings.leeway:
                del self._cache[token]
                raise TokenExpired("the capability token has expired")
            return cached
        claims = self._verify_uncached(token)
        self._cache[token] = claims
        if len(self._cache) > self.settings.cache_size:
            self._cache.popitem(last=False)
        return claims

    def _verify_uncached(self, token: str) -> Claims:
        # SECURITY: the order of the steps (and of the checks within each) decides which error
        # a bad token gets; it is: shape, header, claim types, signature (PyJWT), lifetime.
        header, payload = self._decode_segments(token)
        kid = self._check_header(header)
        claims = _typed_claims(payload, kid)
        self._check_signature(token, kid)
        self._check_lifetime(claims)
        return claims

    def _decode_segments(self, token: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Header and payload of a compact JWS of canonical base64url segments (unverified)."""
        s = self.settings
        if len(token) > s.max_size:
            raise TokenInvalid(f"the token is larger than {s.max_size} bytes")
        parts = token.split(".")
        if len(parts) != 3:
            raise TokenInvalid("the token is not a compact JWS (three dot-separated parts)")
        header = _json_object(_b64url_decode_canonical(parts[0], "header"), "header")
        payload = _json_object(_b64url_decode_canonical(parts[1], "payload"), "payload")
        _b64url_decode_canonical(parts[2], "signature")
        return header, payload

    def _check_header(self, header: dict[str, Any]) -> str:
        """The header's ``kid``, after refusing other fields, another ``alg`` or ``typ``."""
        unknown = set(header) - ALLOWED_HEADER_KEYS
        if unknown:
            raise TokenInvalid(
                f"token header has fields that are not accepted: {sorted(unknown)}",
                errors=[{"header": k} for k in sorted(unknown)],
            )
        if header.get("alg") != self.settings.algorithm:
            raise TokenInvalid(f"token algorithm must be {self.settings.algorithm}")
        if header.get("typ") != TOKEN_TYPE:
            raise TokenInvalid(f"token type (typ) must be {TOKEN_TYPE!r}")
        kid = header.get("kid")
        if not isinstance(kid, str) or kid not in self.keyset.keys:
            raise TokenInvalid("token key id (kid) is not in the configured keyset")
        return kid

    def _check_signature(self, token: str, kid: str) -> None:
        """Signature, audience, issuer and PyJWT's own time checks, by the keyset's key."""
        s = self.settings
        try:
            jwt.decode(
                token,
                self.keyset.keys[kid],
                algorithms=[s.algorithm],
                audience=s.audience,
                issuer=list(s.issuers),
                leeway=s.leeway,
                options={"require": list(REQUIRED_CLAIMS), "strict_aud": False},
            )
        except jwt.ExpiredSignatureError:
            raise TokenExpired("the capability token has expired") from None
        except jwt.ImmatureSignatureError:
            raise TokenInvalid(
                "the capability token is not valid yet (nbf or iat in the future)"
            ) from None
        except jwt.InvalidAudienceError:
            raise TokenInvalid(
                "the token's audience is not this gateway", errors=[{"claim": "aud"}]
            ) from None
        except jwt.InvalidIssuerError:
            raise TokenInvalid(
                "the token's issuer is not trusted", errors=[{"claim": "iss"}]
            ) from None
        except jwt.InvalidSignatureError:
            raise TokenInvalid("the token's signature does not verify") from None
        except jwt.InvalidTokenError as exc:
            raise TokenInvalid(f"the token is not valid: {type(exc).__name__}") from None

    def _check_lifetime(self, claims: Claims) -> None:
        """``iat``/``nbf``/``exp`` consistent, within ``max_lifetime``, and not expired now."""
        s = self.settings
        iat, nbf, exp = claims.issued_at, claims.not_before, claims.expires_at
        now = self.clock()
        if iat > now + s.leeway:
            raise TokenInvalid(
                "the token was issued in the future (iat)", errors=[{"claim": "iat"}]
            )
        if nbf < iat - s.leeway:
            raise TokenInvalid("claim 'nbf' is before 'iat'", errors=[{"claim": "nbf"}])
        if exp <= iat:
            raise TokenInvalid("claim 'exp' is not after 'iat'", errors=[{"claim": "exp"}])
        if exp - min(iat, nbf) > s.max_lifetime:
            raise TokenInvalid(
                f"the token lives longer than the allowed {int(s.max_lifetime)} s",
                errors=[{"claim": "exp"}],
            )
        if now >= exp + s.leeway:
            raise TokenExpired("the capability token has expired")


def _expect_audience(claims: dict[str, Any]) -> tuple[str, ...]:
    aud = claims["aud"]
    audience = (aud,) if isinstance(aud, str) else aud
    if (
        not isinstance(audience, list | tuple)
        or not audience
        or not all(isinstance(a, str) for a in audience)
    ):
        raise TokenInvalid(
            "claim 'aud' must be a string or a list of strings", errors=[{"claim": "aud"}]
        )
    return tuple(audience)


def _typed_claims(payload: dict[str, Any], kid: str) -> Claims:
    """The payload's claims, each of its JSON type (not yet verified: no signature checked)."""
    for name in REQUIRED_CLAIMS:
        if name not in payload:
            raise TokenInvalid(f"token is missing the {name!r} claim", errors=[{"claim": name}])
    # Types first: PyJWT would accept some wrong types (e.g. a string exp in old versions).
    # The order of these checks is the order in which a token's errors are reported.
    agent = _expect_str(payload, "sub", pattern=AGENT_ID)
    jti = _expect_str(payload, "jti")
    issuer = _expect_str(payload, "iss")
    audience = _expect_audience(payload)
    iat = _expect_time(payload, "iat")
    nbf = _expect_time(payload, "nbf")
    exp = _expect_time(payload, "exp")
    roles = _expect_str_list(payload, "roles", allow_empty=False)
    caps = (
        frozenset(_expect_str_list(payload, "caps", allow_empty=True))
        if "caps" in payload
        else None
    )
    run = _expect_str(payload, "run", pattern=AGENT_ID) if "run" in payload else None
    extra = {k: v for k, v in payload.items() if k not in REQUIRED_CLAIMS}
    return Claims(
        agent=agent,
        jti=jti,
        roles=roles,
        caps=caps,
        run=run,
        issuer=issuer,
        audience=audience,
        issued_at=iat,
        not_before=nbf,
        expires_at=exp,
        kid=kid,
        extra=extra,
    )


def inspect_token(token: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Header and payload of a token, decoded without verifying anything (for the CLI)."""
    parts = token.split(".")
    if len(parts) != 3:
        return None, None
    out: list[dict[str, Any] | None] = []
    for seg, what in ((parts[0], "header"), (parts[1], "payload")):
        try:
            out.append(_json_object(_b64url_decode_canonical(seg, what), what))
        except TokenInvalid:
            out.append(None)
    return out[0], out[1]
