"""The policy file's vocabulary, as data: every section, every key, what its value may be.

``load.py`` reads the keys each section allows from here (``Section.required``/``optional``),
and ``policy_schema()`` turns the same tables, with each payload check's own schema, into a
JSON Schema (Draft 2020-12) of the whole file, for editors and linters. The loader stays
the authority on meaning (cross-references, regexes that compile, paths that parse); the
schema says what can be written, with a description for every key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.checks import PAYLOAD_CHECKS
from gateway.target import UPSTREAM_NAME

JSON = dict[str, Any]

# The HTTP methods a rule may allow.
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# JSON-RPC methods a rule may name with ``method:``: a client request, or the agent's answer
# to a request of the server (roots/list, sampling/createMessage, elicitation/create).
MCP_METHODS = (
    "logging/setLevel",
    "roots/list",
    "sampling/createMessage",
    "elicitation/create",
)

DURATION: JSON = {
    "description": "a duration: seconds, or a number with ms, s, m, h or d (30s, 5m)",
    "anyOf": [
        {"type": "number", "minimum": 0},
        {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d)?\s*$"},
    ],
}
SIZE: JSON = {
    "description": "a size: bytes, or a number with B, KiB, MiB, GiB, KB, MB or GB",
    "anyOf": [
        {"type": "integer", "minimum": 0},
        {"type": "string", "pattern": r"^\s*\d+\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$"},
    ],
}
RATE: JSON = {
    "type": "string",
    "description": "calls per unit, optionally with a burst: 60/minute, 3/hour burst 1",
    "pattern": r"^\s*[0-9]+\s*/\s*[A-Za-z]+(\s+burst\s+[0-9]+)?\s*$",
}
TEXT: JSON = {"type": "string"}
# Names, as regular expressions the whole name must match (the loader compiles these).
ROLE_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
RULE_ID = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
DEFAULT_SQL_ATTEMPTS = "300/minute burst 60"
"""The attempt rate of a rule with ``sql:`` that states none: 5 checks a second per agent on
average, 60 back to back, far above what an agent composing queries sends, and a bound on
what one agent's checks can cost (an uncached 10 KB statement takes milliseconds)."""


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    description: str
    schema: Mapping[str, Any]
    required: bool = False


@dataclass(frozen=True, slots=True)
class Section:
    """A mapping in the policy file: the keys it may hold."""

    name: str
    description: str
    keys: tuple[Key, ...]

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.keys if k.required)

    @property
    def optional(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.keys if not k.required)

    def schema(self, extra: Mapping[str, Mapping[str, Any]] | None = None) -> JSON:
        properties: JSON = {k.name: {**k.schema, "description": k.description} for k in self.keys}
        properties.update(extra or {})
        return {
            "type": "object",
            "description": self.description,
            "properties": properties,
            "required": list(self.required),
            "additionalProperties": False,
        }


TIMEOUTS = Section(
    "timeouts",
    "How long the gateway waits for the upstream.",
    (
        Key("connect", "to open a connection (default 5s)", DURATION),
        Key("read", "between two reads of the answer (default 30s)", DURATION),
        Key(
            "total",
            "the whole upstream exchange: connecting, sending and the entire answer, however "
            "it trickles (default 60s; beyond: upstream_timeout, or the stream is cut)",
            DURATION,
        ),
    ),
)
LIMITS = Section(
    "limits",
    "Largest bodies (payload_too_large beyond), and calls in flight to the upstream.",
    (
        Key("request_body", "largest request body (default 1MiB)", SIZE),
        Key("response_body", "largest response body (default 16MiB)", SIZE),
        Key(
            "concurrency",
            "calls in flight to this upstream at once, all agents together (default 64)",
            {"type": "integer", "minimum": 1, "maximum": 4096},
        ),
        Key(
            "per_agent",
            "calls in flight to this upstream at once from one agent (default: a quarter of "
            "concurrency); beyond, a call waits up to the connect timeout for one of its "
            "agent's calls to end, then concurrency_limited",
            {"type": "integer", "minimum": 1, "maximum": 4096},
        ),
    ),
)
CREDENTIALS = Section(
    "credentials",
    "How the gateway authenticates to the upstream; the agent never sees the value.",
    (
        Key(
            "type",
            "none, bearer (Authorization: Bearer), header (a named header), agent-jwt (a "
            "short-lived JWT the gateway signs for each agent)",
            {"enum": ["none", "bearer", "header", "agent-jwt"]},
            required=True,
        ),
        Key(
            "secret",
            "bearer/header: env:NAME or file:PATH, either may contain {agent}",
            {"type": "string", "pattern": r"^(env:[A-Za-z_][A-Za-z0-9_{}]*|file:.+)$"},
        ),
        Key("header", "header: the header's name", TEXT),
        Key("prefix", "header: text put before the secret", TEXT),
        Key("audience", "agent-jwt: the aud claim (default: the upstream's name)", TEXT),
        Key("ttl", "agent-jwt: lifetime, 10s to 1h (default 5m)", DURATION),
    ),
)
MCP_OPTIONS = Section(
    "mcp",
    "How capgate speaks MCP with this upstream.",
    (
        Key(
            "batches",
            "the server takes JSON-RPC batches (current MCP versions do not; default false: "
            "batches are refused)",
            {"type": "boolean"},
        ),
        Key(
            "tool_refusals",
            "a refused tools/call is answered as a JSON-RPC error (default) or as a tool "
            "result with isError, which the model reads",
            {"enum": ["error", "result"]},
        ),
        Key(
            "approval_patience",
            "how long a tools/call held for approval waits for the decision before it is "
            "answered (default 25s, below the usual MCP clients' timeouts): a tool result "
            "with isError saying it awaits approval, with the approval's id; the approval "
            "stays pending, and the same call sent again (same tool and arguments) attaches "
            "to it and runs once approved",
            DURATION,
        ),
        Key(
            "approval_keepalive",
            "while a tools/call is held for approval, a notifications/progress ('capgate: "
            "awaiting approval <id>') every this long, on an event stream answering the call, "
            "so the client does not give up on a silent call (default 15s, at least 100ms; "
            "none: no notifications). Only for a client that accepts text/event-stream and "
            "sent a progressToken; the decision's answer is the stream's last event",
            {"anyOf": [DURATION, {"enum": ["none"]}]},
        ),
    ),
)
UPSTREAM = Section(
    "upstream",
    "Where calls to /<name>/... go.",
    (
        Key(
            "url",
            "http(s) URL without query, fragment or credentials",
            {"type": "string", "pattern": "^https?://"},
            required=True,
        ),
        Key("kind", "the protocol: http (default) or mcp", {"enum": ["http", "mcp"]}),
        Key("timeouts", TIMEOUTS.description, TIMEOUTS.schema()),
        Key("limits", LIMITS.description, LIMITS.schema()),
        Key("credentials", CREDENTIALS.description, CREDENTIALS.schema()),
        Key("mcp", MCP_OPTIONS.description, MCP_OPTIONS.schema()),
        Key(
            "trust",
            "untrusted: what it returns can be written by third parties (web pages, mail, "
            "documents, chat); a run that calls it is tainted, and its sensitive calls then "
            "need approval. Default: trusted",
            {"enum": ["trusted", "untrusted"]},
        ),
        Key("description", "for people", TEXT),
    ),
)
_SCALAR = {"type": ["string", "integer", "number", "boolean"]}
CONSTRAINT = Section(
    "constraint",
    "What one path parameter, query parameter or header value may be.",
    (
        Key("required", "it must be present", {"type": "boolean"}),
        Key("enum", "the only values allowed", {"type": "array", "items": _SCALAR}),
        Key("regex", "a regular expression the whole value must match", TEXT),
        Key("integer", "the value must be a decimal integer", {"type": "boolean"}),
        Key("min", "smallest integer allowed", {"type": "integer"}),
        Key("max", "largest integer allowed", {"type": "integer"}),
        Key("max_length", "longest value allowed (default 1024)", {"type": "integer"}),
        Key("repeat", "the name may appear more than once", {"type": "boolean"}),
    ),
)
_CONSTRAINTS: JSON = {
    "type": "object",
    "additionalProperties": {
        "anyOf": [CONSTRAINT.schema(), {"type": "array", "items": _SCALAR}],
    },
}
REPLAY = Section(
    "replay",
    "How replay answers this rule's calls.",
    (
        Key(
            "repeat_last",
            "answer calls beyond the recorded ones with the last recording",
            {"type": "boolean"},
        ),
    ),
)
RESOURCE = Section(
    "resource",
    "MCP resources as a URI pattern, with constraints on its parameters.",
    (
        Key("uri", "the URI pattern, {name} for a parameter", TEXT, required=True),
        Key("params", "constraints on the URI's {parameters}", _CONSTRAINTS),
    ),
)
RULE = Section(
    "rule",
    "One kind of call a role may make; every call needs a rule that allows it.",
    (
        Key(
            "id",
            "unique id, named in denials and audit lines",
            {"type": "string", "pattern": f"^{RULE_ID}$"},
            required=True,
        ),
        Key("upstream", "the upstream's name", TEXT, required=True),
        Key(
            "allow",
            "'METHOD /path', the path relative to the upstream, {name} for one segment",
            {"type": "string", "pattern": "^(" + "|".join(METHODS) + ") /"},
            required=True,
        ),
        Key("description", "for people", TEXT),
        Key("params", "constraints on the path's {parameters}", _CONSTRAINTS),
        Key("query", "constraints on query parameters (others are refused)", _CONSTRAINTS),
        Key("allow_extra_query", "let query parameters not listed pass", {"type": "boolean"}),
        Key("headers", "headers let through to the upstream, with constraints", _CONSTRAINTS),
        Key("tool", "MCP: the tool this rule allows (tools/call)", TEXT),
        Key("prompt", "MCP: the prompt this rule allows (prompts/get)", TEXT),
        Key(
            "resource",
            "MCP: the resources this rule allows (read, subscribe), a URI with {name} "
            "parameters, or {uri, params} to constrain them",
            {"anyOf": [TEXT, RESOURCE.schema()]},
        ),
        Key(
            "method",
            "MCP: a JSON-RPC method this rule allows: logging/setLevel, or the agent's "
            "answers to the server's roots/list, sampling/createMessage, elicitation/create",
            {"enum": list(MCP_METHODS)},
        ),
        Key(
            "approval",
            "required: a person approves each call first",
            {"enum": ["required", "none"]},
        ),
        Key("rate", "the rule's rate per agent", RATE),
        Key("quota", "calls per run to this rule", {"type": "integer", "minimum": 1}),
        Key(
            "attempts",
            "the rule's attempts per agent, counted before its payload is checked (allowed or "
            "not): a rate, or none; SQL rules default to " + DEFAULT_SQL_ATTEMPTS,
            {"anyOf": [RATE, {"enum": ["none"]}]},
        ),
        Key(
            "volatile",
            "fields recordings match loosely: /json/pointer, query:name or body",
            {"type": "array", "items": TEXT},
        ),
        Key("replay", REPLAY.description, REPLAY.schema()),
        Key(
            "on_state_error",
            "when the state store is down: deny (default) or allow",
            {"enum": ["deny", "allow"]},
        ),
        Key(
            "trust",
            "untrusted: what this call returns can be written by third parties (web pages, mail, "
            "documents, chat); a run that makes it is tainted, and its sensitive calls then "
            "need approval. Default: trusted",
            {"enum": ["trusted", "untrusted"]},
        ),
        Key(
            "sensitive",
            "true: a side effect or a way out (sending mail or money, writing data, sharing, "
            "changing credentials, fetching any URL, messaging anyone); once the run is "
            "tainted by an untrusted read, each such call needs approval (or is refused)",
            {"type": "boolean"},
        ),
        Key(
            "evict_after",
            "throttle, then evict: when this rule's rate or quota has refused a run this many "
            "times (1: the first time it is exhausted), the run is stopped (revoked), as by an "
            "operator's stop",
            {"type": "integer", "minimum": 1, "maximum": 1000000},
        ),
        Key(
            "when_tainted",
            "a sensitive call of a tainted run: approve (held for a person, default) or deny",
            {"enum": ["approve", "deny"]},
        ),
        Key(
            "taint_arguments",
            "the tool's arguments that decide where data or money goes or what changes: a "
            "sensitive call of a tainted run is then held (or refused) only when one of their "
            "values appears in the untrusted content the run read (literal provenance, after "
            "normalising case, spacing, punctuation, URL forms and encodings), or is too short "
            "to tell; without it, every such call is",
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "uniqueItems": True,
            },
        ),
    ),
)
ROLE = Section(
    "role",
    "What an agent holding this role may do.",
    (
        Key("rules", "the calls the role allows", {"type": "array", "items": {}}, required=True),
        Key("description", "for people", TEXT),
        Key("rate", "one rate for all the role's rules, per agent", RATE),
        Key("quota", "calls per run under this role", {"type": "integer", "minimum": 1}),
    ),
)
AGENT = Section(
    "agent",
    "An agent (or a fleet, by pattern) and the roles it may hold.",
    (
        Key(
            "roles",
            "the roles its tokens may carry",
            {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            required=True,
        ),
        Key("description", "for people", TEXT),
    ),
)
DOCUMENT = Section(
    "policy",
    "A capgate policy: upstreams, and roles of rules. Anything not allowed is denied.",
    (
        Key("version", "the format's version", {"const": 1}, required=True),
        Key("upstreams", "by name", {"type": "object"}, required=True),
        Key("roles", "by name", {"type": "object"}, required=True),
        Key(
            "agents",
            "the agents that may call, by name or pattern ('ci-*'), each with the roles it "
            "may hold; or the name of a file (relative to this one) holding that mapping",
            {"type": ["object", "string"]},
            required=True,
        ),
        Key("description", "for people", TEXT),
    ),
)


def policy_schema() -> JSON:
    """A JSON Schema (Draft 2020-12) of the policy file, from the tables above and each
    payload check's own schema."""
    checks = {key: {**entry.schema} for key, entry in PAYLOAD_CHECKS.items()}
    rule = RULE.schema(checks)
    role = ROLE.schema()
    role["properties"]["rules"] = {
        **role["properties"]["rules"],
        "items": rule,
    }
    doc = DOCUMENT.schema()
    doc["properties"]["upstreams"] = {
        **doc["properties"]["upstreams"],
        "minProperties": 1,
        "propertyNames": {"pattern": f"^{UPSTREAM_NAME.pattern}$"},
        "additionalProperties": UPSTREAM.schema(),
    }
    doc["properties"]["roles"] = {
        **doc["properties"]["roles"],
        "propertyNames": {"pattern": f"^{ROLE_NAME}$"},
        "additionalProperties": role,
    }
    agent = AGENT.schema()
    doc["properties"]["agents"] = {
        **doc["properties"]["agents"],
        "additionalProperties": {"anyOf": [agent["properties"]["roles"], agent]},
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://capgate.dev/schemas/policy-v1.json",
        "title": "capgate policy",
        **doc,
    }
