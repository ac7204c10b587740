"""Named operators: the people who use the admin API and the console, each with a role.

An operators file lists who may act and how far::

    operators:
      alice: {role: approver, token_sha256: 5c1f...}
      bob:   {role: admin,    token_sha256: 9e07...}

Roles are ordered: ``viewer`` (sees calls, calls in flight, approvals, the event stream),
``approver`` (a viewer who also decides held calls), ``admin`` (an approver who also pauses,
resumes and stops agents and runs). The file holds SHA-256 digests of the tokens, never the
tokens: `capgate operators add NAME --role ROLE --file FILE` makes a token, prints it once and
stores its digest. A token is 32 random bytes, so its plain digest cannot be reversed by
guessing; a presented token is compared with every operator's digest in constant time, so the
answer's timing says nothing about which digest it was near.

The file may be readable by anyone (it holds no secret) but not writable by group or others:
whoever can write it can make themselves an admin. It is read again when it changes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from gateway.errors import ConfigError

ROLES = ("viewer", "approver", "admin")
"""Each role may do everything the roles before it may."""

TOKEN_PREFIX = "cgo_"  # noqa: S105 (a prefix that marks operator tokens, not a secret)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
MAX_OPERATORS = 1000


@dataclass(frozen=True, slots=True)
class Operator:
    name: str
    role: str

    def may(self, role: str) -> bool:
        """True when this operator's role is ``role`` or above it."""
        return ROLES.index(self.role) >= ROLES.index(role)


def new_token() -> str:
    return TOKEN_PREFIX + base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class OperatorBook:
    """Who may use the admin API: operators from a file, and optionally the legacy single
    admin token (``--admin-token-file``), which acts as the operator ``admin``."""

    def __init__(self, path: Path | None = None, *, admin_token: bytes | None = None) -> None:
        self.path = path
        self._legacy = admin_token
        self._digests: list[tuple[bytes, Operator]] = []
        self._stamp: tuple[int, int] | None = None
        if path is not None:
            self.reload()

    def __len__(self) -> int:
        return len(self._digests) + (self._legacy is not None)

    def reload(self) -> bool:
        """Read the file again if it changed; a bad file raises ``ConfigError`` and the
        operators in force stay. True when the list was replaced."""
        if self.path is None:
            return False
        try:
            st = self.path.stat()
        except OSError as exc:
            raise ConfigError(
                f"cannot read operators file {str(self.path)!r}: {exc.strerror}"
            ) from exc
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return False
        self._stamp = stamp  # a bad file is reported once; its next edit is read again
        self._digests = read_operators(self.path)
        return True

    def authenticate(self, authorization: str) -> Operator | None:
        """The operator a ``Bearer`` header names, or None. Every digest is compared (in
        constant time), whichever matches."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token or len(token) > 256:
            return None
        found: Operator | None = None
        presented = token_digest(token).encode()
        for digest, operator in self._digests:
            if hmac.compare_digest(presented, digest):
                found = operator
        presented_token = token.encode("utf-8", "surrogateescape")  # header bytes as sent
        if self._legacy is not None and hmac.compare_digest(presented_token, self._legacy):
            found = found or Operator("admin", "admin")
        return found

    def by_digest(self, digest: str) -> Operator | None:
        """The operator whose token has this SHA-256 digest, or None. A console session keeps
        the digest, not the token, so removing an operator or giving them a new token ends
        their sessions, and a changed role applies at once. Compared in constant time."""
        found: Operator | None = None
        presented = digest.encode()
        for known, operator in self._digests:
            if hmac.compare_digest(presented, known):
                found = operator
        if self._legacy is not None:
            legacy = token_digest(self._legacy.decode("utf-8", "surrogateescape")).encode()
            if hmac.compare_digest(presented, legacy):
                found = found or Operator("admin", "admin")
        return found

    def names(self) -> list[dict[str, str]]:
        listed = [{"name": op.name, "role": op.role} for _, op in self._digests]
        if self._legacy is not None:
            listed.append({"name": "admin", "role": "admin"})
        return listed


def _entries(path: Path) -> dict[str, Any]:
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"operators file {str(path)!r} is not a regular file")
    if st.st_mode & 0o022:
        raise ConfigError(
            f"operators file {str(path)!r} is writable by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):o}); whoever can write it can make themselves "
            "an admin: chmod 644 it"
        )
    try:
        data = YAML(typ="safe").load(path.read_text("utf-8"))
    except (YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"operators file {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or set(data) != {"operators"}:
        raise ConfigError(f"operators file {str(path)!r}: expected one key, 'operators'")
    entries = data["operators"] or {}
    if not isinstance(entries, dict):
        raise ConfigError(f"operators file {str(path)!r}: 'operators' must be a mapping")
    if len(entries) > MAX_OPERATORS:
        raise ConfigError(f"operators file {str(path)!r}: more than {MAX_OPERATORS} operators")
    return entries


def read_operators(path: Path) -> list[tuple[bytes, Operator]]:
    """The operators of a file, checked: names, roles and digests, no digest twice."""
    try:
        entries = _entries(path)
    except OSError as exc:
        raise ConfigError(f"cannot read operators file {str(path)!r}: {exc.strerror}") from exc
    where = f"operators file {str(path)!r}"
    found: list[tuple[bytes, Operator]] = []
    seen: set[str] = set()
    for name, entry in entries.items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ConfigError(f"{where}: operator name {name!r}: letters, digits and ._@- only")
        if not isinstance(entry, dict) or set(entry) != {"role", "token_sha256"}:
            raise ConfigError(f"{where}: operator {name!r}: expected role and token_sha256")
        role, digest = entry["role"], entry["token_sha256"]
        if role not in ROLES:
            raise ConfigError(f"{where}: operator {name!r}: role {role!r} is not one of {ROLES}")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise ConfigError(f"{where}: operator {name!r}: token_sha256 must be 64 hex digits")
        if digest in seen:
            raise ConfigError(f"{where}: operator {name!r} shares a token with another operator")
        seen.add(digest)
        found.append((digest.encode(), Operator(name, role)))
    return found


def add_operator(path: Path, name: str, role: str) -> str:
    """Add (or give a new token to) an operator; the new token, to be shown once."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"operator name {name!r}: letters, digits and ._@- only (64 at most)")
    if role not in ROLES:
        raise ConfigError(f"role {role!r} is not one of {', '.join(ROLES)}")
    current = _current(path) if path.exists() else {}
    token = new_token()
    current[name] = (role, token_digest(token))
    _write(path, current)
    return token


def remove_operator(path: Path, name: str) -> None:
    current = _current(path)
    if name not in current:
        raise ConfigError(f"no operator {name!r} in {str(path)!r}")
    del current[name]
    _write(path, current)


def _current(path: Path) -> dict[str, tuple[str, str]]:
    return {op.name: (op.role, digest.decode()) for digest, op in read_operators(path)}


def _write(path: Path, operators: dict[str, tuple[str, str]]) -> None:
    """Write the file whole, then move it into place (a reader sees the old or the new)."""
    lines = ["# capgate operators: `capgate operators add|remove` edits this file.", "operators:"]
    for name, (role, digest) in sorted(operators.items()):
        lines.append(f'  {name}: {{role: {role}, token_sha256: "{digest}"}}')
    if not operators:
        lines[-1] = "operators: {}"
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
