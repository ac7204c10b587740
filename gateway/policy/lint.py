"""``capgate policy lint``: warnings about a policy that is valid but broader than it looks.

The loader refuses what is wrong; the linter points at what is legal and probably a mistake,
each warning with ``FILE:LINE:COL``, a stable code and a plain explanation:

=======  =======================================================================================
CG101    a pattern that accepts anything: a ``regex`` such as ``.*`` (any value, ``../`` and
         quotes included), or an agent declared as ``*`` (every agent any trusted issuer names)
CG102    a path (or resource) parameter without a constraint: ``{id}`` takes any segment
CG103    a POST/PUT/PATCH rule that does not check its body's content (no ``body.schema``,
         ``sql`` or ``arguments``; a schema of ``true`` or ``{}`` checks nothing)
CG104    a rule shadowed by an earlier rule of its role: every call it allows is decided by the
         earlier one, so its checks never run
CG105    an upstream no rule uses
CG106    a role no agent may hold
=======  =======================================================================================

A warning is silenced deliberately with a comment naming its code, on its line or alone on
the line above: ``# capgate: allow CG102`` (several: ``# capgate: allow CG102, CG103``); for
a warning about a rule, also on the rule's first line or alone above it. The comment is the
reviewable record that someone decided so.

Codes are a public contract like reason codes: added, never renumbered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.policy.model import Constraint, PathPattern, Policy, Rule
from gateway.policy_file import Node, read_document, read_text

CODES: dict[str, str] = {
    "CG101": "pattern accepts anything",
    "CG102": "unconstrained parameter",
    "CG103": "body not checked",
    "CG104": "rule shadowed by an earlier rule",
    "CG105": "upstream not used",
    "CG106": "role not held by any agent",
}
SILENCE = re.compile(r"#\s*capgate:\s*allow\s+(CG\d{3}(?:\s*,\s*CG\d{3})*)")
# Values a constrained regex should refuse; one that takes all of them takes anything.
_PROBES = ("../../etc/passwd", "x' OR '1'='1\"; --", "%2e%2e%2f\x00")
_WRITES = ("POST", "PUT", "PATCH")
Found = tuple[Node | None, str, str]  # where, code, message


@dataclass(frozen=True, slots=True)
class LintWarning:
    path: str
    line: int
    col: int
    code: str
    message: str
    silenced: bool = False

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.code}: {self.message}"

    def as_json(self) -> dict[str, Any]:
        return {
            "file": self.path,
            "line": self.line,
            "col": self.col,
            "code": self.code,
            "title": CODES[self.code],
            "message": self.message,
            "silenced": self.silenced,
        }


def silenced_lines(text: str) -> dict[int, frozenset[str]]:
    """Line number (1-based) -> the codes a ``# capgate: allow`` comment silences there: on
    the comment's own line, and on the next line when the comment stands alone."""
    out: dict[int, set[str]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        found = SILENCE.search(line)
        if found is None:
            continue
        codes = {c.strip() for c in found.group(1).split(",")}
        out.setdefault(number, set()).update(codes)
        if line.lstrip().startswith("#"):
            out.setdefault(number + 1, set()).update(codes)
    return {k: frozenset(v) for k, v in out.items()}


def broad_regex(pattern: re.Pattern[str]) -> bool:
    return all(pattern.fullmatch(probe) for probe in _PROBES)


def unconstrained(c: Constraint) -> bool:
    """Nothing but the default length bound: any value passes."""
    return c.enum is None and c.regex is None and not c.integer


class _Walk:
    """The raw document, for positions: the rule nodes by id, the keys of each section."""

    def __init__(self, root: Node) -> None:
        self.root = root
        self.rules: dict[str, Node] = {}
        roles = root.get("roles")
        for _, role in roles.items() if roles else ():
            rules = role.get("rules")
            for item in rules.elements() if rules else ():
                rule_id = item.value.get("id") if isinstance(item.value, dict) else None
                if isinstance(rule_id, str):
                    self.rules[rule_id] = item

    def rule_key(self, rule: Rule, *keys: str) -> Node | None:
        """The node at ``keys`` under the rule (the deepest one present)."""
        node = self.rules.get(rule.id)
        for key in keys:
            if node is None:
                return None
            child = node.get(key)
            if child is None:
                return node
            node = child
        return node


def lint_policy(policy: Policy, text: str | None = None) -> list[LintWarning]:
    """Every warning for ``policy`` (loaded from ``policy.source``), silenced ones marked."""
    source = policy.source
    raw = text if text is not None else read_text(source)
    walk = _Walk(read_document(source, raw))
    # (where, code, message, the rule it is about: a comment above the rule silences it too)
    found: list[tuple[Node | None, str, str, Node | None]] = []
    for role in policy.roles.values():
        for i, rule in enumerate(role.rules):
            about = walk.rules.get(rule.id)
            kind = policy.upstreams[rule.upstream].kind
            for node, code, message in (
                *_regexes(walk, rule),
                *_parameters(walk, rule),
                *_body(walk, rule, kind),
                *_shadowed(walk, rule, role.rules[:i]),
            ):
                found.append((node, code, message, about))
    found.extend((*w, None) for w in (*_unused(walk, policy), *_agents(walk)))
    quiet = silenced_lines(raw)
    out: list[LintWarning] = []
    for node, code, message, about in found:
        line, col = (node.line, node.col) if node is not None else (1, 1)
        silenced = code in quiet.get(line, ()) or (
            about is not None and code in quiet.get(about.line, ())
        )
        out.append(LintWarning(source, line, col, code, message, silenced))
    return sorted(out, key=lambda w: (w.line, w.col, w.code))


def _constraints(rule: Rule) -> list[tuple[str, str, Constraint]]:
    """(section, name, constraint) for the rule's params, query, headers and URI params."""
    out: list[tuple[str, str, Constraint]] = []
    for segment in rule.path.segments:
        if isinstance(segment, Constraint):
            out.append(("params", segment.name, segment))
    if rule.resource is not None:
        out.extend(
            ("resource", p.name, p) for p in rule.resource.parts if isinstance(p, Constraint)
        )
    out.extend(("query", name, c) for name, c in rule.query.items())
    out.extend(("headers", name, c) for name, c in rule.headers.items())
    return out


def _regexes(walk: _Walk, rule: Rule) -> list[Found]:
    out: list[Found] = []
    for section, name, c in _constraints(rule):
        if c.regex is None or not broad_regex(c.regex):
            continue
        keys = (
            ("resource", "params", name, "regex")
            if section == "resource"
            else (section, name, "regex")
        )
        node = walk.rule_key(rule, *keys)
        out.append(
            (
                node,
                "CG101",
                f"rule {rule.id!r}: {section} {name!r}: regex {c.regex.pattern!r} accepts "
                "anything ('../', quotes, NUL): say what the value looks like, e.g. "
                "'[a-z0-9-]{1,64}'",
            )
        )
    return out


def _parameters(walk: _Walk, rule: Rule) -> list[Found]:
    out: list[Found] = []
    for section, name, c in _constraints(rule):
        if section not in ("params", "resource") or not unconstrained(c):
            continue
        where = "allow" if section == "params" else "resource"
        kind = "path" if section == "params" else "resource"
        node = walk.rule_key(rule, *(("params", name) if section == "params" else ("resource",)))
        if section == "params" and (node is None or node is walk.rules.get(rule.id)):
            node = walk.rule_key(rule, where)
        out.append(
            (
                node,
                "CG102",
                f"rule {rule.id!r}: {kind} parameter {{{name}}} is unconstrained: any "
                f"segment passes; add 'params: {{{name}: {{regex: ..., enum: [...] or "
                "integer: true}}'",
            )
        )
    return out


def _checks_content(node: Node | None, key: str) -> bool:
    """Whether the rule's ``key`` (body, arguments) checks what the payload says."""
    if node is None or key not in (node.value or {}):
        return False
    value = node.value[key]
    if key == "body":
        value = value.get("schema") if isinstance(value, dict) else None
    return value not in (None, True, {})


def _body(walk: _Walk, rule: Rule, kind: str) -> list[Found]:
    if rule.method not in _WRITES or (kind == "mcp" and rule.tool is None):
        return []  # an MCP rule without a tool: protocol messages, or a method, prompt...
    node = walk.rules.get(rule.id)
    if node is None or any(_checks_content(node, k) for k in ("body", "arguments")):
        return []
    if isinstance(node.value, dict) and "sql" in node.value:
        return []
    what = "tool's arguments" if rule.tool is not None else "body"
    hint = (
        "'arguments:' (a JSON Schema of the tool's input)"
        if rule.tool is not None
        else "'body: {schema: ...}' (a JSON Schema) or 'sql:'"
    )
    return [
        (
            walk.rule_key(rule, "allow"),
            "CG103",
            f"rule {rule.id!r}: {rule.method} without a check of the {what}: add {hint}",
        )
    ]


def _covers_segment(earlier: str | Constraint, later: str | Constraint) -> bool:
    if isinstance(earlier, str):
        return earlier == later
    if isinstance(later, str):
        return later != "" and earlier.violation(later) is None
    return unconstrained(earlier) or earlier == later


def _covers_path(earlier: PathPattern, later: PathPattern) -> bool:
    if len(earlier.segments) != len(later.segments):
        return False
    return all(_covers_segment(a, b) for a, b in zip(earlier.segments, later.segments, strict=True))


def _covers_query(earlier: Rule, later: Rule) -> bool:
    """Every query ``later`` accepts, ``earlier`` accepts too (a cautious approximation)."""
    if any(c.required for c in earlier.query.values()):
        return False
    if not later.query and not later.allow_extra_query:
        return True  # later takes no query at all, which earlier takes
    if earlier.allow_extra_query and all(unconstrained(c) for c in earlier.query.values()):
        return True
    return False


def shadows(earlier: Rule, later: Rule) -> bool:
    """Whether ``earlier`` matches every call ``later`` matches (same role, tried first)."""
    if (earlier.upstream, earlier.method) != (later.upstream, later.method):
        return False
    subject = (earlier.tool, earlier.prompt, earlier.mcp_method)
    if subject != (later.tool, later.prompt, later.mcp_method):
        return False
    if (earlier.resource is None) != (later.resource is None):
        return False
    if earlier.resource is not None and later.resource is not None:
        if earlier.resource.text != later.resource.text:
            return False
    if earlier.headers and earlier.headers != later.headers:
        return False
    return _covers_path(earlier.path, later.path) and _covers_query(earlier, later)


def _shadowed(walk: _Walk, later: Rule, before: tuple[Rule, ...]) -> list[Found]:
    earlier = next((r for r in before if shadows(r, later)), None)
    if earlier is None:
        return []
    message = (
        f"rule {later.id!r} is shadowed by rule {earlier.id!r} (line {earlier.line}), which "
        "matches every call it does and is tried first: its checks never run; put it "
        f"first, or narrow {earlier.id!r}"
    )
    return [(walk.rule_key(later, "allow"), "CG104", message)]


def _unused(walk: _Walk, policy: Policy) -> list[Found]:
    out: list[Found] = []
    used = {rule.upstream for role in policy.roles.values() for rule in role.rules}
    upstreams = walk.root.get("upstreams")
    for name in policy.upstreams:
        if name not in used:
            node = upstreams.key_at(name) if upstreams else None
            message = f"upstream {name!r} is not used by any rule: remove it, or add the rules"
            out.append((node, "CG105", message))
    held = {role for entry in policy.agents.entries for role in entry.roles}
    roles = walk.root.get("roles")
    for name in policy.roles:
        if name not in held:
            node = roles.key_at(name) if roles else None
            message = f"role {name!r} is not held by any agent: no token can use it"
            out.append((node, "CG106", message))
    return out


def _agents(walk: _Walk) -> list[Found]:
    agents = walk.root.get("agents")
    if agents is None or not isinstance(agents.value, dict) or "*" not in agents.value:
        return []
    message = (
        "agent '*' declares every agent name: any token a trusted issuer signs may hold "
        "these roles; name the agents, or a prefix such as 'ci-*'"
    )
    return [(agents.key_at("*"), "CG101", message)]


def lint_file(path: str | Path) -> list[LintWarning]:
    """Load ``path`` (``PolicyError`` if it has errors) and lint it."""
    from gateway.policy.load import load_policy

    text = read_text(path)
    return lint_policy(load_policy(path, text=text), text)
