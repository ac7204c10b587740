"""Regenerate ``recordings/example/``: the example policy's scenario, recorded from the mocks.

    python -m mocks.make_example [--out recordings/example]

The scenario (policy ``policies/example.yaml``, agent ``sre-bot``, run ``example``):

1. ``GET /metrics/metrics/cpu?window=5m``      allowed by ``read-cpu`` (bearer credential)
2. ``GET /logs/logs/application?level=error&limit=5``  allowed by ``read-app-logs``
3. ``POST /services/services/restart {"service": "web"}``  allowed by ``restart-service``
   (agent-JWT credential)
4. ``DELETE /services/services/web``           denied, ``no_rule``

It runs the real gateway in-process with the record transport against the real mocks on free
ports, so the recording is what capgate writes, not a hand-made file. To make it byte-for-byte
repeatable, the recorder gets a fixed wall clock and a counting monotonic clock, request ids
are numbered, ``Date`` and ``Server`` headers are not written, and the manifest lists the
example policy's upstream URLs instead of the mocks' random ports.

It lives with the mocks, not in ``gateway/``: it needs them and ``gateway.app``, and neither
the mocks nor this script ship in the wheel or the image.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "recordings" / "example"
EXAMPLE_WALL = 1717243200.0  # 2024-06-01T12:00:00Z
RUN = "example"
AGENT = "sre-bot"
ROLES = ["sre-diagnostics"]
CLIENT_HEADERS = {
    "User-Agent": "example-agent/1.0",
    "Accept": "application/json",
    "Accept-Encoding": "identity",
}


class Ticks:
    """A monotonic clock that advances one millisecond each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now = round(self.now + 0.001, 6)
        return self.now


async def record_example(out: Path) -> None:
    from aiohttp import ClientSession, web

    from gateway import pipeline
    from gateway.app import build_gateway, create_server, running
    from gateway.config import load_settings
    from gateway.policy.load import load_policy
    from gateway.recording.redact import Redactor
    from gateway.transports.record import RecordTransport
    from mocks.demo import EXAMPLE_POLICY, mock_settings, prepare_workspace
    from mocks.launcher import start_mocks

    with tempfile.TemporaryDirectory(prefix="capgate-example-") as tmp:
        base = prepare_workspace(Path(tmp) / "ws")
        mocks = await start_mocks(mock_settings(base, fixed_ports=False))
        ids = itertools.count(1)
        real_new_request_id = pipeline.new_request_id
        pipeline.new_request_id = lambda: f"example-{next(ids):04d}"
        runner: web.ServerRunner | None = None
        resources = contextlib.AsyncExitStack()
        try:
            ws = prepare_workspace(base.root, mocks.urls)
            settings = load_settings(
                {
                    "policy": str(ws.policy),
                    "jwks": str(ws.jwks),
                    "upstream_key": str(ws.upstream_key),
                    "secrets_dir": str(ws.secrets_dir),
                    "audit": "-",
                    "port": "0",
                },
                {},
            )
            gw = build_gateway(settings, ws.environ())
            recorder = RecordTransport(
                gw.transport,
                out,
                clock=Ticks(),
                wall=lambda: EXAMPLE_WALL,
                redactor=Redactor(omit_headers=frozenset({"date", "server"})),
            )
            example = load_policy(EXAMPLE_POLICY)
            recorder.writer.upstreams = {n: str(u.url) for n, u in example.upstreams.items()}
            gw = gw.with_transport(recorder, recorder)
            await resources.enter_async_context(running(gw))
            runner = web.ServerRunner(create_server(gw), handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            url = f"http://127.0.0.1:{port}"
            token = ws.token(AGENT, ROLES, ttl=600, run=RUN)
            headers = {**CLIENT_HEADERS, "Authorization": f"Bearer {token}"}
            async with ClientSession(skip_auto_headers=("User-Agent",)) as client:
                calls = [
                    ("GET", "/metrics/metrics/cpu?window=5m", None, 200),
                    ("GET", "/logs/logs/application?level=error&limit=5", None, 200),
                    ("POST", "/services/services/restart", {"service": "web"}, 200),
                    ("DELETE", "/services/services/web", None, 403),
                ]
                for method, path, body, expected in calls:
                    async with client.request(
                        method, url + path, json=body, headers=headers
                    ) as resp:
                        await resp.read()
                        if resp.status != expected:
                            raise RuntimeError(
                                f"{method} {path}: expected {expected}, got {resp.status}"
                            )
        finally:
            pipeline.new_request_id = real_new_request_id
            if runner is not None:
                await runner.cleanup()
            await resources.aclose()  # closes the transport: the manifest is final
            await mocks.close()


def make_example(out: Path = DEFAULT_OUT) -> Path:
    """Record the example into a fresh directory and put it in place of ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".example-", dir=out.parent))
    try:
        asyncio.run(record_example(staging / "recording"))
        for path in (staging / "recording").rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)  # checked in: nothing private here
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(staging / "recording"), str(out))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mocks.make_example")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    try:
        out = make_example(args.out)
    except Exception as exc:  # one readable line for the person regenerating the example
        print(f"make_example: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
