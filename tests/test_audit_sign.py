"""The audit signing key: made 0600 when absent, published with overlap, signatures checked."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.audit_sign import (
    CheckpointSigner,
    load_verify_keys,
    signature_ok,
    signed_part,
    signing_key_path,
)
from gateway.errors import ConfigError


def test_the_key_is_made_private_and_reused(tmp_path: Path) -> None:
    path = signing_key_path(tmp_path / "a.jsonl", None)
    assert path.name == "a.jsonl.signing.pem"
    first = CheckpointSigner.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert CheckpointSigner.load_or_create(path).kid == first.kid


def test_a_readable_or_wrong_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "k.pem"
    CheckpointSigner.load_or_create(path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        CheckpointSigner.load_or_create(path)
    path.chmod(0o600)
    path.write_text("not a key")
    with pytest.raises(ConfigError, match="not a PEM key"):
        CheckpointSigner.load_or_create(path)


def test_rotation_keeps_the_old_key_in_the_jwks(tmp_path: Path) -> None:
    jwks = tmp_path / "audit.jwks.json"
    old = CheckpointSigner.load_or_create(tmp_path / "old.pem")
    new = CheckpointSigner.load_or_create(tmp_path / "new.pem")
    old.publish(jwks)
    old.publish(jwks)  # idempotent
    new.publish(jwks)
    keys = load_verify_keys(jwks)
    assert set(keys) == {old.kid, new.kid}
    assert all("d" not in k for k in json.loads(jwks.read_text())["keys"])
    line = old.sign(b'{"v":2,"type":"checkpoint","prev":"' + b"0" * 64 + b'"')
    assert signature_ok(keys[old.kid], line) and not signature_ok(keys[new.kid], line)


def test_any_change_to_a_signed_line_fails(tmp_path: Path) -> None:
    signer = CheckpointSigner(ed25519.Ed25519PrivateKey.generate())
    line = signer.sign(b'{"v":2,"kind":"shutdown","prev":"' + b"a" * 64 + b'"')
    key = signer.key.public_key()
    assert signature_ok(key, line)
    assert not signature_ok(key, line.replace(b"shutdown", b"periodic"))
    assert not signature_ok(key, line.replace(b"a" * 64, b"b" * 64))
    assert signed_part(b'{"v":2}') is None
    assert not signature_ok(key, line[:-10] + b'"}')
