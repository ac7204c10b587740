"""Fixtures for the recording tests: a recording gateway, and a
replay gateway whose upstreams all point at a dead port."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from gateway.app import Gateway, build_gateway
from gateway.config import Settings
from gateway.transport import Transport
from gateway.transports.modes import ModeTransport
from gateway.transports.record import RecordTransport
from gateway.transports.replay import ReplayTransport
from mocks.demo import Workspace, rewrite_policy_urls
from tests.conftest import TEST_POLICY

DEAD = "http://127.0.0.1:9"  # discard port: nothing listens, connections are refused


@dataclasses.dataclass
class Recorded:
    client: TestClient[Any, Any]
    gateway: Gateway
    directory: Path

    @property
    def transport(self) -> RecordTransport:
        assert isinstance(self.gateway.transport, RecordTransport)
        return self.gateway.transport

    async def finish(self) -> Path:
        await self.gateway.transport.close()
        return self.directory


@pytest.fixture
async def recorded(gateway: Gateway, serve_gateway: Any, tmp_path: Path) -> AsyncIterator[Recorded]:
    """The test gateway (real mocks) with the record transport writing to tmp_path/rec."""
    directory = tmp_path / "rec"
    recorder = RecordTransport(gateway.transport, directory)
    gateway = gateway.with_transport(recorder, recorder)
    client = await serve_gateway(gateway)
    yield Recorded(client, gateway, directory)


@pytest.fixture
def dead_policy(tmp_path: Path, mocks: Any) -> Path:
    """The test policy with every upstream on a port where nothing listens."""
    path = tmp_path / "dead-policy.yaml"
    path.write_text(rewrite_policy_urls(TEST_POLICY.read_text(), {n: DEAD for n in mocks.urls}))
    return path


ReplayFactory = Callable[..., Awaitable[tuple[TestClient[Any, Any], Gateway]]]
GatewayFactory = Callable[
    [Callable[[Transport], Transport | ModeTransport]],
    Awaitable[tuple[TestClient[Any, Any], Gateway]],
]


@pytest.fixture
def replay_gateway(
    settings: Settings, workspace: Workspace, dead_policy: Path, tmp_path: Path, serve_gateway: Any
) -> ReplayFactory:
    """A second gateway, every upstream on a dead port, answering from a recording."""
    count = 0

    async def make(directory: Path, **options: Any) -> tuple[TestClient[Any, Any], Gateway]:
        nonlocal count
        count += 1
        s = dataclasses.replace(
            settings, policy=dead_policy, audit=tmp_path / f"replay-audit-{count}.jsonl"
        )
        replay = ReplayTransport(directory, **options)
        gw = build_gateway(s, workspace.environ()).with_transport(replay, replay)
        return await serve_gateway(gw), gw

    return make


@pytest.fixture
def live_gateway(
    settings: Settings, workspace: Workspace, tmp_path: Path, serve_gateway: Any
) -> GatewayFactory:
    """A second gateway on the real mocks, with the transport ``wrap(live)`` returns."""

    async def make(
        wrap: Callable[[Transport], Transport | ModeTransport],
    ) -> tuple[TestClient[Any, Any], Gateway]:
        s = dataclasses.replace(settings, audit=tmp_path / "live-audit.jsonl")
        gw = build_gateway(s, workspace.environ())
        made = wrap(gw.transport)
        if isinstance(made, ModeTransport):
            gw = gw.with_transport(made.transport, made.denials)
        else:
            # A recorder or replayer is also told of refused calls.
            sink = made if hasattr(made, "observe_denial") else None
            gw = gw.with_transport(made, sink)  # type: ignore[arg-type]
        return await serve_gateway(gw), gw

    return make


def bearer(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


def read_all_bytes(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def records(directory: Path, run: str = "default") -> list[dict[str, Any]]:
    return [
        json.loads(line) for line in (directory / "runs" / f"{run}.jsonl").read_text().splitlines()
    ]
