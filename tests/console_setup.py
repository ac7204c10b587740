"""A gateway with an admin listener and named operators, for the web console's tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gateway.admin import create_admin_app
from gateway.app import Gateway, build_gateway
from gateway.config import Settings
from mocks.demo import Workspace
from tests.conftest import Mocks

HELD_RULES = ("restart-service", "echo-post")


def console_policy(policy_file: Path) -> Path:
    """The test policy with approval required on ``restart-service`` and on ``echo-post``
    (any body up to 4 KiB, echoed back: what an approver is shown, byte for byte); the
    ``logs`` upstream untrusted (reading it taints the run) and ``restart-service`` sensitive
    (a tainted run's restart is held, and the approver told why)."""
    text = policy_file.read_text()
    for rule in HELD_RULES:
        anchor = f"      - id: {rule}\n"
        assert anchor in text
        text = text.replace(anchor, anchor + "        approval: required\n")
    text = text.replace("  logs:\n", "  logs:\n    trust: untrusted\n", 1)
    anchor = "      - id: restart-service\n"
    text = text.replace(anchor, anchor + "        sensitive: true\n", 1)
    path = policy_file.with_name("console.yaml")
    path.write_text(text)
    return path


@dataclasses.dataclass
class ConsoleSetup:
    gw: Gateway
    client: Any  # the agents' listener
    admin: Any  # the admin listener
    settings: Settings

    @property
    def url(self) -> str:
        return f"http://{self.admin.host}:{self.admin.port}"


async def start_console(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    operators_file: Path,
    mocks: Mocks,
) -> ConsoleSetup:
    s = dataclasses.replace(
        settings,
        policy=console_policy(policy_file),
        admin_port=0,
        operators_file=operators_file,
        approval_timeout=30.0,
    )
    mocks.clear()
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    assert gw.operators is not None
    admin = await aiohttp_client(create_admin_app(gw, gw.operators))
    return ConsoleSetup(gw, client, admin, s)


def agent(workspace: Workspace, name: str = "tester", role: str = "tester") -> dict[str, str]:
    return {"Authorization": f"Bearer {workspace.token(name, [role])}"}
