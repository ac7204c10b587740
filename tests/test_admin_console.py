"""The web console's server side: its static files, operator sessions (login, logout,
expiry), CSRF and cross-site protection of state-changing requests, the security headers of
every admin answer, and the endpoints the console added (``/stats``, stop)."""

from __future__ import annotations

import asyncio
import re
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import pytest

from gateway.admin_console import (
    CONSOLE_DIR,
    CONTENT_SECURITY_POLICY,
    SESSIONS,
    Sessions,
)
from gateway.operators import remove_operator, token_digest
from mocks.demo import Workspace
from tests.conftest import Mocks
from tests.console_setup import ConsoleSetup, agent, start_console
from tests.test_admin import Operators, conforms


@pytest.fixture
def operators(tmp_path: Path) -> Operators:
    return Operators(tmp_path)


@pytest.fixture
async def setup(
    aiohttp_client: Any,
    serve_gateway: Any,
    settings: Any,
    workspace: Workspace,
    policy_file: Path,
    operators: Operators,
    mocks: Mocks,
) -> ConsoleSetup:
    return await start_console(
        aiohttp_client, serve_gateway, settings, workspace, policy_file, operators.file, mocks
    )


class Browser:
    """What a browser sends with a console session: the cookie, and (when told to) the
    CSRF token and same-origin fetch metadata. Sent by hand, so each test says exactly
    which headers a request carries."""

    def __init__(self, admin: Any, cookie: str, csrf: str) -> None:
        self.admin = admin
        self.cookie = cookie
        self.csrf = csrf

    def headers(self, csrf: str | None = "right", **extra: str) -> dict[str, str]:
        headers = {"Cookie": f"capgate_session={self.cookie}", **extra}
        if csrf == "right":
            headers["X-CSRF-Token"] = self.csrf
        elif csrf is not None:
            headers["X-CSRF-Token"] = csrf
        return headers

    async def get(self, path: str) -> Any:
        return await self.admin.get(path, headers=self.headers(None))

    async def post(self, path: str, csrf: str | None = "right", **extra: str) -> Any:
        return await self.admin.post(path, headers=self.headers(csrf, **extra), json={})


async def login(setup: ConsoleSetup, token: str) -> Browser:
    admin = setup.admin
    admin.session.cookie_jar.clear()
    resp = await admin.post("/console/login", json={"token": token})
    body = await resp.json()
    assert resp.status == 200, body
    conforms("/console/login", "POST", 200, body)
    cookie = SimpleCookie(resp.headers["Set-Cookie"])["capgate_session"]
    admin.session.cookie_jar.clear()  # each request below says what it carries
    return Browser(admin, cookie.value, body["csrf"])


async def reason_of(resp: Any) -> str:
    return str((await resp.json(content_type="application/problem+json"))["reason"])


# --- logging in ---------------------------------------------------------------------------------


async def test_login_gives_a_strict_httponly_cookie_and_never_echoes_the_token(
    setup: ConsoleSetup, operators: Operators
) -> None:
    token = operators.tokens["alice"]
    resp = await setup.admin.post("/console/login", json={"token": token})
    assert resp.status == 200
    body = await resp.json()
    assert (body["name"], body["role"]) == ("alice", "approver")
    assert len(body["csrf"]) >= 32 and 0 < body["expires_in_s"] <= 8 * 3600
    raw = resp.headers["Set-Cookie"]
    morsel = SimpleCookie(raw)["capgate_session"]
    assert morsel["httponly"] and morsel["samesite"] == "Strict" and morsel["path"] == "/"
    assert not morsel["secure"]  # plain HTTP here; set over HTTPS
    assert token not in raw and token not in await resp.text()
    assert morsel.value != token and token_digest(token) not in raw


@pytest.mark.parametrize(
    ("kwargs", "status", "reason"),
    [
        ({"json": {"token": "cgo_wrong"}}, 401, "operator_unauthenticated"),
        ({"json": {"token": ""}}, 401, "operator_unauthenticated"),
        ({"json": {"token": "x" * 10_000}}, 401, "operator_unauthenticated"),
        ({"json": {"token": 5}}, 400, "admin_request_invalid"),
        ({"json": {"token": "a", "role": "admin"}}, 400, "admin_request_invalid"),
        (
            {"data": "token=x", "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
            400,
            "admin_request_invalid",
        ),
        (
            {"data": "{", "headers": {"Content-Type": "application/json"}},
            400,
            "admin_request_invalid",
        ),
    ],
)
async def test_a_bad_login_is_refused_and_opens_no_session(
    setup: ConsoleSetup, kwargs: dict[str, Any], status: int, reason: str
) -> None:
    resp = await setup.admin.post("/console/login", **kwargs)
    assert (resp.status, await reason_of(resp)) == (status, reason)
    assert "Set-Cookie" not in resp.headers
    assert len(setup.admin.server.app[SESSIONS]) == 0


async def test_a_login_from_another_site_is_refused(
    setup: ConsoleSetup, operators: Operators
) -> None:
    token = operators.tokens["root"]
    for headers in (
        {"Origin": "https://evil.example"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
    ):
        resp = await setup.admin.post("/console/login", json={"token": token}, headers=headers)
        assert (resp.status, await reason_of(resp)) == (403, "cross_site_refused"), headers
    assert len(setup.admin.server.app[SESSIONS]) == 0


# --- CSRF -----------------------------------------------------------------------------------------


async def test_a_state_change_with_the_cookie_needs_the_csrf_token_and_the_same_origin(
    setup: ConsoleSetup, operators: Operators, workspace: Workspace, mocks: Mocks
) -> None:
    gw = setup.gw
    headers = {**agent(workspace), "Content-Type": "application/octet-stream"}
    call = asyncio.ensure_future(setup.client.post("/echo/echo/post", data=b"x", headers=headers))
    for _ in range(500):
        if await gw.approvals.pending():
            break
        await asyncio.sleep(0.01)
    [pending] = await gw.approvals.pending()
    approve = f"/approvals/{pending['id']}/approve"
    browser = await login(setup, operators.tokens["alice"])
    host = f"{setup.admin.host}:{setup.admin.port}"
    for csrf, extra, reason in (
        (None, {}, "csrf_token_invalid"),
        ("", {}, "csrf_token_invalid"),
        # The token with its last character changed (to "A", or "B" if it already ends so:
        # "A" alone was the right token one run in 64).
        (
            browser.csrf[:-1] + ("B" if browser.csrf.endswith("A") else "A"),
            {},
            "csrf_token_invalid",
        ),
        ("right", {"Origin": "https://evil.example"}, "cross_site_refused"),
        ("right", {"Origin": f"http://{host}.evil.example"}, "cross_site_refused"),
        ("right", {"Sec-Fetch-Site": "cross-site"}, "cross_site_refused"),
        ("right", {"Sec-Fetch-Site": "same-site"}, "cross_site_refused"),
    ):
        resp = await browser.post(approve, csrf, **extra)
        assert (resp.status, await reason_of(resp)) == (403, reason), (csrf, extra)
        conforms(approve, "POST", 403, await resp.json(content_type=None))
    assert [p["id"] for p in (await gw.approvals.pending())] == [pending["id"]]  # nothing changed
    assert mocks.requests("echo") == []
    # Another operator's CSRF token does not fit this session either.
    other = await login(setup, operators.tokens["root"])
    resp = await browser.post(approve, other.csrf)
    assert (resp.status, await reason_of(resp)) == (403, "csrf_token_invalid")
    # The right token, from the page itself: decided, in alice's name.
    resp = await browser.post(
        approve, "right", Origin=f"http://{host}", **{"Sec-Fetch-Site": "same-origin"}
    )
    assert resp.status == 200 and (await resp.json())["by"] == "alice"
    assert (await call).status == 200


async def test_a_get_with_the_cookie_needs_no_csrf_token_and_bearer_clients_need_none(
    setup: ConsoleSetup, operators: Operators
) -> None:
    browser = await login(setup, operators.tokens["vera"])
    resp = await browser.get("/whoami")
    assert resp.status == 200 and (await resp.json())["name"] == "vera"
    resp = await browser.get("/console/session")
    body = await resp.json()
    assert (body["name"], body["csrf"]) == ("vera", browser.csrf)
    # API clients: the Bearer header, no cookie, no CSRF token (browsers never add it).
    bearer = {"Authorization": f"Bearer {operators.tokens['root']}"}
    resp = await setup.admin.post("/agents/nobody/stop", headers=bearer, json={})
    assert resp.status == 200
    resp = await setup.admin.get("/console/session", headers=bearer)
    assert (await resp.json())["csrf"] is None
    # A Bearer header is what counts when both are sent: a wrong one is not rescued by the cookie.
    resp = await setup.admin.get(
        "/whoami", headers={**browser.headers(None), "Authorization": "Bearer cgo_wrong"}
    )
    assert resp.status == 401


# --- sessions end -------------------------------------------------------------------------------


async def test_logout_ends_the_session_and_clears_the_cookie(
    setup: ConsoleSetup, operators: Operators
) -> None:
    browser = await login(setup, operators.tokens["vera"])
    resp = await browser.post("/console/logout", csrf=None)
    assert (resp.status, await reason_of(resp)) == (403, "csrf_token_invalid")  # no forced logout
    resp = await browser.post("/console/logout")
    assert resp.status == 200 and (await resp.json()) == {"ended": True}
    cleared = SimpleCookie(resp.headers["Set-Cookie"])["capgate_session"]
    assert cleared.value == "" and cleared["max-age"] == "0"
    resp = await browser.get("/whoami")
    assert (resp.status, await reason_of(resp)) == (401, "operator_unauthenticated")


async def test_a_session_expires(setup: ConsoleSetup, operators: Operators) -> None:
    sessions = setup.admin.server.app[SESSIONS]
    now = [1000.0]
    sessions.clock = lambda: now[0]
    browser = await login(setup, operators.tokens["vera"])
    assert (await browser.get("/whoami")).status == 200
    now[0] += sessions.ttl - 1
    assert (await browser.get("/whoami")).status == 200
    now[0] += 2
    resp = await browser.get("/whoami")
    assert (resp.status, await reason_of(resp)) == (401, "operator_unauthenticated")
    assert len(sessions) == 0


async def test_removing_an_operator_or_giving_a_new_token_ends_their_sessions(
    setup: ConsoleSetup, operators: Operators
) -> None:
    from gateway.operators import add_operator

    vera = await login(setup, operators.tokens["vera"])
    alice = await login(setup, operators.tokens["alice"])
    remove_operator(operators.file, "vera")
    add_operator(operators.file, "alice", "approver")  # a new token for alice
    assert setup.gw.operators is not None and setup.gw.operators.reload()
    for browser in (vera, alice):
        resp = await browser.get("/whoami")
        assert (resp.status, await reason_of(resp)) == (401, "operator_unauthenticated")


async def test_a_changed_role_applies_to_the_open_session(
    setup: ConsoleSetup, operators: Operators
) -> None:
    root = await login(setup, operators.tokens["root"])
    assert (await root.get("/operators")).status == 200
    text = operators.file.read_text().replace("root: {role: admin", "root: {role: viewer")
    operators.file.write_text(text)
    assert setup.gw.operators is not None and setup.gw.operators.reload()
    resp = await root.get("/operators")
    assert (resp.status, await reason_of(resp)) == (403, "operator_forbidden")


def test_sessions_are_bounded_and_the_oldest_makes_room() -> None:
    now = [0.0]
    sessions = Sessions(ttl=100, capacity=3, clock=lambda: now[0])
    opened = []
    for i in range(5):
        now[0] = float(i)
        opened.append(sessions.open("d" * 64)[0])
    assert len(sessions) == 3
    assert [sessions.get(s) is not None for s in opened] == [False, False, True, True, True]
    assert sessions.get("") is None and sessions.get("x" * 1000) is None


async def test_a_forged_or_foreign_cookie_is_no_session(
    setup: ConsoleSetup, operators: Operators
) -> None:
    for cookie in ("", "forged", "a" * 43, "x" * 5000):
        resp = await setup.admin.get("/whoami", headers={"Cookie": f"capgate_session={cookie}"})
        assert resp.status in (400, 401), cookie


# --- what every answer carries ------------------------------------------------------------------


async def test_every_answer_carries_the_security_headers(
    setup: ConsoleSetup, operators: Operators
) -> None:
    browser = await login(setup, operators.tokens["vera"])
    bearer = {"Authorization": f"Bearer {operators.tokens['vera']}"}
    answers = [
        await setup.admin.get("/console/", allow_redirects=False),
        await setup.admin.get("/console/console.js"),
        await setup.admin.get("/console/console.css"),
        await setup.admin.get("/console", allow_redirects=False),
        await setup.admin.get("/openapi.json"),
        await setup.admin.get("/whoami"),  # 401
        await setup.admin.get("/nowhere"),  # 404
        await setup.admin.get("/calls", headers=bearer),
        await setup.admin.get("/stats", headers=bearer),
        await browser.get("/approvals"),
        await browser.post("/approvals/0123456789abcdef/approve", csrf=None),  # 403
        await setup.admin.post("/console/login", json={"token": "no"}),  # 401
    ]
    stream = await setup.admin.get("/events", headers=bearer)
    await stream.content.readuntil(b"\n\n")
    answers.append(stream)
    for resp in answers:
        h = resp.headers
        assert h["Content-Security-Policy"] == CONTENT_SECURITY_POLICY, resp.url
        assert h["X-Content-Type-Options"] == "nosniff"
        assert h["Referrer-Policy"] == "no-referrer"
        assert h["X-Frame-Options"] == "DENY"
        assert h["Cache-Control"] in ("no-store", "no-cache"), resp.url
        if not resp.url.path.startswith("/console"):
            assert h["Cache-Control"] == "no-store", resp.url
    stream.close()
    assert answers[3].status == 308 and answers[3].headers["Location"] == "/console/"
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    assert "'unsafe-inline'" not in CONTENT_SECURITY_POLICY


async def test_the_console_files_are_served_and_nothing_else(setup: ConsoleSetup) -> None:
    for name, kind in (
        ("", "text/html"),
        ("index.html", "text/html"),
        ("console.js", "text/javascript"),
        ("console.css", "text/css"),
    ):
        resp = await setup.admin.get("/console/" + name)
        assert resp.status == 200 and resp.content_type == kind, name
    for name in (
        "nope.js",
        "..%2fadmin.py",
        "%2e%2e/admin_console.py",
        "index.html%00",
        "Console.js",
    ):
        resp = await setup.admin.get("/console/" + name)
        assert resp.status == 404, name
        assert resp.content_type == "application/problem+json"


def test_the_page_has_no_inline_script_or_style_and_builds_no_html_from_data() -> None:
    html = (CONSOLE_DIR / "index.html").read_text()
    for tag in re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S):
        assert tag.strip() == ""  # only <script src=...></script>
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="/console/console.js" defer>']
    assert "<style" not in html and " style=" not in html
    assert not re.search(r"\son[a-z]+\s*=", html)  # no inline event handlers
    script = (CONSOLE_DIR / "console.js").read_text()
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
        "localStorage",
        "sessionStorage",
        ".style",
        'setAttribute("on',
    ):
        assert sink not in script, sink


# --- stats and stop -----------------------------------------------------------------------------


async def test_stats_count_decisions_by_reason(
    setup: ConsoleSetup, operators: Operators, workspace: Workspace
) -> None:
    bearer = {"Authorization": f"Bearer {operators.tokens['vera']}"}
    sre = agent(workspace, "sre-bot", "sre-diagnostics")
    assert (await setup.client.get("/echo/echo/one", headers=agent(workspace))).status == 200
    assert (await setup.client.get("/echo/echo/two", headers=agent(workspace))).status == 200
    assert (await setup.client.delete("/services/services/web", headers=sre)).status == 403
    assert (await setup.client.get("/echo/echo/x")).status == 401
    resp = await setup.admin.get("/stats", headers=bearer)
    stats = await resp.json()
    conforms("/stats", "GET", 200, stats)
    assert stats["total"] == 4
    assert stats["by_decision"] == {"allow": 2, "deny": 2}
    assert stats["by_reason"][0] == {"decision": "allow", "reason": "allowed", "count": 2}
    assert {(r["reason"], r["count"]) for r in stats["by_reason"][1:]} == {
        ("no_rule", 1),
        ("token_missing", 1),
    }


async def test_stop_refuses_the_next_call_and_needs_the_admin_role(
    setup: ConsoleSetup, operators: Operators, workspace: Workspace
) -> None:
    other = agent(workspace, "other-bot")
    assert (await setup.client.get("/echo/echo/a", headers=other)).status == 200
    for who in ("vera", "alice"):
        resp = await setup.admin.post(
            "/agents/other-bot/stop", headers=operators.auth(who), json={}
        )
        assert (resp.status, await reason_of(resp)) == (403, "operator_forbidden")
    resp = await setup.admin.post("/agents/other-bot/stop", json={})
    assert resp.status == 401
    assert (await setup.client.get("/echo/echo/b", headers=other)).status == 200  # unchanged
    events = await setup.admin.get("/events?type=operator", headers=operators.auth("vera"))
    await events.content.readuntil(b"\n\n")
    resp = await setup.admin.post(
        "/agents/other-bot/stop", headers=operators.auth("root"), json={"reason": "leak"}
    )
    body = await resp.json()
    assert resp.status == 200
    assert (body["kind"], body["value"], body["action"], body["by"]) == (
        "agent",
        "other-bot",
        "stop",
        "root",
    )
    conforms("/agents/other-bot/stop", "POST", 200, body)
    frame = await asyncio.wait_for(events.content.readuntil(b"\n\n"), 2)
    assert b'"action":"stop"' in frame and b'"by":"root"' in frame and b'"reason":"leak"' in frame
    events.close()
    refused = await setup.client.get("/echo/echo/c", headers=other)
    assert refused.status == 401
    assert (await refused.json(content_type=None))["reason"] == "token_revoked"
    assert (await setup.client.get("/echo/echo/d", headers=agent(workspace))).status == 200
    # A run, likewise.
    run_token = workspace.token("tester", ["tester"], run="run-7")
    run = {"Authorization": f"Bearer {run_token}"}
    assert (await setup.client.get("/echo/echo/e", headers=run)).status == 200
    resp = await setup.admin.post("/runs/run-7/stop", headers=operators.auth("root"))
    assert resp.status == 200 and (await resp.json())["value"] == "run-7"
    assert (await setup.client.get("/echo/echo/f", headers=run)).status == 401
    assert (await setup.client.get("/echo/echo/g", headers=agent(workspace))).status == 200


async def test_an_approver_sees_the_held_body_with_its_secrets_masked(
    setup: ConsoleSetup, operators: Operators, workspace: Workspace, mocks: Mocks
) -> None:
    body = (
        b'{"deploy": "web", "password": "hunter2-hunter2", '
        b'"callback": "https://bob:s3cret@hooks.example/x?api_key=k-123456", "note": "<b>hi</b>"}'
    )
    headers = {**agent(workspace), "Content-Type": "application/json"}
    call = asyncio.ensure_future(setup.client.post("/echo/echo/post", data=body, headers=headers))
    for _ in range(500):
        if await setup.gw.approvals.pending():
            break
        await asyncio.sleep(0.01)
    resp = await setup.admin.get("/approvals", headers=operators.auth("alice"))
    [pending] = (await resp.json())["pending"]
    shown = pending["body"]
    for secret in ("hunter2", "s3cret", "k-123456"):
        assert secret not in shown
    assert '"deploy": "web"' in shown and "<b>hi</b>" in shown and "[redacted:key]" in shown
    await setup.gw.approvals.decide(pending["id"], True, by="alice")
    assert (await call).status == 200
    [seen] = mocks.requests("echo")
    assert seen["body"].encode() == body  # masked for the eye only; every byte went on


async def test_logging_out_closes_the_event_streams_of_the_session(
    setup: ConsoleSetup, operators: Operators, workspace: Workspace, monkeypatch: Any
) -> None:
    from gateway import admin_console

    monkeypatch.setattr(admin_console, "RECHECK_S", 0.0)
    browser = await login(setup, operators.tokens["vera"])
    stream = await setup.admin.get("/events", headers=browser.headers(None))
    assert stream.status == 200
    await stream.content.readuntil(b"\n\n")
    await setup.client.get("/echo/echo/seen", headers=agent(workspace))
    assert b"/echo/echo/seen" in await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 2)
    assert (await browser.post("/console/logout")).status == 200
    await setup.client.get("/echo/echo/unseen", headers=agent(workspace))
    rest = await asyncio.wait_for(stream.content.read(), 2)  # the stream ends, unsent
    assert b"unseen" not in rest
    stream.close()


def test_a_token_of_undecodable_bytes_is_no_operator_and_no_error(operators: Operators) -> None:
    from gateway.operators import OperatorBook

    book = OperatorBook(operators.file, admin_token=b"legacy-admin-token-0123456789")
    assert book.authenticate("Bearer \udcff\udcfe") is None  # how aiohttp hands bytes 0xff 0xfe
    assert book.authenticate("Bearer legacy-admin-token-0123456789") is not None


async def test_undecodable_bytes_in_a_login_or_csrf_header_are_refused_not_an_error(
    setup: ConsoleSetup, operators: Operators
) -> None:
    browser = await login(setup, operators.tokens["root"])
    resp = await setup.admin.post("/console/login", json={"token": "cgo_\udcff\ud800"})
    assert resp.status == 401
    reader, writer = await asyncio.open_connection(setup.admin.host, setup.admin.port)
    writer.write(
        b"POST /agents/x/stop HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\nConnection: close\r\n"
        + f"Cookie: capgate_session={browser.cookie}\r\n".encode()
        + b"X-CSRF-Token: \xff\xfe\r\n\r\n"
    )
    await writer.drain()
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 403 "), answer[:100]
    assert b"csrf_token_invalid" in answer
