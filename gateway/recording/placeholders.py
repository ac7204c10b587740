"""Credentials for replay, where the real secrets do not exist (a CI job).

In mode ``replay`` nothing reaches an upstream, so no real credential is needed; but the
``inject`` stage still asks the credential store for one, and ``build_gateway`` refuses to
start when an ``env:`` secret is missing. ``PlaceholderCredentials`` stands in for
``CredentialStore`` in that mode: it resolves nothing, checks nothing, and injects a fixed,
obviously fake value under the same ``Injection.name`` as the real one, so redaction by
provenance and the recorded ``{"secret": name}`` references stay consistent.

    credentials = PlaceholderCredentials() if mode == "replay" else CredentialStore(...)
"""

from __future__ import annotations

from gateway.credentials import Injection, Secret
from gateway.policy.model import Credentials, Policy

PLACEHOLDER = "capgate-replay-placeholder-credential"


class PlaceholderCredentials:
    """The ``CredentialStore`` interface, with a fake value for every credential."""

    def check_policy(self, policy: Policy) -> None:
        return None

    def injection(self, upstream: str, creds: Credentials, agent: str) -> Injection | None:
        if creds.type == "none":
            return None
        secret = Secret(f"{PLACEHOLDER}-{upstream}")
        return Injection(
            header=creds.header,
            value=Secret(creds.prefix + secret.reveal()) if creds.prefix else secret,
            secret=secret,
            name=f"{upstream}:{creds.type}",
        )
