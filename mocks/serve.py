"""Run every mock upstream until SIGTERM or SIGINT.

    python -m mocks.serve --metrics-token-file PATH --services-jwks PATH \\
        [--db-tokens-file PATH] [--db-path PATH] [--fixed-ports] [--host 127.0.0.1] \\
        [--mcp-json-response]

When all mocks listen, one line of JSON goes to stdout: ``{"ready": true, "urls": {...}}``.
Logs go to stderr. SIGTERM or SIGINT stops the mocks and exits with status 0.

Files: the metrics token is the stripped content of its file; the db tokens file holds one token
per line (blank lines and lines starting with ``#`` are ignored); the JWKS file is a JSON JWK Set.
Without ``--services-jwks`` a throwaway key is generated, so no one can mint accepted tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from mocks.launcher import DEFAULT_METRICS_TOKEN, MockSettings, start_mocks

log = logging.getLogger("mocks.serve")


def read_metrics_token(path: Path) -> str:
    token = path.read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"{path}: metrics token file is empty")
    return token


def read_db_tokens(path: Path) -> frozenset[str]:
    tokens = frozenset(
        stripped
        for line in path.read_text(encoding="utf-8").splitlines()
        if (stripped := line.strip()) and not stripped.startswith("#")
    )
    if not tokens:
        raise ValueError(f"{path}: db tokens file has no tokens")
    return tokens


def read_jwks(path: Path) -> dict[str, Any]:
    jwks = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(jwks, dict) or not isinstance(jwks.get("keys"), list):
        raise ValueError(f"{path}: not a JWK Set (an object with a 'keys' list)")
    return jwks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mocks.serve", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--metrics-token-file", type=Path, help="file holding the metrics token")
    parser.add_argument("--services-jwks", type=Path, help="JWK Set file the services mock trusts")
    parser.add_argument("--services-audience", default="services")
    parser.add_argument("--services-issuer", default="capgate")
    parser.add_argument("--db-tokens-file", type=Path, help="accepted db tokens, one per line")
    parser.add_argument("--db-path", help="SQLite file (re-seeded on start); default in-memory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--fixed-ports",
        action="store_true",
        help="listen on 9101 metrics, 9102 logs, 9103 services, 9104 db, 9105 echo, 9106 mcp",
    )
    parser.add_argument(
        "--mcp-json-response",
        action="store_true",
        help="answer MCP POSTs with JSON bodies instead of SSE streams",
    )
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> MockSettings:
    return MockSettings(
        host=args.host,
        fixed_ports=args.fixed_ports,
        metrics_token=(
            read_metrics_token(args.metrics_token_file)
            if args.metrics_token_file
            else DEFAULT_METRICS_TOKEN
        ),
        services_jwks=read_jwks(args.services_jwks) if args.services_jwks else None,
        services_audience=args.services_audience,
        services_issuer=args.services_issuer,
        db_path=args.db_path,
        db_tokens=read_db_tokens(args.db_tokens_file) if args.db_tokens_file else None,
        mcp_json_response=args.mcp_json_response,
    )


async def serve(settings: MockSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        mocks = await start_mocks(settings)
        try:
            if settings.services_jwks is None:
                log.warning("no --services-jwks: the services mock trusts a throwaway key only")
            sys.stdout.write(json.dumps({"ready": True, "urls": mocks.urls}) + "\n")
            sys.stdout.flush()
            await stop.wait()
        finally:
            await mocks.close()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    # Configure logging before the MCP SDK does (it calls logging.basicConfig at INFO).
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    args = parse_args(argv)
    try:
        settings = settings_from_args(args)
    except (OSError, ValueError) as exc:
        print(f"mocks.serve: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(settings))
    except OSError as exc:  # typically a fixed port that is already taken
        print(f"mocks.serve: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
