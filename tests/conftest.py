"""Shared fixtures: a workspace (keys, secrets, policies), the mocks as a real subprocess on
free ports, and the gateway in-process on aiohttp's test server."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestClient

from gateway.app import SERVER_OPTIONS, Gateway, build_gateway, create_server, running
from gateway.audit_trail import call_records
from gateway.config import Settings, load_settings
from mocks.demo import Workspace, prepare_workspace, rewrite_policy_urls
from tests.redis_server import RedisCluster, RedisServer, redis_server_available

ROOT = Path(__file__).resolve().parent.parent
TEST_POLICY = ROOT / "tests" / "policies" / "gateway.yaml"


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value + "\n")


class Mocks:
    """The mock upstreams, running in a child process (``python -m mocks.serve``)."""

    def __init__(self, proc: subprocess.Popen[str], urls: dict[str, str]) -> None:
        self.proc = proc
        self.urls = urls

    def _base(self, name: str) -> str:
        return self.urls[name].removesuffix("/mcp")

    def requests(self, name: str) -> list[dict[str, Any]]:
        """What the mock received since the last ``clear``."""
        with urllib.request.urlopen(self._base(name) + "/_mock/requests", timeout=5) as resp:  # noqa: S310
            return json.loads(resp.read())

    def stats(self, name: str) -> dict[str, Any]:
        with urllib.request.urlopen(self._base(name) + "/_mock/stats", timeout=5) as resp:  # noqa: S310
            return json.loads(resp.read())

    def clear(self) -> None:
        for name in self.urls:
            req = urllib.request.Request(self._base(name) + "/_mock/requests", method="DELETE")
            urllib.request.urlopen(req, timeout=5).read()  # noqa: S310 (loopback mock)


@pytest.fixture(scope="session")
def base_workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return prepare_workspace(tmp_path_factory.mktemp("ws"))


@pytest.fixture(scope="session")
def mocks(base_workspace: Workspace) -> Iterator[Mocks]:
    ws = base_workspace
    tokens_file = ws.root / "db-tokens.txt"
    tokens_file.write_text("\n".join(ws.db_tokens.values()) + "\n")
    metrics_file = ws.root / "metrics-token.txt"
    metrics_file.write_text(ws.metrics_token)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mocks.serve",
            "--metrics-token-file",
            str(metrics_file),
            "--services-jwks",
            str(ws.upstream_jwks),
            "--db-tokens-file",
            str(tokens_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{"):
            break
        if proc.poll() is not None:
            break
    ready = json.loads(line)
    assert ready["ready"] is True
    yield Mocks(proc, ready["urls"])
    proc.terminate()
    proc.wait(timeout=10)
    proc.stdout.close()


@pytest.fixture(scope="session")
def workspace(base_workspace: Workspace, mocks: Mocks) -> Workspace:
    ws = prepare_workspace(base_workspace.root, mocks.urls)  # the example policy, on mock ports
    for agent in ("tester", "sre-bot", "other-bot", "fuzzer"):
        _write_secret(ws.secrets_dir / f"echo-{agent}.key", f"echo-key-for-{agent}-0123456789")
    return ws


@pytest.fixture
def policy_file(workspace: Workspace, mocks: Mocks, tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(rewrite_policy_urls(TEST_POLICY.read_text(), mocks.urls))
    return path


@pytest.fixture
def settings(workspace: Workspace, policy_file: Path, tmp_path: Path) -> Settings:
    flags = {
        "policy": str(policy_file),
        "jwks": str(workspace.jwks),
        "upstream_key": str(workspace.upstream_key),
        "secrets_dir": str(workspace.secrets_dir),
        "audit": str(tmp_path / "audit.jsonl"),
        "reload_interval": "0.2s",
    }
    return load_settings(flags, {})


@pytest.fixture
def gateway(settings: Settings, workspace: Workspace, mocks: Mocks) -> Gateway:
    mocks.clear()
    return build_gateway(settings, workspace.environ())


ServeGateway = Callable[[Gateway], Awaitable[TestClient[Any, Any]]]


class GatewayTestServer(BaseTestServer):  # type: ignore[type-arg]
    """The agents' listener exactly as ``capgate serve`` builds it (``create_server``: the
    connection guard, the server options), on a free loopback port."""

    def __init__(self, gw: Gateway, **kwargs: Any) -> None:
        self._gw = gw
        super().__init__(host="127.0.0.1", **kwargs)

    async def _make_runner(self, **kwargs: Any) -> web.ServerRunner:
        return web.ServerRunner(create_server(self._gw), shutdown_timeout=0.5)


@pytest.fixture
async def serve_gateway(aiohttp_client: Any) -> AsyncIterator[ServeGateway]:
    """``await serve_gateway(gw)``: the gateway's resources open (``running``) and its agents'
    listener (``create_server``, as ``capgate serve`` runs it) on a test server; a client."""
    async with contextlib.AsyncExitStack() as stack:

        async def serve(gw: Gateway) -> TestClient[Any, Any]:
            await stack.enter_async_context(running(gw))
            assert SERVER_OPTIONS["handler_cancellation"] is True
            server = GatewayTestServer(gw)
            return await aiohttp_client(server)

        yield serve


@pytest.fixture
async def client(serve_gateway: ServeGateway, gateway: Gateway) -> TestClient[Any, Any]:
    return await serve_gateway(gateway)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, empty redis-server on a free port (never the shared one), killed after the
    test. Skipped only outside CI when the binary is missing; in CI it must be there."""
    if not redis_server_available() and os.environ.get("CI", "").lower() not in ("true", "1"):
        pytest.skip("needs a redis-server binary")
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_cluster_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A Redis Cluster of three masters on loopback, started once for the session."""
    if not redis_server_available() and os.environ.get("CI", "").lower() not in ("true", "1"):
        pytest.skip("needs a redis-server binary")
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def redis_cluster(redis_cluster_session: RedisCluster) -> RedisCluster:
    """The session's Redis Cluster, emptied for this test."""
    redis_cluster_session.flush()
    return redis_cluster_session


@pytest.fixture
def token(workspace: Workspace) -> Any:
    def make(agent: str = "tester", roles: list[str] | None = None, **kw: Any) -> str:
        return workspace.token(agent, roles or ["tester"], **kw)

    return make


def audit_lines(settings: Settings, gateway: Gateway) -> list[dict[str, Any]]:
    """The calls in the audit file, one record each (decision and outcome lines joined)."""
    gateway.audit.flush()
    assert settings.audit is not None
    return call_records(json.loads(line) for line in settings.audit.read_text().splitlines())
