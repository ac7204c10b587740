"""``capgate serve`` as a real subprocess against the mocks: start, calls, SIGTERM, exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.audit_trail import call_records
from mocks.demo import Workspace, rewrite_policy_urls
from tests.conftest import ROOT, TEST_POLICY, Mocks

pytestmark = pytest.mark.e2e


class Served:
    def __init__(self, proc: subprocess.Popen[str], ready: dict[str, Any], audit: Path) -> None:
        self.proc = proc
        self.ready = ready
        self.url = ready["url"]
        self.audit = audit

    def call(
        self,
        path: str,
        token: str | None = None,
        method: str = "GET",
        body: bytes | None = None,
        timeout: float = 10,
    ) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(self.url + path, method=method, data=body)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if body is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (loopback)
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            with err:
                return err.code, json.loads(err.read())


def start_capgate(
    args: list[str], env: dict[str, str], cwd: Path
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # The gateway of this checkout, whatever the venv has installed.
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=cwd,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("capgate "):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"capgate did not start: {line!r} {err}")
    ready = json.loads(line.split(" listening ", 1)[1])
    return proc, ready


@pytest.fixture
def served(workspace: Workspace, mocks: Mocks, tmp_path: Path) -> Iterator[Served]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(rewrite_policy_urls(TEST_POLICY.read_text(), mocks.urls))
    audit = tmp_path / "audit.jsonl"
    args = [*workspace.serve_args(0, audit, policy), "--shutdown-grace", "5s"]
    proc, ready = start_capgate(args, workspace.environ(), tmp_path)
    served = Served(proc, ready, audit)
    yield served
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)


def test_ready_line_and_health(served: Served) -> None:
    assert served.ready["ready"] is True
    assert served.ready["url"].startswith("http://127.0.0.1:")
    assert served.ready["state"] == "memory"
    with urllib.request.urlopen(served.ready["health"], timeout=5) as resp:  # noqa: S310
        health = json.loads(resp.read())
    assert health["status"] == "ok"


def test_allowed_and_denied_then_sigterm_flushes_audit(
    served: Served, workspace: Workspace
) -> None:
    sre = workspace.token("sre-bot", ["sre-diagnostics"])
    status, body = served.call("/metrics/metrics/cpu?window=1m", sre)
    assert status == 200 and body["window"] == "1m"
    status, body = served.call("/services/services/web", sre, method="DELETE")
    assert status == 403 and body["reason"] == "no_rule"
    status, body = served.call(
        "/services/services/restart", sre, method="POST", body=b'{"service":"web"}'
    )
    assert status == 200 and body == {"restarted": "web", "by": "sre-bot"}

    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=15) == 0
    lines = call_records(json.loads(x) for x in served.audit.read_text().splitlines())
    assert [(x["decision"], x["status"]) for x in lines] == [
        ("allow", 200),
        ("deny", 403),
        ("allow", 200),
    ]
    check = subprocess.run(
        [sys.executable, "-m", "gateway", "audit", "verify", str(served.audit)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # The start checkpoint, 2 decision + 2 outcome lines, 1 decision line, the shutdown one.
    assert "7 lines, 2 signed checkpoints" in check.stdout


def test_sigterm_lets_calls_in_flight_finish(served: Served, workspace: Workspace) -> None:
    tok = workspace.token("tester", ["tester"])
    result: dict[str, Any] = {}

    def slow_call() -> None:
        result["value"] = served.call("/echo/echo/slow?delay=0.8", tok)

    t = threading.Thread(target=slow_call)
    t.start()
    time.sleep(0.3)  # the call is in flight
    served.proc.send_signal(signal.SIGTERM)
    t.join(timeout=10)
    assert result["value"][0] == 200
    assert served.proc.wait(timeout=15) == 0
    # New connections are refused once it stopped.
    with pytest.raises(urllib.error.URLError):
        served.call("/echo/echo/x", tok, timeout=2)
    lines = call_records(json.loads(x) for x in served.audit.read_text().splitlines())
    assert lines[-1]["path"] == "/echo/echo/slow" and lines[-1]["status"] == 200


def test_bad_policy_at_start_is_one_readable_error(workspace: Workspace, tmp_path: Path) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text("version: 1\nupstreams: {}\nroles:\n  r:\n    rules: [{id: x}]\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--policy",
            str(policy),
            "--jwks",
            str(workspace.jwks),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{policy}:5:" in proc.stderr


def test_bad_setting_is_one_readable_error(workspace: Workspace, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--policy",
            "x.yaml",
            "--jwks",
            str(workspace.jwks),
            "--port",
            "abc",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "capgate: error: --port has value 'abc'; expected an integer 0-65535"
    ]


def test_approvals_through_the_admin_listener_and_cli(
    workspace: Workspace, mocks: Mocks, tmp_path: Path
) -> None:
    text = rewrite_policy_urls(TEST_POLICY.read_text(), mocks.urls)
    anchor = "      - id: restart-service\n"
    policy = tmp_path / "held.yaml"
    policy.write_text(text.replace(anchor, anchor + "        approval: required\n"))
    token_file = tmp_path / "admin.token"
    token_file.write_text("admin-token-0123456789abcdef\n")
    token_file.chmod(0o600)
    args = [*workspace.serve_args(0, tmp_path / "audit.jsonl", policy), "--admin-port", "0"]
    args += ["--admin-token-file", str(token_file), "--approval-timeout", "20s"]
    proc, ready = start_capgate(args, workspace.environ(), tmp_path)
    try:
        served = Served(proc, ready, tmp_path / "audit.jsonl")
        assert ready["admin"].startswith("http://127.0.0.1:")
        sre = workspace.token("sre-bot", ["sre-diagnostics"])
        result: dict[str, Any] = {}

        def held_call() -> None:
            result["value"] = served.call(
                "/services/services/restart", sre, method="POST", body=b'{"service":"worker"}'
            )

        t = threading.Thread(target=held_call)
        t.start()
        cli = [sys.executable, "-m", "gateway", "approvals"]
        admin = ["--admin", ready["admin"], "--token-file", str(token_file)]
        pending: list[dict[str, Any]] = []
        for _ in range(100):
            out = subprocess.run([*cli, "list", *admin], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            pending = json.loads(out.stdout)["pending"]
            if pending:
                break
            time.sleep(0.05)
        [one] = pending
        assert one["agent"] == "sre-bot" and one["rule"] == "restart-service"
        out = subprocess.run(
            [*cli, "approve", one["id"], *admin], capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
        t.join(timeout=20)
        assert result["value"] == (200, {"restarted": "worker", "by": "sre-bot"})
        bad = subprocess.run(
            [*cli, "approve", one["id"], *admin], capture_output=True, text=True, timeout=30
        )
        assert bad.returncode == 2 and "404" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        proc.communicate(timeout=10)


def test_example_policy_sql_and_mcp_through_capgate_serve(
    workspace: Workspace, mocks: Mocks, tmp_path: Path
) -> None:
    """The example policy as served: real rows from SQLite, and the real MCP client."""
    import asyncio

    import httpx2
    from mcp import Client, MCPError
    from mcp.client.streamable_http import streamable_http_client

    audit = tmp_path / "audit.jsonl"
    proc, ready = start_capgate(workspace.serve_args(0, audit), workspace.environ(), tmp_path)
    try:
        served = Served(proc, ready, audit)
        analyst = workspace.token("analyst-bot", ["analyst"])
        status, body = served.call(
            "/db/query", analyst, method="POST",
            body=b'{"sql": "SELECT id, total_cents FROM orders WHERE customer_id = 3"}',
        )  # fmt: skip
        assert status == 200 and len(body["rows"]) == 5  # LIMIT 1000 added, 5 real rows
        before = mocks.stats("db")["queries_executed"]
        status, body = served.call(
            "/db/query", analyst, method="POST", body=b'{"sql": "SELECT ssn FROM customers"}'
        )
        assert status == 403 and body["reason"] == "sql_denied"
        assert mocks.stats("db")["queries_executed"] == before

        async def use_tools() -> tuple[list[str], str]:
            tok = workspace.token("mcp-bot", ["order-support"])
            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {tok}"}, timeout=10)
            url = served.url + "/tools/mcp"
            async with http, Client(streamable_http_client(url, http_client=http)) as mcp:
                names = sorted(t.name for t in (await mcp.list_tools()).tools)
                found = await mcp.call_tool("search_orders", {"customer_id": 3, "limit": 2})
                assert not found.is_error
                try:
                    await mcp.call_tool("delete_order", {"order_id": 1})
                except MCPError as err:
                    return names, err.error.data["reason"]
                return names, "allowed"

        names, reason = asyncio.run(use_tools())
        assert names == ["get_order", "run_sql", "search_orders"]
        assert reason == "tool_denied"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        proc.communicate(timeout=10)


def test_audit_anchor_mirror_and_query_end_to_end(
    workspace: Workspace, mocks: Mocks, tmp_path: Path
) -> None:
    """`capgate serve` with a file anchor and a mirror on "another volume": after SIGTERM the
    trail ends with a shutdown checkpoint the anchor holds; verify and query pass with the
    trusted JWKS copy and the anchor; cut back to the previous run's shutdown checkpoint, the
    trail still passes alone but not against the anchor."""
    import shutil

    policy = tmp_path / "policy.yaml"
    policy.write_text(rewrite_policy_urls(TEST_POLICY.read_text(), mocks.urls))
    audit = tmp_path / "sandbox" / "audit.jsonl"
    outside = tmp_path / "outside"
    args = [
        *workspace.serve_args(0, audit, policy),
        "--audit-anchor",
        f"file:{outside / 'anchor.jsonl'}",
        "--audit-mirror",
        str(outside / "audit.jsonl"),
        "--audit-gateway-id",
        "gw-e2e",
    ]
    tok = workspace.token("tester", ["tester"])
    sizes = []
    for run in range(2):
        proc, ready = start_capgate(args, workspace.environ(), tmp_path)
        served = Served(proc, ready, audit)
        try:
            assert served.call(f"/echo/echo/run-{run}", tok)[0] == 200
            with urllib.request.urlopen(ready["health"], timeout=5) as resp:  # noqa: S310
                health = json.loads(resp.read())
            assert health["audit"]["ok"] and health["audit"]["fsync"] == "1s"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)
        sizes.append(len(audit.read_bytes().splitlines()))
    trusted = outside / "audit.jwks.json"
    shutil.copy(audit.with_name("audit.jsonl.jwks.json"), trusted)
    assert audit.read_bytes() == (outside / "audit.jsonl").read_bytes()

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", "audit", *argv],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )

    anchor = ["--jwks", str(trusted), "--anchor", str(outside / "anchor.jsonl")]
    check = cli("verify", str(audit), *anchor)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "4 signed checkpoints" in check.stdout
    query = cli("query", str(audit), "--agent", "tester", "--format", "json", *anchor)
    assert query.returncode == 0, query.stdout + query.stderr
    answer = json.loads(query.stdout)
    assert [m["path"] for m in answer["matches"]] == ["/echo/echo/run-0", "/echo/echo/run-1"]
    assert [m["status"] for m in answer["matches"]] == [200, 200]
    # Cut back to the end of the first run: signed and whole, but not what the anchor holds.
    audit.write_bytes(b"".join(x + b"\n" for x in audit.read_bytes().splitlines()[: sizes[0]]))
    assert cli("verify", str(audit), "--jwks", str(trusted)).returncode == 0
    check = cli("verify", str(audit), *anchor)
    assert check.returncode == 1 and "the anchor's latest checkpoint" in check.stdout
