"""An approver checks a masked value of a held call without seeing it
(``POST /approvals/{id}/check``): yes or no, never the value; a few checks per approval,
counted in the state store; each published with the operator's name; across a fleet through
salted scrypt digests on the approval board (never the value)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.admin import create_admin_app
from gateway.approval_checks import CHECKS_PER_APPROVAL, digests, masked_values, matches
from gateway.approvals import Approvals
from gateway.config import Settings
from gateway.errors import ApprovalDenied
from gateway.recording.redact import Redactor
from gateway.state import open_store
from mocks.demo import Workspace
from tests.redis_server import RedisServer
from tests.test_approvals import held_call
from tests.test_taint_arguments import (
    ADMIN_TOKEN,
    Upstream,
    agent,
    start,
    tool,
    upstream,  # noqa: F401 (a fixture)
)

PASSWORD_CALL = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "tools/call",
    "params": {"name": "update_password", "arguments": {"password": "1j1l-2k3j-secret"}},
}
BODY = json.dumps(PASSWORD_CALL).encode()
PATH = "params.arguments.password"


def test_the_masked_values_are_found_by_path_and_digests_match_only_them() -> None:
    shown = Redactor().body(BODY).data
    assert b"1j1l" not in shown
    assert masked_values(BODY, shown) == {PATH: "1j1l-2k3j-secret"}
    assert masked_values(b"not json", b"not json") == {}
    [entry] = digests({PATH: "1j1l-2k3j-secret"}).values()
    assert "1j1l" not in json.dumps(entry)
    assert matches("1j1l-2k3j-secret", entry)
    assert not matches("1j1l-2k3j-secreT", entry) and not matches("", entry)
    # Salted: the same value digests differently each time.
    assert digests({PATH: "x"})[PATH] != digests({PATH: "x"})[PATH]


@pytest.mark.parametrize(
    "arguments",
    [
        {"new.password": "what-the-user-asked", "new": {"password": "the-attackers-choice"}},
        {"new": {"password": "the-attackers-choice"}, "new.password": "what-the-user-asked"},
        {"pw[0]": "what-the-user-asked", "pw": ["the-attackers-choice"]},
    ],
)
def test_a_path_that_names_two_values_is_never_checkable(arguments: dict[str, object]) -> None:
    # A sender controls the keys: with '.' or '[' in one, two values share a path, and the
    # person would confirm the one the user asked for while the call also carries another.
    body = json.dumps({"params": {"name": "change_password", "arguments": arguments}}).encode()
    shown = body.replace(b"what-the-user-asked", b"[redacted]").replace(
        b"the-attackers-choice", b"[redacted]"
    )
    found = masked_values(body, shown)
    assert "params.arguments.new.password" not in found
    assert "params.arguments.pw[0]" not in found
    assert found == {}


async def test_the_gateway_holding_the_call_answers_yes_or_no() -> None:
    approvals = Approvals(timeout=5)
    task = asyncio.ensure_future(approvals.hold(held_call(BODY)))
    await asyncio.sleep(0.01)
    [pending] = await approvals.pending()
    assert pending["checkable"] == [PATH] and "1j1l" not in json.dumps(pending)
    assert await approvals.check(pending["id"], PATH, "1j1l-2k3j-secret") == "equal"
    assert await approvals.check(pending["id"], PATH, "new_password") == "different"
    assert await approvals.check(pending["id"], "params.name", "x") == "not_checkable"
    assert await approvals.check("0" * 16, PATH, "x") == "not_found"
    assert await approvals.decide(pending["id"], True, by="ops") == "decided"
    await task
    assert await approvals.check(pending["id"], PATH, "1j1l-2k3j-secret") == "not_found"


async def test_a_lone_surrogate_on_either_side_is_an_answer_not_a_crash() -> None:
    # JSON's \ud800 escape reads as a lone surrogate: in the held body (the agent's) or in
    # the value offered (the approver's), the check answers instead of raising.
    body = json.dumps(
        {"params": {"name": "change_password", "arguments": {"password": "pw-\ud800-x1y2z3"}}}
    ).encode()
    approvals = Approvals(timeout=5)
    task = asyncio.ensure_future(approvals.hold(held_call(body)))
    await asyncio.sleep(0.01)
    [pending] = await approvals.pending()
    assert pending["checkable"] == [PATH]
    assert await approvals.check(pending["id"], PATH, "pw-\ud800-x1y2z3") == "equal"
    assert await approvals.check(pending["id"], PATH, "\udfff") == "different"
    assert "ud800" not in json.dumps(pending)  # masked in the approvers' view too
    assert await approvals.decide(pending["id"], False, by="ops") == "decided"
    with pytest.raises(ApprovalDenied):
        await task


async def test_a_fleet_checks_through_digests_on_the_board(redis_server: RedisServer) -> None:
    one, two = open_store(redis_server.url), open_store(redis_server.url)
    await one.start()
    await two.start()
    try:
        holder = Approvals(timeout=5, board=one.approval_board())
        console = Approvals(timeout=5, board=two.approval_board())
        task = asyncio.ensure_future(holder.hold(held_call(BODY)))
        for _ in range(500):
            listed = await console.pending()
            if listed and await console.check(listed[0]["id"], PATH, "?") != "not_found":
                break
            await asyncio.sleep(0.01)
        [pending] = await console.pending()
        assert pending["checkable"] == [PATH]
        assert await console.check(pending["id"], PATH, "1j1l-2k3j-secret") == "equal"
        assert await console.check(pending["id"], PATH, "new_password") == "different"
        assert await console.check(pending["id"], "nope", "x") == "not_checkable"
        assert await console.decide(pending["id"], False, by="ops") == "decided"
        assert await console.check(pending["id"], PATH, "1j1l-2k3j-secret") == "not_found"
        with pytest.raises(ApprovalDenied):
            await task
    finally:
        await one.close()
        await two.close()


async def test_the_admin_api_checks_a_few_times_and_tells_who_checked(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    tmp_path: Path,
    upstream: tuple[Upstream, str],  # noqa: F811 (the fixture)
) -> None:
    _, url = upstream
    gw, client = await start(serve_gateway, settings, workspace, tmp_path, url)
    told: list[dict[str, Any]] = []
    gw.events.listeners.append(lambda e: told.append(e) if e.get("action") == "check" else None)
    assert gw.operators is not None
    admin = await aiohttp_client(create_admin_app(gw, gw.operators))
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    # A sensitive call of a tainted run whose argument is a secret: held, masked.
    me = agent(workspace)
    assert (await tool(client, me, "read_mail")).status == 200
    sending = asyncio.ensure_future(tool(client, me, "delete_mail", password="1j1l-2k3j-secret"))
    for _ in range(300):
        pending = (await (await admin.get("/approvals", headers=auth)).json())["pending"]
        if pending:
            break
        await asyncio.sleep(0.02)
    [held] = pending
    assert "1j1l" not in json.dumps(held) and held["checkable"] == [PATH]
    check = f"/approvals/{held['id']}/check"

    async def ask(value: str, path: str = PATH) -> Any:
        return await admin.post(check, headers=auth, json={"path": path, "value": value})

    yes = await ask("1j1l-2k3j-secret")
    assert yes.status == 200
    assert await yes.json() == {
        "id": held["id"],
        "path": PATH,
        "equal": True,
        "checks_left": CHECKS_PER_APPROVAL - 1,
        "by": "admin",
    }
    no = await (await ask("new_password")).json()
    assert no["equal"] is False and no["checks_left"] == CHECKS_PER_APPROVAL - 2
    assert (await ask("x", path="params.name")).status == 400  # nothing masked there
    assert (await admin.post(check, headers=auth, json={"path": PATH})).status == 400
    for _ in range(CHECKS_PER_APPROVAL - 3):
        assert (await ask("guess")).status == 200
    limited = await ask("1j1l-2k3j-secret")
    assert limited.status == 429 and (await limited.json())["reason"] == "approval_check_limited"
    missing = await admin.post(
        "/approvals/0123456789abcdef/check", headers=auth, json={"path": PATH, "value": "x"}
    )
    assert missing.status == 404
    assert await gw.approvals.decide(held["id"], False, by="admin") == "decided"
    await sending
    assert [(e["by"], e["equal"]) for e in told] == [("admin", True), ("admin", False)] + [
        ("admin", False)
    ] * (CHECKS_PER_APPROVAL - 3)
    assert "1j1l" not in json.dumps(told) and "guess" not in json.dumps(told)
