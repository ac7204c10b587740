"""The admin API for named operators: roles, recent calls, calls in flight, the live event
stream, decisions recorded with the operator's name, and the OpenAPI document it is held to."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gateway.admin import ROUTES, create_admin_app
from gateway.admin_openapi import openapi_document
from gateway.app import build_gateway
from gateway.config import Settings
from gateway.errors import ConfigError
from gateway.events import EventHub, Filters
from gateway.operators import OperatorBook, add_operator, read_operators, remove_operator
from mocks.demo import Workspace
from tests.conftest import ROOT, Mocks, audit_lines
from tests.test_approvals import held_policy, restart

DOC = openapi_document()


def conforms(path: str, method: str, status: int, body: Any) -> None:
    """The answer validates against the schema the OpenAPI document gives for it."""
    template = next((p for p in DOC["paths"] if _matches(p, path)), None)
    assert template is not None, f"{path} is not in the OpenAPI document"
    responses = DOC["paths"][template][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {path} answered {status}, not documented"
    content = responses[str(status)]["content"]
    schema = next(iter(content.values()))["schema"]
    jsonschema.validate(body, {**schema, "components": DOC["components"]})


def _matches(template: str, path: str) -> bool:
    t, p = template.strip("/").split("/"), path.split("?")[0].strip("/").split("/")
    return len(t) == len(p) and all(a == b or a.startswith("{") for a, b in zip(t, p, strict=True))


class Operators:
    def __init__(self, tmp_path: Path) -> None:
        self.file = tmp_path / "operators.yaml"
        self.tokens = {
            name: add_operator(self.file, name, role)
            for name, role in (("vera", "viewer"), ("alice", "approver"), ("root", "admin"))
        }

    def auth(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[name]}"}


@pytest.fixture
def operators(tmp_path: Path) -> Operators:
    return Operators(tmp_path)


@pytest.fixture
async def console(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Settings,
    workspace: Workspace,
    policy_file: Path,
    operators: Operators,
    mocks: Mocks,
) -> Any:
    s = dataclasses.replace(
        settings,
        policy=held_policy(policy_file),
        admin_port=0,
        operators_file=operators.file,
        approval_timeout=10.0,
    )
    mocks.clear()
    gw = build_gateway(s, workspace.environ())
    client = await serve_gateway(gw)
    assert gw.operators is not None
    admin = await aiohttp_client(create_admin_app(gw, gw.operators))
    return gw, client, admin, s


async def get(admin: Any, path: str, who: str, operators: Operators, status: int = 200) -> Any:
    resp = await admin.get(path, headers=operators.auth(who))
    body = await resp.json(content_type=None)
    assert resp.status == status, body
    conforms(path, "GET", status, body)
    return body


async def pending_one(admin: Any, operators: Operators) -> dict[str, Any]:
    for _ in range(200):
        pending = (await get(admin, "/approvals", "vera", operators))["pending"]
        if pending:
            return pending[0]  # type: ignore[no-any-return]
        await asyncio.sleep(0.01)
    raise AssertionError("nothing became pending")


# --- credentials and roles -----------------------------------------------------------------


async def test_wrong_missing_or_weak_credentials_change_nothing(
    console: Any, operators: Operators, workspace: Workspace, mocks: Mocks
) -> None:
    gw, client, admin, _ = console
    call = asyncio.ensure_future(restart(client, workspace))
    pending = await pending_one(admin, operators)
    decide = f"/approvals/{pending['id']}/approve"
    real = operators.tokens["root"]
    forged = real[:-2] + ("yy" if real.endswith("xx") else "xx")  # never the token itself
    for headers, status, reason in (
        ({}, 401, "operator_unauthenticated"),
        ({"Authorization": "Bearer " + forged}, 401, "operator_unauthenticated"),
        ({"Authorization": operators.tokens["root"]}, 401, "operator_unauthenticated"),
        ({"Authorization": "Basic " + operators.tokens["root"]}, 401, "operator_unauthenticated"),
        (operators.auth("vera"), 403, "operator_forbidden"),  # a viewer may not decide
    ):
        resp = await admin.post(decide, headers=headers)
        body = await resp.json(content_type="application/problem+json")
        assert (resp.status, body["reason"]) == (status, reason)
        conforms(decide, "POST", status, body)
    assert [p["id"] for p in await gw.approvals.pending()] == [pending["id"]]  # still held
    assert mocks.requests("services") == []
    await get(admin, "/operators", "alice", operators, status=403)  # approver is not admin
    names = await get(admin, "/operators", "root", operators)
    assert {o["name"]: o["role"] for o in names["operators"]} == {
        "vera": "viewer",
        "alice": "approver",
        "root": "admin",
    }
    assert "token" not in json.dumps(names)
    await gw.approvals.decide(pending["id"], False, by="cleanup")
    await call


async def test_the_approver_is_named_in_the_audit_line(
    console: Any, operators: Operators, workspace: Workspace, mocks: Mocks
) -> None:
    gw, client, admin, settings = console
    call = asyncio.ensure_future(restart(client, workspace))
    pending = await pending_one(admin, operators)
    inflight = await get(admin, "/calls/inflight", "vera", operators)
    [held] = inflight["calls"]
    assert (held["agent"], held["path"], held["state"]) == (
        "sre-bot",
        "/services/services/restart",
        "held for approval",
    )
    resp = await admin.post(
        f"/approvals/{pending['id']}/approve",
        headers=operators.auth("alice"),
        json={"reason": "change ticket 42"},
    )
    body = await resp.json()
    assert resp.status == 200 and body == {
        "id": pending["id"],
        "decision": "approved",
        "by": "alice",
    }
    conforms(f"/approvals/{pending['id']}/approve", "POST", 200, body)
    answer = await call
    assert answer.status == 200
    [line] = [x for x in audit_lines(settings, gw) if x["path"] == "/services/services/restart"]
    assert (line["approval"], line["operator"]) == (pending["id"], "alice")
    # A second decision on the same call finds nothing: exactly one decision counts.
    again = await admin.post(f"/approvals/{pending['id']}/deny", headers=operators.auth("root"))
    assert again.status == 404
    assert (await get(admin, "/calls/inflight", "vera", operators))["calls"] == []


async def test_a_bad_decision_body_is_a_clear_error(console: Any, operators: Operators) -> None:
    _, _, admin, _ = console
    path = "/approvals/0123456789abcdef/approve"
    for kwargs in (
        {"data": b"{", "headers": {"Content-Type": "application/json"}},
        {"json": {"reason": 5}},
        {"json": {"reason": "x", "extra": 1}},
        {"json": {"reason": "x" * 501}},
        {"data": b"reason=x", "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
    ):
        headers = {**operators.auth("alice"), **kwargs.pop("headers", {})}  # type: ignore[dict-item]
        resp = await admin.post(path, headers=headers, **kwargs)
        body = await resp.json(content_type="application/problem+json")
        assert resp.status == 400 and body["reason"] == "admin_request_invalid", body
    resp = await admin.get("/nowhere", headers=operators.auth("root"))
    assert resp.status == 404
    assert (await resp.json(content_type="application/problem+json"))["reason"] == "admin_not_found"


# --- recent calls and the event stream ------------------------------------------------------


async def test_recent_calls_are_listed_newest_first_with_filters(
    console: Any, operators: Operators, workspace: Workspace
) -> None:
    _, client, admin, _ = console
    sre = {"Authorization": f"Bearer {workspace.token('sre-bot', ['sre-diagnostics'])}"}
    tester = {"Authorization": f"Bearer {workspace.token('tester', ['tester'])}"}
    assert (await client.get("/metrics/metrics/cpu?window=1m", headers=sre)).status == 200
    assert (await client.delete("/services/services/web", headers=sre)).status == 403
    assert (await client.get("/echo/echo/x?secret=hunter2", headers=tester)).status == 200
    calls = (await get(admin, "/calls", "vera", operators))["calls"]
    assert [c["path"] for c in calls][:3] == [
        "/echo/echo/x",
        "/services/services/web",
        "/metrics/metrics/cpu",
    ]
    assert "hunter2" not in json.dumps(calls)  # names of query parameters, never values
    denied = (await get(admin, "/calls?decision=deny&agent=sre-bot", "vera", operators))["calls"]
    assert [(c["reason"], c["method"]) for c in denied] == [("no_rule", "DELETE")]
    one = (await get(admin, "/calls?limit=1", "vera", operators))["calls"]
    assert len(one) == 1
    for bad in ("/calls?limit=0", "/calls?limit=1001", "/calls?limit=x", "/calls?decision=maybe"):
        await get(admin, bad, "vera", operators, status=400)


async def test_the_event_stream_shows_each_decision_as_it_is_made(
    console: Any, operators: Operators, workspace: Workspace
) -> None:
    _, client, admin, _ = console
    resp = await admin.get("/events?agent=tester", headers=operators.auth("vera"))
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    assert (await resp.content.readuntil(b"\n\n")).startswith(b": capgate events")
    tester = {"Authorization": f"Bearer {workspace.token('tester', ['tester'])}"}
    sre = {"Authorization": f"Bearer {workspace.token('sre-bot', ['sre-diagnostics'])}"}
    await client.get("/metrics/metrics/cpu?window=1m", headers=sre)  # filtered out
    await client.get("/echo/echo/live", headers=tester)
    frame = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 1.0)
    fields = dict(line.split(": ", 1) for line in frame.decode().strip().split("\n"))
    event = json.loads(fields["data"])
    assert fields["event"] == "call" and fields["id"] == str(event["seq"])
    assert (event["agent"], event["path"], event["decision"]) == (
        "tester",
        "/echo/echo/live",
        "allow",
    )
    jsonschema.validate(
        event, {**DOC["components"]["schemas"]["Call"], "components": DOC["components"]}
    )
    resp.close()


async def test_a_subscriber_that_falls_behind_is_told_and_dropped() -> None:
    hub = EventHub(queue=3)
    with hub.subscribe(Filters(), "vera") as sub:
        for i in range(10):
            hub.publish({"type": "call", "agent": "a", "n": i})
        got = [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]
    assert [e["type"] for e in got] == ["call", "call", "lagged"]
    assert got[-1]["dropped_after"] == got[1]["seq"] + 1
    assert hub._subscribers == set()


async def test_one_operator_cannot_hold_every_stream() -> None:
    from gateway.errors import ConcurrencyLimited

    hub = EventHub(max_subscribers=8)
    with contextlib_exit_stack() as stack:
        for _ in range(2):
            stack.enter_context(hub.subscribe(Filters(), "vera"))
        with pytest.raises(ConcurrencyLimited):
            stack.enter_context(hub.subscribe(Filters(), "vera"))
        stack.enter_context(hub.subscribe(Filters(), "alice"))  # another operator still can


def contextlib_exit_stack() -> Any:
    import contextlib

    return contextlib.ExitStack()


# --- the OpenAPI document ---------------------------------------------------------------------


def _template(path: str) -> str:
    """An aiohttp route path with its parameters' patterns left out: ``{id}``."""
    import re

    return re.sub(r"\{(\w+):[^}]*\}+", r"{\1}", path)


def test_every_route_is_in_the_openapi_document_and_nothing_else() -> None:
    documented = {(method.upper(), path) for path, ops in DOC["paths"].items() for method in ops}
    served = {(method, _template(path)) for method, path, _, _ in ROUTES}
    assert documented == served
    roles = {
        (method.upper(), path): op.get("x-capgate-role")
        for path, ops in DOC["paths"].items()
        for method, op in ops.items()
    }
    for method, path, _, role in ROUTES:
        assert roles[(method, _template(path))] == role


async def test_openapi_document_is_served_without_credentials(console: Any) -> None:
    _, _, admin, _ = console
    resp = await admin.get("/openapi.json")
    assert resp.status == 200 and (await resp.json())["openapi"] == "3.1.0"


# --- the operators file -----------------------------------------------------------------------


def test_operators_file_holds_digests_never_tokens(operators: Operators) -> None:
    text = operators.file.read_text()
    for token in operators.tokens.values():
        assert token not in text
    book = OperatorBook(operators.file)
    assert book.authenticate("Bearer " + operators.tokens["alice"]).name == "alice"  # type: ignore[union-attr]
    assert book.authenticate("Bearer " + operators.tokens["alice"] + "x") is None
    remove_operator(operators.file, "alice")
    assert book.reload() is True
    assert book.authenticate("Bearer " + operators.tokens["alice"]) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("operators: [a]\n", "must be a mapping"),
        ("people: {}\n", "expected one key"),
        (
            "operators: {'bad name': {role: admin, token_sha256: " + "0" * 64 + "}}\n",
            "operator name",
        ),
        ("operators: {a: {role: god, token_sha256: " + "0" * 64 + "}}\n", "role 'god'"),
        ("operators: {a: {role: admin, token_sha256: abc}}\n", "64 hex digits"),
        ("operators: {a: {role: admin}}\n", "expected role and token_sha256"),
        (
            "operators: {a: {role: admin, token_sha256: " + "a" * 64 + "}, "
            "b: {role: viewer, token_sha256: " + "a" * 64 + "}}\n",
            "shares a token",
        ),
        ("operators: {a: [\n", "not valid YAML"),
    ],
)
def test_a_bad_operators_file_is_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "ops.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_operators(path)
    assert message in str(err.value)


def test_an_operators_file_others_may_write_is_refused(operators: Operators) -> None:
    operators.file.chmod(0o666)
    with pytest.raises(ConfigError) as err:
        read_operators(operators.file)
    assert "writable by group or others" in str(err.value)


def test_operators_cli_adds_lists_and_removes(tmp_path: Path) -> None:
    path = tmp_path / "ops.yaml"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", "operators", *args, "--file", str(path)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=30,
        )

    added = cli("add", "dana", "--role", "approver")
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip()
    assert token.startswith("cgo_") and token not in path.read_text()
    assert cli("list").stdout == "dana\tapprover\n"
    bad = cli("add", "eve")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--role" in bad.stderr
    assert cli("remove", "dana").returncode == 0
    assert cli("list").stdout == ""
    missing = cli("remove", "dana")
    assert missing.returncode == 2 and "no operator 'dana'" in missing.stderr


# --- capgate watch ----------------------------------------------------------------------------


async def test_capgate_watch_prints_each_call_as_it_happens(
    console: Any, operators: Operators, workspace: Workspace, tmp_path: Path
) -> None:
    import os

    _, client, admin, _ = console
    token_file = tmp_path / "vera.token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(operators.tokens["vera"] + "\n")
    url = f"http://{admin.host}:{admin.port}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "watch",
        "--admin",
        url,
        "--token-file",
        str(token_file),
        "--agent",
        "tester",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        tester = {"Authorization": f"Bearer {workspace.token('tester', ['tester'])}"}
        sre = {"Authorization": f"Bearer {workspace.token('sre-bot', ['sre-diagnostics'])}"}
        assert proc.stdout is not None
        line = b""
        for _ in range(50):  # until the stream is open, a call of the agent it follows
            await client.get("/metrics/metrics/cpu?window=1m", headers=sre)
            await client.get("/echo/echo/watched", headers=tester)
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), 0.3)
                break
            except TimeoutError:
                continue
        text = line.decode()
        assert "allow" in text and "tester" in text and "/echo/echo/watched" in text, text
        assert "sre-bot" not in text
    finally:
        proc.kill()
        await proc.wait()


def test_watch_lines_never_carry_terminal_control_characters() -> None:
    from gateway.commands.console import describe

    line = describe(
        {"type": "call", "agent": "a\x1b[2J", "path": "/x\r\nforged line", "decision": "deny"}
    )
    assert "\x1b" not in line and "\r" not in line and "\n" not in line
    assert "\\x1b[2J" in line


def test_watch_against_nothing_is_one_line_and_exit_2(tmp_path: Path, operators: Operators) -> None:
    import os

    token_file = tmp_path / "t"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(operators.tokens["vera"])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "watch",
            "--admin",
            "http://127.0.0.1:9",
            "--token-file",
            str(token_file),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "cannot reach the admin API" in done.stderr


async def test_operators_deciding_at_once_exactly_one_decision_counts(
    console: Any, operators: Operators, workspace: Workspace, mocks: Mocks
) -> None:
    _, client, admin, _ = console
    call = asyncio.ensure_future(restart(client, workspace))
    pending = await pending_one(admin, operators)
    verbs = ["approve", "deny"] * 8
    answers = await asyncio.gather(
        *(
            admin.post(f"/approvals/{pending['id']}/{verb}", headers=operators.auth(who))
            for verb, who in zip(verbs, ["alice", "root"] * 8, strict=True)
        )
    )
    statuses = [a.status for a in answers]
    assert statuses.count(200) == 1 and statuses.count(404) == 15
    won = verbs[statuses.index(200)]
    answer = await call
    assert answer.status == (200 if won == "approve" else 403)
    assert len(mocks.requests("services")) == (1 if won == "approve" else 0)


async def test_a_decision_on_another_body_decides_nothing(
    console: Any, operators: Operators, workspace: Workspace, mocks: Mocks
) -> None:
    import hashlib

    gw, client, admin, _ = console
    call = asyncio.ensure_future(restart(client, workspace))
    pending = await pending_one(admin, operators)
    sent = b'{"service": "web"}'
    assert pending["body_sha256"] == hashlib.sha256(sent).hexdigest()
    path = f"/approvals/{pending['id']}/approve"
    other = hashlib.sha256(b'{"service": "db"}').hexdigest()
    resp = await admin.post(path, headers=operators.auth("alice"), json={"body_sha256": other})
    body = await resp.json(content_type="application/problem+json")
    assert resp.status == 409 and body["reason"] == "approval_mismatch"
    conforms(path, "POST", 409, body)
    assert [p["id"] for p in await gw.approvals.pending()] == [pending["id"]]
    resp = await admin.post(
        path, headers=operators.auth("alice"), json={"body_sha256": pending["body_sha256"]}
    )
    assert resp.status == 200
    assert (await call).status == 200
    [seen] = mocks.requests("services")
    assert seen["body"] == sent.decode()  # byte for byte as shown and digested


async def test_an_approval_under_a_policy_no_longer_in_force_is_refused(
    console: Any, operators: Operators, workspace: Workspace, mocks: Mocks
) -> None:
    gw, client, admin, settings = console
    call = asyncio.ensure_future(restart(client, workspace))
    pending = await pending_one(admin, operators)
    text = settings.policy.read_text()
    settings.policy.write_text(text + "\n# an edit: another policy digest\n")
    for _ in range(200):
        if gw.policy.digest != pending["policy"]:
            break
        await asyncio.sleep(0.02)
    assert gw.policy.digest != pending["policy"]
    resp = await admin.post(f"/approvals/{pending['id']}/approve", headers=operators.auth("alice"))
    assert resp.status == 200
    answer = await call
    body = await answer.json(content_type="application/problem+json")
    assert answer.status == 409 and body["reason"] == "approval_stale"
    assert mocks.requests("services") == []


# --- pause, resume, stop ------------------------------------------------------------------


async def test_pause_resume_and_stop_through_the_api(
    console: Any, operators: Operators, workspace: Workspace, mocks: Mocks
) -> None:
    gw, client, admin, settings = console
    tester = {"Authorization": f"Bearer {workspace.token('tester', ['tester'], run='r1')}"}
    other = {"Authorization": f"Bearer {workspace.token('tester', ['tester'], run='r2')}"}
    for who in ("vera", "alice"):  # viewers and approvers may not
        resp = await admin.post("/agents/tester/pause", headers=operators.auth(who))
        assert resp.status == 403
    assert (await get(admin, "/pauses", "vera", operators))["pauses"] == []
    resp = await admin.post(
        "/runs/r1/pause", headers=operators.auth("root"), json={"reason": "looks odd"}
    )
    body = await resp.json()
    assert resp.status == 200 and body["by"] == "root" and body["until"] is None
    conforms("/runs/r1/pause", "POST", 200, body)
    [paused] = (await get(admin, "/pauses", "vera", operators))["pauses"]
    assert (paused["kind"], paused["value"], paused["by"], paused["reason"]) == (
        "run",
        "r1",
        "root",
        "looks odd",
    )
    held = asyncio.ensure_future(client.get("/echo/echo/held", headers=tester))
    assert (await client.get("/echo/echo/free", headers=other)).status == 200  # r2 goes on
    await asyncio.sleep(0.3)
    assert not held.done()
    resp = await admin.post("/runs/r1/resume", headers=operators.auth("root"))
    assert (await resp.json())["was_paused"] is True
    assert (await asyncio.wait_for(held, 5)).status == 200
    resp = await admin.post(
        "/agents/tester/stop", headers=operators.auth("root"), json={"reason": "enough"}
    )
    body = await resp.json()
    assert resp.status == 200 and body["action"] == "stop"
    conforms("/agents/tester/stop", "POST", 200, body)
    answer = await client.get("/echo/echo/after", headers=other)
    assert answer.status == 401
    assert (await answer.json(content_type=None))["reason"] == "token_revoked"
    stops = (await get(admin, "/stops", "vera", operators))["stops"]
    assert [(s["kind"], s["value"], s["by"], s["reason"]) for s in stops] == [
        ("agent", "tester", "root", "enough")
    ]
    for bad in ({"for_s": 0}, {"for_s": "soon"}, {"reason": 1}, {"until": 5}):
        resp = await admin.post("/agents/x/pause", headers=operators.auth("root"), json=bad)
        assert resp.status == 400, bad


def test_capgate_stop_names_who_and_must_name_someone(tmp_path: Path, operators: Operators) -> None:
    import os

    token_file = tmp_path / "root.token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(operators.tokens["root"])

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway",
                *args,
                "--admin",
                "http://127.0.0.1:9",
                "--token-file",
                str(token_file),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=30,
        )

    missing = cli("stop", "--reason", "x")
    assert missing.returncode == 2 and "--agent" in missing.stderr
    both = cli("pause", "--agent", "a", "--run", "r")
    assert both.returncode == 2
    bad_for = cli("pause", "--agent", "a", "--for", "soon")
    assert bad_for.returncode == 2 and bad_for.stderr.count("\n") == 1 and "--for" in bad_for.stderr
    down = cli("resume", "--agent", "a")
    assert down.returncode == 2 and "cannot reach the admin API" in down.stderr


async def test_the_operator_is_named_in_the_lines_of_calls_they_decline_or_cut(
    console: Any, operators: Operators, workspace: Workspace
) -> None:
    gw, client, admin, settings = console
    call = asyncio.ensure_future(restart(client, workspace))
    pending = await pending_one(admin, operators)
    await admin.post(f"/approvals/{pending['id']}/deny", headers=operators.auth("alice"))
    assert (await call).status == 403
    tester = {"Authorization": f"Bearer {workspace.token('tester', ['tester'])}"}
    slow = asyncio.ensure_future(client.get("/echo/echo/slow?delay=3", headers=tester))
    for _ in range(100):
        if gw.inflight_calls():
            break
        await asyncio.sleep(0.02)
    resp = await admin.post("/agents/tester/stop", headers=operators.auth("root"))
    assert (await resp.json())["calls_cut"] == 1
    assert (await slow).status == 401
    lines = {x["path"]: x for x in audit_lines(settings, gw)}
    declined = lines["/services/services/restart"]
    cut = lines["/echo/echo/slow"]
    assert (declined["reason"], declined["operator"]) == ("approval_denied", "alice")
    assert (cut["reason"], cut["operator"]) == ("token_revoked", "root")
