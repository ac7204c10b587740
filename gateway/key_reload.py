"""Key files that change while the gateway runs: the token JWKS and the upstream signing key.

Both are read again when their file changes (checked on every background tick, by size and
modification time), without a restart and without dropping a call:

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

The audit key (keyed body digests) and the checkpoint signing key are not reloaded: a trail's
lines would no longer verify under one key; rotate them with the audit file (a restart).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.credentials import CredentialStore
from gateway.errors import ConfigError
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
