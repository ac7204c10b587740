"""A short-lived capability token minted for the command CI runs (``capgate replay``,
``capgate sandbox run``): ``--agent A --role R --token-key PEM``.

The token is signed in the CLI process from a test key, so ``serve`` never holds a
token-signing key, and checked against the gateway's JWKS before the command starts (a key the
gateway does not trust fails here, in one line, not as 401s in the command's log).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


def duration_arg(text: str) -> float:
    """An argparse type: a positive duration (``30s``, ``5m``)."""
    from gateway.policy_file import parse_duration

    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return seconds


def add_token_options(p: argparse.ArgumentParser) -> None:
    """The options that mint a token for the command ``replay`` or ``sandbox run`` runs."""
    p.add_argument("--agent", help="mint a token for this agent (with --role, --token-key)")
    p.add_argument("--role", action="append", dest="roles", help="a role of the token")
    p.add_argument(
        "--token-key", type=Path, help="the test signing key (PEM) whose JWKS the gateway trusts"
    )
    p.add_argument(
        "--token-ttl", type=duration_arg, default=600.0, help="the token's lifetime (default 10m)"
    )
    p.add_argument("--run", help="the token's run id")
    p.add_argument(
        "--token-env", default="CAPGATE_TOKEN", help="the variable holding it (CAPGATE_TOKEN)"
    )


@dataclass(frozen=True, slots=True)
class CiToken:
    """What ``capgate replay --agent A --role R --token-key PEM`` mints for the command: a
    short-lived capability token, signed here (``serve`` never holds a token-signing key) and
    passed to the command in the environment variable ``env``."""

    key: Path
    agent: str
    roles: tuple[str, ...]
    ttl: float = 600.0
    run: str | None = None
    env: str = "CAPGATE_TOKEN"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CiToken | None:
        """The token ``add_token_options`` asked for, or None when none was; ``ValueError``
        when only some of ``--agent``, ``--role`` and ``--token-key`` were given."""
        wanted = (args.agent, args.roles, args.token_key)
        if not any(wanted):
            return None
        if not all(wanted):
            raise ValueError("a token for the command needs --agent, --role and --token-key")
        return cls(
            key=args.token_key,
            agent=args.agent,
            roles=tuple(args.roles),
            ttl=args.token_ttl,
            run=args.run,
            env=args.token_env,
        )


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``argv`` (the last one)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def mint_ci_token(spec: CiToken, serve_args: Sequence[str]) -> str:
    """A token for ``spec``, with the audience and issuer the gateway's flags require, checked
    against its ``--jwks`` when given (so a key the gateway does not trust fails here, in one
    line, not as 401s in the command's log). ``ValueError`` says what is wrong."""
    from gateway import tokens
    from gateway.errors import ConfigError, GatewayError

    try:
        key = tokens.load_private_key(spec.key)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    audience = _flag(serve_args, "--audience") or "capgate"
    issuers = _flag(serve_args, "--issuers")
    issuer = issuers.split(",")[0].strip() if issuers else "capgate"
    token = tokens.mint_token(
        key,
        agent=spec.agent,
        roles=list(spec.roles),
        ttl=spec.ttl,
        run=spec.run,
        audience=audience,
        issuer=issuer,
    )
    jwks = _flag(serve_args, "--jwks")
    if jwks is not None:
        algorithm = tokens.algorithm_of(key)
        settings = tokens.TokenSettings(algorithm=algorithm, audience=audience, issuers=(issuer,))
        try:
            tokens.TokenVerifier(tokens.Keyset.from_file(jwks, algorithm), settings).verify(token)
        except (GatewayError, ConfigError) as exc:
            why = exc.detail if isinstance(exc, GatewayError) else str(exc)
            raise ValueError(f"the gateway would refuse the minted token: {why}") from None
    return token
