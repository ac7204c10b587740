"""One AgentDojo suite's tools as an MCP server (Streamable HTTP on loopback).

The tools are the suite's own functions (``TaskSuite.tools``), run by AgentDojo's
``FunctionsRuntime`` over a live environment that the replay sets before each task
(``SuiteServer.env``). ``tools/list`` gives each tool's description and the JSON Schema of
its parameters (AgentDojo's pydantic model); ``tools/call`` answers with the tool result as
AgentDojo shows it to a model (``tool_result_to_str``), or ``isError`` with the error text.

It runs under uvicorn in the current event loop, as ``mocks.mcp_server.MCPMockServer``
does; ``calls`` counts what actually reached the server (what capgate let through).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any, Final

import mcp_types as types
import uvicorn
from agentdojo.agent_pipeline.tool_execution import tool_result_to_str
from agentdojo.functions_runtime import FunctionCall, FunctionsRuntime, TaskEnvironment
from agentdojo.task_suite.task_suite import TaskSuite
from mcp.server.lowlevel.server import Server
from mcp.server.transport_security import TransportSecuritySettings

from mocks.mcp_server import _bind

MCP_PATH: Final = "/mcp"


class _EmbeddedUvicorn(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def tool_listing(suite: TaskSuite[Any]) -> list[types.Tool]:
    tools = []
    for function in suite.tools:
        schema = function.parameters.model_json_schema()
        schema.pop("title", None)
        schema.setdefault("properties", {})
        tools.append(
            types.Tool(name=function.name, description=function.description, input_schema=schema)
        )
    return tools


class SuiteServer:
    """The suite's tools over ``env``, served at ``http://127.0.0.1:<port>/mcp``."""

    def __init__(self, suite: TaskSuite[Any], host: str = "127.0.0.1") -> None:
        self.suite = suite
        self.host = host
        self.runtime = FunctionsRuntime(suite.tools)
        self.env: TaskEnvironment | None = None
        self.calls: list[FunctionCall] = []  # what reached the server, in order
        self.counts: Counter[str] = Counter()
        self._tools = tool_listing(suite)
        self._server = Server(
            f"agentdojo-{suite.name}",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        self._app = self._server.streamable_http_app(
            streamable_http_path=MCP_PATH,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        self._uvicorn: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def reset(self, env: TaskEnvironment) -> None:
        self.env = env
        self.calls = []

    async def _list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self._tools)

    async def _call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> Any:
        name, args = params.name, dict(params.arguments or {})
        self.calls.append(FunctionCall(function=name, args=args))
        self.counts[name] += 1
        result, error = self.runtime.run_function(self.env, name, args)
        if error is not None:
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=error)], is_error=True
            )
        text = tool_result_to_str(result)
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)])

    async def start(self) -> str:
        sock = _bind(self.host, 0)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app, log_config=None, access_log=False, lifespan="on", ws="none",
            timeout_graceful_shutdown=1,
        )  # fmt: skip
        self._uvicorn = _EmbeddedUvicorn(config)
        self._task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        for _ in range(1000):
            if self._uvicorn.started:
                return self.base_url + MCP_PATH
            if self._task.done():
                raise RuntimeError(f"the {self.suite.name} MCP server did not start")
            await asyncio.sleep(0.01)
        raise TimeoutError(f"the {self.suite.name} MCP server did not start in time")

    async def stop(self) -> None:
        server, task = self._uvicorn, self._task
        if server is None or task is None:
            return
        sessions = getattr(self._server.session_manager, "_server_instances", None)
        if isinstance(sessions, dict):
            for transport in list(sessions.values()):
                with contextlib.suppress(Exception):
                    await transport.terminate()
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=6)
        except TimeoutError:
            server.force_exit = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
