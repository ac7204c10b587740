"""Key files that change while the gateway runs: the token JWKS, the upstream signing key,
the audit key and the audit's checkpoint signing key.

All are read again when their file changes (checked on every background tick, by inode, size
and modification time), without a restart and without dropping a call:

- **The JWKS** (the keys that may sign capability tokens). A new key is accepted at once. A
  key that left the file stops verifying tokens after ``jwks_overlap`` (default 0: at once,
  which is what removing a compromised key needs); the usual rotation is to publish the new
  key beside the old one, switch the issuer to it, and remove the old key once its last
  tokens have expired. Verified tokens cached under a key that stopped verifying are
  forgotten. A file that does not parse (or holds no usable key) is refused with one error
  line, and the keys in force stay.
- **The upstream signing key** (``agent-jwt`` credentials): the next credential minted uses
  the new key; credentials minted with the old one are dropped from the cache. The upstream
  should accept both keys during the change (publish both in its JWKS).
- **The audit key** (keyed body digests) **and the checkpoint signing key**
  (``AuditKeyReloader``): the trail records the change where it happens (``key`` line, then a
  ``rekey`` checkpoint signed by the key in force, ``AuditTrail.change_keys``), and only then
  are the new keys used: lines after the ``key`` line are digested under the new audit key
  (a call decided before keeps its decision's key for its response), checkpoints after the
  ``rekey`` one are signed by the new key, whose public key was first added to the audit
  JWKS beside the old ones. The change happens between two lines on the event loop, so no
  line is lost or written twice. A key file that cannot be used (unreadable, a mode the
  secret-file check refuses, not a key) is refused with one error line, and the keys in
  force stay; a trail that cannot be written keeps the keys in force and the change is
  tried again at the next tick. ``docs/audit.md`` says how to rotate.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.audit_record import BodyMac, audit_key_id
from gateway.audit_sign import CheckpointSigner
from gateway.audit_trail import AuditTrail, read_audit_key
from gateway.credentials import CredentialStore
from gateway.errors import AuditUnavailable, ConfigError
from gateway.secret_files import check_secret_file
from gateway.tokens import Keyset, PublicKey, TokenVerifier, load_private_key

log = logging.getLogger("capgate")

Stamp = tuple[int, int, int] | None  # (inode, size, mtime_ns); None: unreadable


def _stamp(path: Path) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class KeyReloader:
    """Watches the JWKS and the upstream signing key (``Gateway.reload_keys`` each tick)."""

    verifier: TokenVerifier
    jwks: Path
    overlap: float = 0.0  # seconds a key that left the JWKS still verifies
    credentials: CredentialStore | None = None
    upstream_key: Path | None = None
    clock: Callable[[], float] = field(default=time.time, repr=False)
    _jwks_stamp: Stamp = field(default=None, init=False)
    _key_stamp: Stamp = field(default=None, init=False)
    # Keys that left the file and until when they still verify.
    _retired: dict[str, tuple[PublicKey, float]] = field(default_factory=dict, init=False)
    error: str | None = field(default=None, init=False)  # the last refused reload (health)

    def __post_init__(self) -> None:
        self._jwks_stamp = _stamp(self.jwks)
        if self.upstream_key is not None:
            self._key_stamp = _stamp(self.upstream_key)

    def now(self) -> float:
        return self.clock()

    def tick(self) -> None:
        self._reload_jwks()
        self._expire_retired()
        self._reload_upstream_key()

    # --- the JWKS ---------------------------------------------------------------------------

    def _reload_jwks(self) -> None:
        stamp = _stamp(self.jwks)
        if stamp == self._jwks_stamp or stamp is None:
            return  # unchanged, or between a delete and a create: the keys in force stay
        self._jwks_stamp = stamp
        current = self.verifier.keyset
        try:
            fresh = Keyset.from_file(self.jwks, current.algorithm)
        except ConfigError as exc:
            self.error = str(exc)
            log.error("token keys reload refused: %s; keeping the keys in force", exc)
            return
        self.error = None
        now = self.now()
        live = {kid: key for kid, (key, _) in self._retired.items() if kid not in fresh.keys}
        self._retired = {k: v for k, v in self._retired.items() if k in live}
        removed = [kid for kid in current.keys if kid not in fresh.keys and kid not in live]
        for kid in removed:
            if self.overlap > 0:
                self._retired[kid] = (current.keys[kid], now + self.overlap)
        added = sorted(set(fresh.keys) - set(current.keys))
        self._install(fresh.keys)
        log.info(
            "token keys reloaded from %s: %d key(s)%s%s",
            self.jwks,
            len(fresh.keys),
            f"; added {added}" if added else "",
            (
                f"; removed {sorted(removed)}"
                + (f" (they verify for {self.overlap:g} s more)" if self.overlap > 0 else "")
            )
            if removed
            else "",
        )

    def _install(self, fresh: dict[str, PublicKey]) -> None:
        keys = dict(fresh)
        for kid, (key, _) in self._retired.items():
            keys.setdefault(kid, key)
        algorithm = self.verifier.keyset.algorithm
        self.verifier.keyset = Keyset(keys, algorithm)
        # A token verified under a key that no longer verifies must be checked again.
        self.verifier.forget(lambda claims: claims.kid not in keys)

    def _expire_retired(self) -> None:
        if not self._retired:
            return
        now = self.now()
        over = [kid for kid, (_, until) in self._retired.items() if until <= now]
        if not over:
            return
        for kid in over:
            del self._retired[kid]
        keys = {k: v for k, v in self.verifier.keyset.keys.items() if k not in over}
        self.verifier.keyset = Keyset(keys, self.verifier.keyset.algorithm)
        self.verifier.forget(lambda claims: claims.kid in over)
        log.info("token keys %s no longer verify (their overlap is over)", sorted(over))

    # --- the upstream signing key ----------------------------------------------------------

    def _reload_upstream_key(self) -> None:
        if self.upstream_key is None or self.credentials is None:
            return
        stamp = _stamp(self.upstream_key)
        if stamp == self._key_stamp or stamp is None:
            return
        self._key_stamp = stamp
        try:
            check_secret_file(self.upstream_key)
            key = load_private_key(self.upstream_key)
        except (ConfigError, OSError) as exc:
            self.error = str(exc)
            log.error("upstream signing key reload refused: %s; keeping the key in force", exc)
            return
        self.error = None
        self.credentials.replace_signing_key(key)
        log.info("upstream signing key reloaded from %s", self.upstream_key)


@dataclass
class AuditKeyReloader:
    """Watches the audit key and the checkpoint signing key (``Gateway.audit_keys`` each
    tick); a change is recorded in the trail before the new key is used."""

    trail: AuditTrail
    mac: BodyMac
    audit_key: Path | None
    signing_key: Path | None
    jwks: Path | None  # where a new signing key's public key is published before it signs
    _key_stamp: Stamp = field(default=None, init=False)
    _signing_stamp: Stamp = field(default=None, init=False)
    # The last refused reload of each file (health), until that file is read again.
    errors: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.audit_key is not None:
            self._key_stamp = _stamp(self.audit_key)
        if self.signing_key is not None:
            self._signing_stamp = _stamp(self.signing_key)

    @property
    def error(self) -> str | None:
        return "; ".join(self.errors.values()) if self.errors else None

    def tick(self) -> None:
        key_stamp = _stamp(self.audit_key) if self.audit_key is not None else None
        signing_stamp = _stamp(self.signing_key) if self.signing_key is not None else None
        key_changed = key_stamp is not None and key_stamp != self._key_stamp
        signing_changed = signing_stamp is not None and signing_stamp != self._signing_stamp
        if not key_changed and not signing_changed:
            return  # unchanged, or between a delete and a create: the keys in force stay
        seen = (self._key_stamp, self._signing_stamp)
        if key_changed:
            self._key_stamp = key_stamp
        if signing_changed:
            self._signing_stamp = signing_stamp
        key = self._read_audit_key() if key_changed else None
        signer = self._read_signing_key() if signing_changed else None
        if key is None and signer is None:
            return  # refused, or the same key written again
        new_id = audit_key_id(key) if key is not None else self.mac.kid
        try:
            self.trail.change_keys(new_id, signer)
        except AuditUnavailable:
            # Nothing changed: the keys in force stay, and the next tick tries again.
            self._key_stamp, self._signing_stamp = seen
            return
        before = self.mac.kid
        if key is not None:
            self.mac.rekey(key)
            log.info("audit key reloaded from %s: id %s (was %s)", self.audit_key, new_id, before)
        if signer is not None:
            log.info(
                "audit signing key reloaded from %s: kid %s signs the checkpoints after the "
                "rekey checkpoint (its public key is in %s)",
                self.signing_key,
                signer.kid,
                self.jwks,
            )

    def _read_audit_key(self) -> bytes | None:
        assert self.audit_key is not None
        try:
            key = read_audit_key(self.audit_key)
        except ConfigError as exc:
            self.errors["audit_key"] = str(exc)
            log.error("audit key reload refused: %s; keeping the key in force", exc)
            return None
        self.errors.pop("audit_key", None)
        return None if audit_key_id(key) == self.mac.kid else key

    def _read_signing_key(self) -> CheckpointSigner | None:
        assert self.signing_key is not None
        try:
            signer = CheckpointSigner.load(self.signing_key)
            current = self.trail.upcoming_signer
            if current is not None and signer.kid == current.kid:
                self.errors.pop("signing_key", None)
                return None
            if self.jwks is not None:
                signer.publish(self.jwks)  # before it signs anything, beside the old keys
        except ConfigError as exc:
            self.errors["signing_key"] = str(exc)
            log.error("audit signing key reload refused: %s; keeping the key in force", exc)
            return None
        self.errors.pop("signing_key", None)
        return signer
