"""The typed, compiled policy: upstreams, roles, rules, and the matcher.

A ``Policy`` is built once by ``policy.load`` and never changed; a reload builds a new one
and swaps it in whole. Everything the hot path needs is precomputed here: rules are indexed
by (role, upstream, method), path patterns are split into segments, regexes compiled.

Matching is default deny. ``Policy.match`` either returns the one rule that allows the call
or raises the ``GatewayError`` that says why not (``no_rule``, ``query_invalid``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from yarl import URL

from gateway.errors import GatewayError, McpDenied, NoRule, QueryInvalid, ToolDenied
from gateway.policy.agents import AgentDirectory
from gateway.target import Target

if TYPE_CHECKING:
    from gateway.payload import PayloadCheck

MCP_PATIENCE = 25.0  # seconds a held MCP tools/call waits before approval_pending
MCP_KEEPALIVE = 15.0  # seconds between the progress notifications of a held MCP tools/call
MCP_KEEPALIVE_MIN = 0.1  # ... at the least (the policy cannot make the gateway flood a client)


@dataclass(frozen=True, slots=True)
class Credentials:
    """How the gateway authenticates to an upstream; ``secret`` is a reference, not a value."""

    type: str = "none"  # none | bearer | header | agent-jwt
    secret: str | None = None  # env:NAME or file:PATH, may contain {agent}
    header: str = "Authorization"
    prefix: str = ""  # e.g. "Bearer " for type bearer
    audience: str | None = None  # agent-jwt
    ttl: float = 300.0  # agent-jwt lifetime, seconds


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    url: URL
    kind: str = "http"  # http | mcp
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    total_timeout: float = 60.0  # the whole exchange, however the answer trickles
    max_request_body: int = 1024 * 1024
    max_response_body: int = 16 * 1024 * 1024
    credentials: Credentials = field(default_factory=Credentials)
    concurrency: int = 64  # calls in flight to it at once, all agents
    per_agent: int = 16  # ... and from one agent
    mcp_batches: bool = False  # MCP: the server takes JSON-RPC batches
    mcp_tool_refusals: str = "error"  # MCP: a refused tools/call is a JSON-RPC error | result
    # MCP: how long a held tools/call waits before it is answered approval_pending
    mcp_approval_patience: float = MCP_PATIENCE
    # MCP: the interval of the progress notifications that keep a held tools/call alive on an
    # event stream (when its client accepts one and sent a progress token); None: none sent
    mcp_approval_keepalive: float | None = MCP_KEEPALIVE
    untrusted: bool = False  # trust: untrusted: what it returns was written by third parties

    @property
    def base_path(self) -> str:
        """The upstream URL's path without its trailing slash ("" for the root)."""
        return self.url.raw_path.rstrip("/")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What one query parameter, path parameter or header value may be."""

    name: str
    required: bool = False
    enum: frozenset[str] | None = None
    regex: re.Pattern[str] | None = None
    integer: bool = False
    minimum: int | None = None
    maximum: int | None = None
    max_length: int = 1024
    repeat: bool = False

    def violation(self, value: str) -> str | None:
        """Why ``value`` is not allowed, or None when it is."""
        if len(value) > self.max_length:
            return f"is longer than {self.max_length} characters"
        if self.enum is not None and value not in self.enum:
            return f"must be one of {sorted(self.enum)}"
        if self.integer:
            # Only plain decimal digits with an optional minus: no '+', spaces, '_' or '0x'.
            if not _INTEGER.fullmatch(value):
                return "must be an integer"
            number = int(value)
            if self.minimum is not None and number < self.minimum:
                return f"must be at least {self.minimum}"
            if self.maximum is not None and number > self.maximum:
                return f"must be at most {self.maximum}"
        if self.regex is not None and not self.regex.fullmatch(value):
            return f"must match {self.regex.pattern!r}"
        return None


VOLATILE_ENTRY = re.compile(r"/.*|query:[^=&]{1,256}|body")
"""The valid forms of a rule's ``volatile`` entry (fields recordings match loosely)."""


def volatile_problem(entry: str) -> str | None:
    """Why a ``volatile`` entry is not valid, or None."""
    if VOLATILE_ENTRY.fullmatch(entry):
        return None
    return f"volatile entry {entry!r} must be a JSON pointer ('/field'), 'query:<name>' or 'body'"


_INTEGER = re.compile(r"-?(0|[1-9][0-9]{0,17})")
_NO_PARAMS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PathPattern:
    """``/metrics/{name}``: literal segments and named single-segment parameters."""

    text: str
    segments: tuple[str | Constraint, ...]  # str: literal (canonical form), Constraint: param
    literal: bool = False  # no parameters: matched by one tuple comparison

    def __post_init__(self) -> None:
        object.__setattr__(self, "literal", all(isinstance(s, str) for s in self.segments))

    def match(self, segments: tuple[str, ...]) -> Mapping[str, str] | None | str:
        """Params when the path matches; None when it does not; a str reason when a param
        value breaks its constraint."""
        if len(segments) != len(self.segments):
            return None
        if self.literal:
            return _NO_PARAMS if segments == self.segments else None
        params: dict[str, str] = {}
        bad: str | None = None
        for want, got in zip(self.segments, segments, strict=True):
            if isinstance(want, str):
                if want != got:
                    return None
            else:
                if got == "":
                    # "/items/" is not "/items/{id}" with an empty id: it is another resource
                    # (often the listing), so a parameter never matches an empty segment.
                    return None
                problem = want.violation(got)
                if problem is not None and bad is None:
                    bad = f"path parameter {want.name!r} {problem}"
                params[want.name] = got
        return bad if bad is not None else params


# A URI pattern's {parameter} matches one piece of a URI: no separator, no escape, no dot
# segment, so a server that decodes or normalises the URI cannot be led outside the pattern.
_URI_PARAM_VALUE = re.compile(r"[^/?#%\\\x00-\x20\x7f]+")


@dataclass(frozen=True, slots=True)
class UriPattern:
    """``test://template/{id}/data``: literal text and named parameters (MCP resources)."""

    text: str
    parts: tuple[str | Constraint, ...]  # str: literal text, Constraint: a parameter

    def match(self, uri: str) -> Mapping[str, str] | None | str:
        """Params when ``uri`` matches; None when not; a str reason when a value breaks its
        constraint (like ``PathPattern.match``)."""
        params: dict[str, str] = {}
        pos = 0
        parts = self.parts
        for i, part in enumerate(parts):
            if isinstance(part, str):
                if not uri.startswith(part, pos):
                    return None
                pos += len(part)
                continue
            following = parts[i + 1] if i + 1 < len(parts) else None
            m = _URI_PARAM_VALUE.match(uri, pos)
            if m is None:
                return None
            end = m.end()
            if isinstance(following, str):
                # The value ends where the next literal text starts (the first such place).
                cut = uri.find(following, pos, end + len(following))
                if cut <= pos:
                    return None
                end = cut
            value = uri[pos:end]
            if value in (".", ".."):
                return None
            problem = part.violation(value)
            if problem is not None:
                return f"resource parameter {part.name!r} {problem}"
            params[part.name] = value
            pos = end
        return params if pos == len(uri) else None


# MCP: what a rule on an MCP upstream allows, besides the protocol's own messages.
MCP_SUBJECTS = ("tool", "prompt", "resource", "method")


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    role: str
    upstream: str
    method: str
    path: PathPattern
    query: Mapping[str, Constraint] = field(default_factory=dict)
    allow_extra_query: bool = False
    headers: Mapping[str, Constraint] = field(default_factory=dict)  # lower-case names
    checks: tuple[PayloadCheck, ...] = ()
    tool: str | None = None  # MCP: the tool this rule allows
    prompt: str | None = None  # MCP: the prompt this rule allows
    resource: UriPattern | None = None  # MCP: the resources (URIs) this rule allows
    mcp_method: str | None = None  # MCP: a JSON-RPC method this rule allows (MCP_METHODS)
    approval: bool = False
    rate: Any = None  # limits.Rate
    quota: int | None = None  # calls per run for this rule
    attempts: Any = None  # limits.Rate: attempts per agent, counted before Validate
    volatile: tuple[str, ...] = ()  # fields that do not count when matching recordings
    replay_repeat_last: bool = False  # replay: answer repeats with the last recording
    on_state_error: str = "deny"  # deny | allow
    untrusted: bool = False  # trust: untrusted: this call returns third parties' content
    sensitive: bool = False  # sensitive: true: a side effect or a way out of the sandbox
    when_tainted: str = "approve"  # a sensitive call of a tainted run: approve | deny
    # the arguments a tainted run's call is held for only when their values appear in the
    # untrusted content the run read (gateway/taint_reads.py); () holds every call
    taint_arguments: tuple[str, ...] = ()
    evict_after: int | None = None  # stop the run at this many rate/quota refusals of it
    line: int = 0  # where the rule starts in the policy file

    def describe(self) -> str:
        return f"{self.method} {self.path.text}"

    def selects(self, subject: Subject) -> Mapping[str, str] | None | str:
        """Whether this rule allows an MCP subject: params (empty but for resources) when it
        does, None when it names another, a str reason when a resource parameter is off."""
        kind, value = subject
        if kind == "tool":
            return _NO_PARAMS if self.tool == value else None
        if kind == "prompt":
            return _NO_PARAMS if self.prompt == value else None
        if kind == "method":
            return _NO_PARAMS if self.mcp_method == value else None
        if kind == "resource" and self.resource is not None:
            return self.resource.match(value)
        if kind == "resource-ref" and self.resource is not None:
            # completion/complete names a resource by URI or by the template itself.
            if self.resource.text == value:
                return _NO_PARAMS
            return self.resource.match(value)
        return None


@dataclass(frozen=True, slots=True)
class Role:
    name: str
    rules: tuple[Rule, ...]
    rate: Any = None
    run_quota: int | None = None


Subject = tuple[str, str]
"""What an MCP message acts on: ("tool", name), ("prompt", name), ("resource", uri),
("resource-ref", uri or template), ("method", json-rpc method)."""


@dataclass(frozen=True, slots=True)
class Match:
    rule: Rule
    params: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Candidates:
    """A token's rules for one upstream and method, in file order, indexed by path shape:
    only the rules whose pattern can match a path's segments are tried on it."""

    rules: tuple[Rule, ...]
    literal: Mapping[tuple[str, ...], tuple[Rule, ...]]  # literal pattern -> its rules
    by_length: Mapping[int, tuple[Rule, ...]]  # patterns with parameters, by segment count
    order: Mapping[str, int]  # rule id -> position in ``rules``

    @classmethod
    def of(cls, rules: list[Rule]) -> Candidates:
        literal: dict[tuple[str, ...], list[Rule]] = {}
        by_length: dict[int, list[Rule]] = {}
        for rule in rules:
            segments = rule.path.segments
            if rule.path.literal:
                literal.setdefault(segments, []).append(rule)  # type: ignore[arg-type]
            else:
                by_length.setdefault(len(segments), []).append(rule)
        return cls(
            rules=tuple(rules),
            literal={k: tuple(v) for k, v in literal.items()},
            by_length={k: tuple(v) for k, v in by_length.items()},
            order={rule.id: i for i, rule in enumerate(rules)},
        )

    def for_path(self, segments: tuple[str, ...]) -> tuple[Rule, ...]:
        """The rules that may match ``segments``, in file order."""
        exact = self.literal.get(segments, ())
        shaped = self.by_length.get(len(segments), ())
        if not shaped:
            return exact
        if not exact:
            return shaped
        return tuple(sorted(exact + shaped, key=lambda r: self.order[r.id]))


@dataclass
class Policy:
    version: int
    source: str
    upstreams: dict[str, Upstream]
    roles: dict[str, Role]
    digest: str = ""
    agents: AgentDirectory = field(default_factory=AgentDirectory)
    files: tuple[str, ...] = ()  # the files it was read from (the policy, its agents file)
    # (role, upstream, method) -> rules in file order
    _index: dict[tuple[str, str, str], tuple[Rule, ...]] = field(default_factory=dict)
    rules_by_id: dict[str, Rule] = field(default_factory=dict)
    _candidates: dict[tuple[Any, ...], Candidates] = field(default_factory=dict, repr=False)
    # Some rule has taint_arguments: what tainted runs read is recorded (gateway/taint.py).
    records_reads: bool = False

    def __post_init__(self) -> None:
        index: dict[tuple[str, str, str], list[Rule]] = {}
        for role in self.roles.values():
            for rule in role.rules:
                index.setdefault((role.name, rule.upstream, rule.method), []).append(rule)
                self.rules_by_id[rule.id] = rule
                if rule.taint_arguments:
                    self.records_reads = True
        self._index = {k: tuple(v) for k, v in index.items()}

    def candidates(
        self, roles: Iterable[str], caps: frozenset[str] | None, upstream: str, method: str
    ) -> list[Rule]:
        """Rules the token's roles grant for this upstream and method, narrowed by caps.

        Memoised per policy (a reload builds a new ``Policy``, so the memo goes with it);
        bounded, since roles and caps come from tokens."""
        return list(self._indexed(roles, caps, upstream, method).rules)

    def _indexed(
        self, roles: Iterable[str], caps: frozenset[str] | None, upstream: str, method: str
    ) -> Candidates:
        key = (tuple(roles), caps, upstream, method)
        found = self._candidates.get(key)
        if found is None:
            found = Candidates.of(self._compute_candidates(key[0], caps, upstream, method))
            if len(self._candidates) >= 4096:
                self._candidates.clear()
            self._candidates[key] = found
        return found

    def _compute_candidates(
        self, roles: tuple[str, ...], caps: frozenset[str] | None, upstream: str, method: str
    ) -> list[Rule]:
        out: list[Rule] = []
        seen: set[str] = set()
        for role in roles:
            for rule in self._index.get((role, upstream, method), ()):
                if rule.id in seen:
                    continue
                if caps is not None and rule.id not in caps:
                    continue
                seen.add(rule.id)
                out.append(rule)
        return out

    def match(
        self,
        roles: Iterable[str],
        caps: frozenset[str] | None,
        target: Target,
        method: str,
        headers: Mapping[str, str],
        subject: Subject | None = None,
    ) -> Match:
        """The first rule that allows the call, or raise why none does.

        A rule that matches the path but not the query or headers is remembered, so the
        denial says what was wrong (``query_invalid``) instead of only ``no_rule``.
        """
        if target.upstream not in self.upstreams:
            raise NoRule(f"there is no upstream named {target.upstream!r}")
        near: QueryInvalid | None = None
        near_path: str | None = None
        candidates = self._indexed(roles, caps, target.upstream, method)
        for rule in candidates.for_path(target.segments):
            # An MCP message acting on something needs a rule naming it; a protocol message
            # (no subject) is allowed by any rule on the endpoint.
            if subject is not None:
                selected = rule.selects(subject)
                if selected is None:
                    continue
                if isinstance(selected, str):
                    near_path = near_path or f"rule {rule.id!r}: {selected}"
                    continue
            params = rule.path.match(target.segments)
            if params is None:
                continue
            if isinstance(params, str):
                near_path = near_path or f"rule {rule.id!r}: {params}"
                continue
            problem = _query_violation(rule, target.query_pairs) or _header_violation(rule, headers)
            if problem is not None:
                near = near or QueryInvalid(problem, rule=rule.id)
                continue
            return Match(rule, params)
        if near is not None:
            raise near
        if subject is not None:
            raise _subject_denied(subject, near_path)
        detail = f"no rule of the token's roles allows {method} /{target.upstream}{target.rest}"
        if near_path is not None:
            detail += f" ({near_path})"
        raise NoRule(detail)


def _subject_denied(subject: Subject, near: str | None) -> GatewayError:
    kind, value = subject
    shown = value if len(value) <= 200 else value[:197] + "..."
    if kind == "tool":
        return ToolDenied(f"no rule of the token's roles allows the tool {shown!r}")
    what = {
        "prompt": "the prompt",
        "resource": "the resource",
        "resource-ref": "completions for the resource",
        "method": "the MCP method",
    }.get(kind, kind)
    detail = f"no rule of the token's roles allows {what} {shown!r}"
    return McpDenied(detail + (f" ({near})" if near else ""))


def _query_violation(rule: Rule, pairs: tuple[tuple[str, str], ...]) -> str | None:
    seen: dict[str, int] = {}
    for name, value in pairs:
        constraint = rule.query.get(name)
        if constraint is None:
            if not rule.allow_extra_query:
                return f"query parameter {name!r} is not allowed by rule {rule.id!r}"
            continue
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1 and not constraint.repeat:
            return f"query parameter {name!r} is repeated"
        problem = constraint.violation(value)
        if problem is not None:
            return f"query parameter {name!r} {problem}"
    for name, constraint in rule.query.items():
        if constraint.required and name not in seen:
            return f"query parameter {name!r} is required"
    return None


def _header_violation(rule: Rule, headers: Mapping[str, str]) -> str | None:
    for name, constraint in rule.headers.items():
        if hasattr(headers, "getall"):
            values = headers.getall(name, [])
        else:
            # A plain mapping: header names are case-insensitive, so a value under "X-Env"
            # must meet the constraint on "x-env" rather than be skipped.
            values = [v for k, v in headers.items() if k.lower() == name]
        if not values:
            if constraint.required:
                return f"header {name!r} is required"
            continue
        if len(values) > 1 and not constraint.repeat:
            return f"header {name!r} is repeated"
        for value in values:
            problem = constraint.violation(value)
            if problem is not None:
                return f"header {name!r} {problem}"
    return None
