"""What a rule's payload checks read, may rewrite, and report.

A check never sees the call. It is given one ``Payload``:

=====================  ================================================================
payload                what it is
=====================  ================================================================
``BodyPayload``        a plain HTTP request's body (bytes, its media type, strict JSON once)
``ToolCallPayload``    one MCP ``tools/call`` message: the tool's name and its ``arguments``
``PromptPayload``      one MCP ``prompts/get`` message: the prompt's name and ``arguments``
=====================  ================================================================

A check raises a ``GatewayError`` to refuse, may rewrite the payload (the SQL check adds a
LIMIT), and may note what it found in ``Findings`` (statement kinds, tables) for the audit
record. The protocol that made the payload folds any rewrite back into the bytes that are
forwarded, so what was checked is what is sent.

A check given a payload it cannot read refuses the call (fail closed); the policy loader
already refuses such rules, so this only guards against a bug.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import BodyInvalid, UnsupportedMediaType

MAX_JSON_DEPTH = 64


@dataclass(slots=True)
class Findings:
    """What the checks of one call found that the audit record may say: names, never text."""

    sql_kinds: frozenset[str] = frozenset()
    sql_tables: frozenset[str] = frozenset()
    rewritten: bool = False  # a check rewrote a payload (the forwarded bytes differ)

    def note_sql(self, kinds: Iterable[str], tables: Iterable[str]) -> None:
        self.sql_kinds = self.sql_kinds.union(kinds)
        self.sql_tables = self.sql_tables.union(tables)


@dataclass(frozen=True, slots=True)
class CheckContext:
    """What a check's compiler may know about its rule."""

    rule_id: str | None
    tool: str | None = None  # the MCP tool the rule allows
    upstream_kind: str | None = None  # http | mcp
    prompt: str | None = None  # the MCP prompt the rule allows


class Payload:
    """Base of the things checks read; ``findings`` is shared by the whole call."""

    __slots__ = ("findings", "rewritten")

    def __init__(self, findings: Findings) -> None:
        self.findings = findings
        self.rewritten = False

    def _rewrote(self) -> None:
        self.rewritten = True
        self.findings.rewritten = True


class BodyPayload(Payload):
    """A request body as received; parsed as strict JSON at most once, on demand."""

    __slots__ = ("raw", "media_type", "charset", "_json")

    _UNPARSED: Any = object()

    def __init__(self, raw: bytes, content_type: str, findings: Findings) -> None:
        super().__init__(findings)
        self.raw = raw
        self.media_type, self.charset = media_type_of(content_type)
        self._json: Any = self._UNPARSED

    def json(self) -> Any:
        """The body as strict JSON; ``body_invalid`` unless it is sent as JSON and is JSON."""
        if self._json is self._UNPARSED:
            media = self.media_type
            if media != "application/json" and not media.endswith("+json"):
                raise BodyInvalid("the body must be sent with Content-Type: application/json")
            self.check_charset()
            self._json = parse_json(self.raw)
        return self._json

    def text(self) -> str:
        """The body as UTF-8 text (``unsupported_media_type`` for another declared charset)."""
        self.check_charset()
        try:
            return self.raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BodyInvalid("the body is not UTF-8 text") from None

    def check_charset(self) -> None:
        # SECURITY: the upstream decodes with the declared charset; the check reads UTF-8.
        # Any other charset (utf-7 smuggled a second "sql" key) would make them disagree.
        if self.charset not in (None, "utf-8", "utf8"):
            raise UnsupportedMediaType(
                f"a checked body must be UTF-8; this one declares charset={self.charset!r}"
            )

    @property
    def forwarded_content_type(self) -> str:
        """The ``Content-Type`` sent upstream for a checked body: its media type, and the
        charset it was read in (no other parameter the upstream might act on)."""
        return f"{self.media_type}; charset=utf-8" if self.charset else self.media_type

    def replace_json(self, value: Any) -> None:
        """Forward ``value`` (compact UTF-8 JSON) instead of the body received."""
        self._json = value
        self.raw = dump_json(value)
        self._rewrote()

    def replace_raw(self, raw: bytes) -> None:
        self._json = self._UNPARSED
        self.raw = raw
        self._rewrote()


class ArgumentsPayload(Payload):
    """The arguments (a JSON object) an MCP message passes to a named tool or prompt."""

    __slots__ = ("name", "arguments")
    what = "tool"

    def __init__(self, name: str, arguments: dict[str, Any], findings: Findings) -> None:
        super().__init__(findings)
        self.name = name
        self.arguments = arguments

    @property
    def tool(self) -> str:
        return self.name

    def replace_argument(self, name: str, value: Any) -> None:
        self.arguments[name] = value
        self._rewrote()


class ToolCallPayload(ArgumentsPayload):
    """One MCP ``tools/call``: which tool, with which arguments."""

    __slots__ = ()
    what = "tool"


class PromptPayload(ArgumentsPayload):
    """One MCP ``prompts/get``: which prompt, with which arguments."""

    __slots__ = ()
    what = "prompt"


class PayloadCheck(Protocol):
    """A compiled check of a payload (JSON Schema, SQL, tool arguments), from a rule."""

    kind: str

    def check(self, payload: Payload) -> None:
        """Raise a ``GatewayError`` when the payload breaks the rule; may rewrite it."""


def media_type_of(content_type: str) -> tuple[str, str | None]:
    """``application/json; charset=UTF-8`` -> ``("application/json", "utf-8")``."""
    media, _, params = content_type.partition(";")
    charset = None
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    return media.strip().lower(), charset


# --- strict JSON ----------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            # Parsers disagree on which of two equal keys wins: the upstream may read the
            # other value than the one checked.
            raise BodyInvalid(f"the JSON body has a duplicated key {key!r}")
        out[key] = value
    return out


def _check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise BodyInvalid(f"the JSON body is nested deeper than {limit} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _reject_constant(name: str) -> Any:
    raise BodyInvalid(f"the JSON body contains {name}, which is not JSON")


def parse_json(data: bytes) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, bounded depth."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyInvalid("the body is not UTF-8 text") from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except BodyInvalid:
        raise
    except RecursionError:
        raise BodyInvalid(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise BodyInvalid(f"the body is not valid JSON: {exc.args[0]}") from None
    _check_depth(value)
    return value


def dump_json(value: Any) -> bytes:
    """Compact UTF-8 JSON, as rewritten payloads are forwarded."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
        "utf-8"
    )
