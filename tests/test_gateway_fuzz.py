"""Property: a refused target never reaches an upstream; an allowed one arrives byte for byte.

The gateway runs in a thread with its own event loop, in front of the echo mock; hypothesis
sends raw request lines over a socket (an HTTP client would normalise them first).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.app import build_gateway, create_server, running
from gateway.config import Settings
from mocks.demo import Workspace
from tests.conftest import Mocks


class ThreadedGateway:
    def __init__(self, settings: Settings, environ: dict[str, str]) -> None:
        self.loop = asyncio.new_event_loop()
        self.gw = build_gateway(settings, environ)
        self.port = 0
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        resources = running(self.gw)
        self.loop.run_until_complete(resources.__aenter__())

        async def make_runner() -> web.ServerRunner:
            return web.ServerRunner(create_server(self.gw))

        runner = self.loop.run_until_complete(make_runner())
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self.runner = runner
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.run_until_complete(resources.__aexit__(None, None, None))
        self.loop.close()

    def __enter__(self) -> ThreadedGateway:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def raw_get(self, target: str, token: str) -> tuple[int, bytes]:
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(
                f"GET {target} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {token}\r\n"
                "Connection: close\r\n\r\n".encode("latin-1")
            )
            chunks = []
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
        raw = b"".join(chunks)
        status = int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0
        return status, raw.split(b"\r\n\r\n", 1)[-1]


@pytest.fixture
def threaded(settings: Settings, workspace: Workspace, mocks: Mocks) -> Iterator[ThreadedGateway]:
    mocks.clear()
    with ThreadedGateway(settings, workspace.environ()) as gw:
        yield gw


# Pieces an attacker would combine: canonical text, escapes of every kind, separators.
CLEAN = st.sampled_from(
    [
        "a",
        "b",
        "Z",
        "0",
        "-",
        "_",
        "~",
        "%20",
        "%C3%A9",
        "+",
        ":",
        "@",
        "!",
        "$",
        "'",
        "(",
        ")",
        "*",
        ",",
        "=",
        "&",
    ]
)
DANGEROUS = st.sampled_from(
    [
        ".",
        "..",
        "/",
        "//",
        "%2F",
        "%2f",
        "%2E",
        "%2e",
        "%25",
        "%252F",
        "%5C",
        "\\",
        ";",
        "%3B",
        "%00",
        "%0A",
        "%41",
        "%",
        "%G0",
        "?",
        "#",
        "%c3%a9",
        "%FF",
    ]
)
PIECES = st.one_of(CLEAN, CLEAN, CLEAN, DANGEROUS)
SEGMENT = st.lists(PIECES, min_size=0, max_size=6).map("".join)


@st.composite
def targets(draw: Any) -> str:
    path = "/".join(draw(st.lists(SEGMENT, min_size=1, max_size=4)))
    target = "/echo/echo/" + path
    if draw(st.booleans()):
        target += "?" + draw(st.lists(PIECES, min_size=0, max_size=8).map("".join))
    return target


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(target=targets())
def test_refused_never_forwarded_allowed_forwarded_exactly(
    threaded: ThreadedGateway, mocks: Mocks, workspace: Workspace, target: str
) -> None:
    token = workspace.token("fuzzer", ["fuzz"])
    mocks.clear()
    status, body = threaded.raw_get(target, token)
    seen = mocks.requests("echo")
    event(f"status {status}")
    if status == 200:
        [request] = seen
        # The upstream got exactly the checked bytes, minus the upstream prefix.
        assert request["path"] == target[len("/echo") :]
        assert json.loads(body)["path"] == target[len("/echo") :].partition("?")[0]
    else:
        assert seen == [], (target, status)
        assert status in (400, 403), (target, status, body)
