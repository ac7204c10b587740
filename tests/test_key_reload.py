"""Token keys and the upstream signing key change without a restart (``key_reload.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import jwt
import pytest

from gateway.app import build_gateway
from gateway.config import Settings
from gateway.credentials import CredentialStore
from gateway.errors import TokenInvalid
from gateway.key_reload import KeyReloader
from gateway.policy.model import Credentials
from gateway.tokens import (
    Keyset,
    TokenSettings,
    TokenVerifier,
    generate_keys,
    key_id,
    load_private_key,
    mint_token,
    public_jwk,
)
from mocks.demo import Workspace
from tests.conftest import Mocks


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _keys(tmp_path: Path, name: str) -> Any:
    key_file, _ = generate_keys(tmp_path / name)
    return load_private_key(key_file)


def _write_jwks(path: Path, *keys: Any) -> None:
    """Write a new JWKS (a new inode and size, as a deployment would)."""
    doc = {"keys": [public_jwk(k.public_key(), key_id(k.public_key())) for k in keys]}
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _token(key: Any, agent: str = "a") -> str:
    return mint_token(key, agent=agent, roles=["r"], ttl=600)


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Any, Any, Path, TokenVerifier]:
    old, new = _keys(tmp_path, "old"), _keys(tmp_path, "new")
    jwks = tmp_path / "jwks.json"
    _write_jwks(jwks, old)
    verifier = TokenVerifier(Keyset.from_file(jwks, "EdDSA"), TokenSettings())
    return old, new, jwks, verifier


def test_a_rotation_adds_the_new_key_then_removes_the_old_one_at_once(
    setup: tuple[Any, Any, Path, TokenVerifier],
) -> None:
    old, new, jwks, verifier = setup
    reloader = KeyReloader(verifier, jwks)
    old_token = _token(old)
    assert verifier.verify(old_token).agent == "a"  # cached from now on
    with pytest.raises(TokenInvalid, match="kid"):
        verifier.verify(_token(new))
    _write_jwks(jwks, old, new)
    reloader.tick()
    assert verifier.verify(_token(new)).agent == "a"
    assert verifier.verify(old_token).agent == "a"
    _write_jwks(jwks, new)
    reloader.tick()
    # Removed means refused at once, the cached verdict included (a compromised key).
    with pytest.raises(TokenInvalid, match="kid"):
        verifier.verify(old_token)
    assert verifier.verify(_token(new, agent="b")).agent == "b"


def test_with_an_overlap_a_removed_key_verifies_until_it_is_over(
    setup: tuple[Any, Any, Path, TokenVerifier],
) -> None:
    old, new, jwks, verifier = setup
    clock = Clock()
    reloader = KeyReloader(verifier, jwks, overlap=60.0, clock=clock)
    old_token = _token(old)
    verifier.verify(old_token)
    _write_jwks(jwks, new)
    reloader.tick()
    assert verifier.verify(old_token).agent == "a"
    assert verifier.verify(_token(new)).agent == "a"
    clock.now += 59
    reloader.tick()
    assert verifier.verify(old_token).agent == "a"
    clock.now += 2
    reloader.tick()
    with pytest.raises(TokenInvalid, match="kid"):
        verifier.verify(old_token)
    # Put back within the window, a key is simply a key again.
    _write_jwks(jwks, new, old)
    reloader.tick()
    assert verifier.verify(old_token).agent == "a"


def test_a_bad_jwks_is_refused_in_one_line_and_the_keys_in_force_stay(
    setup: tuple[Any, Any, Path, TokenVerifier], caplog: pytest.LogCaptureFixture
) -> None:
    old, _, jwks, verifier = setup
    reloader = KeyReloader(verifier, jwks)
    for bad in ("{not json", json.dumps({"keys": []}), json.dumps({"keys": [{"kid": "x"}]})):
        jwks.write_text(bad)
        caplog.clear()
        reloader.tick()
        assert verifier.verify(_token(old)).agent == "a"
        [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert line.startswith("token keys reload refused:") and "keeping the keys" in line
        assert reloader.error is not None
    jwks.unlink()  # between a delete and a create: nothing changes
    reloader.tick()
    assert verifier.verify(_token(old)).agent == "a"


def test_the_upstream_signing_key_is_replaced_for_the_next_credential(tmp_path: Path) -> None:
    key_file, _ = generate_keys(tmp_path / "up")
    first = load_private_key(key_file)
    store = CredentialStore({}, tmp_path, signing_key=first)
    verifier = TokenVerifier(Keyset({}, "EdDSA"), TokenSettings())
    reloader = KeyReloader(
        verifier, tmp_path / "none.json", credentials=store, upstream_key=key_file
    )
    creds = Credentials(type="agent-jwt", audience="svc", ttl=300, prefix="Bearer ")

    def minted_by(key: Any) -> bool:
        injection = store.injection("svc", creds, "agent-1")
        assert injection is not None
        token = injection.value.reveal().removeprefix("Bearer ")
        try:
            jwt.decode(token, key.public_key(), algorithms=["EdDSA"], audience="svc")
        except jwt.InvalidSignatureError:
            return False
        return True

    assert minted_by(first)
    generate_keys(tmp_path / "up2")
    os.replace(tmp_path / "up2" / "signing-key.pem", key_file)
    second = load_private_key(key_file)
    reloader.tick()
    assert minted_by(second) and not minted_by(first)


async def test_the_gateway_reads_a_changed_jwks_while_it_serves(
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    mocks: Mocks,
    tmp_path: Path,
) -> None:
    jwks = tmp_path / "jwks.json"
    jwks.write_bytes(workspace.jwks.read_bytes())
    gw = build_gateway(dataclasses.replace(settings, jwks=jwks), workspace.environ())
    client = await serve_gateway(gw)
    newcomer = _keys(tmp_path, "newcomer")
    token = mint_token(newcomer, agent="tester", roles=["tester"], ttl=600)
    headers = {"Authorization": f"Bearer {token}"}
    assert (await client.get("/echo/echo/x", headers=headers)).status == 401
    workspace_key = load_private_key(workspace.token_key)
    _write_jwks(jwks, workspace_key, newcomer)
    for _ in range(50):  # the background loop reads it within its interval (0.2 s here)
        if (await client.get("/echo/echo/x", headers=headers)).status == 200:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the new key was never accepted")
