"""``capgate sandbox run [options] [serve options] -- COMMAND ...`` (see ``gateway/sandbox.py``).

The gateway is configured exactly as ``capgate serve`` is (the same options, config file and
environment); it listens inside the sandbox at ``127.0.0.1:8787`` instead of on a host port,
writes its ready line to standard error (the command owns standard output), and ends when the
command does, with the command's exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from gateway.commands.ci_token import CiToken, add_token_options, mint_ci_token
from gateway.config import Settings, revocations_path
from gateway.errors import ConfigError

EXIT_USAGE = 2


def add_sandbox_parser(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    parser_class: type,
    serve: argparse.ArgumentParser,
) -> None:
    """``sandbox run``: its own options, and every option of ``serve`` (copied from it)."""
    sb = sub.add_parser(
        "sandbox", help="run a command whose only way out is the gateway (Linux, root)"
    )
    sbsub = sb.add_subparsers(dest="sandbox_command", required=True, parser_class=parser_class)
    run = sbsub.add_parser(
        "run",
        help="run COMMAND in new namespaces with the gateway at 127.0.0.1:8787 as its only peer",
        parents=[serve],
        conflict_handler="resolve",  # -h/--help, which serve has too
    )
    run.add_argument(
        "--token-file",
        type=Path,
        help="the agent's capability token, given to COMMAND as $CAPGATE_TOKEN (the file "
        "itself stays outside)",
    )
    # ... or one minted here for CI from a test key (the gateway never holds the key).
    add_token_options(run)
    run.add_argument(
        "--expose",
        action="append",
        type=Path,
        default=[],
        metavar="PATH",
        help="a path COMMAND may read (repeatable; system directories and the working "
        "directory are always there)",
    )
    run.add_argument(
        "--writable",
        action="append",
        type=Path,
        default=[],
        metavar="PATH",
        help="a path COMMAND may write (repeatable; the working directory is writable)",
    )
    run.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for COMMAND (repeatable; its environment is otherwise "
        "cleared)",
    )
    run.add_argument(
        "--user",
        default=None,
        metavar="UID:GID",
        help="the unprivileged user COMMAND runs as (default 65534:65534, nobody)",
    )
    run.add_argument(
        "sandboxed",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="the command to run in the sandbox, after --",
    )


def _user(text: str | None) -> tuple[int, int]:
    from gateway.sandbox import NOBODY

    if text is None:
        return NOBODY, NOBODY
    uid, sep, gid = text.partition(":")
    if not uid.isdigit() or (sep and not gid.isdigit()):
        raise ConfigError(f"--user {text!r}: expected UID:GID in numbers, e.g. 65534:65534")
    u = int(uid)
    g = int(gid) if sep else u
    if u == 0 or g == 0:
        raise ConfigError("--user: the sandboxed command never runs as root")
    return u, g


def _environ(pairs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name or "\0" in pair:
            raise ConfigError(f"--env {pair!r}: expected NAME=VALUE")
        out[name] = value
    return out


def _token(args: argparse.Namespace, settings: Settings) -> tuple[str | None, str]:
    """The command's token and its variable: read from ``--token-file``, or minted from
    ``--agent --role --token-key`` and checked against the gateway's JWKS."""
    if args.token_file is not None:
        if any((args.agent, args.roles, args.token_key)):
            raise ConfigError("--token-file and --agent/--role/--token-key: give one or the other")
        try:
            return args.token_file.read_text("utf-8").strip(), args.token_env
        except OSError as exc:
            raise ConfigError(f"--token-file {str(args.token_file)!r}: {exc.strerror}") from None
    try:
        spec = CiToken.from_args(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if spec is None:
        return None, args.token_env
    gateway_flags = [
        "--audience",
        settings.tokens.audience,
        "--issuers",
        ",".join(settings.tokens.issuers),
        "--jwks",
        str(settings.jwks),
    ]
    try:
        return mint_ci_token(spec, gateway_flags), spec.env
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _credential_files(settings: Settings) -> Iterator[Path]:
    """The files the policy's credentials are read from (a per-agent one: its directory)."""
    from gateway.policy.load import load_policy

    policy = load_policy(settings.policy)
    base = (settings.secrets_dir or settings.policy.resolve().parent).resolve()
    for up in policy.upstreams.values():
        secret = up.credentials.secret
        if secret is None or not secret.startswith("file:"):
            continue
        path = Path(secret[5:])
        path = path if path.is_absolute() else base / path
        yield path.parent if "{agent}" in str(path) else path


def gateway_files(settings: Settings, config: Path | None, token_file: Path | None) -> list[Path]:
    """Everything the gateway reads or writes that the command must not see."""
    import glob

    from gateway.audit_sign import jwks_path, signing_key_path
    from gateway.audit_trail import audit_key_path

    paths: list[Path | None] = [
        config,
        token_file,
        settings.policy,
        settings.jwks,
        settings.upstream_key,
        settings.secrets_dir,
        settings.admin_token_file,
        settings.operators_file,
        settings.recordings,
        settings.replay_report,
        settings.audit_mirror,
        revocations_path(settings),
    ]
    if settings.audit is not None:
        key = audit_key_path(settings.audit, settings.audit_key)
        paths += [
            settings.audit,
            key,
            signing_key_path(settings.audit, settings.audit_signing_key),
            jwks_path(settings.audit, settings.audit_jwks),
        ]
        if key is not None:  # earlier audit keys kept for reading older lines (docs/audit.md)
            paths += sorted(key.parent.glob(glob.escape(key.name) + ".*"))
    paths += list(_credential_files(settings))
    out: list[Path] = []
    for p in paths:
        if p is not None and p.resolve() not in out:
            out.append(p.resolve())
    return out


def sandbox_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from gateway.app import Listen, configure_logging, serve
    from gateway.config import load_settings, serve_flags
    from gateway.sandbox import (
        SANDBOX_HOST,
        SANDBOX_PORT,
        SandboxSpec,
        open_namespace,
        preflight,
        run_command,
        sandbox_environ,
    )

    command = list(args.sandboxed)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ConfigError("usage: capgate sandbox run [options] [serve options] -- COMMAND ...")
    preflight()
    settings = load_settings(serve_flags(args), environ, args.config)
    token, token_env = _token(args, settings)
    uid, gid = _user(args.user)
    cwd = Path(os.getcwd()).resolve()
    spec = SandboxSpec(
        command=command,
        cwd=cwd,
        expose=[p.resolve() for p in args.expose],
        writable=[p.resolve() for p in args.writable],
        hidden=gateway_files(settings, args.config, args.token_file),
        environ=sandbox_environ(environ, token, _environ(args.env), token_env=token_env),
        uid=uid,
        gid=gid,
    )
    for path in (*spec.expose, *spec.writable):
        if not path.exists():
            raise ConfigError(f"{path}: no such file or directory (in --expose/--writable)")
    configure_logging(settings.log_level)
    namespace = open_namespace()
    try:
        listen = Listen(
            sock=namespace.sock,
            url=f"http://{SANDBOX_HOST}:{SANDBOX_PORT}",
            main=lambda stop: run_command(spec, namespace, stop),
            announce=sys.stderr,
        )
        return asyncio.run(serve(settings, environ, listen=listen))
    finally:
        namespace.close()
