"""The web console in a real headless browser: Debian's chromium, driven by Playwright.

Each test logs an operator in through the login form, as a person would, and watches the
page while agents call the gateway. Screenshots are kept under ``test-artifacts/console/``
(ignored by git). These tests are skipped only when no chromium is installed; ``.ci/run``
installs it, so they run in CI.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mocks.demo import Workspace
from tests.conftest import ROOT, Mocks, audit_lines
from tests.console_setup import ConsoleSetup, agent, start_console
from tests.test_admin import Operators

playwright_api = pytest.importorskip(
    "playwright.async_api", reason="playwright is not installed (pip install -e '.[dev]')"
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = ROOT / "test-artifacts" / "console"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium on PATH: apt-get install chromium (.ci/run installs it)",
    ),
]


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


@pytest.fixture
async def browser(setup: ConsoleSetup) -> AsyncIterator[Any]:
    """A headless chromium, closed before the gateway (whose event streams it holds open)."""
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=args, headless=True)
        try:
            yield browser
        finally:
            await browser.close()


class Console:
    """One operator's page, with every script error, console error and dialog it raised."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.problems: list[str] = []
        page.on("pageerror", lambda exc: self.problems.append(f"pageerror: {exc}"))
        page.on("console", self._console)
        page.on("dialog", self._dialog)

    def _console(self, message: Any) -> None:
        # A refused request (401 before logging in, a wrong token) is logged by chromium as
        # a failed resource load; anything else (a CSP violation, a script error) counts.
        if message.type == "error" and "Failed to load resource" not in message.text:
            self.problems.append(f"console: {message.text}")

    def _dialog(self, dialog: Any) -> None:
        self.problems.append(f"dialog: {dialog.type} {dialog.message}")
        asyncio.ensure_future(dialog.dismiss())

    async def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        await self.page.screenshot(path=str(path), full_page=True)
        return path


async def open_console(browser: Any, setup: ConsoleSetup, token: str | None) -> Console:
    context = await browser.new_context(viewport={"width": 1360, "height": 900})
    console = Console(await context.new_page())
    page = console.page
    await page.goto(setup.url + "/console/")
    await page.get_by_label("Operator token").wait_for()
    if token is not None:
        await page.get_by_label("Operator token").fill(token)
        await page.get_by_role("button", name="Log in").click()
        await page.locator("#live.on").wait_for(timeout=5000)  # the event stream is open
    return console


# --- the live table ---------------------------------------------------------------------------


async def test_a_new_call_appears_within_a_second_without_reloading(
    browser: Any, setup: ConsoleSetup, operators: Operators, workspace: Workspace
) -> None:
    console = await open_console(browser, setup, operators.tokens["vera"])
    page = console.page
    await page.get_by_text("No calls yet").wait_for()
    answer = await setup.client.get("/echo/echo/first-call", headers=agent(workspace))
    assert answer.status == 200
    ended = time.monotonic()
    row = page.locator("#calls tr", has_text="/echo/echo/first-call")
    await row.wait_for(timeout=1000)
    assert time.monotonic() - ended < 1.0
    assert await row.locator("td").nth(1).text_content() == "tester"
    assert "allow" in (await row.text_content() or "")
    # A refusal appears too, with its reason, and the counts follow.
    await setup.client.delete(
        "/services/services/web", headers=agent(workspace, "sre-bot", "sre-diagnostics")
    )
    refused = page.locator("#calls tr", has_text="/services/services/web")
    await refused.wait_for(timeout=1000)
    assert "no_rule" in (await refused.text_content() or "")
    await page.locator("#reasons tr", has_text="no_rule").wait_for(timeout=2000)
    await page.locator("#stat-deny", has_text="1").wait_for(timeout=2000)
    await console.screenshot("live-calls")
    assert console.problems == []


# --- agent-controlled text is text ------------------------------------------------------------

HOSTILE_BODY = (
    '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>\n'
    '{"note": "</pre><b id=bold>not bold</b>", "quote": "\\" \' `", "é": "\\u003cimg\\u003e"}'
)
HOSTILE_TOOL = "<img src=x onerror=window.__pwned=3>"


class Held:
    """Calls held for approval by a test; whatever is still held is denied at the end."""

    def __init__(self, setup: ConsoleSetup, workspace: Workspace) -> None:
        self.setup = setup
        self.workspace = workspace
        self.tasks: list[asyncio.Task[tuple[int, bytes]]] = []

    async def __call__(self, body: bytes) -> asyncio.Task[tuple[int, bytes]]:
        """Post ``body`` to the held rule ``echo-post``; the task ends with the answer."""
        headers = {**agent(self.workspace), "Content-Type": "application/octet-stream"}

        async def call() -> tuple[int, bytes]:
            answer = await self.setup.client.post("/echo/echo/post", data=body, headers=headers)
            return answer.status, await answer.read()

        before = len(await self.setup.gw.approvals.pending())
        task = asyncio.ensure_future(call())
        self.tasks.append(task)
        for _ in range(500):
            if len(await self.setup.gw.approvals.pending()) > before:
                return task
            await asyncio.sleep(0.01)
        raise AssertionError("the call was not held")

    async def release(self) -> None:
        for pending in await self.setup.gw.approvals.pending():
            await self.setup.gw.approvals.decide(pending["id"], False, by="cleanup")
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def hold(setup: ConsoleSetup, workspace: Workspace) -> AsyncIterator[Held]:
    held = Held(setup, workspace)
    yield held
    await held.release()


async def test_hostile_paths_tool_names_and_bodies_render_as_text(
    browser: Any, setup: ConsoleSetup, operators: Operators, workspace: Workspace, hold: Held
) -> None:
    console = await open_console(browser, setup, operators.tokens["alice"])
    page = console.page
    hostile_path = "/echo/echo/%3Cimg%20src%3Dx%20onerror%3Dwindow.__pwned%3D4%3E"
    await setup.client.get(hostile_path, headers=agent(workspace))
    rpc = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": HOSTILE_TOOL, "arguments": {"x": "<script>window.__pwned=5</script>"}},
    }
    await setup.client.post(
        "/tools/mcp",
        json=rpc,
        headers={
            **agent(workspace, "mcp-bot", "mcp-agent"),
            "Accept": "application/json, text/event-stream",
        },
    )
    # The same markup unencoded in the request line, as a hostile client may send it.
    host, port = setup.client.host, setup.client.port
    reader, writer = await asyncio.open_connection(host, port)
    auth = agent(workspace)["Authorization"]
    writer.write(
        b"GET /echo/echo/<img/src=x/onerror=window.__pwned=6> HTTP/1.1\r\n"
        + f"Host: {host}\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n".encode()
    )
    await writer.drain()
    raw_answer = await reader.read()
    writer.close()
    held = await hold(HOSTILE_BODY.encode())
    await page.locator("#calls tr", has_text="onerror").first.wait_for(timeout=2000)
    await page.locator("#calls tr", has_text="/tools/mcp").wait_for(timeout=2000)
    card = page.locator("#approvals li")
    await card.wait_for(timeout=2000)
    # The held call's body is shown exactly, as text.
    assert await card.locator("pre").text_content() == HOSTILE_BODY
    # No element came from the agent's text, no script ran, no dialog opened.
    assert await page.locator("img").count() == 0
    assert await page.locator("#bold").count() == 0
    assert await page.locator("script").count() == 1  # console.js
    assert await page.evaluate("window.__pwned") is None
    paths = await page.locator("#calls code").all_text_contents()
    assert any("onerror" in p for p in paths), paths
    assert raw_answer.startswith(b"HTTP/1.1 400 ")  # target_ambiguous, and audited as sent
    assert "/echo/echo/<img/src=x/onerror=window.__pwned=6>" in paths
    await console.screenshot("hostile-text")
    assert console.problems == []
    await hold.release()
    status, _ = await held
    assert status == 403


# --- approvals ----------------------------------------------------------------------------------


async def test_clicking_approve_releases_the_held_call_byte_for_byte(
    browser: Any,
    setup: ConsoleSetup,
    operators: Operators,
    workspace: Workspace,
    mocks: Mocks,
    hold: Held,
) -> None:
    console = await open_console(browser, setup, operators.tokens["alice"])
    page = console.page
    body = '{"deploy": "web", "note": "naïve <b>markup</b>", "n": [1, 2.50, null]}\n'.encode()
    held = await hold(body)
    card = page.locator("#approvals li", has_text="/echo/echo/post")
    await card.wait_for(timeout=2000)
    assert "echo-post" in (await card.locator(".why").text_content() or "")
    await page.locator("#inflight tr", has_text="held for approval").wait_for(timeout=2000)
    assert mocks.requests("echo") == []  # nothing reached the upstream yet
    await card.get_by_label("Reason").fill("change ticket 42")
    await console.screenshot("approval-held")
    await card.get_by_role("button", name="Approve").click()
    status, answer = await asyncio.wait_for(held, 5)
    assert status == 200
    [seen] = mocks.requests("echo")
    assert seen["body"].encode() == body
    assert json.loads(answer)["body"] == body.decode()
    await card.get_by_text("Approved by alice").wait_for(timeout=2000)
    await page.locator("#approvals li").wait_for(state="detached", timeout=3000)
    await page.get_by_text("No call is waiting for a decision").wait_for()
    row = page.locator("#calls tr", has_text="/echo/echo/post")
    await row.wait_for(timeout=2000)
    assert "approved by alice" in (await row.text_content() or "")
    [line] = [x for x in audit_lines(setup.settings, setup.gw) if x["path"] == "/echo/echo/post"]
    assert line["operator"] == "alice"
    await console.screenshot("approval-released")
    assert console.problems == []


# --- stop ---------------------------------------------------------------------------------------


async def test_stop_refuses_the_agents_next_call(
    browser: Any, setup: ConsoleSetup, operators: Operators, workspace: Workspace
) -> None:
    console = await open_console(browser, setup, operators.tokens["root"])
    page = console.page
    doomed = agent(workspace, "other-bot")
    assert (await setup.client.get("/echo/echo/before", headers=doomed)).status == 200
    stop = page.get_by_role("button", name="Stop agent other-bot")
    await stop.wait_for(timeout=2000)
    # Escape leaves the confirmation without doing anything.
    await stop.click()
    await page.get_by_role("dialog").wait_for()
    await page.keyboard.press("Escape")
    await page.get_by_role("dialog").wait_for(state="hidden")
    assert (await setup.client.get("/echo/echo/still", headers=doomed)).status == 200
    await stop.click()
    dialog = page.get_by_role("dialog")
    await dialog.get_by_label("Reason").fill("leaking data")
    await console.screenshot("stop-confirm")
    await dialog.get_by_role("button", name="Stop agent").click()
    await page.get_by_text("Stop: agent other-bot.").wait_for(timeout=2000)
    after = await setup.client.get("/echo/echo/after", headers=doomed)
    assert after.status == 401
    assert (await after.json(content_type=None))["reason"] == "token_revoked"
    # Another agent is not touched.
    assert (await setup.client.get("/echo/echo/other", headers=agent(workspace))).status == 200
    refused = page.locator("#calls tr", has_text="/echo/echo/after")
    await refused.wait_for(timeout=2000)
    assert "token_revoked" in (await refused.text_content() or "")
    await page.locator("#subjects tr", has_text="other-bot").get_by_text("stopped").wait_for()
    await page.locator("#reasons tr", has_text="token_revoked").wait_for(timeout=2000)
    await console.screenshot("stopped")
    assert console.problems == []


# --- roles and credentials -------------------------------------------------------------------


async def test_a_viewer_sees_no_controls_and_cannot_act(
    browser: Any, setup: ConsoleSetup, operators: Operators, workspace: Workspace, hold: Held
) -> None:
    console = await open_console(browser, setup, operators.tokens["vera"])
    page = console.page
    held = await hold(b"hold me")
    card = page.locator("#approvals li")
    await card.wait_for(timeout=2000)
    await card.get_by_text("Deciding needs the approver role").wait_for()
    assert await page.get_by_role("button", name="Approve").count() == 0
    assert await page.get_by_role("button", name="Deny").count() == 0
    await page.locator("#subjects tr", has_text="tester").wait_for(timeout=2000)
    assert await page.get_by_role("button", name="Stop agent tester").count() == 0
    await console.screenshot("viewer")
    # Forced through the viewer's own session (cookie and CSRF token): 403, nothing changes.
    session = await (await page.request.get(setup.url + "/console/session")).json()
    [pending] = await setup.gw.approvals.pending()
    for path in (f"/approvals/{pending['id']}/approve", "/agents/tester/stop"):
        answer = await page.request.post(
            setup.url + path,
            headers={"X-CSRF-Token": session["csrf"], "Content-Type": "application/json"},
            data="{}",
        )
        assert answer.status == 403
        assert (await answer.json())["reason"] == "operator_forbidden"
    assert [p["id"] for p in (await setup.gw.approvals.pending())] == [pending["id"]]
    assert (await setup.client.get("/echo/echo/still", headers=agent(workspace))).status == 200
    assert console.problems == []
    await hold.release()
    assert (await held)[0] == 403


async def test_a_wrong_token_is_refused_clearly(browser: Any, setup: ConsoleSetup) -> None:
    console = await open_console(browser, setup, None)
    page = console.page
    await page.get_by_label("Operator token").fill("cgo_not-a-real-token")
    await page.get_by_role("button", name="Log in").click()
    alert = page.get_by_role("alert")
    await alert.wait_for(timeout=2000)
    assert "not an operator token" in (await alert.text_content() or "")
    assert await page.locator("#app").is_hidden()
    assert await page.get_by_label("Operator token").input_value() == ""  # not kept
    cookies = await page.context.cookies()
    assert cookies == []
    await console.screenshot("login-refused")
    assert console.problems == []


async def test_the_keyboard_alone_logs_in_and_denies_with_a_reason(
    browser: Any, setup: ConsoleSetup, operators: Operators, hold: Held
) -> None:
    console = await open_console(browser, setup, None)
    page = console.page
    assert await page.evaluate("document.activeElement.id") == "token"  # focus starts there
    await page.keyboard.type(operators.tokens["alice"])
    await page.keyboard.press("Enter")
    await page.locator("#live.on").wait_for(timeout=5000)
    held = await hold(b"rm -rf /")
    card = page.locator("#approvals li")
    await card.wait_for(timeout=2000)
    await card.get_by_label("Reason").focus()
    await page.keyboard.type("not during the freeze")
    await page.keyboard.press("Tab")
    assert await page.evaluate("document.activeElement.textContent") == "Approve"
    await page.keyboard.press("Tab")
    assert await page.evaluate("document.activeElement.textContent") == "Deny"
    await page.keyboard.press("Enter")
    status, answer = await asyncio.wait_for(held, 5)
    problem = json.loads(answer)
    assert (status, problem["reason"]) == (403, "approval_denied")
    assert "not during the freeze" in problem["detail"]
    await page.get_by_text("Denied: POST /echo/echo/post (tester).").wait_for(timeout=2000)
    await console.screenshot("keyboard-denied")
    assert console.problems == []


async def test_the_console_fits_a_narrow_screen_in_dark_mode(
    browser: Any, setup: ConsoleSetup, operators: Operators, workspace: Workspace
) -> None:
    context = await browser.new_context(viewport={"width": 390, "height": 844}, color_scheme="dark")
    console = Console(await context.new_page())
    page = console.page
    await page.goto(setup.url + "/console/")
    await page.get_by_label("Operator token").fill(operators.tokens["root"])
    await page.get_by_label("Operator token").press("Enter")
    await page.locator("#live.on").wait_for(timeout=5000)
    await setup.client.get("/echo/echo/" + "long-name-" * 3, headers=agent(workspace))
    await page.locator("#calls tr").first.wait_for(timeout=2000)
    # The page itself never scrolls sideways; a wide table scrolls inside its card.
    width = await page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, width
    background = await page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(18, 22, 27)"  # the dark palette
    await console.screenshot("narrow-dark")
    assert console.problems == []


# --- pause and resume, taint ----------------------------------------------------------------


async def _confirm(page: Any, console: Console, action: str, subject: str, shot: str = "") -> None:
    await page.get_by_role("button", name=f"{action} {subject}").click()
    dialog = page.get_by_role("dialog")
    await dialog.get_by_label("Reason").fill(f"{action.lower()} for the test")
    if shot:
        await console.screenshot(shot)
    await dialog.get_by_role("button", name=f"{action} {subject.split()[0]}").click()
    await page.get_by_text(f"{action}: {subject}.").wait_for(timeout=2000)


async def test_pause_holds_the_agents_next_call_until_resume(
    browser: Any, setup: ConsoleSetup, operators: Operators, workspace: Workspace
) -> None:
    console = await open_console(browser, setup, operators.tokens["root"])
    page = console.page
    other = agent(workspace, "other-bot")
    assert (await setup.client.get("/echo/echo/before", headers=other)).status == 200
    await page.get_by_role("button", name="Pause agent other-bot").wait_for(timeout=2000)
    await _confirm(page, console, "Pause", "agent other-bot")
    row = page.locator("#subjects tr", has_text="other-bot")
    await row.get_by_text("paused").wait_for(timeout=3000)
    call = asyncio.ensure_future(setup.client.get("/echo/echo/waiting", headers=other))
    await asyncio.sleep(0.5)
    assert not call.done()  # held by the pause
    assert (await setup.client.get("/echo/echo/free", headers=agent(workspace))).status == 200
    await console.screenshot("paused")
    await _confirm(page, console, "Resume", "agent other-bot")
    answer = await asyncio.wait_for(call, 5)
    assert answer.status == 200
    await row.get_by_text("paused").wait_for(state="hidden", timeout=6000)
    assert console.problems == []


async def test_a_runs_taint_and_its_cause_are_shown_and_asked_about(
    browser: Any, setup: ConsoleSetup, operators: Operators, workspace: Workspace
) -> None:
    console = await open_console(browser, setup, operators.tokens["alice"])
    page = console.page
    run = {
        "Authorization": f"Bearer {workspace.token('sre-bot', ['sre-diagnostics'], run='run-42')}"
    }
    clean = {
        "Authorization": f"Bearer {workspace.token('sre-bot', ['sre-diagnostics'], run='run-7')}"
    }
    assert (await setup.client.get("/metrics/metrics/cpu?window=1m", headers=clean)).status == 200
    logs = "/logs/logs/application?level=info&limit=5"
    assert (await setup.client.get(logs, headers=run)).status == 200  # untrusted content
    tainted = page.locator("#subjects tr", has_text="run-42")
    await tainted.get_by_text("tainted by upstream logs").wait_for(timeout=2000)
    await page.locator("#subjects tr", has_text="run-7").get_by_text("clean").wait_for()
    restart = asyncio.ensure_future(
        setup.client.post("/services/services/restart", json={"service": "web"}, headers=run)
    )
    card = page.locator("#approvals li", has_text="/services/services/restart")
    await card.wait_for(timeout=3000)
    why = await card.locator(".why").text_content() or ""
    assert "logs" in why, why
    await console.screenshot("taint")
    await card.get_by_label("Reason").fill("tainted run")
    await card.get_by_role("button", name="Deny").click()
    answer = await asyncio.wait_for(restart, 5)
    assert answer.status == 403
    assert console.problems == []
