"""``make run``: capgate with the example policy, memory state and the mock upstreams.

Prepares ``.demo/`` (token signing keys, the gateway's upstream key, per-agent secrets),
starts the mocks on their fixed ports (9101-9106), mints a demo token, prints two curl lines
(one allowed, one denied), and runs ``capgate serve`` in the foreground until Ctrl-C.

``prepare_workspace`` is also what the end-to-end tests use, with the mocks on free ports.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.tokens import generate_keys, load_private_key, mint_token

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_POLICY = ROOT / "policies" / "example.yaml"
DEMO_AGENTS = ("sre-bot", "analyst-bot", "mcp-bot")
_MOCK_URL = re.compile(r"http://127\.0\.0\.1:91(0[1-6])")
_PORT_NAMES = {
    "01": "metrics",
    "02": "logs",
    "03": "services",
    "04": "db",
    "05": "echo",
    "06": "mcp",
}


@dataclass(frozen=True)
class Workspace:
    root: Path
    policy: Path
    jwks: Path
    token_key: Path
    upstream_key: Path
    upstream_jwks: Path
    secrets_dir: Path
    metrics_token: str
    db_tokens: Mapping[str, str]  # agent -> token

    def environ(self) -> dict[str, str]:
        return {"METRICS_TOKEN": self.metrics_token}

    def serve_args(
        self, port: int = 8787, audit: Path | None = None, policy: Path | None = None
    ) -> list[str]:
        """``capgate serve`` flags for this workspace (its policy unless another is given)."""
        return [
            "--policy", str(policy or self.policy),
            "--jwks", str(self.jwks),
            "--upstream-key", str(self.upstream_key),
            "--secrets-dir", str(self.secrets_dir),
            "--port", str(port),
            "--audit", str(audit or self.root / "audit.jsonl"),
        ]  # fmt: skip

    def token(
        self,
        agent: str,
        roles: list[str],
        ttl: float = 3600,
        run: str | None = None,
        caps: list[str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        return mint_token(
            load_private_key(self.token_key),
            agent=agent,
            roles=roles,
            ttl=ttl,
            run=run,
            caps=caps,
            extra=extra,
        )


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value + "\n")


def rewrite_policy_urls(text: str, urls: Mapping[str, str]) -> str:
    """Point the example policy's fixed mock ports at the mocks' actual URLs."""

    def swap(m: re.Match[str]) -> str:
        name = _PORT_NAMES[m.group(1)]
        url = urls.get(name, m.group(0))
        return url[: -len("/mcp")] if name == "mcp" and url.endswith("/mcp") else url

    return _MOCK_URL.sub(swap, text)


def prepare_workspace(
    root: Path, urls: Mapping[str, str] | None = None, policy_text: str | None = None
) -> Workspace:
    """Keys, secrets and a policy for the mocks; reuses keys already there."""
    root.mkdir(parents=True, exist_ok=True)
    keys, upstream = root / "keys", root / "upstream"
    if not (keys / "signing-key.pem").exists():
        generate_keys(keys)
    if not (upstream / "signing-key.pem").exists():
        generate_keys(upstream)
    secrets_dir = root / "secrets"
    metrics_file = secrets_dir / "metrics.token"
    if metrics_file.exists():
        metrics_token = metrics_file.read_text().strip()
    else:
        metrics_token = "mt-" + secrets.token_urlsafe(24)
        _write_secret(metrics_file, metrics_token)
    db_tokens: dict[str, str] = {}
    for agent in DEMO_AGENTS:
        path = secrets_dir / f"db-{agent}.token"
        if not path.exists():
            _write_secret(path, "db-" + secrets.token_urlsafe(24))
        db_tokens[agent] = path.read_text().strip()
    text = policy_text if policy_text is not None else EXAMPLE_POLICY.read_text()
    policy = EXAMPLE_POLICY
    if urls is not None or policy_text is not None:
        policy = root / "policy.yaml"
        policy.write_text(rewrite_policy_urls(text, urls or {}))
    return Workspace(
        root=root,
        policy=policy,
        jwks=keys / "jwks.json",
        token_key=keys / "signing-key.pem",
        upstream_key=upstream / "signing-key.pem",
        upstream_jwks=upstream / "jwks.json",
        secrets_dir=secrets_dir,
        metrics_token=metrics_token,
        db_tokens=db_tokens,
    )


def mock_settings(ws: Workspace, fixed_ports: bool):  # type: ignore[no-untyped-def]
    import json

    from mocks.launcher import MockSettings

    return MockSettings(
        fixed_ports=fixed_ports,
        metrics_token=ws.metrics_token,
        services_jwks=json.loads(ws.upstream_jwks.read_text()),
        db_tokens=frozenset(ws.db_tokens.values()),
    )


async def run_demo(port: int) -> None:
    from gateway.app import configure_logging, serve
    from gateway.cli import build_parser
    from gateway.config import load_settings
    from mocks.launcher import start_mocks

    ws = prepare_workspace(ROOT / ".demo")
    environ = {**os.environ, **ws.environ()}
    args = build_parser().parse_args(
        ["serve", *ws.serve_args(port, ROOT / ".demo" / "audit.jsonl")]
    )
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    settings = load_settings(flags, environ)
    configure_logging(settings.log_level)
    for noisy in ("uvicorn", "uvicorn.error", "mcp"):  # the MCP mock's server logs
        logging.getLogger(noisy).setLevel(logging.WARNING)
    mocks = await start_mocks(mock_settings(ws, fixed_ports=True))
    token = ws.token("sre-bot", ["sre-diagnostics"], ttl=3600, run="demo")
    analyst = ws.token("analyst-bot", ["analyst"], ttl=3600, run="demo")

    auth = '"Authorization: Bearer $TOKEN"'

    def ready(url: str) -> None:
        print(
            "\nDemo token for agent 'sre-bot' (role sre-diagnostics, valid 1 hour):\n"
            f"  export TOKEN={token}\n\n"
            "Allowed (CPU metrics over 5 minutes):\n"
            f"  curl -s -H {auth} '{url}/metrics/metrics/cpu?window=5m'\n\n"
            "Denied (no rule lets this agent delete anything):\n"
            f"  curl -s -X DELETE -H {auth} '{url}/services/services/web'\n\n"
            "SQL as the analyst agent (SELECT on orders and customers, never customers.ssn):\n"
            f"  export ANALYST={analyst}\n"
            '  curl -s -H "Authorization: Bearer $ANALYST" \\\n'
            "    -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"sql": "SELECT id, status FROM orders LIMIT 3"}}\' {url}/db/query\n\n'
            f"Audit: {ROOT / '.demo' / 'audit.jsonl'}   Stop: Ctrl-C\n",
            flush=True,
        )

    try:
        await serve(settings, environ, on_ready=ready)
    finally:
        await mocks.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mocks.demo")
    parser.add_argument("--port", type=int, default=8787)
    args = parser.parse_args(argv)
    try:
        asyncio.run(run_demo(args.port))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # one readable line, no traceback, for the person running the demo
        print(f"capgate demo: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
