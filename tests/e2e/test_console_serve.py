"""The web console as `capgate serve` runs it: page, login, a session's requests, and a
shutdown that an open event stream does not hold up."""

from __future__ import annotations

import http.client
import json
import signal
import time
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from gateway.admin_console import CONTENT_SECURITY_POLICY
from mocks.demo import Workspace, rewrite_policy_urls
from tests.conftest import ROOT, TEST_POLICY, Mocks
from tests.e2e.test_serve import start_capgate
from tests.test_admin import Operators

pytestmark = pytest.mark.e2e


def test_the_console_through_capgate_serve(
    workspace: Workspace, mocks: Mocks, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(rewrite_policy_urls(TEST_POLICY.read_text(), mocks.urls))
    operators = Operators(tmp_path)
    args = [*workspace.serve_args(0, tmp_path / "audit.jsonl", policy), "--admin-port", "0"]
    args += ["--operators", str(operators.file), "--shutdown-grace", "2s"]
    # The subprocess imports this checkout's gateway package, whatever is installed.
    env = {**workspace.environ(), "PYTHONPATH": str(ROOT)}
    proc, ready = start_capgate(args, env, tmp_path)
    admin = urlsplit(ready["admin"])
    assert admin.hostname is not None and admin.port is not None

    def conn() -> http.client.HTTPConnection:
        return http.client.HTTPConnection(admin.hostname, admin.port, timeout=10)

    stream = conn()
    try:
        page = conn()
        page.request("GET", "/console/")
        resp = page.getresponse()
        html = resp.read().decode()
        assert resp.status == 200 and 'src="/console/console.js"' in html
        assert resp.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        body = json.dumps({"token": operators.tokens["root"]})
        page.request("POST", "/console/login", body, {"Content-Type": "application/json"})
        resp = page.getresponse()
        session = json.loads(resp.read())
        assert resp.status == 200 and session["name"] == "root"
        cookie = SimpleCookie(resp.headers["Set-Cookie"])["capgate_session"].value
        with_cookie = {"Cookie": f"capgate_session={cookie}"}
        page.request("GET", "/stats", headers=with_cookie)
        resp = page.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["total"] == 0
        stop = {**with_cookie, "Content-Type": "application/json"}
        page.request("POST", "/agents/nobody/stop", "{}", stop)  # no CSRF token
        resp = page.getresponse()
        assert resp.status == 403 and json.loads(resp.read())["reason"] == "csrf_token_invalid"
        page.request("POST", "/agents/nobody/stop", "{}", {**stop, "X-CSRF-Token": session["csrf"]})
        resp = page.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["by"] == "root"
        page.close()
        stream.request("GET", "/events", headers=with_cookie)
        events = stream.getresponse()
        assert events.status == 200 and events.readline().startswith(b": capgate events")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 10  # the open stream did not hold the shutdown
    finally:
        stream.close()
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
