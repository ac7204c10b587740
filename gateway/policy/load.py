"""Policy YAML -> ``Policy``, with ``FILE:LINE:COL: message`` for every error.

The whole file is checked in one pass; a file with any error raises ``PolicyError`` listing
all of them and never produces a partial policy. The format is documented in README.md and
by example in ``policies/example.yaml``.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, NamedTuple

from yarl import URL

from gateway.checks import PAYLOAD_CHECKS, CheckContext, PayloadCheck
from gateway.policy import spec
from gateway.policy.agents import AgentDirectory, AgentsRead, read_agents
from gateway.policy.model import (
    MCP_KEEPALIVE,
    MCP_KEEPALIVE_MIN,
    MCP_PATIENCE,
    MCP_SUBJECTS,
    Constraint,
    Credentials,
    PathPattern,
    Policy,
    Role,
    Rule,
    Upstream,
    UriPattern,
    volatile_problem,
)
from gateway.policy.spec import MCP_METHODS, METHODS
from gateway.policy_file import Node, PolicyError, read_document, read_text
from gateway.target import UPSTREAM_NAME

SUPPORTED_VERSIONS = (1,)
DEFAULT_CONCURRENCY = 64

NAME = re.compile(spec.ROLE_NAME)
RULE_ID = re.compile(spec.RULE_ID)
PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]{0,63})\}")
# A literal path segment in a pattern: pchar without '%' escapes, ';' or a lone dot segment.
LITERAL_SEGMENT = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,=:@]+")
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
SECRET_REF = re.compile(r"(env:[A-Za-z_][A-Za-z0-9_{}]*|file:.+)")
# Headers a rule may not name: the gateway owns them (credentials, hop-by-hop, routing).
RESERVED_HEADERS = frozenset(
    {
        "authorization",
        "cookie",
        "host",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "forwarded",
    }
)


def load_policy(path: str | Path, text: str | None = None) -> Policy:
    """Load and compile a policy file; raise ``PolicyError`` with every problem found."""
    raw_text = text if text is not None else read_text(path)
    root = read_document(path, raw_text)
    doc = root.as_map(required=spec.DOCUMENT.required, optional=spec.DOCUMENT.optional)
    if doc is None:
        raise PolicyError(root.issues)
    if "version" in doc:
        version = doc["version"].as_int()
        if version is not None and version not in SUPPORTED_VERSIONS:
            doc["version"].fail(f"version: unsupported version {version}; expected 1")
    upstreams: dict[str, Upstream] = {}
    if "upstreams" in doc:
        for key, node in doc["upstreams"].entries():
            up = _upstream(key, node)
            if up is not None:
                upstreams[up.name] = up
        if isinstance(doc["upstreams"].value, dict) and not doc["upstreams"].value:
            doc["upstreams"].fail("upstreams: at least one upstream is required")
    roles: dict[str, Role] = {}
    rule_ids: dict[str, Node] = {}
    # Names written under `upstreams`, valid or not: a rule naming an upstream that has its
    # own errors is not reported again as naming an unknown upstream.
    written = doc["upstreams"].value if "upstreams" in doc else None
    declared = (
        frozenset(k for k in written if isinstance(k, str))
        if isinstance(written, dict)
        else frozenset()
    )
    if "roles" in doc:
        for key, node in doc["roles"].entries():
            role = _role(key, node, upstreams, rule_ids, declared)
            if role is not None:
                roles[role.name] = role
    agents = AgentsRead(AgentDirectory())
    if "agents" in doc:
        written_roles = doc["roles"].value if "roles" in doc else None
        role_names = (
            frozenset(k for k in written_roles if isinstance(k, str))
            if isinstance(written_roles, dict)
            else frozenset()
        )
        agents = read_agents(doc["agents"], str(path), role_names)
    if root.issues:
        raise PolicyError(root.issues)
    digest = hashlib.sha256(f"{raw_text}\0{agents.content}".encode()).hexdigest()[:16]
    return Policy(
        version=1,
        source=str(path),
        upstreams=upstreams,
        roles=roles,
        digest=digest,
        agents=agents.directory,
        files=(str(path),) + ((agents.file,) if agents.file else ()),
    )


def _upstream(key: Node, node: Node) -> Upstream | None:
    name = key.value
    if not UPSTREAM_NAME.fullmatch(name):
        key.fail(f"upstream name {name!r} must be lower-case letters, digits, '-' or '_'")
    m = node.as_map(required=spec.UPSTREAM.required, optional=spec.UPSTREAM.optional)
    if m is None:
        return None
    url: URL | None = None
    if "url" in m:
        text = m["url"].as_str()
        if text is not None:
            try:
                url = URL(text)
            except (ValueError, TypeError):
                url = None
            if (
                url is None
                or url.scheme not in ("http", "https")
                or not url.host
                or url.query_string
                or url.fragment
                or url.user
            ):
                m["url"].fail(
                    f"upstreams.{name}.url: expected an http(s) URL without query, "
                    f"fragment or credentials, got {text if '@' not in text else '<redacted>'!r}"
                )
                url = None
    kind = m["kind"].as_choice(("http", "mcp")) if "kind" in m else "http"
    connect, read, total = 5.0, 30.0, 60.0
    if "timeouts" in m:
        t = m["timeouts"].as_map(optional=spec.TIMEOUTS.optional)
        if t:
            connect = _positive(t, "connect", connect, "as_duration")
            read = _positive(t, "read", read, "as_duration")
            total = _positive(t, "total", total, "as_duration")
    req_limit, resp_limit = 1024 * 1024, 16 * 1024 * 1024
    concurrency, per_agent = DEFAULT_CONCURRENCY, None
    if "limits" in m:
        lim = m["limits"].as_map(optional=spec.LIMITS.optional)
        if lim:
            req_limit = _positive(lim, "request_body", req_limit, "as_size")
            resp_limit = _positive(lim, "response_body", resp_limit, "as_size")
            if "concurrency" in lim:
                concurrency = lim["concurrency"].as_int(minimum=1, maximum=4096) or concurrency
            if "per_agent" in lim:
                per_agent = lim["per_agent"].as_int(minimum=1, maximum=concurrency)
    creds = _credentials(name, m["credentials"]) if "credentials" in m else Credentials()
    mcp = _mcp_options(name, kind, m["mcp"]) if "mcp" in m else McpOptions()
    untrusted = _untrusted(m)
    if url is None or kind is None or creds is None:
        return None
    return Upstream(
        name=name,
        url=url,
        kind=kind,
        connect_timeout=connect,
        read_timeout=read,
        total_timeout=total,
        max_request_body=req_limit,
        concurrency=concurrency,
        per_agent=per_agent or max(1, concurrency // 4),
        max_response_body=resp_limit,
        credentials=creds,
        mcp_batches=mcp.batches,
        mcp_tool_refusals=mcp.tool_refusals,
        mcp_approval_patience=mcp.patience,
        mcp_approval_keepalive=mcp.keepalive,
        untrusted=untrusted,
    )


def _untrusted(m: dict[str, Node]) -> bool:
    """``trust: untrusted`` (an upstream's or a rule's)."""
    return "trust" in m and m["trust"].as_choice(("trusted", "untrusted")) == "untrusted"


class _Exposure(NamedTuple):
    """How a rule stands to prompt injection: it reads untrusted content, or it acts."""

    untrusted: bool
    sensitive: bool
    when_tainted: str
    evict_after: int | None
    taint_arguments: tuple[str, ...] = ()


def _rule_exposure(m: dict[str, Node]) -> _Exposure:
    """``trust``, ``sensitive``, ``when_tainted``; when_tainted only beside sensitive: true."""
    sensitive = bool(m["sensitive"].as_bool()) if "sensitive" in m else False
    when = "approve"
    if "when_tainted" in m:
        when = m["when_tainted"].as_choice(("approve", "deny")) or "approve"
        if not sensitive:
            m["when_tainted"].fail(
                f"{m['when_tainted'].where}: when_tainted applies to sensitive rules only "
                "(add 'sensitive: true')"
            )
    evict = None
    if "evict_after" in m:
        evict = m["evict_after"].as_int(minimum=1, maximum=1_000_000)
        if "rate" not in m and "quota" not in m:
            m["evict_after"].fail(
                f"{m['evict_after'].where}: evict_after needs the rule's own rate or quota"
            )
    return _Exposure(_untrusted(m), sensitive, when, evict, _taint_arguments(m, sensitive))


def _taint_arguments(m: dict[str, Node], sensitive: bool) -> tuple[str, ...]:
    """``taint_arguments``: tool argument names, beside ``sensitive: true`` and ``tool:``."""
    if "taint_arguments" not in m:
        return ()
    node = m["taint_arguments"]
    names = node.as_str_list()
    if names is None:
        return ()
    if not sensitive or "tool" not in m:
        node.fail(
            f"{node.where}: taint_arguments applies to sensitive rules of an MCP tool only "
            "(add 'sensitive: true' and 'tool:')"
        )
    if not names or any(not n for n in names) or len(set(names)) != len(names):
        node.fail(f"{node.where}: expected a list of distinct argument names, at least one")
    return tuple(names)


class McpOptions(NamedTuple):
    """An MCP upstream's ``mcp: {batches, tool_refusals, approval_patience,
    approval_keepalive}``."""

    batches: bool = False
    tool_refusals: str = "error"
    patience: float = MCP_PATIENCE
    keepalive: float | None = MCP_KEEPALIVE


def _mcp_options(name: str, kind: str | None, node: Node) -> McpOptions:
    if kind != "mcp":
        node.fail(f"upstreams.{name}.mcp: only for an upstream of kind mcp")
    opts = node.as_map(optional=spec.MCP_OPTIONS.optional)
    if not opts:
        return McpOptions()
    batches = bool(opts["batches"].as_bool()) if "batches" in opts else False
    tool_refusals = "error"
    if "tool_refusals" in opts:
        tool_refusals = opts["tool_refusals"].as_choice(("error", "result")) or "error"
    patience = _positive(opts, "approval_patience", MCP_PATIENCE, "as_duration")
    return McpOptions(batches, tool_refusals, patience, _keepalive(opts))


def _keepalive(opts: dict[str, Node]) -> float | None:
    """``approval_keepalive``: a duration of at least ``MCP_KEEPALIVE_MIN``, or none."""
    node = opts.get("approval_keepalive")
    if node is None:
        return MCP_KEEPALIVE
    if node.value == "none":
        return None
    every = node.as_duration()
    if every is None:
        return MCP_KEEPALIVE
    if every < MCP_KEEPALIVE_MIN:
        node.fail(f"{node.where}: must be at least {MCP_KEEPALIVE_MIN * 1000:g}ms (or none)")
        return MCP_KEEPALIVE
    return every


def _positive(m: dict[str, Node], key: str, default: Any, how: str) -> Any:
    """A duration or size that must be above zero; ``default`` when absent or invalid."""
    if key not in m:
        return default
    value = getattr(m[key], how)()
    if value is None:
        return default
    if value <= 0:
        m[key].fail(f"{m[key].where}: must be greater than zero")
        return default
    return value


def _credentials(upstream: str, node: Node) -> Credentials | None:
    m = node.as_map(required=spec.CREDENTIALS.required, optional=spec.CREDENTIALS.optional)
    if m is None or "type" not in m:
        return None
    kind = m["type"].as_choice(("none", "bearer", "header", "agent-jwt"))
    if kind is None:
        return None
    secret = None
    if kind in ("bearer", "header"):
        if "secret" not in m:
            node.fail(f"upstreams.{upstream}.credentials: type {kind} needs a 'secret'")
            return None
        secret = m["secret"].as_str(pattern=SECRET_REF, what="a reference env:NAME or file:PATH")
        if secret is None:
            return None
    elif "secret" in m:
        m["secret"].fail(f"upstreams.{upstream}.credentials: type {kind} takes no 'secret'")
    header, prefix = "Authorization", "Bearer " if kind in ("bearer", "agent-jwt") else ""
    if kind == "header":
        if "header" not in m:
            node.fail(f"upstreams.{upstream}.credentials: type header needs a 'header' name")
            return None
        header = m["header"].as_str(pattern=HEADER_NAME, what="a header name") or header
        if header.lower() in RESERVED_HEADERS - {"authorization"}:
            m["header"].fail(f"header {header!r} cannot carry a credential")
        prefix = m["prefix"].as_str() or "" if "prefix" in m else ""
    audience = None
    ttl = 300.0
    if kind == "agent-jwt":
        audience = m["audience"].as_str() if "audience" in m else upstream
        if "ttl" in m:
            ttl = m["ttl"].as_duration() or ttl
            if not 10 <= ttl <= 3600:
                m["ttl"].fail("ttl: an agent-jwt lifetime must be between 10s and 1h")
    return Credentials(
        type=kind, secret=secret, header=header, prefix=prefix, audience=audience, ttl=ttl
    )


def _role(
    key: Node,
    node: Node,
    upstreams: dict[str, Upstream],
    ids: dict[str, Node],
    declared: frozenset[str] = frozenset(),
) -> Role | None:
    name = key.value
    if not NAME.fullmatch(name):
        key.fail(f"role name {name!r} must be letters, digits, '.', '-' or '_'")
    m = node.as_map(required=spec.ROLE.required, optional=spec.ROLE.optional)
    if m is None:
        return None
    rate = _rate(m["rate"]) if "rate" in m else None
    run_quota = m["quota"].as_int(minimum=1) if "quota" in m else None
    rules: list[Rule] = []
    if "rules" in m:
        items = m["rules"].as_list()
        for item in items or ():
            rule = _rule(name, item, upstreams, ids, declared)
            if rule is not None:
                rules.append(rule)
    return Role(name=name, rules=tuple(rules), rate=rate, run_quota=run_quota)


def _rate(node: Node) -> Any:
    from gateway.rates import parse_rate

    text = node.as_str(what="a rate such as 60/minute")
    if text is None:
        return None
    try:
        return parse_rate(text)
    except ValueError as exc:
        node.fail(f"{node.where}: {exc}")
        return None


class _Behaviour(NamedTuple):
    """The keys of a rule that say how an allowed call is handled (not what it matches)."""

    approval: bool
    rate: Any
    quota: int | None
    attempts: Any
    volatile: tuple[str, ...]
    repeat_last: bool
    on_state_error: str | None


def _rule(
    role: str,
    node: Node,
    upstreams: dict[str, Upstream],
    ids: dict[str, Node],
    declared: frozenset[str] = frozenset(),
) -> Rule | None:
    m = node.as_map(
        required=spec.RULE.required, optional=spec.RULE.optional + tuple(PAYLOAD_CHECKS)
    )
    if m is None:
        return None
    # The keys are read in this order so that errors are reported in it.
    rule_id = _rule_id(m, ids)
    upstream = _rule_upstream(m, upstreams, declared)
    method, pattern = _rule_allow(m)
    query = _constraints(m["query"]) if "query" in m else {}
    extra = m["allow_extra_query"].as_bool() if "allow_extra_query" in m else False
    headers = _header_constraints(m["headers"]) if "headers" in m else {}
    mcp = _mcp_subject(m, upstream, upstreams)
    how = _rule_behaviour(m)
    exposure = _rule_exposure(m)
    if mcp.method == "elicitation/create" and "approval" not in m:
        m["method"].fail(
            f"{m['method'].where}: answers to elicitation/create put words in the agent's "
            "mouth that a person should see: say 'approval: required' (or, knowingly, "
            "'approval: none')"
        )
    context = CheckContext(
        rule_id=rule_id,
        tool=mcp.tool,
        upstream_kind=upstreams[upstream].kind if upstream else None,
        prompt=mcp.prompt,
    )
    checks = _payload_checks(m, context)
    if rule_id is None or upstream is None or method is None or pattern is None:
        return None
    return Rule(
        id=rule_id,
        role=role,
        upstream=upstream,
        method=method,
        path=pattern,
        query=query,
        allow_extra_query=bool(extra),
        headers=headers,
        checks=checks,
        tool=mcp.tool,
        prompt=mcp.prompt,
        resource=mcp.resource,
        mcp_method=mcp.method,
        approval=how.approval,
        rate=how.rate,
        quota=how.quota,
        attempts=_attempts(m, how.attempts, checks),
        volatile=how.volatile,
        replay_repeat_last=how.repeat_last,
        on_state_error=how.on_state_error or "deny",
        untrusted=exposure.untrusted,
        sensitive=exposure.sensitive,
        when_tainted=exposure.when_tainted,
        taint_arguments=exposure.taint_arguments,
        evict_after=exposure.evict_after,
        line=node.line,
    )


def _rule_id(m: dict[str, Node], ids: dict[str, Node]) -> str | None:
    """The rule's ``id``, registered in ``ids`` (a second rule with the same id is an error)."""
    rule_id = m["id"].as_str(pattern=RULE_ID, what="a rule id") if "id" in m else None
    if rule_id is not None:
        if rule_id in ids:
            first = ids[rule_id]
            m["id"].fail(f"duplicate rule id {rule_id!r} (first defined at line {first.line})")
        else:
            ids[rule_id] = m["id"]
    return rule_id


def _rule_upstream(
    m: dict[str, Node], upstreams: dict[str, Upstream], declared: frozenset[str]
) -> str | None:
    """The rule's ``upstream`` if it is a valid one (an unknown name is an error)."""
    upstream = m["upstream"].as_str() if "upstream" in m else None
    if upstream is not None and upstream not in upstreams:
        if upstream not in declared:
            m["upstream"].fail(
                f"unknown upstream {upstream!r}; defined upstreams: "
                f"{sorted(declared | set(upstreams))}"
            )
        upstream = None
    return upstream


def _rule_allow(m: dict[str, Node]) -> tuple[str | None, PathPattern | None]:
    """Method and path pattern of ``allow``, its parameters constrained by ``params``."""
    params = _constraints(m["params"]) if "params" in m else {}
    if "allow" in m:
        return _allow(m["allow"], params)
    return None, None


def _constraints(node: Node) -> dict[str, Constraint]:
    """``params`` or ``query``: a constraint for each name."""
    out: dict[str, Constraint] = {}
    for k, v in node.entries():
        c = _constraint(k.value, v)
        if c is not None:
            out[k.value] = c
    return out


def _header_constraints(node: Node) -> dict[str, Constraint]:
    """``headers``: a constraint for each (lower-cased) header a rule may let through."""
    out: dict[str, Constraint] = {}
    for k, v in node.entries():
        if not HEADER_NAME.fullmatch(k.value):
            k.fail(f"{k.value!r} is not a header name")
            continue
        if k.value.lower() in RESERVED_HEADERS or k.value.lower().startswith("proxy-"):
            k.fail(f"header {k.value!r} is managed by the gateway and cannot be allowed")
            continue
        c = _constraint(k.value.lower(), v)
        if c is not None:
            out[k.value.lower()] = c
    return out


class _McpSubject(NamedTuple):
    """What an MCP rule allows: at most one of a tool, a prompt, resources or a method."""

    tool: str | None = None
    prompt: str | None = None
    resource: UriPattern | None = None
    method: str | None = None


def _mcp_subject(
    m: dict[str, Node], upstream: str | None, upstreams: dict[str, Upstream]
) -> _McpSubject:
    """``tool``, ``prompt``, ``resource`` or ``method``: only on an MCP upstream, one only."""
    named = [key for key in MCP_SUBJECTS if key in m]
    if not named:
        return _McpSubject()
    key = named[0]
    if upstream is not None and upstreams[upstream].kind != "mcp":
        m[key].fail(
            f"'{key}' needs an upstream of kind mcp; {upstream!r} is {upstreams[upstream].kind}"
        )
    for extra in named[1:]:
        m[extra].fail(
            f"{m[extra].where}: a rule names one of tool, prompt, resource or method "
            f"(this one names {key!r} already)"
        )
    if key == "resource":
        return _McpSubject(resource=_uri_pattern(m["resource"]))
    if key == "method":
        return _McpSubject(method=m["method"].as_choice(MCP_METHODS))
    text = m[key].as_str(what=f"a {key} name")
    if text is not None and not text:
        m[key].fail(f"{m[key].where}: the {key} name is empty")
    return _McpSubject(tool=text) if key == "tool" else _McpSubject(prompt=text)


def _uri_pattern(node: Node) -> UriPattern | None:
    """``resource: "test://docs/{name}"``, or ``{uri: ..., params: {name: {...}}}``."""
    params: dict[str, Constraint] = {}
    if isinstance(node.value, dict):
        m = node.as_map(required=spec.RESOURCE.required, optional=spec.RESOURCE.optional)
        if m is None or "uri" not in m:
            return None
        params = _constraints(m["params"]) if "params" in m else {}
        node = m["uri"]
    text = node.as_str(what="a resource URI pattern")
    if text is None:
        return None
    parts: list[str | Constraint] = []
    names: set[str] = set()
    pos = 0
    for found in PARAM.finditer(text):
        literal = text[pos : found.start()]
        if literal:
            parts.append(literal)
        elif parts:
            node.fail(f"{node.where}: two parameters must be apart by some literal text")
            return None
        name = found.group(1)
        if name in names:
            node.fail(f"{node.where}: parameter {name!r} appears twice in {text!r}")
            return None
        names.add(name)
        parts.append(params.get(name, Constraint(name=name)))
        pos = found.end()
    if text[pos:]:
        parts.append(text[pos:])
    if (
        not parts
        or not isinstance(parts[0], str)
        or "{" in "".join(p for p in parts if isinstance(p, str))
    ):
        node.fail(
            f"{node.where}: a resource pattern is a URI that starts with literal text, with "
            f"{{name}} parameters; got {text!r}"
        )
        return None
    for name in params:
        if name not in names:
            node.fail(f"{node.where}: params: {name!r} is not a parameter of {text!r}")
    return UriPattern(text=text, parts=tuple(parts))


def _rule_behaviour(m: dict[str, Node]) -> _Behaviour:
    """``approval``, ``rate``, ``quota``, ``volatile``, ``replay``, ``on_state_error``."""
    approval = False
    if "approval" in m:
        approval = m["approval"].as_choice(("required", "none")) == "required"
    rate = _rate(m["rate"]) if "rate" in m else None
    quota = m["quota"].as_int(minimum=1) if "quota" in m else None
    attempts: Any = None
    if "attempts" in m:
        attempts = "none" if m["attempts"].value == "none" else _rate(m["attempts"])
    volatile = _volatile(m["volatile"]) if "volatile" in m else ()
    repeat_last = False
    if "replay" in m:
        replay = m["replay"].as_map(optional=spec.REPLAY.optional)
        if replay and "repeat_last" in replay:
            repeat_last = bool(replay["repeat_last"].as_bool())
    on_state_error = (
        m["on_state_error"].as_choice(("deny", "allow")) if "on_state_error" in m else "deny"
    )
    return _Behaviour(approval, rate, quota, attempts, volatile, repeat_last, on_state_error)


def _attempts(m: dict[str, Node], stated: Any, checks: tuple[PayloadCheck, ...]) -> Any:
    """The rule's attempt rate: as stated (``none``: no limit), else the SQL default when the
    rule checks SQL (its checks are what attempts bound), else none."""
    if stated == "none":
        return None
    if stated is not None or "attempts" in m:
        return stated
    if any(getattr(check, "kind", None) == "sql" for check in checks):
        from gateway.rates import parse_rate

        return parse_rate(spec.DEFAULT_SQL_ATTEMPTS)
    return None


def _payload_checks(m: dict[str, Node], context: CheckContext) -> tuple[PayloadCheck, ...]:
    """The payload checks (``sql``, ...) a rule names, each compiled by its check."""
    checks: list[PayloadCheck] = []
    for key, kind in PAYLOAD_CHECKS.items():
        if key in m:
            check = kind.compile(m[key], context)
            if check is not None:
                checks.append(check)
    return tuple(checks)


def _volatile(node: Node) -> tuple[str, ...]:
    """Fields that change between runs (timestamps, nonces): /json/pointer, query:name, body."""
    items = node.as_list()
    out: list[str] = []
    for item in items or ():
        text = item.as_str()
        if text is None:
            continue
        problem = volatile_problem(text)
        if problem is not None:
            item.fail(f"{item.where}: {problem}")
            continue
        out.append(text)
    return tuple(out)


def _allow(node: Node, params: dict[str, Constraint]) -> tuple[str | None, PathPattern | None]:
    text = node.as_str(what="'METHOD /path'")
    if text is None:
        return None, None
    method, _, path = text.strip().partition(" ")
    path = path.strip()
    if method not in METHODS:
        node.fail(f"allow: unknown method {method!r}; expected one of {list(METHODS)}")
        return None, None
    if not path.startswith("/"):
        node.fail(f"allow: path pattern must start with '/', got {path!r}")
        return None, None
    segments: list[str | Constraint] = []
    named: set[str] = set()
    parts = path[1:].split("/") if path != "/" else [""]
    for i, part in enumerate(parts):
        pm = PARAM.fullmatch(part)
        if pm:
            name = pm.group(1)
            if name in named:
                node.fail(f"allow: path parameter {name!r} appears twice")
                return None, None
            named.add(name)
            segments.append(params.get(name, Constraint(name=name)))
            continue
        if part == "" and i == len(parts) - 1:
            segments.append("")  # trailing slash, matched literally
            continue
        if part in (".", "..") or not LITERAL_SEGMENT.fullmatch(part):
            node.fail(
                f"allow: bad path pattern segment {part!r} in {path!r}; expected literal "
                "text (letters, digits, -._~!$&'()*+,=:@) or a {name} parameter"
            )
            return None, None
        segments.append(part)
    for name in params:
        if name not in named:
            node.fail(f"params: {name!r} is not a parameter of the path {path!r}")
    return method, PathPattern(text=path, segments=tuple(segments))


def _constraint(name: str, node: Node) -> Constraint | None:
    if isinstance(node.value, list):  # shorthand: a list of allowed values
        values = node.as_str_list()
        return Constraint(name=name, enum=frozenset(values)) if values is not None else None
    m = node.as_map(optional=spec.CONSTRAINT.optional)
    if m is None:
        return None
    enum = None
    if "enum" in m:
        items: list[str | None] = [
            str(v.value)
            if isinstance(v.value, int | str) and not isinstance(v.value, bool)
            else v.as_str()
            for v in (m["enum"].as_list() or [])
        ]
        if any(v is None for v in items):
            return None
        enum = frozenset(v for v in items if v is not None)
    regex = None
    if "regex" in m:
        text = m["regex"].as_str()
        if text is not None:
            try:
                regex = re.compile(text)
            except re.error as exc:
                m["regex"].fail(f"{m['regex'].where}: bad regular expression: {exc}")
    minimum = m["min"].as_int() if "min" in m else None
    maximum = m["max"].as_int() if "max" in m else None
    integer = bool(m["integer"].as_bool()) if "integer" in m else False
    integer = integer or minimum is not None or maximum is not None
    if minimum is not None and maximum is not None and minimum > maximum:
        node.fail(f"{node.where}: min {minimum} is greater than max {maximum}")
    max_length = m["max_length"].as_int(minimum=1) if "max_length" in m else 1024
    return Constraint(
        name=name,
        required=bool(m["required"].as_bool()) if "required" in m else False,
        enum=enum,
        regex=regex,
        integer=integer,
        minimum=minimum,
        maximum=maximum,
        max_length=max_length or 1024,
        repeat=bool(m["repeat"].as_bool()) if "repeat" in m else False,
    )
