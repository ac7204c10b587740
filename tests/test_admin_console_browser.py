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
