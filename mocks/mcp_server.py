"""A mock MCP server (Streamable HTTP) with order, SQL and file tools, served by uvicorn.

Built on the official SDK's high-level server, `mcp.server.mcpserver.MCPServer` (mcp 2.x; the
v1 name was FastMCP). The MCP endpoint is ``/mcp``; sessions are stateful (the server issues
``Mcp-Session-Id`` on ``initialize``) and answers come as SSE streams, or as plain JSON bodies
with ``json_response=True``. Clients speaking the 2026-07-28 protocol (``Mcp-Protocol-Version``
header, no handshake) are served too, statelessly, by the same endpoint.

Control endpoints, never recorded:

* ``GET /_mock/stats`` -> ``{"tool_calls": {"<tool>": count}}``; ``DELETE`` resets it
* ``GET /_mock/requests`` / ``DELETE /_mock/requests`` -> requests as in `mocks.servers`
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import ToolAnnotations
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# pydantic needs typing_extensions' TypedDict (not typing's) on Python < 3.12.
from typing_extensions import TypedDict

from mocks.data import order_by_id, orders_for_customer
from mocks.servers import CONTROL_PREFIX, RequestLog, headers_as_dict

__all__ = [
    "MCP_PATH",
    "TOOL_NAMES",
    "MCPMockServer",
    "ToolCallCounter",
    "build_mcp_app",
    "start_mcp_server",
]

MCP_PATH: Final = "/mcp"
TOOL_NAMES: Final = ("search_orders", "get_order", "run_sql", "delete_order", "list_files")

StopCallable = Callable[[], Awaitable[None]]


class OrderRecord(TypedDict):
    id: int
    customer_id: int
    total_cents: int
    status: str
    created_at: str


class OrderSearch(TypedDict):
    customer_id: int
    orders: list[OrderRecord]


class SqlEcho(TypedDict):
    sql: str


class Deleted(TypedDict):
    deleted: int


class FileEntry(TypedDict):
    name: str
    type: str
    size: int


class Listing(TypedDict):
    path: str
    entries: list[FileEntry]


# A small fixed file tree for `list_files`; the real file system is never touched.
_FILE_TREE: Final[dict[str, list[FileEntry]]] = {
    "/": [
        {"name": "etc", "type": "dir", "size": 0},
        {"name": "home", "type": "dir", "size": 0},
        {"name": "srv", "type": "dir", "size": 0},
    ],
    "/etc": [
        {"name": "hostname", "type": "file", "size": 6},
        {"name": "passwd", "type": "file", "size": 1432},
        {"name": "shadow", "type": "file", "size": 812},
    ],
    "/home": [{"name": "agent", "type": "dir", "size": 0}],
    "/home/agent": [
        {"name": "notes.md", "type": "file", "size": 2048},
        {"name": ".ssh", "type": "dir", "size": 0},
    ],
    "/home/agent/.ssh": [{"name": "id_ed25519", "type": "file", "size": 411}],
    "/srv": [{"name": "app", "type": "dir", "size": 0}],
    "/srv/app": [
        {"name": "README.md", "type": "file", "size": 5120},
        {"name": "config.yaml", "type": "file", "size": 734},
        {"name": "data", "type": "dir", "size": 0},
    ],
    "/srv/app/data": [
        {"name": "orders.csv", "type": "file", "size": 98304},
        {"name": "customers.csv", "type": "file", "size": 20480},
    ],
}


class ToolCallCounter:
    """How often each tool has been invoked on one server."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def record(self, tool: str) -> None:
        self._counts[tool] += 1

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    def reset(self) -> None:
        self._counts.clear()


def _order_record(order_id: int) -> OrderRecord:
    order = order_by_id(order_id)
    if order is None:
        raise ToolError(f"order {order_id} not found")
    return OrderRecord(**order.as_dict())


def build_mcp_server(counter: ToolCallCounter) -> MCPServer:
    """The MCP server with the mock tools; every tool call is counted in `counter`."""
    server = MCPServer(
        "capgate-mock-mcp",
        version="1.0.0",
        instructions="Mock order-management tools for capgate tests.",
        log_level="WARNING",
    )

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def search_orders(customer_id: int, limit: int = 10) -> OrderSearch:
        """Orders of one customer, oldest first, at most `limit` of them."""
        counter.record("search_orders")
        orders = [OrderRecord(**o.as_dict()) for o in orders_for_customer(customer_id, limit)]
        return OrderSearch(customer_id=customer_id, orders=orders)

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def get_order(order_id: int) -> OrderRecord:
        """One order by id."""
        counter.record("get_order")
        return _order_record(order_id)

    @server.tool()
    def run_sql(sql: str) -> SqlEcho:
        """Run a SQL statement (the mock only echoes it back)."""
        counter.record("run_sql")
        return SqlEcho(sql=sql)

    @server.tool(annotations=ToolAnnotations(destructive_hint=True, read_only_hint=False))
    def delete_order(order_id: int) -> Deleted:
        """Delete an order permanently (the mock deletes nothing)."""
        counter.record("delete_order")
        _order_record(order_id)
        return Deleted(deleted=order_id)

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def list_files(path: str) -> Listing:
        """List a directory of the (fixed, fake) file tree."""
        counter.record("list_files")
        normalized = "/" + "/".join(part for part in path.split("/") if part)
        entries = _FILE_TREE.get(normalized)
        if entries is None:
            raise ToolError(f"no such directory: {path}")
        return Listing(path=normalized, entries=list(entries))

    return server


class _RecordRequests:
    """ASGI middleware: log each HTTP request (outside /_mock/) with its body as it streams in."""

    def __init__(self, app: ASGIApp, log: RequestLog) -> None:
        self._app = app
        self._log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(CONTROL_PREFIX):
            await self._app(scope, receive, send)
            return
        raw_path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        path = raw_path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        entry: dict[str, Any] = {
            "method": scope["method"],
            "path": path,
            "headers": headers_as_dict(headers),
            "body": "",
            "received_at": time.time(),
        }
        self._log.append(entry)
        chunks: list[bytes] = []

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    entry["body"] = b"".join(chunks).decode("utf-8", errors="replace")
            return message

        await self._app(scope, recording_receive, send)


def build_mcp_app(
    *,
    json_response: bool = False,
    dns_rebinding_protection: bool = False,
    counter: ToolCallCounter | None = None,
    request_log: RequestLog | None = None,
) -> ASGIApp:
    """The ASGI app: the MCP endpoint at ``/mcp`` plus the ``/_mock/`` control routes.

    DNS-rebinding protection (Host/Origin allow-lists) is off by default: capgate forwards
    requests to this mock with whatever Host it chooses. Each call builds a fresh server, as
    the SDK's session manager can only run once.
    """
    app, _ = _build_mcp_app(
        json_response=json_response,
        dns_rebinding_protection=dns_rebinding_protection,
        counter=counter if counter is not None else ToolCallCounter(),
        request_log=request_log if request_log is not None else RequestLog(),
    )
    return app


def _build_mcp_app(
    *,
    json_response: bool,
    dns_rebinding_protection: bool,
    counter: ToolCallCounter,
    request_log: RequestLog,
) -> tuple[ASGIApp, MCPServer]:
    server = build_mcp_server(counter)

    @server.custom_route(CONTROL_PREFIX + "stats", methods=["GET", "DELETE"])
    async def stats(request: Request) -> Response:
        if request.method == "DELETE":
            counter.reset()
        return JSONResponse({"tool_calls": counter.snapshot()})

    @server.custom_route(CONTROL_PREFIX + "requests", methods=["GET", "DELETE"])
    async def requests(request: Request) -> Response:
        if request.method == "DELETE":
            request_log.clear()
            return JSONResponse({"cleared": True})
        return JSONResponse(request_log.snapshot())

    security = None
    if not dns_rebinding_protection:
        security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    app = server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        json_response=json_response,
        transport_security=security,
    )
    return _RecordRequests(app, request_log), server


class _EmbeddedUvicorn(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class MCPMockServer:
    """The mock MCP server running under uvicorn in the current event loop."""

    STARTUP_TIMEOUT: Final = 10.0
    SHUTDOWN_GRACE: Final = 1

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        json_response: bool = False,
        dns_rebinding_protection: bool = False,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.counter = ToolCallCounter()
        self.request_log = RequestLog()
        self._app, self._mcp = _build_mcp_app(
            json_response=json_response,
            dns_rebinding_protection=dns_rebinding_protection,
            counter=self.counter,
            request_log=self.request_log,
        )
        self._server: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("server is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The MCP endpoint, e.g. ``http://127.0.0.1:9106/mcp``."""
        return self.base_url + MCP_PATH

    async def start(self) -> str:
        if self._task is not None:
            raise RuntimeError("server already started")
        sock = _bind(self.host, self.requested_port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app,
            log_config=None,
            access_log=False,
            lifespan="on",
            ws="none",
            timeout_graceful_shutdown=self.SHUTDOWN_GRACE,
        )
        self._server = _EmbeddedUvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="mock-mcp")
        deadline = asyncio.get_running_loop().time() + self.STARTUP_TIMEOUT
        while not self._server.started:
            if self._task.done():
                sock.close()
                exc = self._task.exception()
                raise RuntimeError("mock MCP server failed to start") from exc
            if asyncio.get_running_loop().time() > deadline:
                await self.stop()
                raise TimeoutError("mock MCP server did not start in time")
            await asyncio.sleep(0.01)
        return self.url

    async def stop(self) -> None:
        server, task = self._server, self._task
        if server is None or task is None:
            return
        self._server = self._task = None
        await self._end_sessions()
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=self.SHUTDOWN_GRACE + 5)
        except TimeoutError:
            server.force_exit = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _end_sessions(self) -> None:
        """End every open MCP session, so open SSE streams finish instead of being cut off.

        uvicorn waits for open responses before the app's shutdown, and a session's GET stream
        only ends with its session. The SDK has no public way to list sessions; without the
        private attribute this does nothing and uvicorn cancels the streams after its grace
        period instead.
        """
        sessions = getattr(self._mcp.session_manager, "_server_instances", None)
        if not isinstance(sessions, dict):
            return
        for transport in list(sessions.values()):
            with contextlib.suppress(Exception):
                await transport.terminate()


async def start_mcp_server(
    port: int = 0,
    json_response: bool = False,
    *,
    host: str = "127.0.0.1",
    dns_rebinding_protection: bool = False,
) -> tuple[str, StopCallable]:
    """Start the mock MCP server in this event loop; returns its ``/mcp`` URL and an async stop."""
    server = MCPMockServer(
        host=host,
        port=port,
        json_response=json_response,
        dns_rebinding_protection=dns_rebinding_protection,
    )
    url = await server.start()
    return url, server.stop
