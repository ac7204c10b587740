"""The audit's signing key: Ed25519, its own key (never the token keys), published as a JWKS.

A checkpoint line is signed over its own bytes up to and including ``prev`` (the SHA-256 of
the line before it), so one signature vouches for every line before it through the chain.
The signature is the line's last member, ``"sig"``: the signed bytes are the line with that
member removed, closed with ``}`` (see ``signed_part``), prefixed by ``SIGNING_CONTEXT``.

Rotation with overlap: the JWKS beside the trail (``<audit>.jwks.json`` unless configured)
keeps every key it has held; a gateway started with a new key, or reading a new key file while
it runs (``key_reload.py``), adds it, so checkpoints signed by the old key still verify. An
operator removes a retired key from the JWKS only once no trail signed by it needs checking.
Copy the JWKS somewhere the sandbox cannot write: a key read from beside the trail proves
nothing against whoever could write both.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.errors import ConfigError
from gateway.secret_files import check_secret_file
from gateway.tokens import Keyset, key_id, public_jwk

SIGNING_CONTEXT = b"capgate-audit-checkpoint/2\n"
SIG_MEMBER = b',"sig":"'


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def signing_key_path(audit: Path, configured: Path | None) -> Path:
    return configured if configured is not None else audit.with_name(audit.name + ".signing.pem")


def jwks_path(audit: Path, configured: Path | None) -> Path:
    return configured if configured is not None else audit.with_name(audit.name + ".jwks.json")


class CheckpointSigner:
    """Signs checkpoint lines with one Ed25519 key; ``kid`` is its RFC 7638 thumbprint."""

    def __init__(self, key: ed25519.Ed25519PrivateKey) -> None:
        self.key = key
        self.kid = key_id(key.public_key())

    @classmethod
    def load_or_create(cls, path: Path) -> CheckpointSigner:
        """The key in ``path`` (PKCS#8 PEM, 0600), made when absent."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError(
                f"cannot create audit signing key {str(path)!r}: {exc.strerror}"
            ) from exc
        else:
            pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            with os.fdopen(fd, "wb") as fh:
                fh.write(pem)
        return cls.load(path)

    @classmethod
    def load(cls, path: Path) -> CheckpointSigner:
        """The key in ``path``, never created (a reload): ``ConfigError`` when unusable."""
        try:
            check_secret_file(path)
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"cannot read audit signing key {str(path)!r}: {exc.strerror}"
            ) from exc
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"audit signing key {str(path)!r} is not a PEM key") from exc
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ConfigError(f"audit signing key {str(path)!r} must be an Ed25519 key")
        return cls(key)

    def public_jwk(self) -> dict[str, str]:
        return public_jwk(self.key.public_key(), self.kid)

    def sign(self, unsigned: bytes) -> bytes:
        """``unsigned`` is a JSON object's bytes without its closing ``}``; the result is the
        line (without newline) with ``sig`` appended as its last member."""
        sig = self.key.sign(SIGNING_CONTEXT + unsigned + b"}")
        return unsigned + SIG_MEMBER + _b64(sig).encode() + b'"}'

    def publish(self, path: Path) -> None:
        """Add this key to the JWKS at ``path`` (kept keys stay: rotation with overlap)."""
        keys: list[dict[str, str]] = []
        try:
            document = json.loads(path.read_text("utf-8"))
            if isinstance(document, dict) and isinstance(document.get("keys"), list):
                keys = [k for k in document["keys"] if isinstance(k, dict)]
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read audit JWKS {str(path)!r}: {exc}") from exc
        if any(k.get("kid") == self.kid for k in keys):
            return
        keys.append(self.public_jwk())
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"keys": keys}, indent=2) + "\n", "utf-8")
            os.replace(tmp, path)
        except OSError as exc:
            raise ConfigError(f"cannot write audit JWKS {str(path)!r}: {exc.strerror}") from exc


def signed_part(line: bytes) -> tuple[bytes, bytes] | None:
    """(the bytes that were signed, the signature) of a checkpoint line, or None."""
    head, sep, tail = line.rpartition(SIG_MEMBER)
    if not sep or not tail.endswith(b'"}'):
        return None
    try:
        sig = _unb64(tail[:-2].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None
    return SIGNING_CONTEXT + head + b"}", sig


def load_verify_keys(path: Path) -> dict[str, ed25519.Ed25519PublicKey]:
    """The audit's public keys by kid, from a JWKS file."""
    keyset = Keyset.from_file(path, "EdDSA")
    return {
        kid: key for kid, key in keyset.keys.items() if isinstance(key, ed25519.Ed25519PublicKey)
    }


def signature_ok(key: ed25519.Ed25519PublicKey, line: bytes) -> bool:
    part = signed_part(line)
    if part is None:
        return False
    data, sig = part
    try:
        key.verify(sig, data)
    except InvalidSignature:
        return False
    return True
