"""An MCP server (Streamable HTTP) with everything the official conformance suite's server
scenarios call: ``python -m mocks.conformance_server [--port 0] [--host 127.0.0.1]``.

The suite (``@modelcontextprotocol/conformance`` 0.1.9, pinned in ``conformance/``) connects
as an MCP client and checks what it gets back. What each scenario calls, and this server's
answer (names, URIs and texts are the ones the scenarios' descriptions ask for):

* tools: ``test_simple_text``, ``test_image_content``, ``test_audio_content``,
  ``test_embedded_resource``, ``test_multiple_content_types``, ``test_error_handling``
  (``isError: true``), ``test_tool_with_logging`` (three ``notifications/message`` at info,
  ~50 ms apart), ``test_tool_with_progress`` (progress 0, 50, 100 of 100 when the request
  has a progress token), ``test_sampling`` (asks the client ``sampling/createMessage``),
  ``test_elicitation``, ``test_elicitation_sep1034_defaults`` and
  ``test_elicitation_sep1330_enums`` (ask the client ``elicitation/create``),
  ``json_schema_2020_12_tool`` (an input schema with ``$schema``, ``$defs`` and
  ``additionalProperties: false``), ``test_reconnection`` (closes its SSE stream before
  answering, when the transport lets it: SEP-1699 polling);
* resources ``test://static-text``, ``test://static-binary``, ``test://watched-resource``,
  the template ``test://template/{id}/data``; ``resources/subscribe`` and ``unsubscribe``;
* prompts ``test_simple_prompt``, ``test_prompt_with_arguments`` (``arg1``, ``arg2``),
  ``test_prompt_with_embedded_resource`` (``resourceUri``), ``test_prompt_with_image``;
* ``completion/complete`` (prompt arguments and the template's ``id``), ``logging/setLevel``
  (per session: later log notifications below the level are not sent), ``ping``.

Built on the SDK's low-level ``mcp.server.Server`` (mcp 2.x), so each answer is exactly the
JSON written here. Sessions are stateful; POST answers are SSE streams; an in-memory event
store gives SSE events ids (priming events, ``retry``, ``Last-Event-ID`` replay) to clients of
protocol 2025-11-25 and later.

When it listens, one line of JSON goes to stdout: ``{"ready": true, "url": ".../mcp",
"pid": N}``. SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import itertools
import json
import logging
import os
import signal
import socket
import struct
import sys
import warnings
import wave
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import mcp_types as t
import uvicorn
from mcp.server import Server, ServerRequestContext
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types import JSONRPCMessage
from starlette.types import ASGIApp

__all__ = [
    "MCP_PATH",
    "PROMPT_NAMES",
    "RESOURCE_URIS",
    "TOOL_NAMES",
    "build_conformance_app",
    "main",
]

log = logging.getLogger("mocks.conformance_server")

MCP_PATH: Final = "/mcp"
SERVER_NAME: Final = "capgate-conformance-mock"
RETRY_MS: Final = 500

Ctx = ServerRequestContext[Any, Any]

# --------------------------------------------------------------------------- fixed content


def _png_1x1_red() -> bytes:
    """A valid 1x1 RGB PNG, one red pixel, built here rather than pasted as base64."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)  # 1x1, 8 bit, truecolour
    pixels = zlib.compress(b"\x00\xff\x00\x00")  # filter byte 0, then R G B
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


def _wav_silence() -> bytes:
    """A valid WAV file: 10 ms of 8 kHz mono 16-bit silence."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(8000)
        out.writeframes(b"\x00\x00" * 80)
    return buf.getvalue()


PNG_B64: Final = base64.b64encode(_png_1x1_red()).decode()
WAV_B64: Final = base64.b64encode(_wav_silence()).decode()
STATIC_TEXT: Final = "This is the content of the static text resource."

# --------------------------------------------------------------------------- tools

_NO_ARGS: Final[dict[str, Any]] = {"type": "object", "properties": {}}


def _string_args(**descriptions: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            name: {"type": "string", "description": d} for name, d in descriptions.items()
        },
        "required": list(descriptions),
    }


JSON_SCHEMA_2020_12: Final = "https://json-schema.org/draft/2020-12/schema"

TOOLS: Final[tuple[t.Tool, ...]] = (
    t.Tool(name="test_simple_text", description="Returns one text block.", input_schema=_NO_ARGS),
    t.Tool(name="test_image_content", description="Returns a PNG image.", input_schema=_NO_ARGS),
    t.Tool(name="test_audio_content", description="Returns a WAV sound.", input_schema=_NO_ARGS),
    t.Tool(
        name="test_embedded_resource",
        description="Returns an embedded text resource.",
        input_schema=_NO_ARGS,
    ),
    t.Tool(
        name="test_multiple_content_types",
        description="Returns text, an image and an embedded resource.",
        input_schema=_NO_ARGS,
    ),
    t.Tool(
        name="test_tool_with_logging",
        description="Sends three info log notifications while it runs.",
        input_schema=_NO_ARGS,
    ),
    t.Tool(
        name="test_error_handling",
        description="Always fails, as a tool result with isError.",
        input_schema=_NO_ARGS,
    ),
    t.Tool(
        name="test_tool_with_progress",
        description="Reports progress 0, 50 and 100 of 100.",
        input_schema=_NO_ARGS,
    ),
    t.Tool(
        name="test_sampling",
        description="Asks the client's LLM (sampling/createMessage) and returns its answer.",
        input_schema=_string_args(prompt="The prompt to send to the LLM"),
    ),
    t.Tool(
        name="test_elicitation",
        description="Asks the user (elicitation/create) for a username and an email.",
        input_schema=_string_args(message="The message to show the user"),
    ),
    t.Tool(
        name="test_elicitation_sep1034_defaults",
        description="Elicitation whose fields of every primitive type have defaults (SEP-1034).",
        input_schema=_NO_ARGS,
    ),
    t.Tool(
        name="test_elicitation_sep1330_enums",
        description="Elicitation with the five enum forms of SEP-1330.",
        input_schema=_NO_ARGS,
    ),
    t.Tool(
        name="json_schema_2020_12_tool",
        description="Tool with JSON Schema 2020-12 features",
        input_schema={
            "$schema": JSON_SCHEMA_2020_12,
            "type": "object",
            "$defs": {
                "address": {
                    "type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                }
            },
            "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"}},
            "additionalProperties": False,
        },
    ),
    t.Tool(
        name="test_reconnection",
        description="Closes its SSE stream mid-call, then answers (SEP-1699 polling).",
        input_schema=_NO_ARGS,
    ),
)
TOOL_NAMES: Final = tuple(tool.name for tool in TOOLS)

_SEP1034_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "Your name", "default": "John Doe"},
        "age": {"type": "integer", "description": "Your age", "default": 30},
        "score": {"type": "number", "description": "Your score", "default": 95.5},
        "status": {
            "type": "string",
            "description": "Account status",
            "enum": ["active", "inactive", "pending"],
            "default": "active",
        },
        "verified": {"type": "boolean", "description": "Verified?", "default": True},
    },
}

_SEP1330_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "untitledSingle": {"type": "string", "enum": ["option1", "option2", "option3"]},
        "titledSingle": {
            "type": "string",
            "oneOf": [
                {"const": "value1", "title": "First Option"},
                {"const": "value2", "title": "Second Option"},
                {"const": "value3", "title": "Third Option"},
            ],
        },
        "legacyEnum": {
            "type": "string",
            "enum": ["opt1", "opt2", "opt3"],
            "enumNames": ["Option One", "Option Two", "Option Three"],
        },
        "untitledMulti": {
            "type": "array",
            "items": {"type": "string", "enum": ["option1", "option2", "option3"]},
        },
        "titledMulti": {
            "type": "array",
            "items": {
                "anyOf": [
                    {"const": "value1", "title": "First Choice"},
                    {"const": "value2", "title": "Second Choice"},
                    {"const": "value3", "title": "Third Choice"},
                ]
            },
        },
    },
}


def _text(text: str) -> t.TextContent:
    return t.TextContent(type="text", text=text)


def _image() -> t.ImageContent:
    return t.ImageContent(type="image", data=PNG_B64, mime_type="image/png")


def _embedded(uri: str, mime_type: str, text: str) -> t.EmbeddedResource:
    contents = t.TextResourceContents(uri=uri, mime_type=mime_type, text=text)
    return t.EmbeddedResource(type="resource", resource=contents)


# --------------------------------------------------------------------------- resources

RESOURCES: Final[tuple[t.Resource, ...]] = (
    t.Resource(
        uri="test://static-text",
        name="static-text",
        description="A static text resource",
        mime_type="text/plain",
    ),
    t.Resource(
        uri="test://static-binary",
        name="static-binary",
        description="A static binary resource (a PNG image)",
        mime_type="image/png",
    ),
    t.Resource(
        uri="test://watched-resource",
        name="watched-resource",
        description="A resource to subscribe to",
        mime_type="text/plain",
    ),
)
RESOURCE_URIS: Final = tuple(r.uri for r in RESOURCES)
TEMPLATE_PREFIX: Final = "test://template/"
TEMPLATE_SUFFIX: Final = "/data"
RESOURCE_TEMPLATE: Final = t.ResourceTemplate(
    uri_template=TEMPLATE_PREFIX + "{id}" + TEMPLATE_SUFFIX,
    name="template-data",
    description="Data for one id",
    mime_type="application/json",
)

# --------------------------------------------------------------------------- prompts

PROMPTS: Final[tuple[t.Prompt, ...]] = (
    t.Prompt(name="test_simple_prompt", description="A prompt without arguments"),
    t.Prompt(
        name="test_prompt_with_arguments",
        description="A prompt with two arguments",
        arguments=[
            t.PromptArgument(name="arg1", description="First test argument", required=True),
            t.PromptArgument(name="arg2", description="Second test argument", required=True),
        ],
    ),
    t.Prompt(
        name="test_prompt_with_embedded_resource",
        description="A prompt that embeds a resource",
        arguments=[
            t.PromptArgument(
                name="resourceUri", description="URI of the resource to embed", required=True
            )
        ],
    ),
    t.Prompt(name="test_prompt_with_image", description="A prompt with an image"),
)
PROMPT_NAMES: Final = tuple(p.name for p in PROMPTS)

# What completion/complete offers, per (reference name, argument name).
_COMPLETIONS: Final[dict[tuple[str, str], tuple[str, ...]]] = {
    ("test_prompt_with_arguments", "arg1"): ("paris", "park", "party", "test", "testValue1"),
    ("test_prompt_with_arguments", "arg2"): ("world", "testValue2"),
    (RESOURCE_TEMPLATE.uri_template, "id"): ("1", "42", "123"),
}

# --------------------------------------------------------------------------- logging levels

LOG_LEVELS: Final = (
    "debug",
    "info",
    "notice",
    "warning",
    "error",
    "critical",
    "alert",
    "emergency",
)


@dataclass
class SessionState:
    """What one MCP session asked for: its log level and its subscriptions."""

    log_level: str = "debug"
    subscriptions: set[str] = field(default_factory=set)


class Sessions:
    """Per-session state, keyed by the ``Mcp-Session-Id`` the request came with."""

    def __init__(self) -> None:
        self._states: dict[str, SessionState] = {}

    def of(self, ctx: Ctx) -> SessionState:
        headers = getattr(ctx.request, "headers", None)
        key = headers.get("mcp-session-id", "") if headers is not None else ""
        return self._states.setdefault(key, SessionState())


# --------------------------------------------------------------------------- event store


class MemoryEventStore(EventStore):
    """Events kept in memory (the newest `capacity`), so a client can resume a stream."""

    def __init__(self, capacity: int = 1000) -> None:
        self._events: deque[tuple[EventId, StreamId, JSONRPCMessage | None]] = deque(
            maxlen=capacity
        )
        self._ids = itertools.count(1)

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        event_id = f"{stream_id}:{next(self._ids)}"
        self._events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(
        self, last_event_id: EventId, send_callback: EventCallback
    ) -> StreamId | None:
        events = list(self._events)
        index = next((i for i, e in enumerate(events) if e[0] == last_event_id), None)
        if index is None:
            return None
        stream_id = events[index][1]
        for event_id, stream, message in events[index + 1 :]:
            if stream == stream_id and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream_id


# --------------------------------------------------------------------------- the server


class ConformanceHandlers:
    """The request handlers; one instance per server (it holds the sessions' state)."""

    def __init__(self) -> None:
        self.sessions = Sessions()
        self._tools: dict[str, Callable[[Ctx, dict[str, Any]], Awaitable[t.CallToolResult]]] = {
            "test_simple_text": self._simple_text,
            "test_image_content": self._image_content,
            "test_audio_content": self._audio_content,
            "test_embedded_resource": self._embedded_resource,
            "test_multiple_content_types": self._multiple_content_types,
            "test_tool_with_logging": self._with_logging,
            "test_error_handling": self._error_handling,
            "test_tool_with_progress": self._with_progress,
            "test_sampling": self._sampling,
            "test_elicitation": self._elicitation,
            "test_elicitation_sep1034_defaults": self._elicitation_defaults,
            "test_elicitation_sep1330_enums": self._elicitation_enums,
            "json_schema_2020_12_tool": self._json_schema_tool,
            "test_reconnection": self._reconnection,
        }
        assert set(self._tools) == set(TOOL_NAMES)

    # ---- tools

    async def list_tools(
        self, ctx: Ctx, params: t.PaginatedRequestParams | None
    ) -> t.ListToolsResult:
        return t.ListToolsResult(tools=list(TOOLS))

    async def call_tool(self, ctx: Ctx, params: t.CallToolRequestParams) -> t.CallToolResult:
        tool = self._tools.get(params.name)
        if tool is None:
            raise MCPError(code=t.INVALID_PARAMS, message=f"unknown tool: {params.name}")
        return await tool(ctx, params.arguments or {})

    async def _simple_text(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        return t.CallToolResult(content=[_text("This is a simple text response for testing.")])

    async def _image_content(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        return t.CallToolResult(content=[_image()])

    async def _audio_content(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        audio = t.AudioContent(type="audio", data=WAV_B64, mime_type="audio/wav")
        return t.CallToolResult(content=[audio])

    async def _embedded_resource(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        resource = _embedded(
            "test://embedded-resource", "text/plain", "This is an embedded resource content."
        )
        return t.CallToolResult(content=[resource])

    async def _multiple_content_types(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        data = json.dumps({"test": "data", "value": 123}, separators=(",", ":"))
        return t.CallToolResult(
            content=[
                _text("Multiple content types test:"),
                _image(),
                _embedded("test://mixed-content-resource", "application/json", data),
            ]
        )

    async def _with_logging(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        await self._log(ctx, "info", "Tool execution started")
        await asyncio.sleep(0.05)
        await self._log(ctx, "info", "Tool processing data")
        await asyncio.sleep(0.05)
        await self._log(ctx, "info", "Tool execution completed")
        return t.CallToolResult(content=[_text("Tool with logging executed successfully")])

    async def _error_handling(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        text = "This tool intentionally returns an error for testing"
        return t.CallToolResult(content=[_text(text)], is_error=True)

    async def _with_progress(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        for step, progress in enumerate((0, 50, 100)):
            if step:
                await asyncio.sleep(0.05)
            await ctx.session.report_progress(progress, 100, f"{progress}% done")
        return t.CallToolResult(content=[_text("Tool with progress executed successfully")])

    async def _sampling(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        prompt = args.get("prompt")
        if not isinstance(prompt, str):
            return t.CallToolResult(content=[_text("'prompt' must be a string")], is_error=True)
        message = t.SamplingMessage(role="user", content=_text(prompt))
        with warnings.catch_warnings():  # sampling is deprecated as of 2026-07-28, not before
            warnings.simplefilter("ignore")
            answer = await ctx.session.create_message(
                [message], max_tokens=100, related_request_id=ctx.request_id
            )
        blocks = answer.content if isinstance(answer.content, list) else [answer.content]
        text = " ".join(b.text for b in blocks if isinstance(b, t.TextContent))
        return t.CallToolResult(content=[_text(f"LLM response: {text}")])

    async def _elicitation(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        message = args.get("message")
        if not isinstance(message, str):
            return t.CallToolResult(content=[_text("'message' must be a string")], is_error=True)
        schema = {
            "type": "object",
            "properties": {
                "username": {"type": "string", "description": "User's response"},
                "email": {"type": "string", "description": "User's email address"},
            },
            "required": ["username", "email"],
        }
        answer = await ctx.session.elicit_form(message, schema, related_request_id=ctx.request_id)
        text = f"User response: action={answer.action}, content={json.dumps(answer.content)}"
        return t.CallToolResult(content=[_text(text)])

    async def _elicit_completed(
        self, ctx: Ctx, message: str, schema: dict[str, Any]
    ) -> t.CallToolResult:
        answer = await ctx.session.elicit_form(message, schema, related_request_id=ctx.request_id)
        text = (
            f"Elicitation completed: action={answer.action}, content={json.dumps(answer.content)}"
        )
        return t.CallToolResult(content=[_text(text)])

    async def _elicitation_defaults(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        return await self._elicit_completed(ctx, "Please review your profile", _SEP1034_SCHEMA)

    async def _elicitation_enums(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        return await self._elicit_completed(ctx, "Please choose your options", _SEP1330_SCHEMA)

    async def _json_schema_tool(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        return t.CallToolResult(content=[_text(f"Received: {json.dumps(args, sort_keys=True)}")])

    async def _reconnection(self, ctx: Ctx, args: dict[str, Any]) -> t.CallToolResult:
        # The transport offers to close the stream only to clients that can resume it
        # (protocol 2025-11-25 and later, with an event store); others get the answer inline.
        if ctx.close_sse_stream is not None:
            await asyncio.sleep(0.05)
            await ctx.close_sse_stream()
            await asyncio.sleep(0.2)
        return t.CallToolResult(content=[_text("Reconnection test completed")])

    async def _log(self, ctx: Ctx, level: str, data: str) -> None:
        threshold = self.sessions.of(ctx).log_level
        if LOG_LEVELS.index(level) < LOG_LEVELS.index(threshold):
            return
        with warnings.catch_warnings():  # logging is deprecated as of 2026-07-28, not before
            warnings.simplefilter("ignore")
            await ctx.session.send_log_message(
                level,  # type: ignore[arg-type]
                data,
                logger="conformance",
                related_request_id=ctx.request_id,
            )

    # ---- logging

    async def set_level(self, ctx: Ctx, params: t.SetLevelRequestParams) -> t.EmptyResult:
        self.sessions.of(ctx).log_level = params.level
        return t.EmptyResult()

    # ---- resources

    async def list_resources(
        self, ctx: Ctx, params: t.PaginatedRequestParams | None
    ) -> t.ListResourcesResult:
        return t.ListResourcesResult(resources=list(RESOURCES))

    async def list_resource_templates(
        self, ctx: Ctx, params: t.PaginatedRequestParams | None
    ) -> t.ListResourceTemplatesResult:
        return t.ListResourceTemplatesResult(resource_templates=[RESOURCE_TEMPLATE])

    async def read_resource(
        self, ctx: Ctx, params: t.ReadResourceRequestParams
    ) -> t.ReadResourceResult:
        uri = str(params.uri)
        contents: t.TextResourceContents | t.BlobResourceContents
        if uri == "test://static-text":
            contents = t.TextResourceContents(uri=uri, mime_type="text/plain", text=STATIC_TEXT)
        elif uri == "test://static-binary":
            contents = t.BlobResourceContents(uri=uri, mime_type="image/png", blob=PNG_B64)
        elif uri == "test://watched-resource":
            contents = t.TextResourceContents(uri=uri, mime_type="text/plain", text="watched")
        elif (
            uri.startswith(TEMPLATE_PREFIX)
            and uri.endswith(TEMPLATE_SUFFIX)
            and (ident := uri[len(TEMPLATE_PREFIX) : -len(TEMPLATE_SUFFIX)])
            and "/" not in ident
        ):
            data = {"id": ident, "templateTest": True, "data": f"Data for ID: {ident}"}
            text = json.dumps(data, separators=(",", ":"))
            contents = t.TextResourceContents(uri=uri, mime_type="application/json", text=text)
        else:
            raise MCPError(code=t.INVALID_PARAMS, message=f"Resource not found: {uri}")
        return t.ReadResourceResult(contents=[contents])

    async def subscribe(self, ctx: Ctx, params: t.SubscribeRequestParams) -> t.EmptyResult:
        self.sessions.of(ctx).subscriptions.add(str(params.uri))
        return t.EmptyResult()

    async def unsubscribe(self, ctx: Ctx, params: t.UnsubscribeRequestParams) -> t.EmptyResult:
        self.sessions.of(ctx).subscriptions.discard(str(params.uri))
        return t.EmptyResult()

    # ---- prompts

    async def list_prompts(
        self, ctx: Ctx, params: t.PaginatedRequestParams | None
    ) -> t.ListPromptsResult:
        return t.ListPromptsResult(prompts=list(PROMPTS))

    async def get_prompt(self, ctx: Ctx, params: t.GetPromptRequestParams) -> t.GetPromptResult:
        args = params.arguments or {}
        if params.name == "test_simple_prompt":
            messages = [
                t.PromptMessage(role="user", content=_text("This is a simple prompt for testing."))
            ]
        elif params.name == "test_prompt_with_arguments":
            missing = [a for a in ("arg1", "arg2") if a not in args]
            if missing:
                raise MCPError(code=t.INVALID_PARAMS, message=f"missing arguments: {missing}")
            text = f"Prompt with arguments: arg1='{args['arg1']}', arg2='{args['arg2']}'"
            messages = [t.PromptMessage(role="user", content=_text(text))]
        elif params.name == "test_prompt_with_embedded_resource":
            uri = args.get("resourceUri")
            if not uri:
                raise MCPError(code=t.INVALID_PARAMS, message="missing argument: resourceUri")
            embedded = _embedded(uri, "text/plain", "Embedded resource content for testing.")
            messages = [
                t.PromptMessage(role="user", content=embedded),
                t.PromptMessage(
                    role="user", content=_text("Please process the embedded resource above.")
                ),
            ]
        elif params.name == "test_prompt_with_image":
            messages = [
                t.PromptMessage(role="user", content=_image()),
                t.PromptMessage(role="user", content=_text("Please analyze the image above.")),
            ]
        else:
            raise MCPError(code=t.INVALID_PARAMS, message=f"unknown prompt: {params.name}")
        return t.GetPromptResult(messages=messages)

    # ---- completion

    async def complete(self, ctx: Ctx, params: t.CompleteRequestParams) -> t.CompleteResult:
        ref = params.ref
        name = ref.name if isinstance(ref, t.PromptReference) else ref.uri
        offered = _COMPLETIONS.get((name, params.argument.name), ())
        values = [v for v in offered if v.startswith(params.argument.value)]
        return t.CompleteResult(
            completion=t.Completion(values=values, total=len(values), has_more=False)
        )


def build_server(handlers: ConformanceHandlers | None = None) -> Server[Any]:
    """The low-level MCP server with every handler the conformance scenarios call."""
    h = handlers if handlers is not None else ConformanceHandlers()
    server: Server[Any] = Server(
        SERVER_NAME,
        version="1.0.0",
        instructions="The MCP conformance suite's server scenarios, for capgate's tests.",
        on_list_tools=h.list_tools,
        on_call_tool=h.call_tool,
        on_list_resources=h.list_resources,
        on_list_resource_templates=h.list_resource_templates,
        on_read_resource=h.read_resource,
        on_subscribe_resource=h.subscribe,
        on_unsubscribe_resource=h.unsubscribe,
        on_list_prompts=h.list_prompts,
        on_get_prompt=h.get_prompt,
        on_completion=h.complete,
    )
    # Not a constructor argument: the SDK marks logging deprecated as of 2026-07-28 there.
    server.add_request_handler("logging/setLevel", t.SetLevelRequestParams, h.set_level)
    return server


def build_conformance_app(*, json_response: bool = False) -> tuple[ASGIApp, Server[Any]]:
    """The ASGI app serving the MCP endpoint at ``/mcp``, and its server.

    DNS-rebinding protection is off: capgate forwards with the Host it chooses.
    """
    server = build_server()
    app = server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        json_response=json_response,
        event_store=MemoryEventStore(),
        retry_interval=RETRY_MS,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    return app, server


# --------------------------------------------------------------------------- serving


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (``serve`` installs ours)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


async def _end_sessions(server: Server[Any]) -> None:
    """End open sessions, so their GET streams finish instead of holding uvicorn's shutdown.

    The SDK has no public way to list sessions; without the private attribute this does
    nothing and uvicorn cuts the streams after its grace period instead.
    """
    sessions = getattr(server.session_manager, "_server_instances", None)
    if isinstance(sessions, dict):
        for transport in list(sessions.values()):
            with contextlib.suppress(Exception):
                await transport.terminate()


async def serve(host: str, port: int, json_response: bool) -> None:
    app, server = build_conformance_app(json_response=json_response)
    sock = _bind(host, port)
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="on",
        ws="none",
        timeout_graceful_shutdown=1,
    )
    runner = _Uvicorn(config)
    task = asyncio.create_task(runner.serve(sockets=[sock]))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not runner.started:
        if task.done():
            await task
            raise RuntimeError("the conformance server did not start")
        await asyncio.sleep(0.01)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    ready = {"ready": True, "url": f"http://{shown}:{bound}{MCP_PATH}", "pid": os.getpid()}
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    await _end_sessions(server)
    runner.should_exit = True
    try:
        await asyncio.wait_for(task, timeout=5)
    except TimeoutError:
        runner.force_exit = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m mocks.conformance_server", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 (default): a free port")
    parser.add_argument(
        "--json-response", action="store_true", help="answer POSTs with JSON, not SSE"
    )
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.host, args.port, args.json_response))
    except OSError as exc:
        print(f"mocks.conformance_server: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
