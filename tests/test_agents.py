"""Declared agents: who may call, holding which roles (``policy/agents.py``)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.app import build_gateway
from gateway.config import load_settings
from gateway.errors import AgentUnknown, RoleNotGranted
from gateway.policy.agents import MEMO_LIMIT, PATTERN_CHARS, compile_pattern
from gateway.policy.load import load_policy
from gateway.policy_file import PolicyError
from gateway.testing import policy_from_text
from mocks.demo import Workspace

HEAD = """\
version: 1
upstreams:
  up: {url: "http://127.0.0.1:9"}
roles:
  reader:
    rules:
      - {id: read, upstream: up, allow: GET /things}
  writer:
    rules:
      - {id: write, upstream: up, allow: DELETE /things}
"""


def directory(agents_yaml: str) -> Any:
    return policy_from_text(HEAD + agents_yaml).agents


def test_an_exact_name_grants_its_roles_and_nothing_more() -> None:
    agents = directory("agents:\n  bot-1: [reader]\n")
    agents.admit("bot-1", ["reader"])
    agents.admit("bot-1", [])
    with pytest.raises(RoleNotGranted, match=r"\['writer'\]"):
        agents.admit("bot-1", ["reader", "writer"])
    with pytest.raises(AgentUnknown):
        agents.admit("bot-2", ["reader"])


def test_patterns_cover_a_fleet_and_exact_names_win_over_them() -> None:
    agents = directory(
        "agents:\n"
        "  ci-*: [reader]\n"
        "  ci-admin: {roles: [reader, writer], description: the release job}\n"
        "  ci-*-eu: [writer]\n"
    )
    agents.admit("ci-7", ["reader"])
    agents.admit("ci-admin", ["writer"])
    # The first pattern in file order decides: ci-7-eu is covered by ci-* (reader only).
    with pytest.raises(RoleNotGranted):
        agents.admit("ci-7-eu", ["writer"])
    with pytest.raises(AgentUnknown):
        agents.admit("ci-", ["reader"])  # * stands for at least one character
    with pytest.raises(AgentUnknown):
        agents.admit("ci-a/b", ["reader"])  # nor for a character outside names
    with pytest.raises(AgentUnknown):
        agents.admit("xci-1", ["reader"])  # whole names only


def test_pattern_memo_is_bounded() -> None:
    agents = directory("agents:\n  bot-*: [reader]\n")
    for i in range(MEMO_LIMIT * 2 + 5):
        agents.admit(f"bot-{i}", ["reader"])
        with pytest.raises(AgentUnknown):
            agents.admit(f"other-{i}", ["reader"])
    assert len(agents._memo) <= MEMO_LIMIT


def test_a_policy_must_declare_its_agents() -> None:
    with pytest.raises(PolicyError, match="missing required key 'agents'"):
        policy_from_text(HEAD)


@pytest.mark.parametrize(
    ("agents_yaml", "line", "col", "message"),
    [
        ("agents:\n  bot: [reader, admin]\n", 12, 17, "unknown role 'admin'"),
        ("agents:\n  bot: reader\n", 12, 8, "expected a list"),
        ("agents:\n  'two words': [reader]\n", 12, 3, "no spaces"),
        ("agents:\n  'ci-**': [reader]\n", 12, 3, "no spaces"),
        ("agents:\n  bot: {roles: [reader], color: red}\n", 12, 26, "unknown key 'color'"),
        ("agents:\n  bot: {description: x}\n", 12, 8, "missing required key 'roles'"),
        ("agents: [bot]\n", 11, 9, "expected a mapping of agent names"),
    ],
)
def test_declaration_errors_are_placed(agents_yaml: str, line: int, col: int, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_text(HEAD + agents_yaml)
    [issue] = info.value.issues
    assert (issue.line, issue.col) == (line, col), issue
    assert message in issue.message


def test_agents_can_live_in_a_file_named_by_the_policy(tmp_path: Path) -> None:
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "agents.yaml").write_text("bot-*: [reader]\nlead: [writer]\n")
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(HEAD + "agents: fleet/agents.yaml\n")
    policy = load_policy(policy_path)
    policy.agents.admit("bot-3", ["reader"])
    policy.agents.admit("lead", ["writer"])
    assert policy.files == (str(policy_path), str(tmp_path / "fleet" / "agents.yaml"))
    # The digest covers the agents file: a change there is a new policy.
    digest = policy.digest
    (tmp_path / "fleet" / "agents.yaml").write_text("bot-*: [reader, writer]\n")
    assert load_policy(policy_path).digest != digest
    # Errors in it are reported at their place in it.
    (tmp_path / "fleet" / "agents.yaml").write_text("bot-*: [reader]\nlead: [nope]\n")
    with pytest.raises(PolicyError) as info:
        load_policy(policy_path)
    [issue] = info.value.issues
    assert issue.path.endswith("fleet/agents.yaml") and (issue.line, issue.col) == (2, 8)
    # A missing file names both the policy's line and the file.
    (tmp_path / "fleet" / "agents.yaml").unlink()
    with pytest.raises(PolicyError) as info:
        load_policy(policy_path)
    assert any("cannot read the agents file" in i.message for i in info.value.issues)


async def test_editing_the_agents_file_reloads_the_policy(
    tmp_path: Path, workspace: Workspace
) -> None:
    agents_file = tmp_path / "agents.yaml"
    agents_file.write_text("bot: [reader]\n")
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(HEAD + "agents: agents.yaml\n")
    settings = load_settings(
        {"policy": str(policy_path), "jwks": str(workspace.jwks), "audit": "-"}, {}
    )
    gw = build_gateway(settings, workspace.environ())
    with pytest.raises(AgentUnknown):
        gw.policy.agents.admit("newcomer", ["reader"])
    agents_file.write_text("bot: [reader]\nnewcomer: [reader]\n")
    st = agents_file.stat()
    os.utime(agents_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gw.reload_policy()
    gw.policy.agents.admit("newcomer", ["reader"])


NAME_CHAR = re.compile(PATTERN_CHARS)


@given(
    st.lists(st.text("ab.-*x", min_size=0, max_size=4), min_size=1, max_size=3),
    st.text(st.characters(codec="utf-8"), max_size=12),
)
def test_a_pattern_matches_its_literal_parts_exactly(parts: list[str], name: str) -> None:
    """Only ``*`` is special: ``.`` and ``-`` in a declaration are themselves, and ``*`` never
    stands for an empty run or a character outside agent-name characters."""
    pattern_text = "*".join(p.replace("*", "") for p in parts)
    if "**" in pattern_text:
        return
    pattern = compile_pattern(pattern_text)
    m = pattern.fullmatch(name)
    literal = pattern_text.split("*")
    if m is None:
        return
    # Rebuild: name is literal[0] + w1 + literal[1] + ... with each w a run of name chars.
    rest = name
    assert rest.startswith(literal[0])
    rest = rest[len(literal[0]) :]
    for part in literal[1:]:
        # Some split of rest exists; at least check the wildcard run is made of name chars.
        idx = rest.rfind(part) if part else len(rest)
        assert idx >= 1
        assert NAME_CHAR.fullmatch(rest[:idx]) is not None
        rest = rest[idx + len(part) :]
    assert rest == ""
