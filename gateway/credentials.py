"""Per-agent upstream credentials: resolved here, injected last, never shown to the agent.

An upstream's ``credentials`` in the policy names how the gateway authenticates to it:

=============  ===========================================================================
``none``       nothing is added
``bearer``     ``Authorization: Bearer <secret>``
``header``     ``<header>: <prefix><secret>``
``agent-jwt``  ``Authorization: Bearer <JWT>`` minted by the gateway for this agent:
               ``aud`` = the upstream, ``sub`` = the agent, short TTL, cached and refreshed
=============  ===========================================================================

Secrets are references: ``env:NAME`` or ``file:PATH``; ``{agent}`` in either is replaced by
the agent id so each agent has its own secret. A secret file must pass ``check_secret_file``
(owner-only, or group-readable in one of capgate's groups as Kubernetes mounts secrets;
checked at start for fixed paths, at first use for per-agent ones). Values are
held in ``Secret`` objects whose ``repr`` is masked, and are never put in an error.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from gateway.errors import ConfigError, InternalError
from gateway.policy.model import Credentials, Policy
from gateway.secret_files import check_secret_file
from gateway.tokens import AGENT_ID, PrivateKey, mint_upstream_jwt

ENV_AGENT_SAFE = re.compile(r"[A-Za-z0-9_]+")
FILE_RECHECK_SECONDS = 5.0
MAX_SECRET_BYTES = 16 * 1024
MAX_CACHED_INJECTIONS = 4096  # (upstream, credential, agent) entries kept for env: secrets
MAX_CACHED_SECRETS = 4096  # agent JWTs and per-agent secret files kept


class Secret:
    """A credential value; its repr and str never show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('****')"

    __str__ = __repr__


def _bounded_put(
    cache: dict[Any, tuple[float, Secret]], key: Any, entry: tuple[float, Secret], now: float
) -> None:
    """Put ``entry`` (its first item: when it stops being good) in ``cache``, keeping it at
    ``MAX_CACHED_SECRETS`` entries: expired ones go first, then the oldest (agent ids come
    from tokens, so their number is not ours to choose)."""
    if len(cache) >= MAX_CACHED_SECRETS:
        for stale in [k for k, (until, _) in cache.items() if until <= now]:
            del cache[stale]
        while len(cache) >= MAX_CACHED_SECRETS:
            del cache[next(iter(cache))]
    cache[key] = entry


class CredentialUnavailable(InternalError):
    """Raised when the credential an upstream needs cannot be resolved for this agent."""


@dataclass(frozen=True, slots=True)
class Injection:
    header: str
    value: Secret  # the whole header value, prefix included
    secret: Secret  # the bare secret, which must never reach the agent
    name: str  # a stable name for the secret, used by recordings: "<upstream>:<type>"


MIN_BASE64_FORM = 12  # shorter base64 fragments of a secret would mask unrelated text


@functools.lru_cache(maxsize=4096)
def labelled_forms(secret: str) -> tuple[tuple[str, bytes], ...]:
    """The byte forms in which an upstream may reflect a credential, each with a label ("" for
    the secret as sent), longest first: as sent, JSON-escaped, percent-encoded, and the stretch
    of its base64 (standard, URL-safe) that the secret alone determines, at each of the three
    alignments it can have in a longer encoded text. Masking these is defence in depth: an
    upstream that transforms a secret another way (hashes, splits, encrypts it) is not caught
    by any mask."""
    raw = secret.encode()
    forms: dict[bytes, str] = {raw: ""}
    forms.setdefault(json.dumps(secret)[1:-1].encode(), "json")
    forms.setdefault(quote(secret, safe="").encode(), "pct")
    for pad in range(3):
        data = b"\0" * pad + raw
        first = -(-pad // 3)  # the first 3-byte group made of the secret only
        last = (pad + len(raw)) // 3  # one past the last such group
        if last - first <= 0:
            continue
        for label, encode in (("b64", base64.b64encode), ("b64u", base64.urlsafe_b64encode)):
            encoded = encode(data)[first * 4 : last * 4]
            if len(encoded) >= MIN_BASE64_FORM:
                forms.setdefault(encoded, f"{label}.{pad}")
    return tuple(
        sorted(((lb, f) for f, lb in forms.items() if len(f) >= 4), key=lambda i: -len(i[1]))
    )


def reflected_forms(secret: str) -> tuple[bytes, ...]:
    """``labelled_forms`` without their labels (what the respond stage masks)."""
    return tuple(form for _, form in labelled_forms(secret))


def _escapes(char: str) -> list[bytes]:
    """The ways JSON may write ``char`` inside a string, as regular expressions."""
    alts = [re.escape(char.encode())]
    if ord(char) < 0x10000:
        hex_digits = f"{ord(char):04x}"
        alts.append(
            rb"\\u"
            + "".join(f"[{d}{d.upper()}]" if d.isalpha() else d for d in hex_digits).encode()
        )
    if char in '/"\\':
        alts.append(re.escape(("\\" + char).encode()))
    return alts


@dataclass(frozen=True, slots=True)
class Reflections:
    """Everything the respond stage looks for to keep one secret from the agent: its exact
    byte forms (``labelled_forms``), the same with any of its characters JSON-escaped
    (``\\u0068unter2``: a decoder reads the secret, no exact form matches), and its text
    forms lower-cased for header names (which HTTP/2 lower-cases on the way)."""

    forms: tuple[bytes, ...]
    names: tuple[str, ...]
    escaped: re.Pattern[bytes]
    longest: int  # the longest match any of them can have
    shortest: int  # the shortest: a text shorter than this holds no reflection

    def mask(self, data: bytes) -> bytes:
        """``data`` with every reflection replaced by asterisks of the same length."""
        for form in self.forms:
            if form in data:
                data = data.replace(form, b"*" * len(form))
        if b"\\" in data:
            data = self.escaped.sub(lambda m: b"*" * len(m.group()), data)
        return data

    def in_name(self, name: str) -> bool:
        low = name.lower()
        return any(text in low for text in self.names)


@functools.lru_cache(maxsize=4096)
def reflections_of(secret: str) -> Reflections:
    forms = reflected_forms(secret)
    escaped = re.compile(b"".join(b"(?:" + b"|".join(_escapes(c)) + b")" for c in secret))
    names = tuple(f.decode("latin-1").lower() for f in forms)
    # (A secret under four bytes has no exact form to mask: it would mask unrelated text.)
    longest = max((6 * len(secret), *(len(f) for f in forms)))
    # Every character of the secret takes at least one byte in an escaped match.
    shortest = min((len(secret), *(len(f) for f in forms)))
    return Reflections(forms, names, escaped, longest, shortest)


class Credentialing(Protocol):
    """What the gateway asks of a credential source: ``CredentialStore``, or in replay mode
    ``PlaceholderCredentials``."""

    def check_policy(self, policy: Policy) -> None:
        """Fail at start (``ConfigError``) for a credential that cannot be resolved."""

    def injection(self, upstream: str, creds: Credentials, agent: str) -> Injection | None:
        """The header to add for this agent on this upstream, or None."""


class CredentialStore:
    """Resolves each upstream's credential for an agent; owns the agent-JWT signing key."""

    def __init__(
        self,
        environ: Mapping[str, str],
        base_dir: Path,
        signing_key: PrivateKey | None = None,
        issuer: str = "capgate",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.environ = environ
        self.base_dir = base_dir
        self.signing_key = signing_key
        self.issuer = issuer
        self.clock = clock
        self._files: dict[Path, tuple[float, Secret]] = {}
        self._jwts: dict[tuple[str, str], tuple[float, Secret]] = {}
        self._env_injections: dict[tuple[str, str, str, str, str, str], Injection] = {}

    def replace_signing_key(self, key: PrivateKey) -> None:
        """A new key for ``agent-jwt`` credentials (``key_reload.py``): credentials minted
        with the old one are not handed out again."""
        self.signing_key = key
        self._jwts.clear()

    # -- start-up checks ----------------------------------------------------------------------

    def check_policy(self, policy: Policy) -> None:
        """Refuse to start (or to load a policy) whose fixed secrets are missing or exposed."""
        for up in policy.upstreams.values():
            c = up.credentials
            if c.type == "agent-jwt" and self.signing_key is None:
                raise ConfigError(
                    f"upstream {up.name!r} uses agent-jwt credentials but no upstream signing "
                    "key is configured (--upstream-key)"
                )
            if c.secret is None or "{agent}" in c.secret:
                continue
            if c.secret.startswith("env:"):
                if c.secret[4:] not in self.environ:
                    raise ConfigError(
                        f"upstream {up.name!r}: environment variable {c.secret[4:]!r} is not set"
                    )
            else:
                path = self._path(c.secret[5:])
                if not path.exists():
                    raise ConfigError(f"upstream {up.name!r}: secret file {str(path)!r} not found")
                check_secret_file(path)

    # -- resolution --------------------------------------------------------------------------

    def _path(self, text: str) -> Path:
        p = Path(text)
        return p if p.is_absolute() else self.base_dir / p

    def _resolve_ref(self, ref: str, agent: str, upstream: str) -> Secret:
        if ref.startswith("env:"):
            name = ref[4:]
            if "{agent}" in name:
                if not ENV_AGENT_SAFE.fullmatch(agent):
                    # Substituting other characters could map two agents to one variable.
                    raise CredentialUnavailable(
                        f"no credential for upstream {upstream!r}: this agent id cannot name "
                        "an environment variable"
                    )
                name = name.replace("{agent}", agent)
            value = self.environ.get(name)
            if not value:
                raise CredentialUnavailable(
                    f"no credential is configured for upstream {upstream!r} and this agent"
                )
            return Secret(value)
        template = ref[5:]
        path = self._path(template.replace("{agent}", agent))
        if "{agent}" in template and (
            # A verified agent id has no "/" and starts with a letter or digit, so it can be
            # neither a dot segment nor add a component (per-agent files and directories
            # both work); check anyway, the path must keep the template's shape.
            not AGENT_ID.fullmatch(agent) or len(path.parts) != len(self._path(template).parts)
        ):
            raise CredentialUnavailable(f"no credential for upstream {upstream!r} and this agent")
        return self._read_file(path, upstream)

    def _read_file(self, path: Path, upstream: str) -> Secret:
        now = self.clock()
        cached = self._files.get(path)
        if cached is not None and now < cached[0]:
            return cached[1]
        try:
            check_secret_file(path)
            with path.open("rb") as fh:
                raw = fh.read(MAX_SECRET_BYTES + 1)
        except FileNotFoundError:
            raise CredentialUnavailable(
                f"no credential is configured for upstream {upstream!r} and this agent"
            ) from None
        except (OSError, ConfigError) as exc:
            raise CredentialUnavailable(
                f"the credential file for upstream {upstream!r} cannot be used"
            ) from exc
        value = raw.decode("utf-8", "replace").strip()
        if not value or len(raw) > MAX_SECRET_BYTES or "\n" in value or "\r" in value:
            raise CredentialUnavailable(
                f"the credential file for upstream {upstream!r} is not one line"
            )
        secret = Secret(value)
        self._files.pop(path, None)
        _bounded_put(self._files, path, (now + FILE_RECHECK_SECONDS, secret), now)
        return secret

    def _agent_jwt(self, creds: Credentials, upstream: str, agent: str) -> Secret:
        audience = creds.audience or upstream
        key = (agent, audience)
        now = self.clock()
        cached = self._jwts.get(key)
        if cached is not None and now < cached[0]:
            return cached[1]
        if self.signing_key is None:
            raise CredentialUnavailable(f"no upstream signing key for upstream {upstream!r}")
        token = mint_upstream_jwt(
            self.signing_key,
            issuer=self.issuer,
            audience=audience,
            agent=agent,
            ttl=creds.ttl,
            now=now,
        )
        secret = Secret(token)
        # Refresh when 80% of the lifetime has passed, so upstreams never see it expire.
        _bounded_put(self._jwts, key, (now + creds.ttl * 0.8, secret), now)
        return secret

    def injection(self, upstream: str, creds: Credentials, agent: str) -> Injection | None:
        """The header to add for this agent on this upstream, or None for ``none``."""
        if creds.type == "none":
            return None
        if creds.type == "agent-jwt":
            return self._injection(upstream, creds, self._agent_jwt(creds, upstream, agent))
        assert creds.secret is not None
        if creds.secret.startswith("env:"):
            # The environment was read once at start: the same agent gets the same header.
            key = (upstream, creds.type, creds.header, creds.prefix, creds.secret, agent)
            found = self._env_injections.get(key)
            if found is None:
                found = self._injection(
                    upstream, creds, self._resolve_ref(creds.secret, agent, upstream)
                )
                if len(self._env_injections) >= MAX_CACHED_INJECTIONS:
                    self._env_injections.clear()
                self._env_injections[key] = found
            return found
        return self._injection(upstream, creds, self._resolve_ref(creds.secret, agent, upstream))

    @staticmethod
    def _injection(upstream: str, creds: Credentials, value: Secret) -> Injection:
        return Injection(
            header=creds.header,
            value=Secret(creds.prefix + value.reveal()) if creds.prefix else value,
            secret=value,
            name=f"{upstream}:{creds.type}",
        )
