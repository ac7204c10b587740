"""Start every mock upstream in the current event loop.

    async with await start_mocks(MockSettings(metrics_token="t")) as mocks:
        mocks.urls["metrics"]  # "http://127.0.0.1:40123"
        mocks.urls["mcp"]      # "http://127.0.0.1:40129/mcp" (the MCP endpoint itself)

The aiohttp mocks' URLs are base URLs without a trailing slash; the MCP URL is the endpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any, Final

from aiohttp import web

from mocks.mcp_server import MCPMockServer
from mocks.servers import db_app, echo_app, logs_app, metrics_app, services_app
from mocks.tokens import SigningKey

__all__ = ["FIXED_PORTS", "MOCK_NAMES", "MockSet", "MockSettings", "start_mocks"]

MOCK_NAMES: Final = ("metrics", "logs", "services", "db", "echo", "mcp")
FIXED_PORTS: Final[Mapping[str, int]] = MappingProxyType(
    {"metrics": 9101, "logs": 9102, "services": 9103, "db": 9104, "echo": 9105, "mcp": 9106}
)
DEFAULT_METRICS_TOKEN: Final = "mock-metrics-token"
_SHUTDOWN_TIMEOUT: Final = 1.0


@dataclass(frozen=True)
class MockSettings:
    """How to start the mocks.

    `services_jwks` is the JWK Set the services mock verifies JWTs with (capgate's public
    keys). Without it an Ed25519 key is generated; its private half is on `MockSet.services_key`
    so a test can mint tokens. `db_tokens=None` leaves the database unauthenticated.
    """

    host: str = "127.0.0.1"
    fixed_ports: bool = False
    ports: Mapping[str, int] = field(default_factory=lambda: dict(FIXED_PORTS))
    metrics_token: str = DEFAULT_METRICS_TOKEN
    services_jwks: Mapping[str, Any] | None = None
    services_audience: str = "services"
    services_issuer: str = "capgate"
    db_path: str | None = None
    db_tokens: frozenset[str] | None = None
    mcp_json_response: bool = False

    def port_for(self, name: str) -> int:
        return self.ports[name] if self.fixed_ports else 0


class MockSet:
    """Running mocks: their URLs, and `close()` to stop them all."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.urls: dict[str, str] = {}
        self.services_key: SigningKey | None = None
        self.mcp: MCPMockServer | None = None
        self._runners: list[web.AppRunner] = []
        self._closed = False

    def _url(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"

    async def _serve_app(self, name: str, app: web.Application, port: int) -> None:
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=_SHUTDOWN_TIMEOUT
        )
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, self.host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
        self.urls[name] = self._url(bound_port)

    async def _serve_mcp(self, port: int, json_response: bool) -> None:
        self.mcp = MCPMockServer(host=self.host, port=port, json_response=json_response)
        self.urls["mcp"] = await self.mcp.start()

    async def close(self) -> None:
        """Stop every mock; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self.mcp is not None:
            await self.mcp.stop()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()

    async def __aenter__(self) -> MockSet:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def start_mocks(settings: MockSettings | None = None) -> MockSet:
    """Start all six mocks on `settings.host`; ports are free ones unless `fixed_ports`.

    If any mock fails to start (say its fixed port is taken), the ones already running are
    stopped and the error is raised.
    """
    settings = settings or MockSettings()
    mocks = MockSet(settings.host)
    jwks = settings.services_jwks
    if jwks is None:
        mocks.services_key = SigningKey.generate("EdDSA", kid="mock-services")
        jwks = mocks.services_key.jwks()
    try:
        await mocks._serve_app(
            "metrics", metrics_app(settings.metrics_token), settings.port_for("metrics")
        )
        await mocks._serve_app("logs", logs_app(), settings.port_for("logs"))
        await mocks._serve_app(
            "services",
            services_app(jwks, settings.services_audience, settings.services_issuer),
            settings.port_for("services"),
        )
        await mocks._serve_app(
            "db", db_app(settings.db_path, settings.db_tokens), settings.port_for("db")
        )
        await mocks._serve_app("echo", echo_app(), settings.port_for("echo"))
        await mocks._serve_mcp(settings.port_for("mcp"), settings.mcp_json_response)
    except BaseException:
        with contextlib.suppress(Exception):
            await mocks.close()
        raise
    return mocks
