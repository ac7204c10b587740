"""The agents a policy knows, and the roles each may hold.

A valid signature says who issued a token, not that the agent it names belongs here: a token
for an agent nobody declared is refused (``agent_unknown``), and so is a token whose roles
go beyond the agent's (``role_not_granted``), whoever signed it.

Agents are declared by name (``analyst-bot``) or by pattern (``ci-runner-*``: each ``*``
stands for one or more letters, digits or ``. _ - : @``), so a fleet of thousands is one
line. A name declared exactly wins over patterns; otherwise the first pattern in file order
that matches decides. Lookups are memoised per policy (bounded: agent names come from
tokens).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.errors import AgentUnknown, RoleNotGranted
from gateway.policy_file import Node, PolicyError, read_document

PATTERN_CHARS = r"[A-Za-z0-9._:@-]+"
MEMO_LIMIT = 4096


def compile_pattern(name: str) -> re.Pattern[str]:
    """``ci-runner-*`` as a regular expression matching whole agent names."""
    return re.compile(PATTERN_CHARS.join(re.escape(part) for part in name.split("*")))


@dataclass(frozen=True, slots=True)
class AgentEntry:
    """One declaration: a name or a pattern, the roles it grants, where it was written."""

    name: str
    roles: frozenset[str]
    where: str
    pattern: re.Pattern[str] | None = None


@dataclass(slots=True)
class AgentDirectory:
    """Who may call, holding which roles."""

    entries: tuple[AgentEntry, ...] = ()
    _exact: dict[str, AgentEntry] = field(default_factory=dict, repr=False)
    _patterns: tuple[AgentEntry, ...] = field(default=(), repr=False)
    _memo: dict[str, AgentEntry | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._exact = {e.name: e for e in self.entries if e.pattern is None}
        self._patterns = tuple(e for e in self.entries if e.pattern is not None)

    def entry_for(self, agent: str) -> AgentEntry | None:
        """The declaration that covers ``agent``, or None."""
        found = self._exact.get(agent)
        if found is not None:
            return found
        if agent in self._memo:
            return self._memo[agent]
        found = next((e for e in self._patterns if e.pattern and e.pattern.fullmatch(agent)), None)
        if len(self._memo) >= MEMO_LIMIT:
            self._memo.clear()
        self._memo[agent] = found
        return found

    def admit(self, agent: str, roles: Iterable[str]) -> None:
        """Raise unless ``agent`` is declared and may hold every one of ``roles``."""
        entry = self.entry_for(agent)
        if entry is None:
            raise AgentUnknown(f"agent {agent!r} is not declared in the policy")
        outside = sorted(r for r in roles if r not in entry.roles)
        if outside:
            raise RoleNotGranted(f"agent {agent!r} may not hold role(s) {outside}")


# --- reading the declarations ---------------------------------------------------------------

AGENT_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,256}")


@dataclass(frozen=True, slots=True)
class AgentsRead:
    """What ``agents:`` gave: the directory, and the file it was read from (if one was named)
    with its content as plain data (part of the policy's digest)."""

    directory: AgentDirectory
    file: str | None = None
    content: str = ""


def read_agents(node: Node, policy_path: str, roles: frozenset[str]) -> AgentsRead:
    """``agents:``: the declarations written inline (a mapping), or in the file it names (a
    path relative to the policy's directory, holding the same mapping). Errors are recorded
    on ``node``'s issue list, at their place in whichever file they are."""
    if not isinstance(node.value, str):
        return AgentsRead(AgentDirectory(_entries(node, roles)))
    path = str(Path(policy_path).parent / node.value)
    try:
        root = read_document(path)
    except PolicyError as exc:
        node.fail(f"{node.where}: cannot read the agents file {path!r}")
        node.issues.extend(exc.issues)
        return AgentsRead(AgentDirectory(), path)
    entries = _entries(root, roles)
    node.issues.extend(root.issues)
    content = json.dumps(root.plain(), sort_keys=True)
    return AgentsRead(AgentDirectory(entries), path, content)


def _entries(node: Node, roles: frozenset[str]) -> tuple[AgentEntry, ...]:
    if not isinstance(node.value, dict):
        node.fail(
            f"{node.where or 'the document'}: expected a mapping of agent names (or patterns "
            "such as 'ci-*') to the roles each may hold, or the name of a file holding one"
        )
        return ()
    out: list[AgentEntry] = []
    for key, value in node.entries():
        name = key.value
        if not AGENT_NAME.fullmatch(name) or "**" in name:
            key.fail(
                f"agent name {name!r}: 1 to 256 characters, no spaces or control characters, "
                "no '**'"
            )
            continue
        granted = _granted(value, roles)
        if granted is None:
            continue
        where = f"{key.path}:{key.line}"
        pattern = compile_pattern(name) if "*" in name else None
        out.append(AgentEntry(name, granted, where, pattern))
    return tuple(out)


def _granted(node: Node, roles: frozenset[str]) -> frozenset[str] | None:
    if isinstance(node.value, dict):
        from gateway.policy.spec import AGENT

        m = node.as_map(required=AGENT.required, optional=AGENT.optional)
        if m is None or "roles" not in m:
            return None
        if "description" in m:
            m["description"].as_str()
        node = m["roles"]
    items = node.as_list()
    if items is None:
        return None
    granted: set[str] = set()
    for item in items:
        role = item.as_str()
        if role is None:
            continue
        if role not in roles:
            item.fail(f"{item.where}: unknown role {role!r}; defined roles: {sorted(roles)}")
            continue
        granted.add(role)
    return frozenset(granted)
