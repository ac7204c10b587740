"""Per-agent upstream credentials: references, file modes, agent-jwt, and masking."""

from __future__ import annotations

import os
from pathlib import Path

import jwt
import pytest

from gateway.credentials import (
    CredentialStore,
    CredentialUnavailable,
    Injection,
    Secret,
    reflections_of,
)
from gateway.errors import ConfigError, InternalError, Reason
from gateway.policy.model import Credentials, Policy
from tests.helpers_core import Clock, Signer, policy_from_text


def secret_file(path: Path, value: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value)
    os.chmod(path, mode)
    return path


def policy_with(credentials: str) -> Policy:
    return policy_from_text(
        f"""version: 1
upstreams:
  db: {{url: "http://127.0.0.1:9104", credentials: {credentials}}}
roles: {{}}
agents: {{}}
"""
    )


BEARER = Credentials(type="bearer", secret="env:DB_TOKEN", prefix="Bearer ")


# --- Secret -----------------------------------------------------------------------------------


def test_secret_repr_and_str_are_masked() -> None:
    s = Secret("sk-live-123")
    assert repr(s) == str(s) == "Secret('****')"
    assert "sk-live" not in f"{s} {s!r} {[s]} { ({'k': s}) }"
    assert s.reveal() == "sk-live-123"


def test_injection_repr_does_not_show_the_secret(tmp_path: Path) -> None:
    store = CredentialStore({"DB_TOKEN": "sk-live-123"}, tmp_path)
    inj = store.injection("db", BEARER, "agent-1")
    assert isinstance(inj, Injection)
    assert "sk-live" not in repr(inj)


# --- env references ---------------------------------------------------------------------------


def test_env_bearer(tmp_path: Path) -> None:
    store = CredentialStore({"DB_TOKEN": "sk-live-123"}, tmp_path)
    inj = store.injection("db", BEARER, "agent-1")
    assert inj is not None
    assert inj.header == "Authorization"
    assert inj.value.reveal() == "Bearer sk-live-123"
    assert inj.secret.reveal() == "sk-live-123"
    assert inj.name == "db:bearer"


def test_header_credential_with_prefix(tmp_path: Path) -> None:
    creds = Credentials(type="header", secret="env:K", header="X-Api-Key", prefix="Key ")
    inj = CredentialStore({"K": "abc"}, tmp_path).injection("api", creds, "a")
    assert inj is not None
    assert (inj.header, inj.value.reveal(), inj.secret.reveal()) == ("X-Api-Key", "Key abc", "abc")


def test_none_credentials_inject_nothing(tmp_path: Path) -> None:
    assert CredentialStore({}, tmp_path).injection("logs", Credentials(), "a") is None


def test_env_per_agent(tmp_path: Path) -> None:
    creds = Credentials(type="bearer", secret="env:DB_{agent}_TOKEN", prefix="Bearer ")
    store = CredentialStore({"DB_alice_TOKEN": "a-secret", "DB_bob_TOKEN": "b-secret"}, tmp_path)
    alice = store.injection("db", creds, "alice")
    bob = store.injection("db", creds, "bob")
    assert alice is not None and bob is not None
    assert alice.secret.reveal() == "a-secret" and bob.secret.reveal() == "b-secret"


@pytest.mark.parametrize("agent", ["carol", "a-b", "a.b", "a:b", "x@y"])
def test_env_per_agent_missing_or_unsafe_is_unavailable(tmp_path: Path, agent: str) -> None:
    # "a-b" would otherwise need "-" in a variable name, "a.b" would collide with "a_b", ...
    creds = Credentials(type="bearer", secret="env:DB_{agent}_TOKEN", prefix="Bearer ")
    env = {"DB_alice_TOKEN": "x", "DB_a_b_TOKEN": "collide"}
    with pytest.raises(CredentialUnavailable) as info:
        CredentialStore(env, tmp_path).injection("db", creds, agent)
    err = info.value
    assert isinstance(err, InternalError) and err.reason is Reason.INTERNAL_ERROR
    assert "collide" not in err.detail and "'db'" in err.detail


def test_empty_env_value_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(CredentialUnavailable):
        CredentialStore({"DB_TOKEN": ""}, tmp_path).injection("db", BEARER, "a")


def test_missing_env_var_refused_at_start(tmp_path: Path) -> None:
    policy = policy_with('{type: bearer, secret: "env:DB_TOKEN"}')
    with pytest.raises(ConfigError) as info:
        CredentialStore({}, tmp_path).check_policy(policy)
    assert "'DB_TOKEN' is not set" in str(info.value) and "'db'" in str(info.value)
    CredentialStore({"DB_TOKEN": "x"}, tmp_path).check_policy(policy)  # set: fine


def test_per_agent_env_is_not_checked_at_start(tmp_path: Path) -> None:
    policy = policy_with('{type: bearer, secret: "env:DB_{agent}"}')
    CredentialStore({}, tmp_path).check_policy(policy)


# --- file references --------------------------------------------------------------------------


def test_file_secret_relative_to_base_dir(tmp_path: Path) -> None:
    secret_file(tmp_path / "secrets" / "db.token", "file-secret\n")
    creds = Credentials(type="bearer", secret="file:secrets/db.token", prefix="Bearer ")
    inj = CredentialStore({}, tmp_path).injection("db", creds, "a")
    assert inj is not None and inj.value.reveal() == "Bearer file-secret"


def test_file_secret_absolute_path(tmp_path: Path) -> None:
    path = secret_file(tmp_path / "abs.token", "abs-secret")
    creds = Credentials(type="bearer", secret=f"file:{path}", prefix="Bearer ")
    inj = CredentialStore({}, tmp_path / "elsewhere").injection("db", creds, "a")
    assert inj is not None and inj.secret.reveal() == "abs-secret"


def test_world_readable_file_refused_at_check_policy(tmp_path: Path) -> None:
    secret_file(tmp_path / "secrets" / "db.token", "s", mode=0o644)
    policy = policy_with('{type: bearer, secret: "file:secrets/db.token"}')
    with pytest.raises(ConfigError) as info:
        CredentialStore({}, tmp_path).check_policy(policy)
    assert "readable or writable by group or others" in str(info.value)
    assert "mode 644" in str(info.value) and "chmod 600" in str(info.value)


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620, 0o602, 0o660, 0o460, 0o750])
def test_group_or_other_bits_refused(tmp_path: Path, mode: int) -> None:
    secret_file(tmp_path / "db.token", "s", mode=mode)
    with pytest.raises(ConfigError, match="group or others"):
        CredentialStore({}, tmp_path).check_policy(
            policy_with('{type: bearer, secret: "file:db.token"}')
        )


def test_missing_file_refused_at_check_policy(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        CredentialStore({}, tmp_path).check_policy(
            policy_with('{type: bearer, secret: "file:x.token"}')
        )


def test_directory_as_secret_refused_at_check_policy(tmp_path: Path) -> None:
    (tmp_path / "dir.token").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        CredentialStore({}, tmp_path).check_policy(
            policy_with('{type: bearer, secret: "file:dir.token"}')
        )


def test_world_readable_file_refused_at_use(tmp_path: Path) -> None:
    path = secret_file(tmp_path / "db.token", "sk-file", mode=0o644)
    creds = Credentials(type="bearer", secret="file:db.token", prefix="Bearer ")
    with pytest.raises(CredentialUnavailable) as info:
        CredentialStore({}, tmp_path).injection("db", creds, "a")
    assert "cannot be used" in info.value.detail and "sk-file" not in info.value.detail
    assert isinstance(info.value.__cause__, ConfigError)
    os.chmod(path, 0o600)
    inj = CredentialStore({}, tmp_path).injection("db", creds, "a")
    assert inj is not None and inj.secret.reveal() == "sk-file"


def test_per_agent_files(tmp_path: Path) -> None:
    secret_file(tmp_path / "secrets" / "db-alice.token", "alice-secret")
    secret_file(tmp_path / "secrets" / "db-bob.token", "bob-secret")
    creds = Credentials(type="bearer", secret="file:secrets/db-{agent}.token", prefix="Bearer ")
    store = CredentialStore({}, tmp_path)
    a = store.injection("db", creds, "alice")
    b = store.injection("db", creds, "bob")
    assert a is not None and b is not None
    assert (a.secret.reveal(), b.secret.reveal()) == ("alice-secret", "bob-secret")
    with pytest.raises(CredentialUnavailable, match="no credential is configured"):
        store.injection("db", creds, "carol")


def test_per_agent_directories(tmp_path: Path) -> None:
    # {agent} as a whole directory name: each agent has its own folder of secrets.
    secret_file(tmp_path / "secrets" / "alice" / "db.token", "alice-dir-secret")
    creds = Credentials(type="bearer", secret="file:secrets/{agent}/db.token", prefix="Bearer ")
    inj = CredentialStore({}, tmp_path).injection("db", creds, "alice")
    assert inj is not None and inj.secret.reveal() == "alice-dir-secret"


def test_per_agent_world_readable_file_refused_at_use(tmp_path: Path) -> None:
    secret_file(tmp_path / "db-alice.token", "s", mode=0o644)
    creds = Credentials(type="bearer", secret="file:db-{agent}.token", prefix="Bearer ")
    store = CredentialStore({}, tmp_path)
    store.check_policy(
        policy_with('{type: bearer, secret: "file:db-{agent}.token"}')
    )  # not yet known
    with pytest.raises(CredentialUnavailable):
        store.injection("db", creds, "alice")


@pytest.mark.parametrize(
    "agent",
    [
        "../bob",
        "..",
        ".",
        "a/../../bob",
        "/etc/passwd",
        "bob/../alice",
        "",
        "a\\b",
        "..%2Fbob",
        ".hidden",
    ],
)
@pytest.mark.parametrize(
    "template",
    ["file:secrets/db-{agent}.token", "file:secrets/{agent}", "file:secrets/{agent}/db.token"],
)
def test_agent_id_cannot_escape_the_directory(tmp_path: Path, agent: str, template: str) -> None:
    # Plant secrets an escaping agent id would reach, all with a good mode.
    for rel in (
        "secrets/db-bob.token",
        "bob.token",
        "secrets/bob",
        "secrets/alice/db.token",
        "secrets/db-.token",
        "bob/db.token",
        "db-bob.token",
        "secrets/.hidden",
    ):
        secret_file(tmp_path / rel, "STOLEN")
    creds = Credentials(type="bearer", secret=template, prefix="Bearer ")
    with pytest.raises(CredentialUnavailable) as info:
        CredentialStore({}, tmp_path).injection("db", creds, agent)
    assert "STOLEN" not in info.value.detail


def test_secret_file_must_be_one_line(tmp_path: Path) -> None:
    creds = Credentials(type="bearer", secret="file:s.token", prefix="Bearer ")
    for content in ("line1\nline2\n", "", "   \n", "a\rb"):
        secret_file(tmp_path / "s.token", content)
        with pytest.raises(CredentialUnavailable, match="not one line"):
            CredentialStore({}, tmp_path).injection("db", creds, "a")


def test_secret_file_too_large(tmp_path: Path) -> None:
    secret_file(tmp_path / "s.token", "x" * (16 * 1024 + 1))
    creds = Credentials(type="bearer", secret="file:s.token", prefix="Bearer ")
    with pytest.raises(CredentialUnavailable, match="not one line"):
        CredentialStore({}, tmp_path).injection("db", creds, "a")


def test_file_secret_is_cached_then_reread(tmp_path: Path) -> None:
    path = secret_file(tmp_path / "s.token", "v1")
    creds = Credentials(type="bearer", secret="file:s.token", prefix="Bearer ")
    clock = Clock(1000.0)
    store = CredentialStore({}, tmp_path, clock=clock)
    assert store.injection("db", creds, "a").secret.reveal() == "v1"  # type: ignore[union-attr]
    path.write_text("v2")
    clock.advance(4.9)
    assert store.injection("db", creds, "a").secret.reveal() == "v1"  # type: ignore[union-attr]
    clock.advance(0.2)
    assert store.injection("db", creds, "a").secret.reveal() == "v2"  # type: ignore[union-attr]
    os.chmod(path, 0o644)  # a mode change is noticed at the next re-read too
    clock.advance(5.1)
    with pytest.raises(CredentialUnavailable):
        store.injection("db", creds, "a")


# --- agent-jwt --------------------------------------------------------------------------------


def _claims(token: str, signer: Signer, audience: str) -> dict[str, object]:
    return jwt.decode(
        token,
        signer.key.public_key(),
        algorithms=[signer.algorithm],
        audience=audience,
        options={"verify_exp": False, "verify_iat": False, "verify_nbf": False},
    )


@pytest.mark.parametrize("alg", ["EdDSA", "ES256"])
def test_agent_jwt_is_minted_for_the_agent_and_audience(tmp_path: Path, alg: str) -> None:
    signer = Signer(alg)
    clock = Clock(1_700_000_000.0)
    store = CredentialStore({}, tmp_path, signing_key=signer.key, issuer="gw-1", clock=clock)
    creds = Credentials(type="agent-jwt", audience="services", ttl=300, prefix="Bearer ")
    inj = store.injection("services", creds, "sre-bot")
    assert inj is not None and inj.header == "Authorization"
    token = inj.secret.reveal()
    assert inj.value.reveal() == "Bearer " + token
    header = jwt.get_unverified_header(token)
    assert header["alg"] == alg and header["kid"] == signer.kid
    c = _claims(token, signer, "services")
    assert c["aud"] == "services" and c["sub"] == "sre-bot" and c["iss"] == "gw-1"
    assert c["iat"] == c["nbf"] == 1_700_000_000 and c["exp"] == 1_700_000_300
    assert isinstance(c["jti"], str) and c["jti"]
    assert "roles" not in c  # an upstream credential, not a capability token
    assert inj.name == "services:agent-jwt"


def test_agent_jwt_audience_defaults_to_the_upstream(tmp_path: Path) -> None:
    signer = Signer()
    store = CredentialStore({}, tmp_path, signing_key=signer.key, clock=Clock(1_700_000_000.0))
    inj = store.injection("billing", Credentials(type="agent-jwt", ttl=60, prefix="Bearer "), "a")
    assert inj is not None
    assert _claims(inj.secret.reveal(), signer, "billing")["aud"] == "billing"


def test_agent_jwt_is_cached_then_refreshed_after_80_percent_of_ttl(tmp_path: Path) -> None:
    signer = Signer()
    clock = Clock(1_700_000_000.0)
    store = CredentialStore({}, tmp_path, signing_key=signer.key, clock=clock)
    creds = Credentials(type="agent-jwt", audience="services", ttl=100, prefix="Bearer ")
    first = store.injection("services", creds, "a").secret.reveal()  # type: ignore[union-attr]
    clock.advance(79.9)
    assert store.injection("services", creds, "a").secret.reveal() == first  # type: ignore[union-attr]
    clock.advance(0.2)  # 80.1 s: past 80% of 100 s
    second = store.injection("services", creds, "a").secret.reveal()  # type: ignore[union-attr]
    assert second != first
    c = _claims(second, signer, "services")
    assert c["iat"] == 1_700_000_080 and c["exp"] == 1_700_000_180


def test_agent_jwt_cache_is_per_agent_and_audience(tmp_path: Path) -> None:
    signer = Signer()
    store = CredentialStore({}, tmp_path, signing_key=signer.key, clock=Clock(1_700_000_000.0))
    creds = Credentials(type="agent-jwt", audience="services", ttl=100, prefix="Bearer ")
    a = store.injection("services", creds, "alice").secret.reveal()  # type: ignore[union-attr]
    b = store.injection("services", creds, "bob").secret.reveal()  # type: ignore[union-attr]
    other = Credentials(type="agent-jwt", audience="billing", ttl=100, prefix="Bearer ")
    a2 = store.injection("billing", other, "alice").secret.reveal()  # type: ignore[union-attr]
    assert len({a, b, a2}) == 3
    assert _claims(b, signer, "services")["sub"] == "bob"
    assert _claims(a2, signer, "billing")["aud"] == "billing"


def test_agent_jwt_without_signing_key(tmp_path: Path) -> None:
    policy = policy_with("{type: agent-jwt, audience: db, ttl: 5m}")
    with pytest.raises(ConfigError, match="no upstream signing key"):
        CredentialStore({}, tmp_path).check_policy(policy)
    with pytest.raises(CredentialUnavailable, match="no upstream signing key"):
        CredentialStore({}, tmp_path).injection("db", Credentials(type="agent-jwt"), "a")


@pytest.mark.parametrize("secret", ["k", "ab", "x9z"])
def test_a_secret_too_short_to_mask_does_not_break_the_answer(secret: str) -> None:
    # Under four bytes a secret has no exact form worth masking (it would mask unrelated
    # text); building its reflections once raised TypeError, so every answer of such an
    # upstream became an internal error.
    seen = reflections_of(secret)
    assert seen.forms == () and seen.shortest == len(secret)
    assert seen.mask(b"an answer") == b"an answer"
