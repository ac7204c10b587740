"""Capability tokens: strict verification, keysets, key files, the verified-token cache.

Tokens are built by hand (any header, any payload, signed with the real key) so each test
shows one rule of ``TokenVerifier`` holding on its own, with everything else valid.
"""

from __future__ import annotations

import base64
import hashlib
import json
import stat
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hypothesis import given
from hypothesis import strategies as st

from gateway import tokens
from gateway.errors import ConfigError, Reason, TokenExpired, TokenInvalid
from gateway.tokens import (
    REQUIRED_CLAIMS,
    TOKEN_TYPE,
    Keyset,
    TokenSettings,
    TokenVerifier,
    generate_keys,
    inspect_token,
    key_id,
    load_private_key,
    mint_token,
    public_jwk,
)
from tests.helpers_core import (
    DROP,
    FUZZ,
    Clock,
    Signer,
    b64,
    claims,
    hmac_jws,
    noncanonical,
    sign_jws,
    unb64,
)


@pytest.fixture
def ed() -> Signer:
    return Signer("EdDSA")


@pytest.fixture
def es() -> Signer:
    return Signer("ES256")


@pytest.fixture
def decode_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count signature checks: every call of ``jwt.decode`` made by the verifier."""
    calls: list[str] = []
    real = jwt.decode

    def counting(token: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(token)
        return real(token, *args, **kwargs)

    monkeypatch.setattr(tokens.jwt, "decode", counting)
    return calls


def refused(verifier: TokenVerifier, token: str, *, contains: str = "") -> TokenInvalid:
    with pytest.raises(TokenInvalid) as info:
        verifier.verify(token)
    err = info.value
    assert type(err) is TokenInvalid
    assert err.reason is Reason.TOKEN_INVALID and err.status == 401
    assert contains in err.detail, err.detail
    return err


# --- valid tokens -----------------------------------------------------------------------------


def test_valid_eddsa_token_from_mint(ed: Signer) -> None:
    token = mint_token(ed.key, agent="sre-bot", roles=["sre-diagnostics", "analyst"], run="run-7")
    c = ed.verifier().verify(token)
    assert c.agent == "sre-bot"
    assert c.roles == ("sre-diagnostics", "analyst")
    assert c.run == "run-7"
    assert c.caps is None
    assert c.kid == ed.kid
    assert c.issuer == "capgate" and c.audience == ("capgate",)
    assert c.expires_at - c.issued_at == 300
    assert len(c.jti) == 32


def test_valid_es256_token(es: Signer) -> None:
    token = mint_token(es.key, agent="a1", roles=["r"], caps=["rule-1"], ttl=60)
    header = json.loads(unb64(token.split(".")[0]))
    assert header == {"alg": "ES256", "typ": TOKEN_TYPE, "kid": es.kid}
    c = es.verifier().verify(token)
    assert c.agent == "a1" and c.caps == frozenset({"rule-1"})
    assert c.expires_at - c.issued_at == 60


def test_mint_header_is_exactly_alg_typ_kid(ed: Signer) -> None:
    token = mint_token(ed.key, agent="a", roles=["r"])
    header, payload = inspect_token(token)
    assert header == {"alg": "EdDSA", "typ": TOKEN_TYPE, "kid": ed.kid}
    assert payload is not None
    assert set(payload) == {"iss", "aud", "sub", "iat", "nbf", "exp", "jti", "roles"}


@pytest.mark.parametrize("agent", ["", "a/b", "a b", "-a", ".a", "a" * 129, "é"])
def test_mint_refuses_bad_agent_ids(ed: Signer, agent: str) -> None:
    with pytest.raises(ValueError, match="agent id"):
        mint_token(ed.key, agent=agent, roles=["r"])


def test_hand_signed_valid_token_is_accepted(ed: Signer) -> None:
    # The control for every hand-signed refusal below: the same recipe, nothing broken.
    c = ed.verifier().verify(ed.sign(claims()))
    assert c.agent == "agent-1" and c.jti == "jti-0001"
    c2 = ed.verifier().verify(sign_jws(ed.header(), claims(), ed.key))
    assert c2.agent == "agent-1"


def test_audience_list_containing_ours_is_accepted(ed: Signer) -> None:
    c = ed.verifier().verify(ed.sign(claims(aud=["other", "capgate"])))
    assert c.audience == ("other", "capgate")


def test_second_trusted_issuer_is_accepted(ed: Signer) -> None:
    v = ed.verifier(issuers=("capgate", "ci-issuer"))
    assert v.verify(ed.sign(claims(iss="ci-issuer"))).issuer == "ci-issuer"


def test_float_numeric_dates_are_accepted(ed: Signer) -> None:
    now = time.time()
    c = ed.verifier().verify(ed.sign(claims(iat=now, nbf=now, exp=now + 60.5)))
    assert c.expires_at == pytest.approx(now + 60.5)


# --- caps and extra claims --------------------------------------------------------------------


def test_caps_absent_is_none_and_present_is_frozenset(ed: Signer) -> None:
    v = ed.verifier()
    assert v.verify(ed.sign(claims())).caps is None
    c = v.verify(ed.sign(claims(jti="j2", caps=["read-cpu", "read-cpu", "x"])))
    assert c.caps == frozenset({"read-cpu", "x"}) and isinstance(c.caps, frozenset)


def test_empty_caps_is_an_empty_set_not_none(ed: Signer) -> None:
    # caps=[] must narrow to nothing, never mean "no narrowing".
    c = ed.verifier().verify(ed.sign(claims(caps=[])))
    assert c.caps == frozenset()
    assert c.caps is not None


@pytest.mark.parametrize(
    "caps", ["read-cpu", {"a": 1}, [1], [""], [None], ["x" * 129], ["c"] * 257]
)
def test_bad_caps_are_refused(ed: Signer, caps: Any) -> None:
    err = refused(ed.verifier(), ed.sign(claims(caps=caps)), contains="'caps'")
    assert err.errors == [{"claim": "caps"}]


def test_extra_claims_are_kept_but_do_not_change_identity(ed: Signer) -> None:
    c = ed.verifier().verify(ed.sign(claims(run="r1", team="blue")))
    assert c.extra == {"run": "r1", "team": "blue"}
    assert c.agent == "agent-1"


# --- algorithm attacks ------------------------------------------------------------------------


def test_alg_none_is_refused(ed: Signer, decode_calls: list[str]) -> None:
    v = ed.verifier()
    unsigned = (
        f"{b64(json.dumps(ed.header(alg='none')).encode())}.{b64(json.dumps(claims()).encode())}."
    )
    refused(v, unsigned)
    # With some signature bytes, so it is the algorithm check that refuses, not the empty part.
    with_sig = unsigned + b64(b"\x00" * 64)
    refused(v, with_sig, contains="algorithm must be EdDSA")
    for alg in ("None", "NONE", "nOnE"):
        h = b64(json.dumps(ed.header(alg=alg)).encode())
        refused(
            v, f"{h}.{b64(json.dumps(claims()).encode())}.{b64(b'x' * 64)}", contains="algorithm"
        )
    assert decode_calls == []


def test_hs256_with_the_public_key_as_hmac_secret_is_refused(
    ed: Signer, decode_calls: list[str]
) -> None:
    v = ed.verifier()
    public = ed.key.public_key()
    secrets = [
        public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw),
        public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
        ed.jwk["x"].encode(),
        json.dumps(ed.jwk).encode(),
    ]
    for alg in ("HS256", "HS384", "HS512"):
        for secret in secrets:
            token = hmac_jws(ed.header(alg=alg), claims(), secret)
            refused(v, token, contains="algorithm must be EdDSA")
    assert decode_calls == []


def test_es256_token_on_an_eddsa_gateway_is_refused(ed: Signer, es: Signer) -> None:
    # Signed correctly with an ES256 key, and even carrying the EdDSA key's kid.
    v = ed.verifier()
    refused(v, mint_token(es.key, agent="a", roles=["r"]), contains="algorithm must be EdDSA")
    forged = sign_jws(es.header(kid=ed.kid), claims(), es.key)
    refused(v, forged, contains="algorithm must be EdDSA")


def test_eddsa_token_on_an_es256_gateway_is_refused(ed: Signer, es: Signer) -> None:
    v = es.verifier()
    refused(v, mint_token(ed.key, agent="a", roles=["r"]), contains="algorithm must be ES256")


def test_eddsa_header_with_es256_signature_bytes_fails_the_signature(
    ed: Signer, es: Signer
) -> None:
    # alg says EdDSA and kid names the EdDSA key, but the bytes were signed by another key.
    token = sign_jws(ed.header(), claims(), es.key)
    refused(ed.verifier(), token, contains="signature does not verify")


def test_token_signed_by_another_ed25519_key_with_our_kid_is_refused(ed: Signer) -> None:
    other = Signer("EdDSA")
    token = sign_jws(ed.header(), claims(), other.key)
    refused(ed.verifier(), token, contains="signature does not verify")


# --- header rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("jku", "https://evil.example/jwks.json"),
        ("x5u", "https://evil.example/cert.pem"),
        ("x5c", ["MIIB"]),
        ("jwk", {"kty": "OKP", "crv": "Ed25519", "x": "AAAA"}),
        ("crit", ["exp"]),
        ("cty", "JWT"),
        ("b64", False),
        ("zip", "DEF"),
    ],
)
def test_foreign_header_fields_are_refused(
    ed: Signer, decode_calls: list[str], field: str, value: Any
) -> None:
    token = sign_jws(ed.header(**{field: value}), claims(), ed.key)
    err = refused(ed.verifier(), token, contains="not accepted")
    assert err.errors == [{"header": field}]
    assert decode_calls == []


def test_embedded_jwk_of_the_attackers_key_is_not_used(ed: Signer) -> None:
    attacker = Signer("EdDSA")
    token = sign_jws(attacker.header(jwk=attacker.jwk), claims(), attacker.key)
    err = refused(ed.verifier(), token)
    assert err.errors == [{"header": "jwk"}]


def test_unknown_kid_is_refused(ed: Signer) -> None:
    other = Signer("EdDSA")
    refused(ed.verifier(), other.sign(claims()), contains="not in the configured keyset")


@pytest.mark.parametrize("kid", [DROP, "", 5, None, ["x"], "../../etc/passwd"])
def test_missing_or_bad_kid_is_refused(ed: Signer, kid: Any) -> None:
    token = sign_jws(ed.header(kid=kid), claims(), ed.key)
    refused(ed.verifier(), token, contains="kid")


@pytest.mark.parametrize("typ", [DROP, "JWT", "jwt", "at+jwt", "CAPGATE+JWT", "", None, 1])
def test_wrong_or_missing_typ_is_refused(ed: Signer, typ: Any) -> None:
    token = sign_jws(ed.header(typ=typ), claims(), ed.key)
    refused(ed.verifier(), token, contains="typ")


def test_header_that_is_not_an_object_is_refused(ed: Signer) -> None:
    token = sign_jws(b'["EdDSA"]', claims(), ed.key)
    refused(ed.verifier(), token, contains="header is not a JSON object")


def test_payload_that_is_not_an_object_is_refused(ed: Signer) -> None:
    token = sign_jws(ed.header(), b'"just a string"', ed.key)
    refused(ed.verifier(), token, contains="payload is not a JSON object")


def test_payload_that_is_not_json_is_refused(ed: Signer) -> None:
    refused(ed.verifier(), sign_jws(ed.header(), b"{not json", ed.key), contains="not valid JSON")
    refused(ed.verifier(), sign_jws(ed.header(), b"\xff\xfe{}", ed.key), contains="not valid JSON")


# --- time claims ------------------------------------------------------------------------------


def test_expired_beyond_leeway_raises_token_expired(ed: Signer) -> None:
    now = int(time.time())
    token = ed.sign(claims(iat=now - 200, nbf=now - 200, exp=now - 31))
    with pytest.raises(TokenExpired) as info:
        ed.verifier().verify(token)
    assert info.value.reason is Reason.TOKEN_EXPIRED and info.value.status == 401


def test_expired_within_leeway_is_accepted(ed: Signer) -> None:
    now = int(time.time())
    token = ed.sign(claims(iat=now - 200, nbf=now - 200, exp=now - 10))
    assert ed.verifier().verify(token).expires_at == now - 10


def test_leeway_zero_refuses_what_the_default_leeway_accepts(ed: Signer) -> None:
    now = int(time.time())
    token = ed.sign(claims(iat=now - 200, nbf=now - 200, exp=now - 10))
    with pytest.raises(TokenExpired):
        ed.verifier(leeway=0).verify(token)


def test_not_yet_valid_nbf_is_refused(ed: Signer) -> None:
    now = int(time.time())
    token = ed.sign(claims(iat=now, nbf=now + 120, exp=now + 300))
    refused(ed.verifier(), token, contains="not valid yet")


def test_nbf_in_the_future_within_leeway_is_accepted(ed: Signer) -> None:
    now = int(time.time())
    token = ed.sign(claims(iat=now, nbf=now + 10, exp=now + 300))
    assert ed.verifier().verify(token).not_before == now + 10


def test_iat_in_the_future_is_refused(ed: Signer) -> None:
    now = int(time.time())
    token = ed.sign(claims(iat=now + 120, nbf=now + 120, exp=now + 400))
    err = refused(ed.verifier(), token)
    assert "future" in err.detail or "not valid yet" in err.detail


def test_iat_in_the_future_by_the_verifiers_own_clock_is_refused(ed: Signer) -> None:
    # The verifier's clock (not only PyJWT's wall clock) judges iat.
    now = int(time.time())
    clock = Clock(now - 600)
    err = refused(ed.verifier(clock=clock), ed.sign(claims()), contains="issued in the future")
    assert err.errors == [{"claim": "iat"}]


def test_nbf_before_iat_is_refused(ed: Signer) -> None:
    now = int(time.time())
    err = refused(ed.verifier(), ed.sign(claims(iat=now, nbf=now - 120)), contains="'nbf'")
    assert err.errors == [{"claim": "nbf"}]


def test_exp_not_after_iat_is_refused(ed: Signer) -> None:
    now = int(time.time())
    err = refused(
        ed.verifier(), ed.sign(claims(iat=now - 5, nbf=now - 5, exp=now - 5)), contains="'exp'"
    )
    assert err.errors == [{"claim": "exp"}]


def test_lifetime_above_the_default_maximum_is_refused(ed: Signer) -> None:
    now = int(time.time())
    err = refused(
        ed.verifier(),
        ed.sign(claims(now, exp=now + 3601)),
        contains="longer than the allowed 3600 s",
    )
    assert err.errors == [{"claim": "exp"}]
    assert ed.verifier().verify(ed.sign(claims(now, exp=now + 3600))).expires_at == now + 3600


def test_ten_year_token_is_refused(ed: Signer) -> None:
    now = int(time.time())
    refused(ed.verifier(), ed.sign(claims(now, exp=now + 10 * 365 * 86400)), contains="longer than")


def test_lifetime_counts_from_the_earlier_of_iat_and_nbf(ed: Signer) -> None:
    # nbf a little before iat (within leeway) must not be a way to stretch the lifetime.
    now = int(time.time())
    token = ed.sign(claims(iat=now, nbf=now - 20, exp=now + 3590))
    refused(ed.verifier(), token, contains="longer than")


def test_custom_max_lifetime(ed: Signer) -> None:
    now = int(time.time())
    v = ed.verifier(max_lifetime=60)
    refused(v, ed.sign(claims(now, exp=now + 61)), contains="longer than the allowed 60 s")
    assert v.verify(ed.sign(claims(now, exp=now + 60, jti="ok"))).agent == "agent-1"


# --- audience and issuer ----------------------------------------------------------------------


@pytest.mark.parametrize("aud", ["other", ["other"], ["Capgate"], "capgate "])
def test_wrong_audience_is_refused(ed: Signer, aud: Any) -> None:
    err = refused(ed.verifier(), ed.sign(claims(aud=aud)), contains="audience")
    assert err.errors == [{"claim": "aud"}]


@pytest.mark.parametrize("aud", [[], 5, None, ["capgate", 5], {"capgate": 1}])
def test_malformed_audience_is_refused(ed: Signer, aud: Any) -> None:
    err = refused(ed.verifier(), ed.sign(claims(aud=aud)), contains="'aud'")
    assert err.errors == [{"claim": "aud"}]


@pytest.mark.parametrize("iss", ["evil", "Capgate", "capgate/"])
def test_wrong_issuer_is_refused(ed: Signer, iss: str) -> None:
    err = refused(ed.verifier(), ed.sign(claims(iss=iss)), contains="issuer")
    assert err.errors == [{"claim": "iss"}]


# --- required claims and their types ----------------------------------------------------------


@pytest.mark.parametrize("name", ["iss", "aud", "sub", "iat", "nbf", "exp", "jti", "roles"])
def test_each_required_claim_missing_is_refused(
    ed: Signer, decode_calls: list[str], name: str
) -> None:
    err = refused(
        ed.verifier(), ed.sign(claims(**{name: DROP})), contains=f"missing the '{name}' claim"
    )
    assert err.errors == [{"claim": name}]
    assert decode_calls == []  # refused before any signature work


@pytest.mark.parametrize(
    "name,value,contains",
    [
        ("exp", "9999999999", "NumericDate"),
        ("exp", True, "NumericDate"),
        ("exp", None, "NumericDate"),
        ("exp", [1], "NumericDate"),
        ("iat", "now", "NumericDate"),
        ("nbf", False, "NumericDate"),
        ("roles", "admin", "'roles'"),
        ("roles", [], "'roles'"),
        ("roles", [1], "'roles'"),
        ("roles", ["ok", None], "'roles'"),
        ("roles", [""], "'roles'"),
        ("roles", [["nested"]], "'roles'"),
        ("roles", {"admin": True}, "'roles'"),
        ("roles", ["r" * 129], "'roles'"),
        ("sub", "a/b", "'sub'"),
        ("sub", "a b", "'sub'"),
        ("sub", "", "'sub'"),
        ("sub", 7, "'sub'"),
        ("sub", "../admin", "'sub'"),
        ("sub", "agent\n", "'sub'"),
        ("sub", "a" * 129, "'sub'"),
        ("jti", 5, "'jti'"),
        ("jti", "", "'jti'"),
        ("jti", "j" * 257, "'jti'"),
        ("iss", 5, "'iss'"),
        ("iss", ["capgate"], "'iss'"),
        ("run", 5, "'run'"),
        ("run", "", "'run'"),
        ("run", "run/1", "'run'"),
        ("run", ["r"], "'run'"),
        ("caps", "read-cpu", "'caps'"),
    ],
)
def test_wrong_claim_types_are_refused(ed: Signer, name: str, value: Any, contains: str) -> None:
    err = refused(ed.verifier(), ed.sign(claims(**{name: value})), contains=contains)
    assert err.errors == [{"claim": name}]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1" + "0" * 400, "1e400"])
def test_non_finite_or_huge_exp_is_refused_without_crashing(
    ed: Signer, decode_calls: list[str], literal: str
) -> None:
    # Python's json accepts NaN/Infinity and 400-digit integers; float() of the latter raised
    # OverflowError before the signature was checked, so anyone could turn a 401 into a 500.
    now = int(time.time())
    body = (
        (
            '{"iss":"capgate","aud":"capgate","sub":"a","iat":NOW,"nbf":NOW,"exp":EXP,'
            '"jti":"j","roles":["r"]}'
        )
        .replace("NOW", str(now))
        .replace("EXP", literal)
        .encode()
    )
    signed = sign_jws(ed.header(), body, ed.key)
    unsigned = signed.rsplit(".", 1)[0] + "." + b64(b"\x00" * 64)
    for token in (signed, unsigned):
        refused(ed.verifier(), token)
    assert decode_calls == []


# --- size, segments, encoding -----------------------------------------------------------------


def test_oversized_token_is_refused_before_any_parsing(ed: Signer, decode_calls: list[str]) -> None:
    token = ed.sign(claims(roles=[f"role-{i:04d}-" + "x" * 90 for i in range(100)]))
    assert len(token) > 8192
    refused(ed.verifier(), token, contains="larger than 8192 bytes")
    assert decode_calls == []


def test_token_of_exactly_max_size_is_not_refused_for_size(ed: Signer) -> None:
    base = ed.sign(claims(pad=""))
    pad = 8192 - len(base)
    # Each 3 bytes of payload add 4 characters; aim just under the limit.
    token = ed.sign(claims(pad="x" * (pad * 3 // 4 - 2)))
    assert len(token) <= 8192
    assert ed.verifier().verify(token).extra["pad"].startswith("x")


def test_custom_max_size(ed: Signer) -> None:
    token = ed.sign(claims())
    refused(ed.verifier(max_size=len(token) - 1), token, contains=f"larger than {len(token) - 1}")
    assert ed.verifier(max_size=len(token)).verify(token).agent == "agent-1"


def test_tampered_payload_keeps_signature_and_is_refused(ed: Signer) -> None:
    token = ed.sign(claims(roles=["viewer"]))
    h, _, s = token.split(".")
    forged = f"{h}.{b64(json.dumps(claims(roles=['admin'])).encode())}.{s}"
    refused(ed.verifier(), forged, contains="signature does not verify")


def test_tampered_header_is_refused(ed: Signer) -> None:
    token = ed.sign(claims())
    _, p, s = token.split(".")
    h2 = b64(json.dumps({"kid": ed.kid, "typ": TOKEN_TYPE, "alg": "EdDSA"}).encode())
    refused(ed.verifier(), f"{h2}.{p}.{s}", contains="signature does not verify")


def test_flipped_signature_bit_is_refused(ed: Signer) -> None:
    token = ed.sign(claims())
    h, p, s = token.split(".")
    sig = bytearray(unb64(s))
    sig[10] ^= 1
    refused(ed.verifier(), f"{h}.{p}.{b64(bytes(sig))}", contains="signature does not verify")


@pytest.mark.parametrize("padding", ["=", "==", "==="])
def test_padding_on_the_signature_is_refused(ed: Signer, padding: str) -> None:
    token = ed.sign(claims())
    v = ed.verifier()
    assert v.verify(token)
    refused(ed.verifier(), token + padding, contains="signature is not unpadded base64url")


def test_padding_on_header_or_payload_is_refused(ed: Signer) -> None:
    h, p, s = ed.sign(claims()).split(".")
    refused(ed.verifier(), f"{h}=.{p}.{s}", contains="header")
    refused(ed.verifier(), f"{h}.{p}=.{s}", contains="payload")


def test_non_canonical_signature_encoding_is_refused(ed: Signer) -> None:
    token = ed.sign(claims())
    h, p, s = token.split(".")
    assert len(s) == 86  # 64 bytes: 4 unused bits in the last character
    spelled = noncanonical(s)
    assert spelled != s and unb64(spelled) == unb64(s)
    refused(ed.verifier(), f"{h}.{p}.{spelled}", contains="signature is not canonical")


def test_non_canonical_payload_encoding_is_refused(ed: Signer) -> None:
    # Grow the payload until its encoding has unused bits, then set one.
    for i in range(3):
        token = ed.sign(claims(pad="x" * i))
        h, p, s = token.split(".")
        if len(p) % 4 in (2, 3):
            break
    refused(ed.verifier(), f"{h}.{noncanonical(p)}.{s}", contains="payload is not canonical")


@pytest.mark.parametrize(
    "mangle",
    [
        lambda h, p, s: f"{h}.{p}",
        lambda h, p, s: f"{h}.{p}.{s}.{s}",
        lambda h, p, s: f"{h}.{p}.{s}.",
        lambda h, p, s: f"{h}..{s}",
        lambda h, p, s: f".{p}.{s}",
        lambda h, p, s: "",
        lambda h, p, s: "..",
        lambda h, p, s: f"{h}.{p}.{s[:-1]}+",
        lambda h, p, s: f"{h}.{p}.{s[:-1]}/",
        lambda h, p, s: f"{h}.{p}.{s} ",
        lambda h, p, s: f"{h}.{p.replace('e', 'é', 1)}.{s}",
    ],
    ids=[
        "2-segments",
        "4-segments",
        "trailing-dot",
        "empty-payload",
        "empty-header",
        "empty",
        "only-dots",
        "std-b64-plus",
        "std-b64-slash",
        "trailing-space",
        "non-ascii",
    ],
)
def test_malformed_compact_serialisation_is_refused(ed: Signer, mangle: Any) -> None:
    h, p, s = ed.sign(claims(pad="ee")).split(".")
    refused(ed.verifier(), mangle(h, p, s))


def test_duplicate_key_in_payload_is_refused(ed: Signer) -> None:
    # PyJWT keeps the last "sub"; another parser would keep the first. Hand-built and signed.
    now = int(time.time())
    payload = (
        (
            '{"iss":"capgate","aud":"capgate","sub":"admin","iat":NOW,"nbf":NOW,"exp":EXP,'
            '"jti":"j","roles":["r"],"sub":"agent-1"}'
        )
        .replace("NOW", str(now))
        .replace("EXP", str(now + 60))
        .encode()
    )
    token = sign_jws(ed.header(), payload, ed.key)
    # The signature is valid: PyJWT alone would accept it.
    assert (
        jwt.decode(token, ed.key.public_key(), algorithms=["EdDSA"], audience="capgate")["sub"]
        == "agent-1"
    )
    refused(ed.verifier(), token, contains="duplicated key 'sub'")


def test_duplicate_key_in_header_is_refused(ed: Signer) -> None:
    header = f'{{"alg":"none","alg":"EdDSA","typ":"{TOKEN_TYPE}","kid":"{ed.kid}"}}'.encode()
    refused(ed.verifier(), sign_jws(header, claims(), ed.key), contains="duplicated key 'alg'")


def test_duplicate_key_nested_in_payload_is_refused(ed: Signer) -> None:
    now = int(time.time())
    payload = (
        (
            '{"iss":"capgate","aud":"capgate","sub":"a","iat":NOW,"nbf":NOW,"exp":EXP,'
            '"jti":"j","roles":["r"],"ctx":{"k":1,"k":2}}'
        )
        .replace("NOW", str(now))
        .replace("EXP", str(now + 60))
        .encode()
    )
    refused(ed.verifier(), sign_jws(ed.header(), payload, ed.key), contains="duplicated key 'k'")


def test_deeply_nested_payload_is_refused_not_crashing(ed: Signer) -> None:
    payload = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    token = sign_jws(ed.header(), payload, ed.key)
    refused(ed.verifier(max_size=10**7), token)


# --- the cache --------------------------------------------------------------------------------


def test_same_token_twice_checks_the_signature_once(ed: Signer, decode_calls: list[str]) -> None:
    v = ed.verifier()
    token = ed.sign(claims())
    first = v.verify(token)
    second = v.verify(token)
    assert first is second
    assert decode_calls == [token]


def test_cache_is_keyed_by_exact_text(ed: Signer, decode_calls: list[str]) -> None:
    v = ed.verifier()
    token = ed.sign(claims())
    v.verify(token)
    refused(v, token + "=")  # not served from the cache under a near spelling
    assert decode_calls == [token]


def test_refused_tokens_are_not_cached(ed: Signer, decode_calls: list[str]) -> None:
    v = ed.verifier()
    h, p, s = ed.sign(claims()).split(".")
    sig = bytearray(unb64(s))
    sig[0] ^= 0xFF
    bad = f"{h}.{p}.{b64(bytes(sig))}"
    refused(v, bad)
    refused(v, bad)
    assert decode_calls == [bad, bad]


def test_cached_token_expires_when_the_clock_moves(ed: Signer, decode_calls: list[str]) -> None:
    clock = Clock()
    v = ed.verifier(clock=clock)
    now = int(clock.now)
    token = ed.sign(claims(iat=now, nbf=now, exp=now + 60))
    assert v.verify(token).expires_at == now + 60
    clock.now = now + 60 + 29  # within leeway: still served from the cache
    assert v.verify(token).agent == "agent-1"
    clock.now = now + 60 + 30
    with pytest.raises(TokenExpired):
        v.verify(token)
    assert decode_calls == [token]
    # Dropped from the cache: a later call re-verifies (and PyJWT, on the wall clock, accepts
    # it again only because wall time has not moved; the verifier's clock still refuses).
    with pytest.raises(TokenExpired):
        v.verify(token)
    assert len(decode_calls) == 2


def test_forget_with_predicate_drops_only_matching_entries(
    ed: Signer, decode_calls: list[str]
) -> None:
    v = ed.verifier()
    ta = ed.sign(claims(sub="alice", jti="ja"))
    tb = ed.sign(claims(sub="bob", jti="jb"))
    v.verify(ta)
    v.verify(tb)
    v.forget(lambda c: c.agent == "alice")
    v.verify(ta)
    v.verify(tb)
    assert decode_calls == [ta, tb, ta]
    v.forget()
    v.verify(tb)
    assert decode_calls == [ta, tb, ta, tb]


def test_cache_is_bounded(ed: Signer, decode_calls: list[str]) -> None:
    v = ed.verifier(cache_size=2)
    toks = [ed.sign(claims(jti=f"j{i}")) for i in range(3)]
    for t in toks:
        v.verify(t)
    v.verify(toks[2])  # still cached
    v.verify(toks[0])  # evicted: verified again
    assert decode_calls == [toks[0], toks[1], toks[2], toks[0]]


# --- keysets ----------------------------------------------------------------------------------


def test_keyset_with_private_key_is_refused(ed: Signer) -> None:
    raw = ed.key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    jwk = {**ed.jwk, "d": b64(raw)}
    with pytest.raises(ConfigError, match="private key"):
        Keyset.from_jwks({"keys": [jwk]}, "EdDSA")


def test_keyset_without_a_key_of_the_pinned_algorithm_is_refused(ed: Signer, es: Signer) -> None:
    with pytest.raises(ConfigError, match="no ES256 key"):
        Keyset.from_jwks({"keys": [ed.jwk]}, "ES256")
    with pytest.raises(ConfigError, match="no EdDSA key"):
        Keyset.from_jwks({"keys": [es.jwk]}, "EdDSA")
    with pytest.raises(ConfigError, match="no EdDSA key"):
        Keyset.from_jwks({"keys": []}, "EdDSA")


def test_keys_of_other_types_are_skipped_never_used(ed: Signer, es: Signer) -> None:
    ks = Keyset.from_jwks({"keys": [ed.jwk, es.jwk]}, "ES256")
    assert list(ks.keys) == [es.kid]
    v = TokenVerifier(ks, TokenSettings(algorithm="ES256"))
    refused(v, mint_token(ed.key, agent="a", roles=["r"]))
    assert v.verify(mint_token(es.key, agent="a", roles=["r"])).kid == es.kid


def test_key_whose_alg_member_differs_is_skipped(ed: Signer) -> None:
    with pytest.raises(ConfigError, match="no EdDSA key"):
        Keyset.from_jwks({"keys": [{**ed.jwk, "alg": "ES256"}]}, "EdDSA")


@pytest.mark.parametrize(
    "document,message",
    [
        ([], "'keys' list"),
        ({"keys": {}}, "'keys' list"),
        ({}, "'keys' list"),
        ({"keys": ["x"]}, "not an object"),
        ({"keys": [{"kty": "OKP", "crv": "Ed25519", "x": "AA"}]}, "no 'kid'"),
        ({"keys": [{"kty": "OKP", "crv": "Ed25519", "x": "AA", "kid": ""}]}, "no 'kid'"),
        ({"keys": [{"kty": "OKP", "crv": "Ed25519", "x": "AA", "kid": "k"}]}, "not a valid key"),
    ],
)
def test_malformed_keysets_are_refused(document: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Keyset.from_jwks(document, "EdDSA")


def test_duplicate_kid_is_refused(ed: Signer) -> None:
    other = Signer("EdDSA")
    with pytest.raises(ConfigError, match="duplicate kid"):
        Keyset.from_jwks({"keys": [ed.jwk, {**other.jwk, "kid": ed.kid}]}, "EdDSA")


@pytest.mark.parametrize("alg", ["HS256", "none", "RS256", "eddsa", ""])
def test_keyset_refuses_algorithms_other_than_eddsa_and_es256(ed: Signer, alg: str) -> None:
    with pytest.raises(ConfigError, match="tokens.algorithm"):
        Keyset.from_jwks({"keys": [ed.jwk]}, alg)


def test_verifier_refuses_keyset_and_settings_that_disagree(ed: Signer) -> None:
    with pytest.raises(ConfigError, match="differ"):
        TokenVerifier(ed.keyset(), TokenSettings(algorithm="ES256"))


def test_keyset_from_file(tmp_path: Path, ed: Signer) -> None:
    p = tmp_path / "jwks.json"
    p.write_text(json.dumps({"keys": [ed.jwk]}))
    assert list(Keyset.from_file(p, "EdDSA").keys) == [ed.kid]
    with pytest.raises(ConfigError, match="cannot read keyset"):
        Keyset.from_file(tmp_path / "missing.json", "EdDSA")
    p.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Keyset.from_file(p, "EdDSA")
    p.write_text(json.dumps({"keys": [ed.jwk]}))
    with pytest.raises(ConfigError, match=str(p).replace(".", r"\.") + ": no ES256 key"):
        Keyset.from_file(p, "ES256")


# --- key files --------------------------------------------------------------------------------


def _thumbprint(jwk: dict[str, str]) -> str:
    """RFC 7638, computed independently: required members only, sorted, no whitespace."""
    required = {"OKP": ("crv", "kty", "x"), "EC": ("crv", "kty", "x", "y")}[jwk["kty"]]
    text = "{" + ",".join(f'"{k}":"{jwk[k]}"' for k in required) + "}"
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()


def test_key_id_matches_rfc_8037_test_vector() -> None:
    # RFC 8037 appendix A.2/A.3: the Ed25519 public key and its RFC 7638 thumbprint.
    x = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"
    public = ed25519.Ed25519PublicKey.from_public_bytes(unb64(x))
    assert key_id(public) == "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"


@pytest.mark.parametrize("alg", ["EdDSA", "ES256"])
def test_generate_keys_writes_0600_key_and_jwks(tmp_path: Path, alg: str) -> None:
    key_path, jwks_path = generate_keys(tmp_path / "keys", alg)
    assert key_path == tmp_path / "keys" / "signing-key.pem"
    assert jwks_path == tmp_path / "keys" / "jwks.json"
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    document = json.loads(jwks_path.read_text())
    (jwk,) = document["keys"]
    assert "d" not in jwk
    assert jwk["alg"] == alg and jwk["use"] == "sig"
    key = load_private_key(key_path)
    assert jwk["kid"] == key_id(key.public_key()) == _thumbprint(jwk)
    v = TokenVerifier(Keyset.from_file(jwks_path, alg), TokenSettings(algorithm=alg))
    assert v.verify(mint_token(key, agent="a", roles=["r"])).kid == jwk["kid"]


def test_generate_keys_replaces_a_world_readable_key_with_a_0600_one(tmp_path: Path) -> None:
    old = tmp_path / "signing-key.pem"
    old.write_text("old")
    old.chmod(0o644)
    key_path, _ = generate_keys(tmp_path)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert key_path.read_text().startswith("-----BEGIN PRIVATE KEY-----")


def test_generate_keys_does_not_follow_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "signing-key.pem").symlink_to(victim)
    generate_keys(tmp_path / "keys")
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "keys" / "signing-key.pem").is_symlink()


def test_generate_keys_into_an_unusable_directory_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot write keys"):
        generate_keys(blocker / "keys")
    with pytest.raises(ConfigError, match="algorithm"):
        generate_keys(tmp_path / "k", "HS256")


def test_kid_is_the_rfc_7638_thumbprint_for_both_key_types(ed: Signer, es: Signer) -> None:
    for s in (ed, es):
        assert s.kid == _thumbprint(public_jwk(s.key.public_key(), None))


def _pem(key: Any, password: bytes | None = None) -> bytes:
    enc = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)


def test_load_private_key_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    p = tmp_path / "k.pem"
    with pytest.raises(ConfigError, match="cannot read signing key"):
        load_private_key(p)
    p.write_text("not a key")
    with pytest.raises(ConfigError, match="not an unencrypted PEM key"):
        load_private_key(p)
    p.write_bytes(_pem(ed25519.Ed25519PrivateKey.generate(), b"pw"))
    with pytest.raises(ConfigError, match="not an unencrypted PEM key"):
        load_private_key(p)
    p.write_bytes(_pem(rsa.generate_private_key(public_exponent=65537, key_size=1024)))
    with pytest.raises(ConfigError, match="must be Ed25519 or P-256"):
        load_private_key(p)
    p.write_bytes(_pem(ec.generate_private_key(ec.SECP384R1())))
    with pytest.raises(ConfigError, match="must be Ed25519 or P-256"):
        load_private_key(p)


# --- inspect_token ----------------------------------------------------------------------------


def test_inspect_token_decodes_without_verifying(ed: Signer) -> None:
    other = Signer("EdDSA")
    token = other.sign(claims(sub="someone"))
    header, payload = inspect_token(token)
    assert header is not None and header["kid"] == other.kid
    assert payload is not None and payload["sub"] == "someone"


@pytest.mark.parametrize("token", ["", "a.b", "a.b.c.d", "....", "x"])
def test_inspect_token_of_garbage_gives_nothing(token: str) -> None:
    assert inspect_token(token) == (None, None)


def test_inspect_token_with_bad_payload_keeps_the_header(ed: Signer) -> None:
    h, _, s = ed.sign(claims()).split(".")
    header, payload = inspect_token(f"{h}.{b64(b'{not json')}.{s}")
    assert header is not None and header["alg"] == "EdDSA"
    assert payload is None


# --- properties --------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
_FUZZ_SIGNER = Signer("EdDSA")


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["iss", "aud", "sub", "iat", "nbf", "exp", "jti", "roles", "caps", "run"]),
        _json | st.integers(min_value=-(10**400), max_value=10**400),
        max_size=4,
    ),
    st.lists(
        st.sampled_from(["iss", "aud", "sub", "iat", "nbf", "exp", "jti", "roles"]), max_size=2
    ),
)
def test_any_signed_payload_is_verified_or_refused_never_crashes(
    override: dict[str, Any], drop: list[str]
) -> None:
    payload = claims(**override)
    for name in drop:
        payload.pop(name, None)
    token = _FUZZ_SIGNER.sign(payload)
    try:
        c = _FUZZ_SIGNER.verifier().verify(token)
    except (TokenInvalid, TokenExpired):
        return
    # Accepted: every required claim was present with a sane type and value.
    assert not set(drop) & set(REQUIRED_CLAIMS)
    assert c.roles and all(isinstance(r, str) and r for r in c.roles)
    assert isinstance(c.agent, str) and "/" not in c.agent
    assert c.issued_at <= c.expires_at and c.expires_at - c.issued_at <= 3600
    assert c.caps is None or isinstance(c.caps, frozenset)


@FUZZ
@given(st.data())
def test_mangled_tokens_are_refused_never_crash(data: st.DataObject) -> None:
    token = _FUZZ_SIGNER.sign(claims())
    how = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
    i = data.draw(st.integers(0, len(token) - 1))
    ch = data.draw(st.sampled_from(list("Aa0-_.=+/ \x00é")))
    mangled = {
        "flip": token[:i] + ch + token[i + 1 :],
        "insert": token[:i] + ch + token[i:],
        "delete": token[:i] + token[i + 1 :],
        "truncate": token[:i],
    }[how]
    if mangled == token:
        return
    try:
        _FUZZ_SIGNER.verifier().verify(mangled)
    except TokenInvalid:
        return
    # Only an edit that leaves the signed bytes and signature intact could pass.
    raise AssertionError(f"accepted a mangled token: {how} at {i} with {ch!r}")
